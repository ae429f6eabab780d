"""The budget planner: where every byte goes on one device, before anything is allocated.

Pure arithmetic over the model's tensor inventory (built on the meta device), the expert block
layout and a device profile; nothing here allocates a tensor. The result is a :class:`Plan`:
line items per memory pool, the per-layer expert quota (and on a discrete GPU the pinned host
tier behind it), a predicted miss rate and decode rate, or a refusal naming what would fit.

Legend: L = MoE layers, E = experts per layer, k = top_k, Q = per-layer quota, B = batch,
S = context tokens, a = bytes per dense activation.
"""

from __future__ import annotations

import heapq
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from edgerun.budget.cpu_split import plan_note
from edgerun.bundle.dense_layout import PLAIN, DenseScheme, dense_targets, quantized_nbytes, scheme_label
from edgerun.bundle.layout import expert_block_layout
from edgerun.config import DeviceProfile, default_prefill_lanes, format_bytes
from edgerun.engine.policy import cpu_expert_kernel
from edgerun.errors import ConfigError
from edgerun.models import args as A
from edgerun.models.args import ModelArgs, TensorSpec

if TYPE_CHECKING:  # the planner reads a trace's header and tokens; it never reads a file
    from edgerun.tools.routes import RouteTrace

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # what the runtime can hold weights and KV in
DELTANET_CHUNK = 64  # tokens per chunk of the chunked delta rule (models/layers.py)
RESIDENT_CATEGORIES = tuple(c for c in A.CATEGORIES if c != A.EXPERT)
EXPERT_LEAVES = ("gate_up_proj", "down_proj")  # a layer's stacked routed experts

UNIFIED_POOL = "unified"
VRAM_POOL = "vram"
HOST_POOL = "host_pinned"

UNIFORM_MODEL = (
    "uniform routing: each step's d = E*(1-(1-k/E)^B) distinct experts per layer (d = k at B = 1) "
    "are independent of what the LRU holds, so each misses with probability 1 - Q/E; "
    "misses/token = sum over layers of d*(1 - Q/E) / B"
)

# a decode step's prefetch (``ExpertCache.prefetch``) where no route trace with guesses can be
# replayed: of a layer's misses, the share its guesses (the layer's router on the previous layer's
# residual stream) read a layer early, and the wrong guesses made beside them, per miss (how many of
# those the disk reads is :func:`prefetch_seconds`'s). Measured at 40 layers of the Qwen3.6 geometry,
# random weights, on an H100 (docs/benchmarks.md, forty-eighth session): 30.6 of 43.7 misses a token
# prefetched at 16 GiB and 137.2 of 192.8 at 8 GiB (0.70, 0.71), 9.1 and 41.4 wrong guesses (0.21,
# 0.21); the demo model's decode trace replays 0.56 and 0.26 at 4 slots of 16 (8 buffers)
GUESS_RECALL = 0.70
GUESS_WASTE = 0.21


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class ExpertSource:
    """Where the expert blocks come from and how large each layer's block is."""

    quant: str
    group_size: int
    block_bytes: tuple[int, ...]  # per MoE layer, in ModelArgs.moe_layers order
    origin: str = "layout"  # "layout" (computed) or the bundle manifest's path


def cpu_packed_bytes(args: ModelArgs, experts: ExpertSource) -> int:
    """Bytes the CPU expert kernels keep beside each slot (a repacked copy of an int4 block;
    ``kernels/cpu_layout.py``), for experts they take when unrotated; 0 for any other."""
    from edgerun.kernels.cpu_layout import packed_bytes

    if experts.quant != "int4" or not args.moe_layers:
        return 0
    return packed_bytes(expert_block_layout(args, experts.quant, experts.group_size))


def expert_source_from_layout(
    args: ModelArgs, quant: str = "int4", group_size: int | None = None
) -> ExpertSource:
    layout = expert_block_layout(args, quant, group_size)
    return ExpertSource(quant, layout.group_size, (layout.block_bytes,) * len(args.moe_layers), "layout")


# torch's dtype names -> the planner's
PLANNED_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def runtime_dtype(device: DeviceProfile) -> str:
    """The dtype the engine computes in, and so holds plain resident tensors, KV and state in, on
    ``device``: bf16 on CUDA (the checkpoints'); on a CPU the one this CPU's bf16 hardware calls
    for (``kernels/cpu_features.py``: fp32 where bf16 measured no faster). Pure: no torch."""
    if device.has_cuda:
        return "bf16"
    from edgerun.kernels import cpu_features

    return PLANNED_DTYPES[cpu_features.read().default_dtype()]


@dataclass(frozen=True)
class PlanOptions:
    # every plain resident (non-expert) tensor and the activations; None: the device's runtime_dtype
    dense_dtype: str | None = None
    # which resident linear weights are quantized, and how (a bundle's: its manifest's)
    dense: DenseScheme = DenseScheme()
    kv_dtype: str | None = None  # None: dense_dtype's (the engine's KV follows its compute dtype)
    staging_buffers: int | None = None  # pinned read buffers of one block each; None: 2 * top_k
    prefill_chunk: int = 512  # tokens per prefill forward: sizes the activation workspace
    cuda_graphs: bool = True  # captured decode graphs keep a private pool (CUDA devices only)
    quota: int | None = None  # exact per-layer quota; None: the largest that fits
    draft_tokens: int = 0  # speculative decoding: a verify window of K + 1 rows needs k x (K + 1) experts
    # a CUDA batch's prompts prefilled at once (engine/graphs.PrefillLanes); None: up to
    # DEFAULT_PREFILL_LANES where every expert is held in VRAM and they fit beside it, else 1
    prefill_lanes: int | None = None
    # discrete: a pinned host tier that holds every expert is read in place by the GPU over PCIe
    # (in-place: the far tier, every expert reachable from one slot table) or copied into VRAM slots
    tier_reads: str = "in-place"
    # the routed-expert kernel asked for (--expert-kernel; engine/policy.py): on a CPU device,
    # torch's kernels hold a repacked copy beside each int4 slot, the grouped C kernel none
    expert_kernel: str = "auto"
    # the MTP head's routed experts (with its specs), on a CUDA device: held as expert blocks of the
    # bundle's layout (a bundle served through the expert cache: engine/streaming.HeldExperts),
    # else stacked
    mtp_held: bool = True
    # the expert cache's policy (cache.policy); None: its default. lfu-bypass keeps top_k spill
    # rows of each block size beside the slots (a miss left unheld is read there), where no host
    # tier stands behind the slots and some layer streams
    cache_policy: str | None = None


# --------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Item:
    name: str
    pool: str
    nbytes: int
    detail: str = ""


@dataclass(frozen=True)
class Pool:
    name: str
    cap: int
    used: int

    @property
    def headroom(self) -> int:
        return self.cap - self.used


@dataclass(frozen=True)
class Prediction:
    model: str  # "uniform" or "trace"
    description: str
    misses_per_token: float  # expert blocks read from storage per token, all layers
    device_misses_per_token: float  # blocks copied into VRAM slots per token (discrete); = misses on unified
    misses_per_layer: tuple[float, ...]  # storage reads per token, per MoE layer
    memory_bytes_per_token: int  # resident bytes read per token (dense + active experts + KV + state)
    memory_bound_tok_s: float
    storage_bound_tok_s: float | None  # None: no storage reads predicted
    pcie_bound_tok_s: float | None  # discrete only; None: no copies predicted
    tok_s: float  # the smallest bound: reads fully overlapped with compute
    tok_s_serial: float  # nothing overlapped: every read stalls the step
    trace_tokens: int = 0
    # each layer's reads issued after its router and waited for (decode without prefetch, the CUDA
    # default): :func:`layer_read_seconds` per layer, serial with the step; 0: not predicted
    tok_s_layered: float = 0.0
    far_reads_per_token: float = 0.0  # (discrete, far tier) expert blocks the GPU reads in place over PCIe
    # with decode prefetch on: each layer the longer of the disk's time for its reads and the wait
    # for the misses no guess read a layer early, then the host's gap (:func:`prefetch_seconds`);
    # 0: not predicted
    tok_s_prefetch: float = 0.0
    prefetch_useful_per_token: float = 0.0  # misses a guess read early
    prefetch_wasted_per_token: float = 0.0  # wrong guesses made (read where the disk has time)
    guesses: str = ""  # where the guesses' shares came from (a trace's replay, or the measured prior)


