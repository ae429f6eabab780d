"""The kernel policy: every implementation choice a decode path makes, in one object the engine
owns, resolved once at load against the device.

A request (``KernelPolicy``) says what may run; ``resolve`` turns it into what does run
(``Resolved``), probing each kernel on the device first: a kernel is selected only after it ran
one small case there and matched its torch reference. What was asked for (or what ``auto`` would
pick) and did not resolve is a *fallback* with its reason, shown in the start-up line and counted
in /metrics. Nothing here reads the environment.

Fields and what they decide:

- ``experts``: the routed-expert step over the slot pool. ``reference`` dequantizes each expert
  with torch (``kernels/moe_reference.py``); ``triton`` runs the fused dequant + GEMV kernels
  (``kernels/moe_triton.py``); ``cpu`` torch's int4 / int8 weight-only CPU GEMMs on slots
  repacked once per fill (``kernels/moe_cpu.py``); ``cpu_grouped`` one C call per layer for all of
  a token's experts, from the slots' own bytes (``kernels/moe_cpu_grouped.py``, compiled at first
  use; without a compiler, or if its probe fails, ``cpu`` runs and the fallback says why; ``auto``
  on a CPU picks ``cpu_grouped`` where its probe passes, ``GROUPED_DEFAULT``). They agree within
  the probe's stated tolerance (fp32 vs bf16 accumulation), not bit for bit, so the choice is
  fixed for the life of the engine: every request, graph-captured or eager, runs the same kernels
  and decodes to the same tokens.
- ``dense``: the decode step's projections, norms, router, attention and Gated DeltaNet step.
  ``torch`` runs the model's own modules (cuBLAS, or an exact dequantization then cuBLAS for
  int8 / int4 weights; ~100 small kernels per DeltaNet layer); ``triton`` the fused kernels
  (``kernels/qlinear_triton.py``: one GEMV per fused projection straight from the stored
  bytes, with its epilogue; ``kernels/decode_triton.py``: router top-k, attention;
  ``kernels/dense_triton.py``: the DeltaNet step, norms). They round at the same points and
  agree within the dense probe's tolerance (a few bf16 ulps), not bit for bit: fixed for the
  engine's life, like ``experts``.
- ``dense`` on the CPU: the int4 / int8 projections through torch's weight-only CPU kernels
  (``kernels/qlinear_cpu.py``, bf16 activations) where their probe passes, within the bf16
  tolerance of the reference.
- ``dense`` also decides a prompt's DeltaNet delta rule: fla-core's chunked Triton kernels
  (``kernels/delta_chunk.py``) on CUDA for bf16 / fp16 models where their probe passes, else the
  torch reference; within that probe's tolerance of each other.
- ``graphs``: capture the decode step's device work in CUDA graphs (``engine/graphs.py``), or
  run exactly the same operations eagerly. Both emit identical tokens (tested).
- ``cpu`` (shown, not chosen here; in the start-up line's device line): the CPU's bf16 hardware
  (AVX512-BF16, AMX), the compute dtype it calls for when none is asked (``engine/setup.py``'s
  ``runtime`` takes it) and why, or that another was asked for (``kernels/cpu_features.py``).
- ``launches`` (shown, not chosen): the Triton decode kernels use programmatic dependent launch
  on sm_90+ (``kernels/launch.py``); it overlaps a kernel's weight reads with the previous
  kernel's tail and does not change a bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgerun.errors import ConfigError

if TYPE_CHECKING:  # importing the policy does not import torch: the daemon binds its socket first
    import torch

    from edgerun.kernels.moe import MoeKernelPolicy

EXPERT_KERNELS = ("auto", "reference", "triton", "cpu", "cpu_grouped")
DENSE_KERNELS = ("auto", "torch", "triton")
GRAPH_MODES = ("auto", "on", "off")
WINDOW_ROWS = ("auto", "shared", "alone")
DENSE_ACTS = ("bf16", "int8")  # the activations of int4 projections of many rows: as they are, or int8 (W4A8)
EXPERT_ACTS = ("bf16", "int8")  # the routed experts' gate_up in the GEMV: x as it is, or int8 (W4A8)
# auto on the CPU tries the grouped C kernel first: with an expert's tokens run together it
# measured at or above torch's kernels at 1 and 2 threads, decode and prefill (docs/benchmarks.md,
# "Grouped CPU expert kernel, an expert's tokens together"); a refused probe runs torch's, named
GROUPED_DEFAULT = True


@dataclass(frozen=True)
class KernelPolicy:
    experts: str = "auto"  # auto: triton (CUDA) or cpu (CPU) where its probe passes, else reference
    graphs: str = "auto"  # auto/on: capture on CUDA; off: the same step, eagerly
    dense: str = "auto"  # auto: fused Triton decode kernels where their probe passes, else torch
    # triton: at or below, fused GEMV; above, the grouped GEMM (None: by the experts' format,
    # kernels/moe.GEMV_MAX_TOKENS)
    gemv_max_tokens: int | None = None
    # a speculative verify window's projections: auto / shared, the rows in one GEMV (the weight
    # read once) where the start-up probe finds them bit for bit the one-row steps, else each row
    # by programs of its own; alone: each row by programs of its own (the weight read per row, in
    # parallel). Both give every row the one-row step's bits: a measurement switch
    window_rows: str = "auto"
    # int8: the int4 g32 projections of many rows a program (``Model.use_int8_activations``) take x
    # quantized to int8 per 32 columns in their decode GEMV (W4A8, kernels/qlinear_w4a8.py): fewer
    # instructions a weight value; a model's logits move by int8's rounding (docs/gpu.md)
    dense_act: str = "bf16"
    # int8: the routed experts' gate_up in the expert GEMV (int4 g32 experts, unrotated) on x
    # quantized to int8 per 32 columns, stored by the router's launch (``MoeKernelPolicy.act``)
    expert_act: str = "bf16"

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_KERNELS:
            raise ConfigError(f"expert kernel {self.experts!r} is not one of {', '.join(EXPERT_KERNELS)}")
        if self.dense not in DENSE_KERNELS:
            raise ConfigError(f"dense kernel {self.dense!r} is not one of {', '.join(DENSE_KERNELS)}")
        if self.graphs not in GRAPH_MODES:
            raise ConfigError(f"graphs {self.graphs!r} is not one of {', '.join(GRAPH_MODES)}")
        if self.dense_act not in DENSE_ACTS:
            raise ConfigError(f"dense activations {self.dense_act!r} are not one of {', '.join(DENSE_ACTS)}")
        if self.dense_act == "int8" and self.dense == "torch":
            raise ConfigError(
                "--dense-act int8 runs in the Triton GEMV: it does not combine with --dense-kernel torch"
            )
        if self.expert_act not in EXPERT_ACTS:
            raise ConfigError(
                f"expert activations {self.expert_act!r} are not one of {', '.join(EXPERT_ACTS)}"
            )
        if self.expert_act == "int8" and self.experts not in ("auto", "triton"):
            raise ConfigError(
                f"--expert-act int8 runs in the Triton expert kernel: it does not combine with --expert-kernel {self.experts}"
            )
        if self.window_rows not in WINDOW_ROWS:
            raise ConfigError(f"window rows {self.window_rows!r} is not one of {', '.join(WINDOW_ROWS)}")


@dataclass
class Resolved:
    moe: MoeKernelPolicy
    graphs: bool
    dense: str = "torch"
    window_rows: str = "auto"  # KernelPolicy.window_rows, as asked
    dense_act: str = "bf16"  # KernelPolicy.dense_act, where the Triton dense kernels run
    delta_chunk: bool = False  # prompts' DeltaNet delta rule through fla-core (kernels/delta_chunk.py)
    cpu_dense: bool = (
        False  # int4 / int8 projections through the CPU weight-only kernels (kernels/qlinear_cpu.py)
    )
    cpu: str = ""  # on the CPU: its bf16 hardware, the compute dtype, and its default here and why
    choices: dict[str, str] = field(default_factory=dict)  # field -> what runs and why
    fallbacks: dict[str, str] = field(default_factory=dict)  # field -> why the fast path is not used

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.choices.items())


def resolve(
    policy: KernelPolicy, device: torch.device, layouts=(), top_k: int = 8, args=None, dtype=None, gemv=()
) -> Resolved:
    """``layouts``: the bundle's expert block layouts when experts come from a slot pool (none
    for stacked resident experts, which run torch's own matmuls). ``args`` and ``dtype``: the
    model's geometry and compute dtype, for the dense kernels' probe (without them: torch).
    ``gemv``: the model's projection GEMV cases (``CausalLM.gemv_cases``), probed with them."""
    import torch

    from edgerun.kernels.moe import MoeKernelPolicy
    from edgerun.kernels.probe import probe

    device = torch.device(device)
    moe = MoeKernelPolicy(gemv_max_tokens=policy.gemv_max_tokens)
    out = Resolved(moe, graphs=False, window_rows=policy.window_rows)
    if not layouts:
        out.choices["experts"] = "torch (stacked resident weights)"
    elif policy.experts == "reference":
        out.choices["experts"] = "reference (by request)"
    elif device.type != "cuda":
        if policy.experts == "triton":
            out.choices["experts"] = "reference (Triton kernels run on CUDA)"
            out.fallbacks["expert_kernel"] = f"triton asked for, but the device is {device}"
        else:
            _resolve_cpu_experts(layouts, top_k, out, policy.experts)
    elif policy.experts in ("cpu", "cpu_grouped"):
        out.choices["experts"] = "reference (the CPU kernels run on the CPU)"
        out.fallbacks["expert_kernel"] = f"{policy.experts} asked for, but the device is {device}"
    else:
        results = [
            probe(layout, device, top_k=top_k, policy=MoeKernelPolicy("triton", *_sizes(policy)))
            for layout in layouts
        ]
        refused = [r for r in results if not r.selected]
        if refused:
            out.choices["experts"] = "reference"
            out.fallbacks["expert_kernel"] = f"{refused[0].name} not selected: {refused[0].reason}"
        else:
            out.moe = MoeKernelPolicy("triton", *_sizes(policy))
            out.choices["experts"] = f"{results[0].name} ({results[0].reason})"
    _resolve_dense(policy, device, args, dtype, out, gemv)
    if policy.dense_act == "int8":  # asked for by name: refused, not fallen back from
        if out.dense != "triton":
            why = out.fallbacks.get("dense_kernel") or out.choices.get("dense", "torch")
            raise ConfigError(
                f"--dense-act int8 runs in the Triton GEMV on CUDA; the dense kernels here are {why}"
            )
        out.dense_act = "int8"
    if policy.expert_act == "int8":
        _resolve_expert_act(policy, device, layouts, top_k, out)
    _resolve_delta_chunk(policy, device, args, dtype, out)
    if device.type != "cuda":
        out.choices["graphs"] = f"off (no CUDA graphs on {device.type})"
    elif policy.graphs == "off":
        out.choices["graphs"] = "off (by request)"
    else:
        out.graphs = True
        out.choices["graphs"] = "on"
    if out.dense == "triton" or out.moe.impl == "triton":
        from edgerun.kernels.launch import describe

        out.choices["launches"] = describe(device)
    if device.type == "cpu":
        from edgerun.kernels import cpu_features

        name = str(dtype or torch.float32).removeprefix("torch.")
        out.cpu = cpu_features.read().describe(name)
    return out


