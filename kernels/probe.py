"""Start-up capability probe for the Triton expert kernels.

A kernel is selected only after it ran on the device and matched its torch reference, never
because a symbol imports. ``probe`` runs the real layout (geometry, scheme, group, rotation) on a
few random slots through both Triton paths the policy can take (fused GEMV for decode, bf16
scratch + GEMM for prefill), twice each:

- accuracy: max |out - ref| <= TOLERANCE * max |ref|, ref = ``moe_experts_ref`` in fp32 on the
  same bf16 inputs. The kernel's output is bf16 (8 significant bits: a rounding of up to 2^-9,
  0.2%, of the value), and the GEMM path also rounds int8 weights, x, gate/up and h to bf16; those
  errors stay well under 1% of the output's scale. 2e-2 leaves margin for that and still refuses
  real faults (a wrong nibble order, scale, slot or rotation moves the output by O(1) of its
  scale). Non-finite outputs fail.
- determinism: the two runs must be bitwise identical.

Any exception (no Triton, no CUDA device, a compile error, an unsupported layout) is a refusal
whose reason says why; the reference then runs. Nothing here reads or changes the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgerun.bundle.layout import BlockLayout
from edgerun.kernels.moe import MoeKernelPolicy, moe_experts
from edgerun.kernels.moe_reference import RouterLogits, layout_dims, moe_experts_ref, random_pool

TOLERANCE = 2e-2
TRITON = MoeKernelPolicy(impl="triton")


@dataclass(frozen=True)
class ProbeResult:
    name: str
    selected: bool
    reason: str


def kernel_name(layout: BlockLayout) -> str:
    fmt = layout.quant + (f" g{layout.group_size}" if layout.group_size else "")
    return f"moe_triton[{fmt}{' hadamard' if layout.rotation == 'hadamard' else ''}]"


def _guarded(name: str, check, *args) -> ProbeResult:
    """``check(*args)`` -> (selected, reason) as a ProbeResult named ``name``; whatever it raises
    (a build, a launch, a kernel) is a refusal whose reason says what broke."""
    try:
        selected, reason = check(*args)
    except Exception as e:
        selected, reason = False, f"{type(e).__name__}: {e}".strip()
    return ProbeResult(name, selected, reason)


def probe(
    layout: BlockLayout,
    device: torch.device | str,
    top_k: int = 8,
    policy: MoeKernelPolicy = TRITON,
) -> ProbeResult:
    """Run ``layout``'s experts through the Triton kernels on ``device`` and compare with the
    reference; selected only if every case matches within TOLERANCE and repeats bit for bit."""
    return _guarded(kernel_name(layout), _probe, layout, torch.device(device), top_k, policy)


def _probe(
    layout: BlockLayout, device: torch.device, top_k: int, policy: MoeKernelPolicy
) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"Triton kernels run on CUDA devices; this one is {device}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available to torch"
    try:
        from edgerun.kernels import moe_triton
    except ImportError as e:
        return False, f"Triton is not importable: {e}"
    why = moe_triton.unsupported(layout)
    if why:
        return False, why
    # the GEMV at one token and at its most (a prompt), the grouped GEMM past it
    n = policy.gemv_tokens(layout)
    tokens = sorted({t for t in (1, n, n + 1) if t > 0})
    ok, worst = _cases(layout, device, top_k, policy, tokens, torch.bfloat16)
    if not ok:
        return False, worst
    why = _route_case(layout, device, top_k, policy)
    if why:
        return False, why
    torch.cuda.synchronize(device)
    return True, (
        f"matched the reference on {torch.cuda.get_device_name(device)} (max error {worst:.1e} of the "
        f"output's scale, limit {TOLERANCE:g}) and repeated bit for bit"
    )


CPU = MoeKernelPolicy(impl="cpu")


def probe_cpu(layout: BlockLayout, top_k: int = 8) -> ProbeResult:
    """The CPU kernels (kernels/moe_cpu.py) on ``layout``: the repack must equal torch's own
    ``_convert_weight_to_int4pack_for_cpu`` (its layout may differ on another CPU or torch), and
    one token and a few, against the fp32 reference, as ``probe`` checks the Triton kernels."""
    from edgerun.kernels import moe_cpu

    return _guarded(moe_cpu.kernel_name(layout), _probe_cpu, layout, top_k)


def _probe_cpu(layout: BlockLayout, top_k: int) -> tuple[bool, str]:
    from edgerun.bundle.quant import unpack_int4
    from edgerun.kernels import moe_cpu

    why = moe_cpu.unsupported(layout)
    if why:
        return False, why
    if layout.quant == "int4":
        why = moe_cpu.int4_layout_unknown()
        if why:
            return False, why
        pool, gscales = random_pool(layout, 1, generator=torch.Generator().manual_seed(1))
        c = layout.component("down.weight")
        nibbles = unpack_int4(pool[0, c.offset : c.offset + c.nbytes].view(c.shape)).int() + 8
        if not torch.equal(
            moe_cpu.pack_block(layout, pool[0], gscales[0])[1][0],
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1),
        ):
            return False, "the repacked int4 layout is not the one this torch's CPU kernel reads"
    ok, worst = _cases(layout, torch.device("cpu"), top_k, CPU, (1, 5), torch.float32, rows=True)
    if not ok:
        return False, worst
    return True, f"matched the reference (max error {worst:.1e} of the output's scale, limit {TOLERANCE:g})"


GROUPED = MoeKernelPolicy(impl="cpu_grouped")


def probe_cpu_grouped(layout: BlockLayout, top_k: int = 8) -> ProbeResult:
    """The grouped C kernel (kernels/moe_cpu_grouped.py) on ``layout``: built here (no compiler
    or a failed build is a refusal saying so), one token and a few against the fp32 reference as
    ``probe_cpu`` checks torch's, and one token's bits the same on 1 and 2 threads."""
    from edgerun.kernels import moe_cpu_grouped

    return _guarded(moe_cpu_grouped.kernel_name(layout), _probe_cpu_grouped, layout, top_k)


def _probe_cpu_grouped(layout: BlockLayout, top_k: int) -> tuple[bool, str]:
    from edgerun.kernels import moe_cpu_grouped

    why = moe_cpu_grouped.unsupported(layout)
    if why:
        return False, why
    moe_cpu_grouped.library()  # BuildError: no compiler, a compile error
    ok, worst = _cases(layout, torch.device("cpu"), top_k, GROUPED, (1, 5), torch.float32, rows=True)
    if not ok:
        return False, worst
    D, _ = layout_dims(layout)
    gen = torch.Generator().manual_seed(2)
    pool, gscales = random_pool(layout, top_k, generator=gen)
    ids = torch.randperm(top_k, generator=gen)[None]
    x, weights = torch.randn(1, D, generator=gen), torch.rand(1, top_k, generator=gen)
    runs = [
        moe_cpu_grouped.moe_grouped(x, pool, ids, ids, weights, layout, gscales, threads=n) for n in (1, 2)
    ]
    if not torch.equal(*runs):
        return False, "one token's result differs between 1 and 2 threads"
    return True, (
        f"matched the reference (max error {worst:.1e} of the output's scale, limit {TOLERANCE:g}), "
        "the same bits on 1 and 2 threads"
    )


def _route_case(layout: BlockLayout, device: torch.device, top_k: int, policy: MoeKernelPolicy) -> str | None:
    """A decode step that leaves its top-k to the expert launch (``moe_experts``' ``route``, over
    a slot table), at one token and a batch's eight: the ids, weights and output must be those
    of ``router_topk``'s launch followed by the step on its ids, bit for bit. None, or why not."""
    from edgerun.kernels.decode_triton import router_topk

    D, _ = layout_dims(layout)
    E = top_k + 2
    gen = torch.Generator(device=device).manual_seed(1)
    pool, gscales = random_pool(layout, E, generator=gen, device=device)
    table = torch.randperm(E, generator=gen, device=device)
    for T in (t for t in (1, 8) if t <= policy.gemv_tokens(layout)):
        x = torch.randn(T, D, generator=gen, device=device).bfloat16()
        logits = torch.randn(T, E + 1, generator=gen, device=device).bfloat16()
        w, ids = (
            torch.empty(T, top_k, dtype=x.dtype, device=device),
            torch.empty(T, top_k, dtype=torch.long, device=device),
        )
        router_topk(logits, E, top_k, True, w, ids)
        want = moe_experts(x, pool, table[ids], ids, w, layout, gscales, policy=policy, table=table)
        got_w, got_ids = torch.full_like(w, float("nan")), torch.full_like(ids, -1)
        got = moe_experts(x, pool, table[ids], got_ids, got_w, layout, gscales, policy=policy, table=table,
                          route=RouterLogits(logits, E, True))  # fmt: skip
        if not (torch.equal(got_ids, ids) and torch.equal(got_w, w) and torch.equal(got, want)):
            return f"T={T}: the top-k in the expert launch differs from router_topk's launch"
    return None