@dataclass(frozen=True)
class Refusal:
    pool: str
    overflow: int
    item: str  # the smallest item of that pool at least as large as the overflow (else the largest)
    item_bytes: int
    max_context: int | None  # the largest context that fits at this batch and the minimum quota
    max_batch: int | None  # the largest batch that fits at this context (asked only for batch > 1)
    max_quota: int | None  # the largest uniform quota at this context and batch (asked only with a quota)
    message: str


@dataclass(frozen=True)
class Plan:
    model: str
    model_type: str
    device: str
    memory_kind: str
    context: int
    batch: int
    quant: str
    group_size: int
    dense_dtype: str
    kv_dtype: str
    expert_origin: str
    num_experts: int
    top_k: int
    min_quota: int  # min(E, B * k * (K + 1)): one step's (verify window's) experts never evict each other
    moe_layers: tuple[int, ...]
    block_bytes: tuple[int, ...]
    quotas: tuple[int, ...]  # VRAM / unified tier, per MoE layer
    host_quotas: tuple[int, ...]  # pinned host tier (discrete), per MoE layer; () when none
    staging_buffers: int
    items: tuple[Item, ...]
    pools: tuple[Pool, ...]
    prediction: Prediction | None
    refusal: Refusal | None
    notes: tuple[str, ...] = ()
    dense_quant: str = PLAIN  # the resident linear weights' scheme (DenseScheme.label)
    prefill_lanes: int = 1  # a batch's prompts prefilled at once, as counted (PlanOptions.prefill_lanes)

    @property
    def fits(self) -> bool:
        return self.refusal is None

    def item(self, name: str) -> Item:
        for it in self.items:
            if it.name == name:
                return it
        raise KeyError(name)

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits"] = self.fits
        for p, pd in zip(self.pools, d["pools"]):
            pd["headroom"] = p.headroom
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        names = {f.name for f in fields(cls)}
        d = {k: _tuples(v) for k, v in d.items() if k in names}
        d["items"] = tuple(Item(**i) for i in d["items"])
        d["pools"] = tuple(Pool(**{k: v for k, v in p.items() if k != "headroom"}) for p in d["pools"])
        if d.get("prediction") is not None:
            d["prediction"] = Prediction(**d["prediction"])
        if d.get("refusal") is not None:
            d["refusal"] = Refusal(**d["refusal"])
        return cls(**d)


