"""Layers shared by the architectures, with the decode state they keep between steps.

Shape legend: B = batch, T = new tokens, S = cached positions, D = hidden, H = heads,
Hk = kv heads, Dh = head dim, E = experts, A = active experts per token (top_k), I = expert width.
Numerics follow the Hugging Face reference exactly where it decides rounding (norm order,
fp32 router softmax, fp32 delta rule), so greedy tokens match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgerun.kernels.dense_reference import delta_rule_chunked, delta_rule_recurrent, l2norm
from edgerun.kernels.moe_reference import combine_experts
from edgerun.models.args import ModelArgs


class RMSNorm(nn.Module):
    """RMSNorm. ``unit_offset``: scale by (1 + w) in fp32 before the cast (Qwen3.5); otherwise
    cast first, then scale by w (Qwen3)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)

    def decode(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x [N, D]: the module, or the one-launch Triton kernel (``fused``, CUDA only)."""
        if not fused:
            return self(x)
        from edgerun.kernels import dense_triton

        return dense_triton.rms_norm(x, self.weight, self.eps, self.unit_offset)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the DeltaNet output, then multiplied by SiLU(z) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)


class Rotary(nn.Module):
    """RoPE over the first ``rotary_dim`` channels of each head (partial rotary when < head_dim).

    Qwen3.5's multimodal RoPE (mrope sections) gives every section the same position for text
    tokens, so for text it reduces exactly to this 1-D form.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, rotary_dim]
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, Dh]; cos/sin: [T, R] with R <= Dh
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


# --------------------------------------------------------------------------------------------
# Decode state


@dataclass
class KVCache:
    k: torch.Tensor  # [B, Hk, S_max, Dh]
    v: torch.Tensor


@dataclass
class DeltaState:
    conv: torch.Tensor  # [B, C, K-1] last inputs of the causal conv
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] fp32