def _resolve_expert_act(policy: KernelPolicy, device, layouts, top_k: int, out: Resolved) -> None:
    """``--expert-act int8``, asked for by name: the Triton expert kernel with int8 activations
    where every layout takes them and their probe (against the reference on the quantized x's
    values) passes; refused by name otherwise, never fallen back from."""
    from edgerun.kernels.moe import MoeKernelPolicy
    from edgerun.kernels.probe import probe

    if out.moe.impl != "triton":
        why = out.fallbacks.get("expert_kernel") or out.choices.get("experts", "")
        raise ConfigError(
            f"--expert-act int8 runs in the Triton expert kernel on CUDA; the experts here run {why}"
        )
    from edgerun.kernels.moe_triton import a8_unsupported

    for layout in layouts:
        why = a8_unsupported(layout)
        if why:
            raise ConfigError(f"--expert-act int8: {why}")
    a8 = MoeKernelPolicy("triton", *_sizes(policy), act="int8")
    results = [probe(layout, device, top_k=top_k, policy=a8) for layout in layouts]
    refused = [r for r in results if not r.selected]
    if refused:
        raise ConfigError(f"--expert-act int8 refused on {device}: {refused[0].reason}")
    out.moe = a8
    out.choices["expert activations"] = (
        f"int8 per 32 columns (W4A8) in the expert GEMV's gate_up ({results[0].reason}); x as it is in "
        "the down projection and in prompts past the GEMV"
    )