def _tuples(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    return v


# --------------------------------------------------------------------------------------------
# Sizes of the things that do not depend on the quota


def resident_bytes(
    specs: Sequence[TensorSpec], dense_dtype: str = "bf16", dense: DenseScheme | None = None
) -> dict[str, int]:
    """Bytes per category of every tensor that stays resident (all but the routed experts): a
    plain tensor numel x the dense width; a weight ``dense`` quantizes its weight and scale bytes
    (+ 4 for int4's global), as the bundle stores it."""
    return _resident(specs, dense_dtype, dense or DenseScheme())[0]


def _resident(
    specs: Sequence[TensorSpec], dense_dtype: str, dense: DenseScheme
) -> tuple[dict[str, int], dict[str, str]]:
    """``resident_bytes``, and per category how its weights are held (``bf16 weights``, ``int4
    g32 linear weights, the rest bf16``)."""
    width = _dtype_bytes(dense_dtype, "dense_dtype")
    quant = dense_targets(specs, dense)
    nbytes = dict.fromkeys(RESIDENT_CATEGORIES, 0)
    schemes: dict[str, set[str]] = {}
    plain: set[str] = set()
    for s in specs:
        if s.name in quant:
            nbytes[s.category] += quantized_nbytes(s.shape, *quant[s.name])
            schemes.setdefault(s.category, set()).add(scheme_label(*quant[s.name]))
        elif s.category != A.EXPERT:
            nbytes[s.category] += math.prod(s.shape) * width
            plain.add(s.category)
    details = {}
    for cat in RESIDENT_CATEGORIES:
        if cat not in schemes:
            details[cat] = f"{dense_dtype} weights"
            continue
        what = f"{' + '.join(sorted(schemes[cat]))} {'weights' if cat == A.LM_HEAD else 'linear weights'}"
        details[cat] = what + (f", the rest {dense_dtype}" if cat in plain else "")
    return nbytes, details


def held_mtp_delta(specs: Sequence[TensorSpec], experts: ExpertSource, dense_dtype: str) -> int:
    """What holding the MTP head's routed experts as expert blocks (``HeldExperts``: every expert a
    block of the bundle's first MoE layer's size, its slot, and int4's two global scales) changes in its
    resident bytes, against the stacked tensors its specs count; 0 without them."""
    stacked = [s for s in specs if s.category == A.MTP and s.name.rsplit(".", 1)[-1] in EXPERT_LEAVES]
    if not stacked or not experts.block_bytes:
        return 0
    E = stacked[0].shape[0]
    held = E * (experts.block_bytes[0] + 8 + (8 if experts.quant == "int4" else 0))  # + its int64 slot
    return held - sum(math.prod(s.shape) for s in stacked) * _dtype_bytes(dense_dtype, "dense_dtype")


def static_capacity(total_len: int, max_context: int) -> int:
    """Positions of the one-sequence static decode state (CUDA graphs) for a sequence of
    ``total_len`` tokens: the next power of two, at least 256, at most the context."""
    return min(max(256, 1 << (total_len - 1).bit_length()), max(max_context, total_len))


def kv_bytes_per_token(args: ModelArgs, kv_dtype: str = "bf16") -> int:
    """K and V of one token over all full-attention layers."""
    width = _dtype_bytes(kv_dtype, "kv_dtype")
    return len(args.full_attention_layers) * 2 * args.num_key_value_heads * args.head_dim * width


def deltanet_state_bytes(args: ModelArgs, batch: int, dense_dtype: str = "bf16") -> int:
    """Conv history [B, C, K-1] at the dense dtype plus the fp32 recurrent state [B, Hv, Dk, Dv]."""
    a = _dtype_bytes(dense_dtype, "dense_dtype")
    conv = batch * args.linear_conv_dim * (args.linear_conv_kernel_dim - 1) * a
    recurrent = (
        batch * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    )
    return len(args.linear_attention_layers) * (conv + recurrent)


def token_workspace_bytes(args: ModelArgs, dense_dtype: str = "bf16") -> int:
    """Live intermediates of one token through the widest layer: the residual stream (residual,
    normed input, mixer output, FFN output), the wider token mixer (attention: q with its gate, k,
    v, output; DeltaNet: qkv before and after the conv, z, output, a, b, their fp32 per-head
    copies and the chunk matrices), and the wider FFN (router logits fp32, k routed gate_up and
    outputs, the shared expert's gate_up; or a dense MLP's gate_up)."""
    a = _dtype_bytes(dense_dtype, "dense_dtype")
    D = args.hidden_size
    mixer = 0
    if args.full_attention_layers:
        H, Hk, Dh = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        mixer = a * (H * Dh * (2 if args.attn_output_gate else 1) + 2 * Hk * Dh + H * Dh)
    if args.linear_attention_layers:
        nv, dk, dv = args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim
        delta = a * (2 * args.linear_conv_dim + 2 * args.linear_value_dim + 2 * nv)
        delta += 4 * (2 * nv * dk + nv * dv) + 4 * 3 * nv * DELTANET_CHUNK
        mixer = max(mixer, delta)
    ffn = 0
    if args.moe_layers:  # the expert kernels keep fp32 SiLU(gate)·up and outputs per (token, expert)
        k, I = args.num_experts_per_tok, args.moe_intermediate_size
        ffn = 4 * args.num_experts + 4 * k * (I + D) + a * 2 * args.shared_expert_intermediate_size
    if len(args.moe_layers) < args.num_hidden_layers:
        ffn = max(ffn, a * 2 * args.intermediate_size)
    return a * 4 * D + mixer + ffn


def gqa_expansion_bytes(args: ModelArgs, context: int, chunk: int, kv_dtype: str) -> tuple[int, str]:
    """A prompt chunk after the first attends to the keys before it through SDPA's lower-right
    causal mask, whose kernels take as many key heads as query heads: K and V of the whole context
    repeated to the query heads for one layer at a time (``models/layers.causal_attention``).
    (bytes, how); 0 where prompts fit one chunk or the heads are not grouped."""
    if not args.full_attention_layers or context <= chunk:
        return 0, ""
    H, Hk = args.num_attention_heads, args.num_key_value_heads
    if H == Hk:
        return 0, ""
    kv = _dtype_bytes(kv_dtype, "kv_dtype")
    return (
        2 * H * context * args.head_dim * kv,
        f"K,V of {context} tok repeated to {H} heads x {args.head_dim} x {kv} B",
    )


PREFILL_TILE_ROWS = 32  # kernels/moe_triton.py GroupedConfig.block_m (not imported: no torch here)
PREFILL_GRAPH_TOKENS = 2048  # engine/graphs.py's: the longest first chunk replayed from a graph


def prefill_chunk_extra(
    args: ModelArgs, specs, dense: DenseScheme, dense_dtype: str, cuda: bool
) -> tuple[int, str]:
    """What a prefill forward holds beyond its tokens' workspace: on CUDA the grouped expert step
    pads each expert's run to whole tiles (at most PREFILL_TILE_ROWS rows an expert, fp32 of the expert
    width), and a quantized dense weight is dequantized for its GEMM (the largest one but the
    lm_head, which a prompt runs on one row; the projections a module fuses, q/k/v or DeltaNet's
    in_proj, as one: in the compute dtype on CUDA, plus torch's fp32 copy on the CPU).
    (bytes, how)."""
    total, parts = 0, []
    if args.moe_layers and cuda:  # the grouped kernels are CUDA's
        pad = PREFILL_TILE_ROWS * args.num_experts * args.moe_intermediate_size * 4
        total += pad
        parts.append(
            f"expert tile padding {PREFILL_TILE_ROWS} x {args.num_experts} x {args.moe_intermediate_size} x 4 B"
        )
    quant = dense_targets(specs, dense) if dense.quantized else {}
    fused: Counter = Counter()  # projections of one module that read one input run as one weight
    for sp in specs:
        if sp.name in quant and sp.category != A.LM_HEAD:
            fused[(sp.name.rsplit(".", 2)[0], sp.shape[1])] += sp.shape[0]
    shapes = [(rows, cols) for (_, cols), rows in fused.items()]
    if shapes:
        width = _dtype_bytes(dense_dtype, "dense_dtype") + (0 if cuda else 4)
        biggest = max(shapes, key=math.prod)
        total += math.prod(biggest) * width
        parts.append(f"a dequantized weight {biggest[0]}x{biggest[1]} x {width} B")
    return total, " + ".join(parts)


def cpu_packed_dense(specs, dense: DenseScheme) -> tuple[int, str]:
    """The copy of the int4 dense weights the CPU kernels compute from (``kernels/qlinear_cpu.py``,
    kept beside the stored weight): per projection the kernel takes (the projections of a module
    that read one input as one weight), its nibbles again and a bf16 scale and zero per group of
    each row. int8 weights are read in place. (bytes, how)."""
    from edgerun.kernels.cpu_layout import BLOCK_N, INT4_GROUPS

    fused: Counter = Counter()
    for name, (scheme, group) in (dense_targets(specs, dense) if dense.quantized else {}).items():
        if scheme == "int4":
            rows, cols = next(sp.shape for sp in specs if sp.name == name)
            fused[(name.rsplit(".", 2)[0], cols, group)] += rows
    total, n = 0, 0
    for (_, cols, group), rows in fused.items():
        if group in INT4_GROUPS and rows % BLOCK_N == 0 and cols % 32 == 0:
            total += rows * cols // 2 + (cols // group) * rows * 4
            n += 1
    return total, f"{n} int4 projections repacked for the CPU kernels (nibbles + bf16 scale, zero a group)"


def _dtype_bytes(name: str, key: str) -> int:
    if name not in DTYPE_BYTES:
        raise ConfigError(f"{key} {name!r} is not supported (supported: {', '.join(DTYPE_BYTES)})")
    return DTYPE_BYTES[name]


# --------------------------------------------------------------------------------------------
# Sizing


def library_workspace_bytes(compute_capability: str | None) -> int:
    """What cuBLAS keeps per stream as torch sizes it (``CUBLAS_WORKSPACE_CONFIG``, ``:KiB:count``
    pairs; by default 4096 KiB x 8 from compute capability 9.0, else 4096 KiB x 2 + 16 KiB x 8),
    for the two streams the engine runs cuBLAS on (compute; warm-up and capture)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        major = int(str(compute_capability or "0").removeprefix("sm_").split(".")[0][:2] or 0)
        config = ":4096:8" if major >= 9 else ":4096:2:16:8"
    try:
        nums = [int(v) for v in config.split(":")[1:]]
        per_stream = sum(kib * 1024 * n for kib, n in zip(nums[::2], nums[1::2], strict=True))
    except ValueError as exc:
        raise ConfigError(f"CUBLAS_WORKSPACE_CONFIG {config!r} is not :KiB:count pairs") from exc
    return 2 * per_stream


@dataclass(frozen=True)
class _Sizer:
    """Everything the plan's arithmetic needs, with the context and batch left free so the
    refusal can search over them."""

    args: ModelArgs
    experts: ExpertSource
    device: DeviceProfile
    options: PlanOptions
    resident: Mapping[str, int]
    staging_buffers: int
    details: Mapping[str, str]  # per resident category, how its weights are held
    chunk_extra: tuple[int, str] = (0, "")  # prefill_chunk_extra
    packed: int = 0  # bytes the CPU expert kernels keep beside each slot (cpu_packed_bytes)
    packed_dense: tuple[int, str] = (0, "")  # cpu_packed_dense

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.experts.block_bytes

    def held_policy(self, tier: bool = False, every_held: bool = False) -> str:
        """The policy the cache's slots run (``cache.policy.held_policy`` of the options')."""
        from edgerun.cache.policy import held_policy

        return held_policy(self.options.cache_policy, tier, every_held)

    @property
    def spill_rows(self) -> int:
        """The spill rows of each block size the cache keeps (``ExpertCache.spill``): top_k under
        lfu-bypass, else none (kept before a host tier or full quotas are known)."""
        return self.args.num_experts_per_tok if self.held_policy() == "lfu-bypass" else 0

    @property
    def slot_costs(self) -> tuple[int, ...]:
        """Per MoE layer, what one slot holds: its block, and the CPU kernels' packed copy."""
        return tuple(b + self.packed for b in self.blocks)

    @property
    def main_pool(self) -> str:
        return VRAM_POOL if self.device.discrete else UNIFIED_POOL

    def min_quota(self, batch: int) -> int:
        rows = batch * (1 + self.options.draft_tokens)  # a speculative verify window's rows
        return min(self.args.num_experts, rows * self.args.num_experts_per_tok)

    def fixed_items(self, context: int, batch: int) -> list[Item]:
        """Every item but the expert tiers."""
        args, dev, opt = self.args, self.device, self.options
        main = self.main_pool
        a = DTYPE_BYTES[opt.dense_dtype]
        items = [
            Item(
                "os_reserve",
                main,
                dev.os_reserve,
                "display and other processes" if dev.discrete else "OS and other processes",
            ),
        ]
        ws = library_workspace_bytes(dev.compute_capability) if dev.has_cuda else 0
        if ws and dev.cuda_context >= ws:  # the workspaces are torch allocations: the engine's own bytes
            items.append(Item("cuda_context", main, dev.cuda_context - ws, "CUDA context (the driver's)"))
            items.append(
                Item(
                    "library_workspaces",
                    main,
                    ws,
                    f"cuBLAS workspaces of the compute and the capture streams, 2 x {format_bytes(ws // 2)}",
                )
            )
        else:
            items.append(Item("cuda_context", main, dev.cuda_context, "CUDA context and library workspaces"))
        for cat in RESIDENT_CATEGORIES:
            if self.resident.get(cat, 0):
                items.append(Item(cat, main, self.resident[cat], self.details[cat]))
        if self.packed_dense[0]:
            items.append(Item("cpu_packed_dense", main, *self.packed_dense))
        n_full = len(args.full_attention_layers)
        if n_full:
            items.append(
                Item(
                    "kv_cache",
                    main,
                    batch * context * kv_bytes_per_token(args, opt.kv_dtype),
                    f"{n_full} layers x K,V x B {batch} x {args.num_key_value_heads} heads x {context} tok "
                    f"x {args.head_dim} x {DTYPE_BYTES[opt.kv_dtype]} B",
                )
            )
        n_lin = len(args.linear_attention_layers)
        if n_lin:
            items.append(
                Item(
                    "deltanet_state",
                    main,
                    deltanet_state_bytes(args, batch, opt.dense_dtype),
                    f"{n_lin} layers x B {batch} x (conv {args.linear_conv_dim}x{args.linear_conv_kernel_dim - 1} "
                    f"x {a} B + recurrent {args.linear_num_value_heads}x{args.linear_key_head_dim}"
                    f"x{args.linear_value_head_dim} x 4 B)",
                )
            )
        if opt.draft_tokens:  # speculative decoding (engine/speculative.py)
            K = opt.draft_tokens
            trail = (K + 1) * deltanet_state_bytes(args, batch, opt.dense_dtype) if n_lin else 0
            kv = _dtype_bytes(opt.kv_dtype, "kv_dtype")
            heads = args.mtp_num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim
            mtp_kv = batch * context * heads * kv
            rollback = (
                f" + a verify window's {K + 1} DeltaNet states per layer (its rollback)" if trail else ""
            )
            items.append(
                Item(
                    "speculative_state",
                    main,
                    trail + mtp_kv,
                    f"the MTP head's KV ({context} tok, {args.mtp_num_hidden_layers} attention layer)"
                    + rollback,
                )
            )
        per_token = token_workspace_bytes(args, opt.dense_dtype)
        logits = batch * args.vocab_size * 4
        tokens = max(batch, min(opt.prefill_chunk, context))
        extra, how = self.chunk_extra
        gqa, gqa_how = gqa_expansion_bytes(args, context, tokens, opt.kv_dtype)
        items.append(
            Item(
                "activation_workspace",
                main,
                tokens * per_token + logits + extra + gqa,
                f"{tokens} tok x {per_token} B + fp32 logits {batch} x {args.vocab_size}"
                + (f" + {how}" if how else "")
                + (f" + {gqa_how}" if gqa else ""),
            )
        )
        if opt.cuda_graphs and dev.has_cuda:
            # a batch captures a graph set per row count 1..B (engine/graphs.RowSteps); speculative
            # decoding one per verify window size 1..K + 1 beside the one-row step's (DecodeGraphs.verify)
            rows = batch * (batch + 1) // 2
            w = opt.draft_tokens + 1 if opt.draft_tokens else 0
            rows += w * (w + 1) // 2
            items.append(
                Item(
                    "cuda_graph_pool",
                    main,
                    rows * (per_token + args.vocab_size * 4),
                    f"decode graphs, batch {batch}: {rows} tok x ({per_token} B + fp32 logits {args.vocab_size})"
                    + (f" over graph sets of 1..{batch} rows" if batch > 1 else "")
                    + (f", verify windows of 1..{w} rows" if w else ""),
                )
            )
        if batch > 1 and dev.has_cuda:  # a batch's first prompt chunks run on one sequence's state
            positions = static_capacity(min(opt.prefill_chunk, context), context)
            items.append(
                Item(
                    "batch_prefill_state",
                    main,
                    self.prefill_state_bytes(positions),
                    f"one sequence's static state ({positions} positions): a batch's first prompt chunks run "
                    "there, then are copied into their entries",
                )
            )
        if self.blocks:
            staging_pool = HOST_POOL if dev.discrete else main
            items.append(
                Item(
                    "pinned_staging",
                    staging_pool,
                    self.staging_buffers * max(self.blocks),
                    f"{self.staging_buffers} buffers x {format_bytes(max(self.blocks))}",
                )
            )
            if self.spill_rows:  # page-locked host memory the GPU reads in place (ExpertCache.spill)
                sizes = sorted(set(self.blocks))
                items.append(
                    Item(
                        "spill_rows",
                        staging_pool,
                        self.spill_rows * sum(sizes),
                        f"{self.spill_rows} x {'/'.join(map(format_bytes, sizes))}: misses the slots leave "
                        "unheld (lfu-bypass) are read and served there",
                    )
                )
        return items

    def caps(self) -> dict[str, int]:
        if self.device.discrete:
            return {VRAM_POOL: self.device.memory_cap, HOST_POOL: self.device.pinned_limit}
        return {UNIFIED_POOL: self.device.memory_cap}

    def free(self, items: Sequence[Item]) -> dict[str, int]:
        out = self.caps()
        for it in items:
            out[it.pool] -= it.nbytes
        return out

    def prefill_state_bytes(self, positions: int) -> int:
        """One sequence's decode state of ``positions`` positions (KV and DeltaNet states)."""
        args, opt = self.args, self.options
        kv = positions * kv_bytes_per_token(args, opt.kv_dtype) if args.full_attention_layers else 0
        return kv + (deltanet_state_bytes(args, 1, opt.dense_dtype) if args.linear_attention_layers else 0)

    def prefill_graph_item(self, context: int, batch: int, lanes: int = 1) -> Item | None:
        """The prefill graphs' private pool (``engine/graphs.PrefillGraphs``: a first chunk's
        workspace, held beside the eager chunks'), where they run: CUDA graphs on a CUDA device
        and every expert held (they replay only then). A batch's prefill lanes
        (``PrefillLanes``, which replay only where these do) each add their own: a pool like it,
        a scratch state of a chunk, a cuBLAS workspace."""
        args, opt = self.args, self.options
        if not (opt.cuda_graphs and self.device.has_cuda):
            return None
        per_token = token_workspace_bytes(args, opt.dense_dtype)
        graphed = min(max(batch, min(opt.prefill_chunk, context)), PREFILL_GRAPH_TOKENS)
        extra, how = self.chunk_extra
        pool = graphed * per_token + extra
        what = f"prefill graphs (every expert held or read in place): {graphed} tok x {per_token} B" + (
            f" + {how}" if how else ""
        )
        lanes = min(lanes, batch)
        if lanes > 1:
            state = self.prefill_state_bytes(min(opt.prefill_chunk, context))
            ws = library_workspace_bytes(self.device.compute_capability) // 2
            what += (
                f"; {lanes} prefill lanes x (that pool + a scratch state {format_bytes(state)} + a cuBLAS "
                f"workspace {format_bytes(ws)})"
            )
            pool += lanes * (pool + state + ws)
        return Item("prefill_graph_pool", self.main_pool, pool, what)

    def slot_bytes(self, quotas: Sequence[int]) -> int:
        return sum(q * b for q, b in zip(quotas, self.slot_costs))

    def overflow(
        self, context: int, batch: int, quota: int | None = None
    ) -> tuple[str, int, list[Item]] | None:
        """(pool, bytes over, every item) when the fixed items plus ``quota`` (default: the
        minimum) slots per layer do not fit; None when they do. On unified memory the staging
        must also fit under pinned_limit (pool "pinned_limit")."""
        items = self.fixed_items(context, batch)
        q = self.min_quota(batch) if quota is None else quota
        items.append(self.slot_item((q,) * len(self.blocks)))
        staging = sum(it.nbytes for it in items if it.name == "pinned_staging")
        if not self.device.discrete and staging > self.device.pinned_limit:
            return "pinned_limit", staging - self.device.pinned_limit, items
        for pool, left in self.free(items).items():
            if left < 0:
                return pool, -left, items
        return None

    def pools(self, items: Sequence[Item]) -> tuple[Pool, ...]:
        free = self.free(items)
        return tuple(Pool(name, cap, cap - free[name]) for name, cap in self.caps().items())

    def slot_item(self, quotas: Sequence[int]) -> Item:
        detail = _quota_detail(quotas, self.blocks)
        if self.packed:
            detail += f" + {format_bytes(self.packed)} each packed for the CPU kernels"
        return Item("expert_slots", self.main_pool, self.slot_bytes(quotas), detail)


