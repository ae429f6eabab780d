"""Pure-torch references for the dense decode kernels (kernels/dense_triton.py), and random inputs.

Shape legend: B = batch (optional leading dim), N = rows, D = width, C = conv channels
(2·Hk·Dk + Hv·Dv), K = conv taps, Hk / Hv = key / value heads, Dk / Dv = their head dims.

Each function is the module code of edgerun/models/layers.py restated over flat decode-step
tensors, op for op (same shapes where a reduction runs, same casts), so the tests assert
``torch.equal`` against the modules. The gated delta rule itself (``l2norm``,
``delta_rule_recurrent``, ``delta_rule_chunked``) lives here and the model's layers call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """Token-by-token gated delta rule. q, k: [B, H, T, Dk]; v: [B, H, T, Dv]; g, beta: [B, H, T];
    state: [B, H, Dk, Dv] fp32. Returns (out [B, H, T, Dv], new state)."""
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        predicted = (state * kt[..., None]).sum(dim=-2)  # [B, H, Dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + kt[..., None] * delta[..., None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence in chunks: within a chunk the delta-rule updates are solved as one
    unit-lower-triangular system (UT transform), across chunks the state is carried."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    pad = (chunk - T % chunk) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)

    cum = g.cumsum(dim=-1)  # log decay from chunk start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    out = torch.empty(B, H, n, chunk, Dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_dec[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, H, n * chunk, Dv)[:, :, :T], state


@dataclass(frozen=True)
class DeltaDims:
    """Geometry of one Gated DeltaNet layer. Qwen3.5/3.6-35B-A3B: ``DeltaDims(16, 32, 128, 128, 4)``."""

    n_k: int
    n_v: int
    dk: int
    dv: int
    kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k * self.dk + self.n_v * self.dv

    @property
    def value_dim(self) -> int:
        return self.n_v * self.dv

    @classmethod
    def from_args(cls, args) -> DeltaDims:
        """From a ModelArgs (or anything with its ``linear_*`` attributes)."""
        return cls(
            args.linear_num_key_heads,
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
            args.linear_conv_kernel_dim,
        )


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """``RMSNorm.forward``: x [N, D], weight [D] -> [N, D]. unit_offset: x's dtype; otherwise
    the promotion of weight's and x's dtypes (x's when they agree, as in a loaded model)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).type_as(x)
    return weight * xf.to(x.dtype)


def delta_decode_ref(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    n_k: int,
    n_v: int,
    dk: int,
    dv: int,
) -> torch.Tensor:
    """One token of ``GatedDeltaNet.forward`` between the input projections and ``out_proj``.

    mixed_qkv [B?, C], z [B?, Hv·Dv], a / b [B?, Hv]: the raw in_proj_qkv / z / a / b outputs
    (model dtype); conv_state [B?, C, K-1] (updated in place); conv_weight [C, K] (conv1d.weight
    without its middle dim); A_log, dt_bias [Hv]; state fp32 [B?, Hv, Dk, Dv] (updated in place);
    norm_weight [Dv]. Returns the out_proj input [B?, Hv·Dv] in mixed_qkv's dtype. B? is an
    optional leading batch dim, present on all of them or on none.
    """
    batched = mixed_qkv.dim() == 2
    if not batched:  # unsqueeze is a view: the in-place state updates land in the caller's tensors
        mixed_qkv, z, a, b, conv_state, state = (
            t.unsqueeze(0) for t in (mixed_qkv, z, a, b, conv_state, state)
        )
    B = mixed_qkv.shape[0]
    K = conv_weight.shape[-1]
    dtype = mixed_qkv.dtype
    key_dim = n_k * dk

    mixed = mixed_qkv[:, :, None]  # [B, C, T=1]
    window = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1)
    conv_state.copy_(window[:, :, -(K - 1) :])
    taps = window.to(conv_weight.dtype).unfold(-1, K, 1)  # [B, C, 1, K]
    mixed = F.silu((taps * conv_weight[:, None, :]).sum(-1)).to(dtype).transpose(1, 2)

    q, k, v = torch.split(mixed, [key_dim, key_dim, n_v * dv], dim=-1)
    q = q.reshape(B, 1, n_k, dk)
    k = k.reshape(B, 1, n_k, dk)
    v = v.reshape(B, 1, n_v, dv)
    beta = b[:, None].sigmoid()
    g = -A_log.float().exp() * F.softplus(a[:, None].float() + dt_bias)
    if n_v != n_k:
        q = q.repeat_interleave(n_v // n_k, dim=2)
        k = k.repeat_interleave(n_v // n_k, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    out, s1 = delta_rule_recurrent(q, k, v, g, beta, state)
    state.copy_(s1)
    out = out.transpose(1, 2).to(dtype)  # [B, 1, Hv, Dv]

    # GatedRMSNorm over Dv
    xf = out.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = norm_weight * xf.to(dtype)
    out = (out * F.silu(z.reshape(B, 1, n_v, dv).float())).to(dtype)
    out = out.reshape(B, n_v * dv)
    return out if batched else out[0]


def random_delta_inputs(
    dims: DeltaDims,
    batch: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-6,
) -> dict:
    """Keyword arguments of ``delta_decode_ref`` / ``delta_decode`` for one step: random
    activations, a random history and recurrent state, weights drawn like a trained layer's
    (decay rates exp(A_log) in [0.01, 4], norm weights near 1). ``batch`` None: no batch dim."""

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dt)

    lead = () if batch is None else (batch,)
    C, K, Hv = dims.conv_dim, dims.kernel, dims.n_v
    A = torch.rand(Hv, generator=generator, device=device) * 3.99 + 0.01
    return dict(
        mixed_qkv=randn(*lead, C),
        z=randn(*lead, dims.value_dim),
        a=randn(*lead, Hv),
        b=randn(*lead, Hv),
        conv_state=randn(*lead, C, K - 1),
        conv_weight=randn(C, K, scale=0.5),
        A_log=A.log().to(dtype),
        dt_bias=randn(Hv, scale=0.3),
        state=randn(*lead, Hv, dims.dk, dims.dv, scale=0.5, dt=torch.float32),
        norm_weight=(1.0 + randn(dims.dv, scale=0.3, dt=torch.float32)).to(dtype),
        eps=eps,
        n_k=dims.n_k,
        n_v=dims.n_v,
        dk=dims.dk,
        dv=dims.dv,
    )


def clone_inputs(inputs: dict) -> dict:
    """A copy whose in-place states are the caller's own."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