def cpu_expert_kernel(asked: str) -> str:
    """The routed-expert kernel a CPU runs for ``asked`` (an ``EXPERT_KERNELS`` name) when its
    probe passes: ``cpu_grouped``, ``cpu`` or ``reference``. The planner counts what it holds
    (torch's kernels a repacked copy beside each int4 slot, the grouped kernel none)."""
    if asked not in EXPERT_KERNELS:
        raise ConfigError(f"expert kernel {asked!r} is not one of {', '.join(EXPERT_KERNELS)}")
    if asked in ("reference", "triton"):  # triton on a CPU: the reference, named as a fallback
        return "reference"
    return "cpu_grouped" if asked == "cpu_grouped" or (asked == "auto" and GROUPED_DEFAULT) else "cpu"


def _resolve_cpu_experts(layouts, top_k: int, out: Resolved, asked: str = "auto") -> None:
    """``cpu_grouped`` (asked for, or ``auto`` with GROUPED_DEFAULT) where its probe passes on
    every layout; else, or when ``cpu`` is asked for, torch's CPU kernels where theirs does; else
    the reference. A grouped kernel wanted and refused is the fallback ``expert_kernel_grouped``
    when torch's kernels run instead, part of ``expert_kernel``'s when the reference does."""
    from edgerun.kernels.moe import MoeKernelPolicy
    from edgerun.kernels.probe import probe_cpu, probe_cpu_grouped

    if cpu_expert_kernel(asked) == "cpu_grouped":
        results = [probe_cpu_grouped(layout, top_k) for layout in layouts]
        refused = [r for r in results if not r.selected]
        if not refused:
            out.moe = MoeKernelPolicy("cpu_grouped")
            out.choices["experts"] = f"{results[0].name} ({results[0].reason})"
            return
        out.fallbacks["expert_kernel_grouped"] = f"{refused[0].name} not selected: {refused[0].reason}"
    results = [probe_cpu(layout, top_k) for layout in layouts]
    refused = [r for r in results if not r.selected]
    if refused:  # one fallback, the reference, saying why each CPU kernel was not selected
        out.choices["experts"] = "reference"
        grouped = out.fallbacks.pop("expert_kernel_grouped", None)
        why = f"{refused[0].name} not selected: {refused[0].reason}"
        out.fallbacks["expert_kernel"] = f"{grouped}; {why}" if grouped else why
    else:
        out.moe = MoeKernelPolicy("cpu")
        by = " (by request)" if asked == "cpu" else ""
        out.choices["experts"] = f"{results[0].name}{by} ({results[0].reason})"


