"""The one entry for the routed-expert step over a slot pool, and the policy field that picks
its implementation.

Every implementation here is tested against ``moe_experts_ref`` (equal, or within the tolerance
kernels/probe.py states), so the policy decides speed, never which tokens come out. The engine
sets ``impl="triton"`` only after ``probe`` selected it on the device. Importing this module
does not import Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgerun.bundle.layout import BlockLayout
from edgerun.errors import ConfigError
from edgerun.kernels.moe_reference import FarTier, RouterLogits, moe_experts_ref

IMPLS = ("reference", "triton", "cpu", "cpu_grouped")
# tokens of a step at or below which the fused dequant+GEMV (``moe_gemv``) runs rather than the
# grouped GEMM (``moe_grouped``), by the experts' format: where the GEMV stopped being faster on
# an H200 at Qwen3.6's geometry (benchmarks/bench_moe_kernel.py --grouped, docs/benchmarks.md,
# "Prompts of up to 256 tokens on the decode kernels"): int4 still 0.90x at 256 tokens, int8
# 0.84x at 128 and 1.07x at 192, bf16 0.90x at 96 and 1.05x at 128. Every decode step (a batch
# of at most 8 rows, a verify window) is below all three.
GEMV_MAX_TOKENS = {"int4": 256, "int8": 128, "bf16": 96}
ACTS = ("bf16", "int8")  # the GEMV's gate_up on x as it is, or quantized to int8 per 32 (W4A8)


@dataclass(frozen=True)
class MoeKernelPolicy:
    impl: str = "reference"  # reference: dequantize_block + combine_experts; triton: kernels/moe_triton.py;
    # cpu: torch's int4 / int8 weight-only CPU GEMMs on slots repacked once per fill (kernels/moe_cpu.py);
    # cpu_grouped: one C call per layer from the slots' own bytes (kernels/moe_cpu_grouped.py)
    # triton, T at or below: fused dequant+GEMV; above: the grouped GEMM (None: GEMV_MAX_TOKENS)
    gemv_max_tokens: int | None = None
    # int8 (triton; int4 g32 experts, unrotated): the GEMV's gate_up products W4A8 on x quantized
    # to int8 per 32 columns (``moe_triton.moe_gemv``'s ``xq``): given by the router's launch in a
    # decode graph, else quantized by ``moe_experts`` (``qlinear_w4a8.quantize_x``), the same bits
    act: str = "bf16"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ConfigError(f"expert kernel {self.impl!r} is not one of {', '.join(IMPLS)}")
        if self.act not in ACTS:
            raise ConfigError(f"expert activations {self.act!r} are not one of {', '.join(ACTS)}")
        if self.act == "int8" and self.impl != "triton":
            raise ConfigError(f"int8 expert activations run in the Triton expert kernel, not {self.impl}")
        if self.gemv_max_tokens is not None and self.gemv_max_tokens < 0:
            raise ConfigError(f"gemv_max_tokens must be >= 0, got {self.gemv_max_tokens}")

    def gemv_tokens(self, layout: BlockLayout) -> int:
        """The most tokens of a step of ``layout``'s experts that the GEMV runs."""
        if self.gemv_max_tokens is not None:
            return self.gemv_max_tokens
        return GEMV_MAX_TOKENS[layout.quant]


def folds_route(policy: MoeKernelPolicy, layout: BlockLayout, rows: int) -> bool:
    """Whether a step of ``rows`` tokens over a slot table (every expert held) can leave its top-k
    to the expert launch (``moe_experts``' ``route``): the decode kernel runs it."""
    return policy.impl == "triton" and 0 < rows <= policy.gemv_tokens(layout)