class DecodeState:
    """Per-sequence state between steps: KV for attention layers, conv + recurrent for DeltaNet."""

    def __init__(self, layers: list[KVCache | DeltaState | None], max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len
        self.pos = 0  # tokens already consumed

    def nbytes(self) -> int:
        total = 0
        for entry in self.layers:
            if isinstance(entry, KVCache):
                total += entry.k.nbytes + entry.v.nbytes
            elif isinstance(entry, DeltaState):
                total += entry.conv.nbytes + entry.recurrent.nbytes
        return total


@dataclass
class StaticStep:
    """What one decode step over static buffers (CUDA graphs) shares across layers: the rope of
    the position, the position itself as a device tensor (no shape depends on it), the KV
    buffer's index, and whether the fused Triton dense kernels run."""

    cos: torch.Tensor  # [1, R]
    sin: torch.Tensor
    pos: torch.Tensor  # [1] int64
    kv_index: torch.Tensor  # [S_max] int64
    fused: bool = False


# --------------------------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm; optional sigmoid output gate (Qwen3.5)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.gated = args.attn_output_gate
        q_out = self.n_heads * self.head_dim * (2 if self.gated else 1)
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.norm_unit_offset)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.norm_unit_offset)

    def new_state(self, batch: int, max_len: int, device, dtype) -> KVCache:
        shape = (batch, self.n_kv, max_len, self.head_dim)
        return KVCache(
            torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None, start: int
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        q = self.q_norm(q.reshape(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            cache.k[:, :, start : start + T] = k
            cache.v[:, :, start : start + T] = v
            k, v = cache.k[:, :, : start + T], cache.v[:, :, : start + T]
        out = causal_attention(q, k, v, start)
        out = out.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def decode_static(self, x: torch.Tensor, step: StaticStep, cache: KVCache) -> torch.Tensor:
        """One token of :meth:`forward` over the whole static KV buffer: the new key and value
        are written at ``step.pos`` (a device tensor) and later positions are masked, so no
        shape depends on the position. Query heads are grouped under their KV head instead of
        repeating K and V. x [B, 1, D] -> [B, 1, D]."""
        B, T, _ = x.shape
        H, Hk, Dh = self.n_heads, self.n_kv, self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(B, T, H, 2 * Dh).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        q = self.q_norm(q.reshape(B, T, H, Dh)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, Hk, Dh)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, Hk, Dh).transpose(1, 2)
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        cache.k.index_copy_(2, step.pos, k)
        cache.v.index_copy_(2, step.pos, v)
        q = q.reshape(B, Hk, H // Hk, Dh)  # head h = kv * (H // Hk) + r, as repeat_interleave pairs them
        # scores and softmax in fp32, then P (in the cache's dtype) times V: a few small kernels. A
        # fused SDPA kernel with a mask over the whole buffer measured ~100 µs a layer on an H200.
        scores = torch.matmul(q.float() * Dh**-0.5, cache.k.float().transpose(-1, -2))  # [B, Hk, H/Hk, S]
        scores = scores.masked_fill((step.kv_index > step.pos)[None, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(cache.v.dtype), cache.v)
        out = out.reshape(B, T, H * Dh)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q: [B, H, T, Dh] at positions start..start+T-1; k, v: [B, Hk, S, Dh] at positions 0..S-1."""
    T, S = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    mask = None
    if T > 1:
        qpos = torch.arange(start, start + T, device=q.device)[:, None]
        mask = torch.arange(S, device=q.device)[None, :] <= qpos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# --------------------------------------------------------------------------------------------
# Gated DeltaNet (linear attention)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_k = args.linear_num_key_heads
        self.n_v = args.linear_num_value_heads
        self.dk = args.linear_key_head_dim
        self.dv = args.linear_value_head_dim
        self.key_dim = args.linear_key_dim
        self.value_dim = args.linear_value_dim
        self.conv_dim = args.linear_conv_dim
        self.kernel = args.linear_conv_kernel_dim
        D = args.hidden_size
        self.in_proj_qkv = nn.Linear(D, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(D, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)

    def new_state(self, batch: int, device, dtype) -> DeltaState:
        return DeltaState(
            conv=torch.zeros(batch, self.conv_dim, self.kernel - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(batch, self.n_v, self.dk, self.dv, device=device, dtype=torch.float32),
        )

    def forward(self, x: torch.Tensor, state: DeltaState | None) -> torch.Tensor:
        B, T, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        history = state.conv if state is not None else mixed.new_zeros(B, self.conv_dim, self.kernel - 1)
        window = torch.cat([history.to(mixed.dtype), mixed], dim=-1)
        if state is not None:
            state.conv.copy_(window[:, :, -(self.kernel - 1) :])
        w = self.conv1d.weight  # [C, 1, K]
        # depthwise causal conv as K multiply-adds per channel: F.conv1d is ~50x slower at decode sizes
        taps = window.to(w.dtype).unfold(-1, self.kernel, 1)  # [B, C, T, K]
        mixed = F.silu((taps * w[:, None, 0, :]).sum(-1)).to(x.dtype).transpose(1, 2)

        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.n_k, self.dk)
        k = k.reshape(B, T, self.n_k, self.dk)
        v = v.reshape(B, T, self.n_v, self.dv)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if self.n_v != self.n_k:
            q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
            k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
        # fp32, [B, H, T, *]
        q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))
        q = l2norm(q) * self.dk**-0.5
        k = l2norm(k)
        s0 = state.recurrent if state is not None else q.new_zeros(B, self.n_v, self.dk, self.dv)
        if T == 1:
            out, s1 = delta_rule_recurrent(q, k, v, g, beta, s0)
        else:
            out, s1 = delta_rule_chunked(q, k, v, g, beta, s0)
        if state is not None:
            state.recurrent.copy_(s1)
        out = out.transpose(1, 2).to(x.dtype)  # [B, T, Hv, Dv]
        z = self.in_proj_z(x).reshape(B, T, self.n_v, self.dv)
        out = self.norm(out, z).reshape(B, T, self.value_dim)
        return self.out_proj(out)

    def decode(self, x: torch.Tensor, state: DeltaState, fused: bool = False) -> torch.Tensor:
        """One token, x [1, D] -> [1, D]: :meth:`forward`, or (``fused``, CUDA only) the one-launch
        Triton step between this module's own projections (``kernels/dense_triton.py``)."""
        if not fused:
            return self(x[None], state)[0]
        from edgerun.kernels import dense_triton

        out = dense_triton.delta_decode(
            self.in_proj_qkv(x)[0], self.in_proj_z(x)[0], self.in_proj_a(x)[0], self.in_proj_b(x)[0],
            state.conv[0], self.conv1d.weight[:, 0], self.A_log, self.dt_bias, state.recurrent[0],
            self.norm.weight, self.norm.eps, self.n_k, self.n_v, self.dk, self.dv,
        )  # fmt: skip
        return self.out_proj(out[None])


# --------------------------------------------------------------------------------------------
# Feed-forward and MoE


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax router in fp32; top-k; optional renormalisation of the k weights."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.num_experts, args.hidden_size))
        self.top_k = args.num_experts_per_tok
        self.normalize = args.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, D] -> weights [N, A] (x.dtype), ids [N, A] (int64)
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids


class Experts(nn.Module):
    """All routed experts of one layer, resident and stacked: gate_up [E, 2I, D], down [E, D, I]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        E, I, D = args.num_experts, args.moe_intermediate_size, args.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_experts(x, ids, weights, lambda e: (self.gate_up_proj[e], self.down_proj[e]))

    def gathered(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One token, x [1, D], ids / weights [1, A] -> [1, D], with no host round trip (so a CUDA
        graph can hold it): the A experts' weights gathered by id on the device, summed in
        ascending expert-id order (a fixed order)."""
        ids, order = torch.sort(ids[0], stable=True)
        w = weights[0].index_select(0, order)
        gate_up = self.gate_up_proj.index_select(0, ids)  # [A, 2I, D]
        down = self.down_proj.index_select(0, ids)  # [A, D, I]
        h = x.to(gate_up.dtype).expand(ids.shape[0], -1)[..., None]  # [A, D, 1]
        gate, up = torch.bmm(gate_up, h)[..., 0].chunk(2, dim=-1)
        y = torch.bmm(down, (F.silu(gate) * up)[..., None])[..., 0]  # [A, D]
        return (y * w[:, None].to(y.dtype)).sum(0, keepdim=True).to(x.dtype)


class SparseMoe(nn.Module):
    """Routed experts, plus (Qwen3.5) a shared expert scaled by a sigmoid gate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = Router(args)
        self.experts = Experts(args)
        self.has_shared = args.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        weights, ids = self.gate(flat)
        out = self.combine(self.experts(flat, ids, weights), self.shared_output(flat))
        return out.reshape(B, T, D)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gated shared expert on x [N, D] (None without one)."""
        if not self.has_shared:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    @staticmethod
    def combine(routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        return routed if shared is None else routed + shared