def _resolve_dense(policy: KernelPolicy, device: torch.device, args, dtype, out: Resolved, gemv=()) -> None:
    import torch

    if policy.dense == "torch":
        out.choices["dense"] = "torch (by request)"
        return
    if device.type != "cuda" or args is None:
        out.choices["dense"] = "torch" + (" (Triton kernels run on CUDA)" if device.type != "cuda" else "")
        if policy.dense == "triton":
            out.fallbacks["dense_kernel"] = f"triton asked for, but the device is {device}"
        elif device.type == "cpu" and any(c[0] != "plain" for c in gemv):
            from edgerun.kernels.qlinear_cpu import probe

            result = probe(gemv)
            if result.selected:
                out.cpu_dense = True
                out.choices["dense"] = (
                    f"{result.name} for the int4 / int8 projections ({result.reason}), torch for the rest"
                )
            else:
                out.fallbacks["dense_kernel"] = f"{result.name} not selected: {result.reason}"
        return
    from edgerun.kernels.dense_probe import probe_dense

    result = probe_dense(args, device, dtype or torch.bfloat16, gemv)
    if result.selected:
        out.dense = "triton"
        out.choices["dense"] = f"{result.name} ({result.reason})"
    else:
        out.choices["dense"] = "torch"
        out.fallbacks["dense_kernel"] = f"{result.name} not selected: {result.reason}"


def _resolve_delta_chunk(policy: KernelPolicy, device: torch.device, args, dtype, out: Resolved) -> None:
    """The delta rule of a prompt chunk in DeltaNet layers: fla-core's chunked kernels where
    their probe passes (CUDA, a bf16 / fp16 model), else the torch reference."""
    import torch

    if args is None or not getattr(args, "linear_num_key_heads", 0):
        return
    key = "deltanet prefill"
    if policy.dense == "torch":
        out.choices[key] = "torch (by request)"
        return
    if device.type != "cuda":
        out.choices[key] = "torch"
        return
    if dtype == torch.float32:
        out.choices[key] = "torch (an fp32 model keeps the reference's fp32 precision)"
        return
    from edgerun.kernels.delta_chunk import probe_chunk
    from edgerun.kernels.dense_reference import DeltaDims

    result = probe_chunk(DeltaDims.from_args(args), device)
    if result.selected:
        out.delta_chunk = True
        out.choices[key] = f"{result.name} ({result.reason})"
    else:
        out.choices[key] = "torch"
        out.fallbacks["deltanet_prefill"] = f"{result.name} not selected: {result.reason}"


def _sizes(policy: KernelPolicy) -> tuple[int | None]:
    return (policy.gemv_max_tokens,)