def moe_experts(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None = None,
    policy: MoeKernelPolicy = MoeKernelPolicy(),
    out_dtype: torch.dtype | None = None,
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
    table: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    packed: dict | None = None,
    far: FarTier | None = None,
    shared_down: tuple | None = None,
    xq: tuple[torch.Tensor, ...] | None = None,
    route: RouterLogits | None = None,
) -> torch.Tensor:
    """x [T, D], pool uint8 [S, block_bytes], slot_idx / expert_ids int64 [T, A], weights [T, A],
    global_scales fp32 [S, 2] (int4) -> [T, D] in ``out_dtype`` (default x's dtype). A token's
    experts are summed in ascending expert-id order whichever implementation runs.

    In parts: with ``expert_range`` (lo, hi) only those experts run (entries of other experts may
    hold any slot: they are not read), added into ``acc`` from :func:`accumulator`; calls over
    consecutive ranges in ascending order give the bits one call would. Round the sum to x's dtype at the
    end.

    ``table`` (int64 [E]: the slot of every expert, when the layer holds them all): slots are
    ``table[expert_ids]`` and ``slot_idx`` is not read (the decode kernel looks them up itself).
    ``into`` (resid [T, D], shared [T, D] or None): the result is added into ``resid`` in place,
    rounded as ``resid.add_(routed + shared)`` rounds; ``resid`` is returned (the decode kernel
    does it in its epilogue). ``packed`` (cpu): slot -> the slot's weights repacked for the CPU
    kernels, kept by the caller across steps (the cache drops a slot's entry when it refills it).
    ``far`` (:class:`FarTier`): slots from S = pool.shape[0] on are its rows, pinned host memory
    the GPU reads in place, or the cache's spill rows (a miss served without a slot), in any
    memory the kernel reads (global scales then cover both: [S + R, 2]). ``shared_down``: the
    shared expert's down projection into ``into``'s shared output, in the decode kernel's gate_up
    launch (``moe_triton.moe_gemv``'s); only where that kernel runs the step. ``xq``: x quantized
    to int8 per 32 columns, where the policy's ``act`` is int8 and something stored it already
    (the router's launch: ``qgemv``'s ``norm_q_out``); else the GEMV step quantizes x itself.
    Steps past the GEMV (the grouped GEMM of a long prompt) take x as it is. ``route``: the
    router's logits, routed into ``expert_ids`` and ``weights`` by the decode kernel's launch
    (``moe_triton.moe_gemv``'s; :func:`folds_route` says where it runs)."""
    if xq is not None and policy.act != "int8":
        raise ValueError(
            f"xq is x quantized to int8 for int8 expert activations; this policy's are {policy.act}"
        )
    part = dict(acc=acc, expert_range=expert_range) if expert_range is not None else {}
    if part and (table is not None or into is not None):
        raise ValueError("a step run in parts takes neither a slot table nor a residual")
    if policy.impl == "triton" and x.shape[0] <= policy.gemv_tokens(layout):
        from edgerun.kernels import moe_triton

        if policy.act == "int8" and xq is None:
            from edgerun.kernels.qlinear_w4a8 import quantize_x

            xq = quantize_x(x)
        return moe_triton.moe_gemv(
            x, pool, slot_idx, expert_ids, weights, layout, global_scales, out_dtype, table=table, into=into,
            far=far, shared_down=shared_down, xq=xq, route=route, **part,
        )  # fmt: skip
    if route is not None:
        raise ValueError(
            f"route runs in the decode kernel's launch; this step runs {policy.impl} on {x.shape[0]} token(s)"
        )
    if shared_down is not None:
        raise ValueError(
            f"shared_down runs in the decode kernel's launch; this step runs {policy.impl} on {x.shape[0]} token(s)"
        )
    if table is not None:
        slot_idx = table[expert_ids]
    args = (x, pool, slot_idx, expert_ids, weights, layout, global_scales, out_dtype)
    if policy.impl == "reference":
        routed = moe_experts_ref(*args, **part, far=far)
    elif policy.impl == "cpu":
        from edgerun.kernels.moe_cpu import moe_cpu

        routed = moe_cpu(*args[:7], {} if packed is None else packed, out_dtype, **part, far=far)
    elif policy.impl == "cpu_grouped":
        from edgerun.kernels.moe_cpu_grouped import moe_grouped

        routed = moe_grouped(*args, **part, far=far)
    else:
        from edgerun.kernels import moe_triton

        routed = moe_triton.moe_grouped(*args, **part, far=far)
    return add_into(routed, into)


def add_into(routed: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor | None] | None) -> torch.Tensor:
    """``routed`` added into ``into``'s residual in place with the shared expert's output, as
    ``moe_experts`` rounds it (``routed`` itself without ``into``)."""
    if into is None:
        return routed
    resid, shared = into
    return resid.add_(routed if shared is None else routed + shared)


def accumulator(x: torch.Tensor, policy: MoeKernelPolicy) -> torch.Tensor:
    """The running sum of an expert step run in parts: x's dtype for the reference (which sums
    in x's dtype), fp32 for the Triton and CPU paths (which sum in fp32 and round once)."""
    return torch.zeros(
        x.shape, dtype=x.dtype if policy.impl == "reference" else torch.float32, device=x.device
    )
