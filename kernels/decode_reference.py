"""Pure-torch references for the router and attention decode kernels (kernels/decode_triton.py),
their random inputs, and the cases a start-up probe runs.

Shape legend: N = rows, E = experts, X = extra logit columns, A = active experts (top_k),
H = query heads, Hk = kv heads, Dh = head dim, R = rotary dim, S = S_max (KV buffer positions).

Each reference is the module code of edgerun/models/layers.py restated over flat decode-step
tensors, op for op (same shapes where a reduction runs, same casts): ``router_topk_ref`` is
``Router.forward`` after the linear (plus the shared-expert gate's sigmoid),
``attention_decode_ref`` is ``Attention.decode_static`` between the projections and o_proj. The
tests assert they equal the modules (tests/kernels/test_decode_reference.py).

Probe tolerances (``TOLERANCE``, max |got - ref| over max |ref| of each output):

- fp32 1e-4: the kernels differ from the references only in fp32 summation order (dot products
  over Dh, softmax sums, the split combine) and transcendental ulps (exp2 for exp, Triton's
  cos/sin); each is ~1e-6 relative, a hundred times under the limit.
- bf16 2e-2, fp16 5e-3: the kernels round where the modules round, but an fp32-level difference
  now and then moves a rounded value (a cos/sin, a normalised channel, a rotary product, a
  router weight) by one ulp, and the attention rounds its unnormalised probabilities where the
  module rounds the normalised ones (each weight off by up to 2^-9 either way, independently).
  Both reach the output as at most an ulp or two of it; a bf16 ulp is 2^-8 to 2^-7 of a value,
  so two of the largest are at most 1.6e-2 of the scale (fp16: 2^-11 to 2^-10 an ulp, 5e-3).
  Real faults (a wrong head, kv group, rotary partner, position or expert) move an output by
  O(1) of its scale.
- the cache row written at pos: the key within the same tolerance (it is normalised and rotated
  like q), the value bit for bit (a copy); every other row bit for bit (untouched).
- ids: equal to the reference's wherever its top-(k+1) probabilities are strictly decreasing;
  the selected set equal wherever the k-th and (k+1)-th differ. (Random bf16 logits do tie now
  and then, and the reference's torch.topk does not promise an order among equals.)

Seen on an H200 at the real geometries: attention 1.2e-6 (fp32) and 5.6e-3 (bf16) of the output's
scale, the bf16 key at pos bit-equal; router weights 3.5e-7 of each weight (fp32), bit-equal
(bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgerun.kernels.dense_probe import TOLERANCE, within
from edgerun.kernels.dense_probe import Refused as Mismatch  # the probes' one refusal
from edgerun.kernels.dense_reference import clone_inputs, rms_norm_ref

PROBE_POS = 37  # the probe's step: a short history (over two splits at Dh 256)
PROBE_S_MAX = 128


@dataclass(frozen=True)
class AttnDims:
    """Geometry of one full-attention layer. Qwen3.6-35B-A3B: ``AttnDims(16, 2, 256, 64, True)``."""

    n_heads: int
    n_kv: int
    head_dim: int
    rotary_dim: int
    gated: bool

    @property
    def qkv_width(self) -> int:
        return self.n_heads * self.head_dim * (2 if self.gated else 1) + 2 * self.n_kv * self.head_dim

    @classmethod
    def from_args(cls, args) -> AttnDims:
        """From a ModelArgs (or anything with its attention attributes)."""
        return cls(
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            args.rotary_dim,
            bool(args.attn_output_gate),
        )


# --------------------------------------------------------------------------------------------
# Router


def router_topk_ref(
    logits: torch.Tensor,
    num_experts: int,
    top_k: int,
    normalize: bool,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
    gate_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``Router.forward`` after its linear, on logits [N, E + X]: writes weights_out [N, A]
    (logits' dtype), ids_out [N, A] int64 and, if given, gate_out [N, 1] = sigmoid(logits[:, E])
    (``SparseMoe.shared_output``'s gate). Returns the three outputs."""
    probs = torch.softmax(logits[:, :num_experts], dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    weights_out.copy_(top.to(logits.dtype))
    ids_out.copy_(ids)
    if gate_out is not None:
        gate_out.copy_(torch.sigmoid(logits[:, num_experts : num_experts + 1]))
    return weights_out, ids_out, gate_out


def decisive_rows(logits: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows of logits [N, E + X] decide the reference's top-k: (set, order), each a bool
    [N]. set: the k-th and (k+1)-th probabilities differ, so which experts is decided; order:
    the top-(k+1) probabilities strictly decrease, so their order is decided too."""
    probs = torch.softmax(logits[:, :num_experts], dim=-1, dtype=torch.float32)
    top = torch.topk(probs, min(top_k + 1, num_experts), dim=-1).values
    steps = top[:, :-1] > top[:, 1:]
    if top_k == num_experts:  # every expert is picked: the set always, the order by the steps
        return torch.ones_like(steps[:, 0]), steps.all(-1)
    return steps[:, top_k - 1], steps.all(-1)


def random_router_inputs(
    n: int,
    num_experts: int,
    top_k: int,
    extra: int = 0,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    normalize: bool = True,
) -> dict:
    """Keyword arguments of ``router_topk_ref`` / ``router_topk``: logits [n, E + extra] like a
    router's (a few units wide), outputs allocated; gate_out when extra >= 1."""
    logits = (torch.randn(n, num_experts + extra, generator=generator, device=device) * 2).to(dtype)
    return dict(
        logits=logits,
        num_experts=num_experts,
        top_k=top_k,
        normalize=normalize,
        weights_out=torch.empty(n, top_k, dtype=dtype, device=device),
        ids_out=torch.empty(n, top_k, dtype=torch.int64, device=device),
        gate_out=torch.empty(n, 1, dtype=dtype, device=device) if extra else None,
    )


# --------------------------------------------------------------------------------------------
# Attention


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``Rotary.inv_freq``: fp32 [R/2], computed on the CPU (also while a model is built on the
    meta device, where arange would import torch's compiler stack), then moved to ``device`` if
    one is given."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim
    inv = 1.0 / (theta**exponents)
    return inv if device is None else inv.to(device)


def rotary_ref(
    pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Rotary.forward``: positions [T] -> cos, sin [T, R] in dtype."""
    freqs = pos.float()[:, None] * inv_freq.to(pos.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary``: x [..., Dh], cos / sin [T, R] with R <= Dh; channels past R pass."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def attention_decode_ref(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    unit_offset: bool,
    inv_freq: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    gated: bool,
) -> torch.Tensor:
    """``Attention.decode_static`` for one token between the projections and o_proj.

    qkv [1, Q + 2·Hk·Dh]: q_proj | k_proj | v_proj outputs (Q = H·Dh, or 2·H·Dh when gated: per
    head its query then its output gate); q_norm_w, k_norm_w [Dh]; inv_freq fp32 [R/2]; pos
    int64 [1]; k_cache, v_cache [1, Hk, S, Dh] (the new key and value written at pos). Writes
    the o_proj input into out [1, H·Dh] and returns it.
    """
    H, Hk, Dh = n_heads, n_kv, head_dim
    B, T = 1, 1
    q_width = H * Dh * (2 if gated else 1)
    q, k, v = torch.split(qkv, [q_width, Hk * Dh, Hk * Dh], dim=-1)
    gate = None
    if gated:
        q, gate = q.view(B, T, H, 2 * Dh).chunk(2, dim=-1)
        gate = gate.reshape(B, T, -1)
    q = rms_norm_ref(q.reshape(B, T, H, Dh), q_norm_w, eps, unit_offset).transpose(1, 2)
    k = rms_norm_ref(k.view(B, T, Hk, Dh), k_norm_w, eps, unit_offset).transpose(1, 2)
    v = v.view(B, T, Hk, Dh).transpose(1, 2)
    cos, sin = rotary_ref(pos, inv_freq, qkv.dtype)
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    q = q.reshape(B, Hk, H // Hk, Dh)
    kv_index = torch.arange(k_cache.shape[2], device=k_cache.device)
    scores = torch.matmul(q.float() * Dh**-0.5, k_cache.float().transpose(-1, -2))
    scores = scores.masked_fill((kv_index > pos)[None, None, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1).to(v_cache.dtype), v_cache)
    o = o.reshape(B, T, H * Dh)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    out.copy_(o.reshape(1, H * Dh))
    return out


def random_attention_inputs(
    dims: AttnDims,
    s_max: int,
    pos: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    unit_offset: bool = True,
    eps: float = 1e-6,
    theta: float = 10_000_000.0,
) -> dict:
    """Keyword arguments of ``attention_decode_ref`` / ``attention_decode`` for a step at
    ``pos``: random projections, norm weights drawn like a trained layer's, a random history in
    every cache row (the rows past pos too: the step must ignore them), out allocated."""

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device=device) * scale

    H, Hk, Dh = dims.n_heads, dims.n_kv, dims.head_dim
    offset = 0.0 if unit_offset else 1.0
    return dict(
        qkv=randn(1, dims.qkv_width, scale=2.0).to(dtype),
        q_norm_w=(offset + randn(Dh, scale=0.3)).to(dtype),
        k_norm_w=(offset + randn(Dh, scale=0.3)).to(dtype),
        eps=eps,
        unit_offset=unit_offset,
        inv_freq=rope_inv_freq(dims.rotary_dim, theta, device),
        pos=torch.tensor([pos], dtype=torch.int64, device=device),
        k_cache=randn(1, Hk, s_max, Dh).to(dtype),
        v_cache=randn(1, Hk, s_max, Dh).to(dtype),
        out=torch.empty(1, H * Dh, dtype=dtype, device=device),
        n_heads=H,
        n_kv=Hk,
        head_dim=Dh,
        gated=dims.gated,
    )


def poison_future(inputs: dict) -> None:
    """NaN in every cache row past pos (a host read of pos: test set-up only): a step that read
    any of them would give a non-finite output."""
    p = int(inputs["pos"])
    inputs["k_cache"][:, :, p + 1 :] = float("nan")
    inputs["v_cache"][:, :, p + 1 :] = float("nan")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN rows included, which torch.equal calls unequal)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = a.element_size()
    return a.dtype == b.dtype and torch.equal(a.view(ints[size]), b.view(ints[size]))


# --------------------------------------------------------------------------------------------
# Probe cases


def _repeats(what: str, runs: list[dict], names: tuple[str, ...]) -> None:
    for name in names:
        a, b = runs[0][name], runs[1][name]
        if a is not None and not same_bits(a, b):
            raise Mismatch(f"{what}: two runs on the same inputs differ in {name} (not deterministic)")


def check_router(runs: list[dict], ref: dict, tol: float) -> float:
    """Two ``router_topk`` runs (their keyword arguments, after the calls) against
    ``router_topk_ref``'s: ids as the module docstring says, weights and gate within ``tol`` of
    the output's scale, the runs bit-equal. The worst error, or Mismatch saying what differs."""
    got, E, A = runs[0], ref["num_experts"], ref["top_k"]
    decided_set, decided_order = decisive_rows(ref["logits"], E, A)
    if not torch.equal(got["ids_out"][decided_order], ref["ids_out"][decided_order]):
        raise Mismatch(f"router_topk (E {E}, k {A}): expert ids differ from the reference's")
    sets = (got["ids_out"].sort(-1).values == ref["ids_out"].sort(-1).values).all(-1)
    if not sets[decided_set].all():
        raise Mismatch(f"router_topk (E {E}, k {A}): the selected experts differ from the reference's")
    worst = within(f"router_topk (E {E}, k {A}) weights", got["weights_out"], ref["weights_out"], tol)
    if ref["gate_out"] is not None:
        worst = max(worst, within("router_topk gate", got["gate_out"], ref["gate_out"], tol))
    _repeats("router_topk", runs, ("weights_out", "ids_out", "gate_out"))
    return worst


def check_attention(runs: list[dict], ref: dict, before: dict, tol: float) -> float:
    """Two ``attention_decode`` runs (keyword arguments after the calls; ``before``: the first's
    before it) against ``attention_decode_ref``'s: the output and the key written at pos within
    ``tol`` of their scale, the value at pos and every other cache row bit for bit, the runs
    bit-equal. The worst error, or Mismatch saying what differs."""
    got, p = runs[0], int(ref["pos"])
    what = f"attention_decode (H {ref['n_heads']}, Hk {ref['n_kv']}, Dh {ref['head_dim']}, pos {p})"
    worst = within(f"{what} output", got["out"], ref["out"], tol)
    k_row, k_ref = got["k_cache"][:, :, p], ref["k_cache"][:, :, p]
    worst = max(worst, within(f"{what} key at pos", k_row, k_ref, tol))
    if not same_bits(got["v_cache"][:, :, p], ref["v_cache"][:, :, p]):
        raise Mismatch(f"{what}: the value written at pos is not the projection's")
    rows = torch.arange(got["k_cache"].shape[2], device=k_row.device) != p
    for name in ("k_cache", "v_cache"):
        if not same_bits(got[name][:, :, rows], before[name][:, :, rows]):
            raise Mismatch(f"{what}: {name} rows other than pos changed")
    _repeats(what, runs, ("out", "k_cache", "v_cache"))
    return worst


def run_attention(inputs: dict, kernel) -> tuple[list[dict], dict, dict]:
    """``kernel`` (``attention_decode``) twice and the reference once on copies of ``inputs``,
    the kernel's cache rows past pos poisoned first: (runs, ref, before) for check_attention."""
    ref = clone_inputs(inputs)
    attention_decode_ref(**ref)
    runs = [clone_inputs(inputs) for _ in range(2)]
    for r in runs:
        poison_future(r)
    before = clone_inputs(runs[0])
    for r in runs:
        kernel(**r)
    return runs, ref, before


def capacity_mismatch(
    kernel, dims: AttnDims, pos: int, capacities: list[int], gen, device, dtype
) -> str | None:
    """``kernel`` (``attention_decode``) on one history at ``pos`` held in caches of each
    capacity: the output and the cache rows 0..pos must be the same bits whatever the capacity
    (a static decode state's size follows the request's length; its tokens must not). None, or
    the capacity that differs."""
    base = random_attention_inputs(dims, capacities[0], pos, gen, device=device, dtype=dtype)
    first = None
    for cap in capacities:
        inputs = clone_inputs(base)
        for name in ("k_cache", "v_cache"):
            t = base[name]
            big = torch.full((*t.shape[:2], cap, t.shape[3]), float("nan"), dtype=t.dtype, device=t.device)
            big[:, :, : pos + 1] = t[:, :, : pos + 1]
            inputs[name] = big
        kernel(**inputs)
        got = (inputs["out"], inputs["k_cache"][:, :, : pos + 1], inputs["v_cache"][:, :, : pos + 1])
        if first is None:
            first = got
        elif not all(same_bits(a, b) for a, b in zip(got, first, strict=True)):
            return f"pos {pos}: a cache of {cap} positions gives other bits than one of {capacities[0]}"
    return None


def window_mismatch(
    kernel, dims: AttnDims, start: int, n: int, s_max: int, gen, device, dtype, unit_offset: bool = True
) -> str | None:
    """``kernel`` (``attention_decode``) on a speculative verify window: n tokens of one sequence
    at start..start + n - 1 over a random history, in one call (``window``), against n one-row
    calls in order on copies of the same inputs. The window's own positions hold random keys
    before it (each row must read only those the rows up to it wrote), later ones NaN (read by
    none). None when every row's output and the caches afterwards are the same bits, else what
    differs."""
    inputs = random_attention_inputs(dims, s_max, start, gen, device, dtype, unit_offset)
    inputs["qkv"] = (torch.randn(n, dims.qkv_width, generator=gen, device=device) * 2).to(dtype)
    inputs["pos"] = torch.arange(start, start + n, device=device)
    inputs["out"] = torch.empty(n, dims.n_heads * dims.head_dim, dtype=dtype, device=device)
    for name in ("k_cache", "v_cache"):
        inputs[name][:, :, start + n :] = float("nan")
    rows = clone_inputs(inputs)
    kernel(**inputs, window=True)
    for j in range(n):
        kernel(
            **{
                **rows,
                "qkv": rows["qkv"][j : j + 1],
                "pos": rows["pos"][j : j + 1],
                "out": rows["out"][j : j + 1],
            }
        )
    what = f"a window of {n} at {start} ({dtype}, gated {dims.gated})"
    for j in range(n):
        if not same_bits(inputs["out"][j], rows["out"][j]):
            return f"{what}: row {j}'s output is not the one-row call's"
    for name in ("k_cache", "v_cache"):
        if not same_bits(inputs[name], rows[name]):
            return f"{what}: {name} afterwards is not the one-row calls'"
    return None


def run_router(inputs: dict, kernel) -> tuple[list[dict], dict]:
    """``kernel`` (``router_topk``) twice and the reference once: (runs, ref) for check_router."""
    ref = clone_inputs(inputs)
    router_topk_ref(**ref)
    runs = [clone_inputs(inputs) for _ in range(2)]
    for r in runs:
        kernel(**r)
    return runs, ref


def probe_cases(args, device: torch.device | str, dtype: torch.dtype) -> float:
    """Run ``router_topk`` and ``attention_decode`` at ``args``' geometry (a ModelArgs, or
    anything with its attention, rope, norm and expert attributes) on ``device`` (CUDA; CPU
    under Triton's interpreter) in ``dtype``, twice each, against the references on random
    inputs: four router rows (with the shared-expert gate column when the model has a shared
    expert), and one attention step at PROBE_POS over a random history in a PROBE_S_MAX buffer.
    Returns the worst error relative to an output's scale; Mismatch names the case that was over
    TOLERANCE (the module docstring says why those limits) or did not repeat bit for bit. A
    geometry the kernels cannot run is a Mismatch too. Skips attention without attention heads
    and the router without experts."""
    from edgerun.kernels import decode_triton as K

    if dtype not in TOLERANCE:
        raise Mismatch(f"no kernel for model dtype {dtype}")
    device = torch.device(device)
    tol = TOLERANCE[dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    E, A = args.num_experts, args.num_experts_per_tok
    if E > 0:
        why = K.unsupported_router(E, A)
        if why:
            raise Mismatch(f"router_topk: {why}")
        extra = 1 if getattr(args, "shared_expert_intermediate_size", 0) > 0 else 0
        inputs = random_router_inputs(4, E, A, extra, gen, device, dtype, args.norm_topk_prob)
        worst = max(worst, check_router(*run_router(inputs, K.router_topk), tol))
    if args.num_attention_heads > 0:
        dims = AttnDims.from_args(args)
        why = K.unsupported_attention(dims.n_heads, dims.n_kv, dims.head_dim, dims.rotary_dim)
        if why:
            raise Mismatch(f"attention_decode: {why}")
        inputs = random_attention_inputs(
            dims, PROBE_S_MAX, PROBE_POS, gen, device, dtype, args.norm_unit_offset,
            args.rms_norm_eps, args.rope_theta,
        )  # fmt: skip
        worst = max(worst, check_attention(*run_attention(inputs, K.attention_decode), tol))
    return worst