def _cases(
    layout: BlockLayout,
    device: torch.device,
    top_k: int,
    policy: MoeKernelPolicy,
    tokens,
    x_dtype: torch.dtype,
    rows: bool = False,
) -> tuple[bool, float | str]:
    """Random cases of each token count through ``policy``'s kernels against the fp32 reference:
    within TOLERANCE, repeated bit for bit and (``rows``) a token's result independent of the
    other tokens of its batch. (True, the worst error) or (False, why not)."""
    D, _ = layout_dims(layout)
    S = top_k + 2
    gen = torch.Generator(device=device).manual_seed(0)
    pool, gscales = random_pool(layout, S, generator=gen, device=device)
    slot_of = torch.randperm(S, generator=gen, device=device)  # expert e sits in slot slot_of[e]
    worst = 0.0
    for T in tokens:
        x = torch.randn(T, D, generator=gen, device=device).to(x_dtype)
        ids = torch.rand(T, S, generator=gen, device=device).argsort(dim=1)[:, :top_k]
        weights = torch.rand(T, top_k, generator=gen, device=device).softmax(dim=-1)
        args = (x, pool, slot_of[ids], ids, weights, layout, gscales)
        runs = [moe_experts(*args, policy=policy) for _ in range(2)]
        seen = x.float()
        if policy.act == "int8" and T <= policy.gemv_tokens(layout):  # the values int8 x holds
            from edgerun.kernels.qlinear_w4a8 import quantized_values_ref

            seen = quantized_values_ref(x)
        ref = moe_experts_ref(seen, *args[1:])
        if not torch.isfinite(runs[0]).all():
            return False, f"T={T}: non-finite output"
        err = float((runs[0].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if err > TOLERANCE:
            return False, f"T={T}: max error {err:.2e} of the output's scale is over {TOLERANCE:g}"
        if not torch.equal(runs[0], runs[1]):
            return False, f"T={T}: two runs on the same inputs differ (not deterministic)"
        if rows:
            one = moe_experts(
                x[:1], pool, slot_of[ids[:1]], ids[:1], weights[:1], layout, gscales, policy=policy
            )
            if not torch.equal(one, runs[0][:1]):
                return False, f"T={T}: a token's result depends on the other tokens in its batch"
        worst = max(worst, err)
    return True, worst