def _quota_detail(quotas: Sequence[int], blocks: Sequence[int]) -> str:
    if not quotas:
        return "no MoE layers"
    lo, hi = min(quotas), max(quotas)
    per = f"{lo}" if lo == hi else f"{lo}..{hi}"
    block = format_bytes(blocks[0]) if len(set(blocks)) == 1 else "per-layer blocks"
    return f"quota {per}/layer x {len(quotas)} layers x {block}"


def _largest(lo: int, hi: int, ok) -> int | None:
    """The largest n in [lo, hi] with ok(n), for ok true up to some point and false after."""
    if lo > hi or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------------------------
# Quota allocation


def _uniform_quotas(
    budget: int, blocks: Sequence[int], floors: Sequence[int], cap: int
) -> tuple[int, ...] | None:
    """Raise every layer to a common level q (never below its floor) as far as the budget allows."""
    level = _largest(0, cap, lambda q: sum(max(f, q) * b for f, b in zip(floors, blocks)) <= budget)
    if level is None:
        return None
    return tuple(max(f, level) for f in floors)


def _traced_quotas(
    budget: int, blocks: Sequence[int], floors: Sequence[int], cap: int, curves: Sequence[Sequence[int]]
) -> tuple[int, ...] | None:
    """Give slots where the trace's misses drop most per byte, looking ahead past flat stretches
    of a layer's miss curve (an LRU curve has cliffs: a cyclic working set hits only once it all
    fits), as utility-based cache partitioning does. Once no slot saves a miss, spread the rest
    evenly."""
    quotas = list(floors)
    left = budget - sum(q * b for q, b in zip(quotas, blocks))
    if left < 0:
        return None

    def best(i: int) -> tuple[float, int, int] | None:
        """(-misses saved per byte, slots, layer) of layer i's best affordable raise."""
        q, c, b = quotas[i], curves[i], blocks[i]
        gain, size = 0.0, 0
        for j in range(q + 1, min(cap, q + left // b) + 1):
            g = (c[q] - c[j]) / ((j - q) * b)
            if g > gain:
                gain, size = g, j - q
        return (-gain, size, i) if size else None

    heap = [e for e in map(best, range(len(quotas))) if e is not None]
    heapq.heapify(heap)
    while heap:
        entry = heapq.heappop(heap)
        i = entry[2]
        fresh = best(i)  # the budget shrank since it was pushed: its best raise may have too
        if fresh != entry:
            if fresh is not None:
                heapq.heappush(heap, fresh)
            continue
        quotas[i] += entry[1]
        left -= entry[1] * blocks[i]
        fresh = best(i)
        if fresh is not None:
            heapq.heappush(heap, fresh)
    return _uniform_quotas(budget, blocks, quotas, cap)


def split_quotas(curves: Sequence[Sequence[int]], slots: int, floor: int) -> tuple[int, ...]:
    """The plan's per-layer quotas for ``slots`` slots in all when every layer's slot costs the
    same (the demo's, a study's equal total): :func:`_traced_quotas` on the layers' miss curves,
    each layer at least ``floor``, at most its curve's last quota (every expert)."""
    if not curves:
        raise ValueError("no miss curves to split quotas by")
    layers = len(curves)
    if slots < floor * layers:
        raise ValueError(f"{slots} slots cannot give {layers} layers {floor} each")
    quotas = _traced_quotas(slots, (1,) * layers, (floor,) * layers, len(curves[0]) - 1, curves)
    assert quotas is not None  # the floor fits, checked above
    return quotas


# --------------------------------------------------------------------------------------------
# Route traces


def trace_steps(trace: RouteTrace, batch: int) -> list[list[tuple[int, ...]]]:
    """Per MoE layer, the steps of the trace: ``batch`` consecutive tokens form one step (their
    ids deduplicated in token, then router, order)."""
    n_layers = len(trace.header.moe_layers)
    out: list[list[tuple[int, ...]]] = [[] for _ in range(n_layers)]
    for start in range(0, len(trace.tokens), batch):
        group = trace.tokens[start : start + batch]
        for j in range(n_layers):
            out[j].append(tuple(dict.fromkeys(e for tok in group for e in tok[j])))
    return out


def miss_curve(steps: Sequence[Sequence[int]], num_experts: int) -> list[int]:
    """misses[Q] for Q = 0..num_experts under the expert cache's LRU (``cache.policy.LRUSet``: a
    step's ids deduplicated in order, hits decided against what the step found, then every id of
    the step most recent, the earliest oldest), in one pass. LRU's stack property makes this exact:
    an id hits at quota Q iff fewer than Q other ids were used since it last was. Valid for Q at
    least every step's distinct ids (the cache refuses smaller quotas)."""
    stack: list[int] = []  # most recent first, a step's ids in reverse router order
    hist: Counter[int] = Counter()  # hits by stack depth
    total = 0
    for ids in steps:
        step = list(dict.fromkeys(ids))
        total += len(step)
        for e in step:  # depths at the start of the step: a step's ids never evict each other
            try:
                hist[stack.index(e)] += 1
            except ValueError:
                pass  # first use: a miss at every quota
        seen = set(step)
        stack = step[::-1] + [e for e in stack if e not in seen]
    curve, hits = [], 0
    for q in range(num_experts + 1):
        curve.append(total - hits)
        hits += hist[q]
    return curve


def policy_replay(steps: Sequence[Sequence[int]], quota: int, policy: str, top_k: int) -> int:
    """Misses of one layer's steps through the expert cache's ``policy`` with ``quota`` slots
    (and top_k spill rows: what the cache counts; :func:`replay` is LRU's, read off its miss
    curve)."""
    from edgerun.cache.policy import expert_set, replay_misses

    return replay_misses(steps, expert_set(quota, policy, spill=top_k))


def replay(steps: Sequence[Sequence[int]], quota: int) -> int:
    """Misses of one layer's steps through the cache's LRU with ``quota`` slots; refused, as the
    cache refuses it, when a step holds more distinct ids than the quota."""
    if quota < 1:
        raise ValueError(f"quota must be >= 1, got {quota}")
    widest = max((len(set(s)) for s in steps), default=0)
    if widest > quota:
        raise ValueError(
            f"a step routes to {widest} distinct experts but the quota is {quota}: "
            "one step's experts would evict each other"
        )
    return miss_curve(steps, quota)[quota]


# --------------------------------------------------------------------------------------------
# The planner


def plan(
    args: ModelArgs,
    specs: Sequence[TensorSpec],
    experts: ExpertSource,
    device: DeviceProfile,
    context: int,
    batch: int = 1,
    options: PlanOptions | None = None,
    trace: RouteTrace | None = None,
    *,
    model_name: str = "",
    resident: Mapping[str, int] | None = None,
    notes: Sequence[str] = (),
) -> Plan:
    """Plan one model on one device. ``resident`` overrides the spec-derived bytes per category
    (the engine re-plans with what loading measured)."""
    options = options or PlanOptions()
    dense_dtype = options.dense_dtype or runtime_dtype(device)
    options = replace(options, dense_dtype=dense_dtype, kv_dtype=options.kv_dtype or dense_dtype)
    _dtype_bytes(options.dense_dtype, "dense_dtype")
    _dtype_bytes(options.kv_dtype, "kv_dtype")
    computed, details = _resident(specs, options.dense_dtype, options.dense)
    delta = held_mtp_delta(specs, experts, options.dense_dtype) if options.mtp_held and device.has_cuda else 0
    if delta:
        computed[A.MTP] += delta
        details[A.MTP] += f", its routed experts {experts.quant} blocks"
    res = dict(resident) if resident is not None else computed
    L, E, k = len(args.moe_layers), args.num_experts, args.num_experts_per_tok
    if len(experts.block_bytes) != L:
        raise ConfigError(
            f"expert source lists {len(experts.block_bytes)} layers' block sizes; the model has {L}"
        )
    if context < 1 or context > args.max_position_embeddings:
        raise ConfigError(
            f"context {context} must be in 1..{args.max_position_embeddings} (max_position_embeddings)"
        )
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    if options.prefill_chunk < 1:
        raise ConfigError(f"prefill_chunk must be >= 1, got {options.prefill_chunk}")
    if options.prefill_lanes is not None and options.prefill_lanes < 1:
        raise ConfigError(f"prefill_lanes must be >= 1, got {options.prefill_lanes}")
    staging = options.staging_buffers if options.staging_buffers is not None else 2 * k
    if L and staging < 1:
        raise ConfigError(f"staging_buffers must be >= 1, got {staging}")
    extra = prefill_chunk_extra(args, specs, options.dense, options.dense_dtype, device.has_cuda)
    repacks = not device.has_cuda and cpu_expert_kernel(options.expert_kernel) == "cpu"
    packed = cpu_packed_bytes(args, experts) if repacks else 0
    packed_dense = (0, "") if device.has_cuda else cpu_packed_dense(specs, options.dense)
    sizer = _Sizer(args, experts, device, options, res, staging, details, extra, packed, packed_dense)
    floor = sizer.min_quota(batch)
    if options.draft_tokens < 0:
        raise ConfigError(f"draft_tokens must be >= 0, got {options.draft_tokens}")
    if options.quota is not None and not floor <= options.quota <= E:
        K = options.draft_tokens
        what = (
            f"top_k x batch x (draft tokens + 1) = {floor} so a verify window's"
            if K
            else f"top_k x batch = {floor} so one step's"
        )
        fits = options.quota // (batch * k) - 1
        hint = ""
        if K and options.quota < floor:
            hint = (
                f"; --draft-tokens {min(fits, K)} fits this quota"
                if fits >= 1
                else "; no draft count fits this quota"
            )
        raise ConfigError(
            f"quota {options.quota} must be in {floor}..{E}: at least {what} "
            f"experts never evict each other, at most num_experts{hint}"
        )
    if trace is not None:
        trace.header.check_matches(args, trace.source or "route trace")
        if not trace.tokens:
            raise ConfigError(f"{trace.source or 'route trace'}: holds no tokens")

    base = dict(
        model=model_name or args.model_type,
        model_type=args.model_type,
        device=device.name,
        memory_kind=device.memory_kind,
        context=context,
        batch=batch,
        quant=experts.quant,
        group_size=experts.group_size,
        dense_dtype=options.dense_dtype,
        kv_dtype=options.kv_dtype,
        expert_origin=experts.origin,
        num_experts=E,
        top_k=k,
        min_quota=floor,
        moe_layers=args.moe_layers,
        block_bytes=experts.block_bytes,
        staging_buffers=staging if L else 0,
        dense_quant=options.dense.label(),
    )
    notes = list(notes)
    if options.cuda_graphs and not device.has_cuda:
        notes.append("no CUDA on this device: no graph pool")

    over = sizer.overflow(context, batch, options.quota)
    if over is not None:
        refused = _refused(sizer, base, context, batch, over, notes)
        hint = None
        if resident is None and not options.dense.quantized:
            hint = _int4_dense_hint(args, specs, experts, device, context, batch, options, trace, res)
        if hint is not None:
            r = refused.refusal
            refused = replace(refused, refusal=replace(r, message=f"{r.message} {hint}"))
        return refused

    fixed = sizer.fixed_items(context, batch)
    free = sizer.free(fixed)
    main = sizer.main_pool
    steps = trace_steps(trace, batch) if trace is not None else None
    curves = [miss_curve(s, E) for s in steps] if steps is not None else None
    floors = (floor,) * L
    if options.quota is not None:
        quotas = (options.quota,) * L
    elif curves is not None:
        quotas = _traced_quotas(free[main], sizer.slot_costs, floors, E, curves)
    else:
        quotas = _uniform_quotas(free[main], sizer.slot_costs, floors, E)
    assert quotas is not None  # the overflow check passed at the floor
    far = _far_tier(sizer, free, options, L, E)
    lanes = min(options.prefill_lanes or 1, batch)
    graph_pool = (
        sizer.prefill_graph_item(context, batch, lanes)
        if L and (far or all(q == E for q in quotas))
        else None
    )
    if far and graph_pool is not None and options.quota is None:
        # every expert reachable (VRAM slots or the far tier): prompts replay prefill graphs, whose
        # pool comes out of VRAM before the slots are sized
        room = free[main] - graph_pool.nbytes
        sized = (
            _traced_quotas(room, sizer.slot_costs, floors, E, curves)
            if curves is not None
            else _uniform_quotas(room, sizer.slot_costs, floors, E)
        )
        if sized is not None:
            quotas = sized
        else:
            graph_pool = None  # not even the floor beside it: prompts run eagerly
            notes.append(
                "the prefill graphs' pool does not fit beside the minimum VRAM quota: prompts run eagerly"
            )
    if (
        graph_pool is not None
        and options.quota is None
        and sizer.slot_bytes(quotas) + graph_pool.nbytes > free[main]
    ):
        # every expert held leaves no room for the prefill graphs that holding them turns on: a
        # slot fewer a layer, and prompts run eagerly (no graph pool)
        quotas = _uniform_quotas(free[main], sizer.blocks, floors, E - 1) or quotas
        graph_pool = None if any(q < E for q in quotas) else graph_pool
    if (
        graph_pool is not None and sizer.slot_bytes(quotas) + graph_pool.nbytes > free[main]
    ):  # --quota E asked
        notes.append(
            f"the prefill graphs' pool ({format_bytes(graph_pool.nbytes)}) does not fit beside every expert held: "
            f"a prompt may go over the cap by up to that much; quota {E - 1} leaves room (prompts then run eagerly)"
        )
    if options.prefill_lanes is None and graph_pool is not None and not far and batch > 1:
        # lanes by default only where they take no expert slot: every expert held in VRAM, and
        # the lanes' pools beside them
        wide_lanes = default_prefill_lanes("cuda", batch)  # graphs replay: a CUDA device
        wide = sizer.prefill_graph_item(context, batch, wide_lanes)
        if wide is not None and sizer.slot_bytes(quotas) + wide.nbytes <= free[main]:
            graph_pool, lanes = wide, wide_lanes
    if graph_pool is None:
        lanes = 1  # no prefill graphs replay, so no lanes run
    items = fixed + [sizer.slot_item(quotas)] + ([graph_pool] if graph_pool is not None else [])

    host_quotas: tuple[int, ...] = ()
    if far:
        host_quotas = (E,) * L
        items.append(
            Item(
                "host_expert_tier",
                HOST_POOL,
                sizer.slot_bytes(host_quotas),
                f"every expert of {L} layers, read in place by the GPU over PCIe where VRAM slots lack them",
            )
        )
    elif device.discrete and L:
        # a host tier takes the spill rows' place (its slots hold every miss: no row is kept), so
        # it may use their pinned memory; without a tier the rows stay
        spill = sum(it.nbytes for it in items if it.name == "spill_rows" and it.pool == HOST_POOL)
        budget = free[HOST_POOL] + spill
        if curves is not None:
            host = _traced_quotas(budget, sizer.blocks, quotas, E, curves)
        else:
            host = _uniform_quotas(budget, sizer.blocks, quotas, E)
        if host is None:
            notes.append(
                f"no pinned host tier: {format_bytes(budget)} of pinned memory is left after staging, "
                f"less than the VRAM tier ({format_bytes(sizer.slot_bytes(quotas))}) it would have to include"
            )
        else:
            host_quotas = host
            items.append(
                Item(
                    "host_expert_tier",
                    HOST_POOL,
                    sizer.slot_bytes(host),
                    _quota_detail(host, sizer.blocks) + " (inclusive of the VRAM tier)",
                )
            )
    if far:  # CPU experts beside the far tier (budget/cpu_split.py)
        cpu_note = plan_note(
            k, E, quotas, host_quotas, sizer.blocks, device.pcie_bandwidth, device.cpu_expert_bandwidth
        )
        notes += [cpu_note] if cpu_note else []
    if sizer.held_policy(bool(host_quotas), all(q >= E for q in quotas)) != "lfu-bypass":  # no spill rows
        items = [it for it in items if it.name != "spill_rows"]
    prediction = _predict(sizer, context, batch, quotas, host_quotas, res, steps, trace, far)
    return Plan(
        **base,
        quotas=quotas,
        host_quotas=host_quotas,
        items=tuple(items),
        pools=sizer.pools(items),
        prediction=prediction,
        refusal=None,
        notes=tuple(notes),
        prefill_lanes=lanes,
    )


def _int4_dense_hint(
    args: ModelArgs,
    specs: Sequence[TensorSpec],
    experts: ExpertSource,
    device: DeviceProfile,
    context: int,
    batch: int,
    options: PlanOptions,
    trace: RouteTrace | None,
    resident: Mapping[str, int],
) -> str | None:
    """What a refusal with plain dense weights adds when the same plan fits with the resident
    linear weights int4 (default group); None when it does not, or their widths take no int4
    group."""
    try:
        dense = DenseScheme.resolve("int4", tied=args.tie_word_embeddings)
        alt = plan(args, specs, experts, device, context, batch, replace(options, dense=dense), trace)
    except ConfigError:
        return None
    if not alt.fits:
        return None
    saved = sum(resident.values()) - sum(i.nbytes for i in alt.items if i.name in RESIDENT_CATEGORIES)
    return (
        f"With int4 resident linear weights (--dense int4: {format_bytes(saved)} less resident) it fits: "
        f"{_quota_detail(alt.quotas, alt.block_bytes)}, {alt.prediction.tok_s:.1f} tok/s predicted."
    )


def _refused(
    sizer: _Sizer,
    base: dict[str, Any],
    context: int,
    batch: int,
    over: tuple[str, int, list[Item]],
    notes: list[str],
) -> Plan:
    pool, overflow, items = over
    args, E, opt = sizer.args, sizer.args.num_experts, sizer.options
    quota = opt.quota if opt.quota is not None else sizer.min_quota(batch)
    pinned = pool == "pinned_limit"
    pool_items = [it for it in items if (it.name == "pinned_staging" if pinned else it.pool == pool)]
    bigger = [it for it in pool_items if it.nbytes >= overflow]
    culprit = min(bigger, key=lambda it: it.nbytes) if bigger else max(pool_items, key=lambda it: it.nbytes)

    def fits(ctx: int, b: int, q: int | None = None) -> bool:
        return sizer.overflow(ctx, b, q) is None

    max_context = _largest(1, args.max_position_embeddings, lambda c: fits(c, batch))
    max_batch = _largest(1, batch - 1, lambda b: fits(context, b)) if batch > 1 else None
    max_quota = None
    if opt.quota is not None:
        max_quota = _largest(sizer.min_quota(batch), E, lambda q: fits(context, batch, q))

    where = "pinned memory (pinned_limit)" if pinned else f"the {pool} pool"
    cap = sizer.device.pinned_limit if pinned else sizer.caps()[pool]
    minimum = "top_k x batch x (draft tokens + 1)" if opt.draft_tokens else "top_k x batch"
    kind = f"the minimum: {minimum}" if opt.quota is None else "as asked"
    msg = [
        f"does not fit on {sizer.device.name}: {where} is over by {format_bytes(overflow)} "
        f"(needs {format_bytes(cap + overflow)} of {format_bytes(cap)}) at context {context}, batch {batch}, "
        f"{quota} expert slots per layer ({kind}).",
        f"Smallest over-budget item (alone larger than the overflow): {culprit.name} "
        f"({format_bytes(culprit.nbytes)})."
        if bigger
        else f"No single item is as large as the overflow; the largest is {culprit.name} "
        f"({format_bytes(culprit.nbytes)}).",
    ]
    if max_quota is not None:
        msg.append(f"Largest quota that fits at context {context}, batch {batch}: {max_quota} per layer.")
    elif opt.quota is not None:
        msg.append(f"No quota fits at context {context}, batch {batch}.")
    if max_context is not None and max_context < context:
        msg.append(
            f"Largest context that fits at batch {batch} with {sizer.min_quota(batch)} slots per layer: "
            f"{max_context} tokens."
        )
    elif max_context is None:
        msg.append(
            f"No context length fits at batch {batch}, even with {sizer.min_quota(batch)} slots per layer."
        )
    if max_batch is not None:
        msg.append(f"Largest batch that fits at context {context}: {max_batch}.")
    elif batch > 1:
        msg.append(f"No batch fits at context {context}.")
    refusal = Refusal(
        pool, overflow, culprit.name, culprit.nbytes, max_context, max_batch, max_quota, " ".join(msg)
    )
    return Plan(
        **base,
        quotas=(quota,) * len(sizer.blocks),
        host_quotas=(),
        items=tuple(items),
        pools=sizer.pools(items),
        prediction=None,
        refusal=refusal,
        notes=tuple(notes),
    )


def _non_expert_step_bytes(sizer: _Sizer, context: int, batch: int, resident: Mapping[str, int]) -> int:
    """What a decode step of ``batch`` tokens reads besides the routed experts: the resident
    weights (of the embedding only ``batch`` rows unless tied), the KV cache at the full
    ``context`` and the DeltaNet state, read and written."""
    args, opt = sizer.args, sizer.options
    embed = resident.get(A.EMBED, 0)
    rows = embed if args.tie_word_embeddings else batch * args.hidden_size * DTYPE_BYTES[opt.dense_dtype]
    dense_read = sum(resident.values()) - embed + rows
    kv_read = batch * context * kv_bytes_per_token(args, opt.kv_dtype)
    return dense_read + kv_read + 2 * deltanet_state_bytes(args, batch, opt.dense_dtype)


def _far_tier(sizer: _Sizer, free: Mapping[str, int], options: PlanOptions, L: int, E: int) -> bool:
    """A discrete device whose pinned host budget holds every expert of every layer reads the
    ones its VRAM slots lack in place over PCIe (``cache.expert_cache``'s far tier)."""
    return (
        sizer.device.discrete
        and L > 0
        and options.tier_reads == "in-place"
        and sizer.slot_bytes((E,) * L) <= free[HOST_POOL]
    )


def _predict_far(
    sizer: _Sizer,
    context: int,
    batch: int,
    quotas: Sequence[int],
    resident: Mapping[str, int],
    steps: list[list[tuple[int, ...]]] | None,
    trace: RouteTrace | None,
) -> Prediction:
    """Decode with a far tier: each layer's VRAM slots hold its most used experts (by the trace;
    uniform routing otherwise), every other (token, expert) pair reads its block from pinned
    host memory over PCIe, with no storage reads and no misses. VRAM and PCIe reads overlap at
    best (the bound), not at all (serial)."""
    args, dev = sizer.args, sizer.device
    E, k, B = args.num_experts, args.num_experts_per_tok, batch
    blocks = sizer.blocks
    if steps is not None:
        n_tok = len(trace.tokens)
        far = []
        for s, q in zip(steps, quotas):
            counts: dict[int, int] = {}
            for step in s:
                for e in step:
                    counts[e] = counts.get(e, 0) + 1
            hot = sum(sorted(counts.values(), reverse=True)[:q])
            far.append(k * (1 - hot / max(sum(counts.values()), 1)))
        model = "trace"
        desc = (
            f"route trace {trace.source or ''} ({n_tok} tokens): each layer's VRAM slots hold its {min(quotas)}+ "
            "most used experts, the other pairs read in place from the pinned host tier over PCIe"
        )
    else:
        far = [k * (1 - q / E) for q in quotas]
        model, n_tok = "uniform", 0
        desc = (
            "uniform routing: a token's top_k experts are in VRAM slots with probability quota/E, else "
            "read in place from the pinned host tier over PCIe (every expert there: no storage reads)"
        )
    near_read = sum((k - f) * b for f, b in zip(far, blocks)) * B
    step_bytes = _non_expert_step_bytes(sizer, context, B, resident) + near_read
    t_mem = step_bytes / dev.memory_bandwidth
    t_pcie = sum(f * b for f, b in zip(far, blocks)) * B / dev.pcie_bandwidth
    return Prediction(
        model=model,
        description=desc,
        misses_per_token=0.0,
        device_misses_per_token=0.0,
        misses_per_layer=(0.0,) * len(quotas),
        memory_bytes_per_token=int(step_bytes / B),
        memory_bound_tok_s=B / t_mem,
        storage_bound_tok_s=None,
        pcie_bound_tok_s=B / t_pcie if t_pcie > 0 else None,
        tok_s=B / max(t_mem, t_pcie),
        tok_s_serial=B / (t_mem + t_pcie),
        trace_tokens=n_tok,
        far_reads_per_token=sum(far),
    )


def _predict(
    sizer: _Sizer,
    context: int,
    batch: int,
    quotas: Sequence[int],
    host_quotas: Sequence[int],
    resident: Mapping[str, int],
    steps: list[list[tuple[int, ...]]] | None,
    trace: RouteTrace | None,
    far: bool = False,
) -> Prediction:
    args, dev = sizer.args, sizer.device
    E, k, B = args.num_experts, args.num_experts_per_tok, batch
    blocks = sizer.blocks
    if far:
        return _predict_far(sizer, context, batch, quotas, resident, steps, trace)
    # storage tier: what the unified slots (or, discrete, the inclusive host tier) lack
    storage_q = host_quotas if host_quotas else quotas
    if steps is not None:
        n_tok = len(trace.tokens)
        policy = sizer.held_policy(bool(host_quotas))  # as the cache's slots run
        device_misses = [policy_replay(s, q, policy, k) / n_tok for s, q in zip(steps, quotas)]
        storage_misses = (
            [policy_replay(s, q, policy, k) / n_tok for s, q in zip(steps, storage_q)]
            if host_quotas
            else list(device_misses)
        )
        distinct = [sum(len(x) for x in s) / len(s) for s in steps]  # per step
        model = "trace"
        desc = (
            f"route trace {trace.source or ''} ({n_tok} tokens, {len(steps[0])} steps of {B}) replayed "
            f"through the cache's policy ({policy}) from empty (cold misses included); "
            "per-layer quotas sized by LRU miss curves"
        )
    else:
        d = E * (1 - (1 - k / E) ** B)
        distinct = [d] * len(quotas)
        device_misses = [d * (1 - q / E) / B for q in quotas]
        storage_misses = [d * (1 - q / E) / B for q in storage_q]
        model, desc, n_tok = "uniform", UNIFORM_MODEL, 0
    if dev.discrete and host_quotas:
        desc += (
            "; the pinned host tier is inclusive: storage reads are its misses, PCIe copies the VRAM tier's"
        )

    expert_read = sum(d * b for d, b in zip(distinct, blocks))
    step_bytes = _non_expert_step_bytes(sizer, context, B, resident) + expert_read

    t_mem = step_bytes / dev.memory_bandwidth
    t_storage = sum(m * b for m, b in zip(storage_misses, blocks)) * B / dev.storage_read_bandwidth
    t_pcie = (
        sum(m * b for m, b in zip(device_misses, blocks)) * B / dev.pcie_bandwidth if dev.discrete else 0.0
    )
    bound = max(t_mem, t_storage, t_pcie)
    # each layer that can miss looks its experts up on the host: its router's ids waited for, the
    # books, the return (host_layer_overhead), then its reads, if any (layer_read_seconds)
    t_layers = sum(
        layer_read_seconds(round(d), m * B / d if d else 0.0, b, dev)
        + (dev.host_layer_overhead if m > 0 else 0.0)
        for m, d, b in zip(storage_misses, distinct, blocks)
    )
    # decode prefetch (a host tier's layers are not prefetched: their misses are copies)
    depth = max(sizer.staging_buffers - k, 0)
    useful, wasted, guesses = (
        _guesses(sizer, quotas, storage_misses, trace, depth) if depth and not host_quotas else ([], [], "")
    )
    t_prefetch = (
        prefetch_seconds(storage_misses, distinct, blocks, useful, wasted, B, dev, t_mem + t_pcie)
        if useful
        else 0.0
    )
    return Prediction(
        model=model,
        description=desc,
        misses_per_token=sum(storage_misses),
        device_misses_per_token=sum(device_misses),
        misses_per_layer=tuple(storage_misses),
        memory_bytes_per_token=int(step_bytes / B),
        memory_bound_tok_s=B / t_mem,
        storage_bound_tok_s=B / t_storage if t_storage > 0 else None,
        pcie_bound_tok_s=B / t_pcie if t_pcie > 0 else None,
        tok_s=B / bound,
        tok_s_serial=B / (t_mem + t_storage + t_pcie),
        trace_tokens=n_tok,
        tok_s_layered=B / (t_mem + t_layers + t_pcie),
        tok_s_prefetch=B / t_prefetch if t_prefetch else 0.0,
        prefetch_useful_per_token=sum(useful),
        prefetch_wasted_per_token=sum(wasted),
        guesses=guesses,
    )


def _guesses(
    sizer: _Sizer,
    quotas: Sequence[int],
    misses: Sequence[float],
    trace: RouteTrace | None,
    depth: int,
) -> tuple[list[float], list[float], str]:
    """Per MoE layer, a decode step's prefetch with ``depth`` buffers: the misses a token its
    guesses read a layer early, the wrong guesses it makes, and where their shares came from (the
    trace's guesses replayed as the cache keeps them, ``tools.simulate``, else the measured prior
    :data:`GUESS_RECALL` / :data:`GUESS_WASTE`). A layer's guesses never outnumber its buffers."""
    shares = None
    why = "no route trace"
    if trace is not None:
        from edgerun.tools.simulate import simulate

        try:
            sim = simulate(
                trace,
                dict(zip(sizer.args.moe_layers, quotas, strict=True)),
                sizer.held_policy(),
                prefetch_depth=depth,
            )
        except ValueError as exc:  # no guesses recorded, or a layer the prefetcher predicts across
            why = str(exc)
        else:
            shares = [
                (p["useful"] / m, p["wasted"] / m) if (m := sim.misses[layer]) else (0.0, 0.0)
                for layer, p in ((layer, sim.prefetch[layer]) for layer in sizer.args.moe_layers)
            ]
    source = (
        f"the trace's, replayed through {depth} prefetch buffers"
        if shares is not None
        else f"{GUESS_RECALL:.0%} of the misses, {GUESS_WASTE:.2f} wrong a miss, as measured at 40 layers ({why})"
    )
    shares = shares or [(GUESS_RECALL, GUESS_WASTE)] * len(misses)
    useful, wasted = [], []
    for m, (r, w) in zip(misses, shares, strict=True):
        scale = min(1.0, depth / (m * (r + w))) if m * (r + w) > 0 else 0.0
        useful.append(m * r * scale)
        wasted.append(m * w * scale)
    return useful, wasted, source


def prefetch_seconds(
    misses: Sequence[float],
    distinct: Sequence[float],
    blocks: Sequence[int],
    useful: Sequence[float],
    wasted: Sequence[float],
    batch: int,
    dev: DeviceProfile,
    other: float,
) -> float:
    """Expected seconds of a decode step with prefetch on, per MoE layer ``misses`` (a token), of
    which ``useful`` were guessed and read a layer early, beside ``wasted`` wrong guesses. Each
    layer's k misses (k ~ Binomial(distinct, misses / distinct), as :func:`layer_read_seconds`)
    are read between one lookup and the next, which waits for them: the layer takes the longer of
    the disk's time for them (at ``storage_read_bandwidth``) and the wait for those no guess
    covered, read after the router (:func:`read_wait_seconds`), then the host's
    ``host_layer_overhead`` before the next lookup issues more. A wrong guess is read only in the
    time the disk has before the lookup that drops it (then it is cancelled): that gap, and a wait
    longer than the misses' reads; a disk that is behind reads few. Plus the step's ``other``
    seconds (memory, PCIe), serial. At the rate the disk read while busy in each row, this model
    is within 15% of 49 of the 50 streamed rows with prefetch recorded on the lent GPU machines
    (docs/benchmarks.md, forty-ninth session; ``benchmarks/replan_streamed.py --planner``)."""
    total = other
    for m, d, b, u, w in zip(misses, distinct, blocks, useful, wasted, strict=True):
        n = round(d)
        if m <= 0 or n <= 0:
            continue
        p, guessed, ride = min(m * batch / d, 1.0), min(u / m, 1.0), (m + w) / m
        waits = [read_wait_seconds(j, b, dev) for j in range(n + 1)]
        for k, pk in enumerate(binomial(n, p)):
            if k == 0 or pk < 1e-12:
                continue
            need = k * b / dev.storage_read_bandwidth  # the misses' reads, guessed or not
            made = k * (ride - 1) * b / dev.storage_read_bandwidth  # the wrong guesses', were all read
            for j, pj in enumerate(binomial(k, 1 - guessed)):  # j of the k unguessed: read after the router
                # the wrong guesses are read in what time the disk has before the lookup that drops
                # them (then they are cancelled): the host's gap, and a wait longer than the reads
                wrong = min(made, dev.host_layer_overhead + max(waits[j] - need, 0.0))
                total += pk * pj * max(need + wrong, waits[j])
        total += dev.host_layer_overhead
    return total


def binomial(n: int, p: float) -> list[float]:
    """P(X = k) for k = 0..n, X ~ Binomial(n, p), in floats (no big integers at large n)."""
    if p <= 0.0 or p >= 1.0:
        return [float(k == (n if p >= 1.0 else 0)) for k in range(n + 1)]
    lp, lq, ln = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    return [
        math.exp(ln - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq)
        for k in range(n + 1)
    ]


def read_wait_seconds(m: int, block: int, dev: DeviceProfile) -> float:
    """Seconds a lookup waits for ``m`` reads issued after its router: ``read_depth`` at a time,
    a wave of j reads at the rate j reads in flight reach (``storage_read_single`` for one,
    ``storage_read_bandwidth`` from ``read_depth`` on, linear between), plus the host's
    ``host_read_overhead`` once where there is any."""
    if m <= 0:
        return 0.0
    depth = max(dev.read_depth, 1)
    single = dev.storage_read_single or dev.storage_read_bandwidth
    full = dev.storage_read_bandwidth
    waves, left = 0.0, m
    while left > 0:
        j = min(left, depth)
        waves += j * block / (full if j >= depth else single + (full - single) * (j - 1) / (depth - 1))
        left -= j
    return waves + dev.host_read_overhead


def layer_read_seconds(n: int, p: float, block: int, dev: DeviceProfile) -> float:
    """Expected seconds one layer of a decode step spends on storage when its reads start after
    its router and the step waits for them: of the step's ``n`` distinct experts each is missing
    with probability ``p`` (independently: m ~ Binomial(n, p)), read as :func:`read_wait_seconds`
    says. On an H200 (docs/benchmarks.md, the native reader) this put a 40-layer step's read wait
    at 48 and 161 ms a token against 50 and 180 measured, where the disk's best rate alone says
    28 and 133."""
    if n <= 0 or p <= 0:
        return 0.0
    return sum(pm * read_wait_seconds(m, block, dev) for m, pm in enumerate(binomial(n, min(p, 1.0))))
