"""Configuration: device profiles (and, later, the serve configuration), loaded from YAML into
frozen dataclasses. Every error names the file and the key; an unknown key suggests the nearest
valid one. Sizes accept ``8GiB``, ``7.5G``, ``512MiB`` or plain bytes; rates accept ``273GB/s``,
``6.5GiB/s`` or plain bytes per second."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from edgerun.errors import ConfigError

UNIFIED = "unified"
DISCRETE = "discrete"
MEMORY_KINDS = (UNIFIED, DISCRETE)

# a CUDA batch's prompts that arrive together prefill in up to this many lanes at once
# (engine/graphs.PrefillLanes) unless serve's --prefill-lanes says: 4 prompts of 11 tokens at 40
# layers took 41 ms to their last first token in 4 lanes, 61 ms one after another (H200,
# docs/benchmarks.md, 2026-12-05)
DEFAULT_PREFILL_LANES = 4


def default_prefill_lanes(device: str, batch: int) -> int:
    """The lanes a batch of ``batch`` on ``device`` prefills in when nothing (an option, a plan)
    says: up to DEFAULT_PREFILL_LANES on CUDA, 1 on the CPU (lanes are CUDA streams)."""
    return min(DEFAULT_PREFILL_LANES, batch) if device == "cuda" else 1


# Decimal prefixes are powers of 1000, binary ones (Ki, Mi, ...) powers of 1024, as in Kubernetes.
_MULTIPLIERS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMgGtT]i?)?([bB])?\s*(/\s*s)?\s*$")


def _quantity(value: Any, key: str, source: str, rate: bool) -> Decimal:
    what = "a rate such as '6.5GB/s' or bytes per second" if rate else "a size such as '8GiB' or bytes"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{source}: key {key!r} must be {what}, got {value!r}")
    if isinstance(value, (int, float)):
        number = Decimal(str(value))
    else:
        m = _QUANTITY.match(value)
        if m is None:
            raise ConfigError(f"{source}: key {key!r} must be {what}, got {value!r}")
        digits, prefix, _, per_second = m.groups()
        if bool(per_second) != rate:
            expected = "a rate (ending in '/s')" if rate else "a size (no '/s')"
            raise ConfigError(f"{source}: key {key!r} must be {expected}, got {value!r}")
        number = Decimal(digits) * _MULTIPLIERS[(prefix or "").lower()]
    if not number.is_finite():
        raise ConfigError(f"{source}: key {key!r} must be {what}, got {value!r}")
    if number < 0:
        raise ConfigError(f"{source}: key {key!r} must not be negative, got {value!r}")
    return number


def parse_bytes(value: Any, key: str = "value", source: str = "config") -> int:
    """``8GiB`` -> 8589934592, ``7.5G`` -> 7500000000, ``4096`` -> 4096; a fraction of a byte
    (``7.4GiB``) rounds down."""
    return int(_quantity(value, key, source, rate=False))


def parse_rate(value: Any, key: str = "value", source: str = "config") -> float:
    """``273GB/s`` -> 2.73e11 bytes per second; a plain number is bytes per second."""
    return float(_quantity(value, key, source, rate=True))


def parse_compute_capability(value: Any, key: str, source: str) -> str | None:
    """``8.7``, ``"12.0"`` or ``"sm_87"`` -> ``"8.7"``; null for a device without CUDA."""
    if value is None:
        return None
    text = str(value).strip().lower()
    m = re.fullmatch(r"sm_?(\d+)(\d)", text) or re.fullmatch(r"(\d+)\.(\d)", text)
    if isinstance(value, bool) or m is None:
        raise ConfigError(
            f"{source}: key {key!r} must look like '8.7' or 'sm_87' (or null without CUDA), got {value!r}"
        )
    return f"{int(m.group(1))}.{m.group(2)}"


def format_bytes(n: int | float) -> str:
    """Binary units, two decimals: 1.50 GiB."""
    n = float(n)
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_rate(r: float) -> str:
    return f"{r / 1e9:.1f} GB/s"


def _suggest(key: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else f" (valid keys: {', '.join(valid)})"


@dataclass(frozen=True)
class DeviceProfile:
    """What the planner may use on one device. On ``unified`` memory (Jetson) ``memory_cap`` is the
    one pool that weights, slots, staging, KV, the CUDA context and ``os_reserve`` share. On a
    ``discrete`` GPU it is the VRAM; host RAM (``host_memory_cap``, behind PCIe) holds the pinned
    host expert tier and the staging buffers."""

    name: str
    memory_kind: str
    memory_cap: int  # bytes: the unified pool, or VRAM on a discrete GPU
    os_reserve: int  # bytes of that pool kept for the OS, display and other processes
    cuda_context: int  # bytes the CUDA context and library workspaces take from that pool
    pinned_limit: int  # bytes of page-locked host memory the runtime may hold
    memory_bandwidth: float  # bytes/s of the memory resident weights are read from
    storage_read_bandwidth: float  # bytes/s of sustained O_DIRECT reads from the expert files
    compute_capability: str | None = None  # "8.7"; None: no CUDA (no graphs, no context)
    host_memory_cap: int = 0  # discrete only: host RAM
    host_reserve: int = 0  # discrete only: host RAM kept for the OS and other processes
    pcie_bandwidth: float = 0.0  # discrete only: bytes/s host -> device from pinned memory
    # discrete only, optional: expert bytes/s the host's CPU kernels compute for a one-token step
    # (edgerun/tools/calibrate.py cpu_expert_seconds); the planner's CPU-experts estimate, 0: none
    cpu_expert_bandwidth: float = 0.0
    # optional, the streamed decode's prediction (budget/planner.layer_read_seconds): bytes/s of
    # one block read alone (0: storage_read_bandwidth), the reads a layer keeps in flight, the
    # host's seconds per layer that reads (its lookup, queueing, waking; measured on an H200 host),
    # and per streamed layer whether it reads or not (the wait for its router's ids on the host,
    # the books, the return to the next segment: benchmarks/stream_timeline.py on an H100 host)
    storage_read_single: float = 0.0
    read_depth: int = 4
    host_read_overhead: float = 3e-4
    host_layer_overhead: float = 2e-4
    description: str = ""
    source: str = ""  # the file it came from

    @property
    def discrete(self) -> bool:
        return self.memory_kind == DISCRETE

    @property
    def has_cuda(self) -> bool:
        return self.compute_capability is not None


_SIZE_KEYS = ("memory_cap", "os_reserve", "cuda_context", "pinned_limit", "host_memory_cap", "host_reserve")
_RATE_KEYS = (
    "memory_bandwidth",
    "storage_read_bandwidth",
    "pcie_bandwidth",
    "cpu_expert_bandwidth",
    "storage_read_single",
)
_NUMBER_KEYS = {
    "read_depth": int,
    "host_read_overhead": float,
    "host_layer_overhead": float,
}  # a count; seconds
_REQUIRED = (
    "name",
    "memory_kind",
    "memory_cap",
    "os_reserve",
    "cuda_context",
    "pinned_limit",
    "memory_bandwidth",
    "storage_read_bandwidth",
)
_DISCRETE_ONLY = ("host_memory_cap", "host_reserve", "pcie_bandwidth")
_DISCRETE_OPTIONAL = ("cpu_expert_bandwidth",)  # discrete only, but may be left out


def device_profile_from_dict(raw: Any, source: str = "device profile") -> DeviceProfile:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a device profile must be a mapping of keys to values")
    valid = [f.name for f in fields(DeviceProfile) if f.name != "source"]
    for key in raw:
        if key not in valid:
            raise ConfigError(f"{source}: unknown key {key!r}{_suggest(str(key), valid)}")
    for key in _REQUIRED:
        if raw.get(key) is None:
            raise ConfigError(f"{source}: required key {key!r} is missing")
    kind = raw["memory_kind"]
    if kind not in MEMORY_KINDS:
        raise ConfigError(f"{source}: key 'memory_kind' must be one of {MEMORY_KINDS}, got {kind!r}")
    values: dict[str, Any] = {"source": source}
    for key, value in raw.items():
        if key in _SIZE_KEYS:
            values[key] = parse_bytes(value, key, source)
        elif key in _RATE_KEYS:
            values[key] = parse_rate(value, key, source)
        elif key == "compute_capability":
            values[key] = parse_compute_capability(value, key, source)
        elif key in _NUMBER_KEYS:
            kind = _NUMBER_KEYS[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value <= 0
                or kind(value) != value
            ):
                raise ConfigError(f"{source}: key {key!r} must be a positive {kind.__name__}, got {value!r}")
            values[key] = kind(value)
        elif value is None:
            continue
        elif not isinstance(value, str):
            raise ConfigError(f"{source}: key {key!r} must be a string, got {value!r}")
        else:
            values[key] = value
    profile = DeviceProfile(**values)
    _check(profile, raw, source)
    return profile


def _check(p: DeviceProfile, raw: dict[str, Any], source: str) -> None:
    def bad(msg: str) -> None:
        raise ConfigError(f"{source}: {msg}")

    for key in ("memory_cap", "pinned_limit", "memory_bandwidth", "storage_read_bandwidth"):
        if getattr(p, key) <= 0:
            bad(f"key {key!r} must be positive, got {raw[key]!r}")
    if p.os_reserve + p.cuda_context >= p.memory_cap:
        bad(
            f"os_reserve ({format_bytes(p.os_reserve)}) + cuda_context ({format_bytes(p.cuda_context)}) "
            f"leave nothing of memory_cap ({format_bytes(p.memory_cap)})"
        )
    if not p.has_cuda and p.cuda_context:
        bad("key 'cuda_context' must be 0 when compute_capability is null (no CUDA)")
    if p.discrete:
        for key in _DISCRETE_ONLY:
            if not getattr(p, key):
                bad(f"key {key!r} is required and must be positive for memory_kind 'discrete'")
        if not p.has_cuda:
            bad("a discrete GPU needs key 'compute_capability'")
        if p.host_reserve >= p.host_memory_cap:
            bad(
                f"host_reserve ({format_bytes(p.host_reserve)}) leaves nothing of "
                f"host_memory_cap ({format_bytes(p.host_memory_cap)})"
            )
        if p.pinned_limit > p.host_memory_cap - p.host_reserve:
            bad(
                f"pinned_limit ({format_bytes(p.pinned_limit)}) exceeds host_memory_cap - host_reserve "
                f"({format_bytes(p.host_memory_cap - p.host_reserve)})"
            )
    else:
        for key in _DISCRETE_ONLY + _DISCRETE_OPTIONAL:
            if raw.get(key):
                bad(f"key {key!r} applies only to memory_kind 'discrete' (this profile is 'unified')")
        if p.pinned_limit > p.memory_cap:
            bad(
                f"pinned_limit ({format_bytes(p.pinned_limit)}) exceeds memory_cap ({format_bytes(p.memory_cap)})"
            )


def load_device_profile(path: str | Path) -> DeviceProfile:
    path = Path(path)
    if not path.is_file():
        siblings = {p.stem: p for p in sorted(path.parent.glob("*.yaml"))} if path.parent.is_dir() else {}
        near = [s for s in siblings if path.stem in s] or difflib.get_close_matches(
            path.stem, list(siblings), n=1
        )
        hint = f" (did you mean {siblings[near[0]]}?)" if near else ""
        raise ConfigError(f"{path}: device profile not found{hint}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    return device_profile_from_dict(raw, str(path))


# ServeConfig (socket path, bundle, kernel-policy defaults) will live here beside DeviceProfile.


@dataclass(frozen=True)
class CacheConfig:
    """Every setting of the expert cache, in one object from the plan (or the flags) to the cache.

    ``quotas``: slots per MoE layer (one number for all, or by layer). ``host_quotas``: the
    pinned host tier behind device slots (discrete GPUs). ``pool``: where slots live (host on
    the CPU; device or mapped on CUDA; None: host on the CPU, and on CUDA mapped where the
    profile's memory is unified, else device). ``tier_reads``: how device slots reach the pinned
    host tier (in-place or copy; see the field). ``budget``:
    bytes slots and staging may take, refused over it. ``warm``: per-layer expert frequencies
    to preload. ``profile`` / ``context``: the plan the quotas came from, so the engine can
    re-plan against the dense bytes it measured after loading (None: fixed quotas). ``prefetch``:
    reads issued before a lookup asks for them (``ExpertCache.prefetch``), False to turn off,
    None for the device's default. ``policy``: which experts a layer's slots keep
    (``cache.policy``: lfu-bypass, LFU with decay that may leave a miss unheld; lfu, every miss
    held; lru; None: lfu-bypass)."""

    quotas: int | Mapping[int, int]
    host_quotas: int | Mapping[int, int] | None = None
    read_mode: str = "auto"
    # reads in flight; None: the default for the device and disk (cache.expert_cache.read_shape: one
    # per staging buffer; 2 on CUDA from a virtio disk)
    read_depth: int | None = None
    # who reads (edgerun.cache.reader): native (C threads, no GIL) | preadv (a Python thread per read
    # in flight) | io_uring | auto (native where it builds, else preadv, a counted fallback)
    reader: str = "auto"
    # each block read as this many parts at once by the native reader (whole pages each): a disk that
    # serves one large request at a fraction of its rate (a virtio or network disk) keeps several busy;
    # None: the default for the device and disk (cache.expert_cache.read_shape: 1; 2 on CUDA from virtio)
    read_pieces: int | None = None
    pool: str | None = None
    # a pinned host tier holding every expert of a layer (discrete GPUs): "in-place", the GPU reads
    # the experts its device slots lack straight from pinned memory over PCIe (no copy, no host
    # sync: the step stays one graph); "copy", misses are copied into device slots first.
    # None: in-place where the GPU can read mapped host memory
    tier_reads: str | None = None
    # a far tier's experts computed on the CPU from host memory beside the GPU's reads (decode
    # steps): "auto", as many as the start-up calibration says finish with the GPU (often none);
    # "on", every far expert of a step; "off" (the default until the split is measured on a GPU), none
    # (edgerun/engine/cpu_experts.py)
    cpu_experts: str = "off"
    unified_memory: bool = False  # the device profile's memory is unified: CUDA slots default to mapped
    staging: int | None = None
    warm: Mapping[int, Any] | None = None
    budget: int | None = None
    profile: Path | None = None
    context: int | None = None
    batch: int = 1  # sequences decoding together, as planned (a step's experts: the union of its rows')
    summary: str = "fixed quota"  # how the quotas were chosen, for the start-up line
    # read experts before the lookup asks (the next layer's predicted, prefill's next batch);
    # None: on for CPU slots, off for CUDA ones until it is measured there (the cache says so)
    prefetch: bool | None = None
    # how many streamed layers ahead a decode step's prefetch reads: 1, the next layer's experts
    # predicted from this layer's residual stream; 2, the one after's too (its guesses refined a
    # layer later), each layer holding at most half the prefetch buffers (ExpertCache.prefetch)
    prefetch_ahead: int = 1
    policy: str | None = None  # None: the cache's default (cache.policy.DEFAULT_POLICY)
    trace: Path | None = None  # route trace the plan's per-layer quotas come from (re-planned with it)
    # speculative decoding's draft tokens K: the plan counts the MTP head and its quota floor
    # holds a verify window's top_k x (K + 1) experts; 0: none
    draft_tokens: int = 0
    # a CUDA batch's prompts prefilled at once, as the plan counted them; None: no plan resolved
    # them (engine/setup.default_prefill_lanes)
    prefill_lanes: int | None = None
    # the engine's compute dtype as the planner names it (fp32 | bf16 | fp16), which plain resident
    # tensors, KV and state are held in; None: the device's (budget.planner.runtime_dtype)
    dtype: str | None = None

    def quota_by_layer(self, layers: Sequence[int]) -> dict[int, int]:
        q = self.quotas
        return dict(q) if isinstance(q, Mapping) else {layer: q for layer in layers}


SPECULATIVE_METHODS = ("mtp",)
SPECULATIVE_SAMPLED = ("plain", "verify")
MAX_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative mtp --draft-tokens K``): the model's own MTP head
    drafts K tokens a step, one forward of the model verifies them (engine/speculative.py)."""

    method: str = "mtp"
    draft_tokens: int = 1
    # a sampled (not greedy) request: plain decoding (its draws on the logits' device), or drafted
    # and verified with the rejection test on the host (2K + 1 distributions on the CPU a step:
    # slower than a plain step until that test runs on the device, docs/benchmarks.md)
    sampled: str = "plain"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported (supported: {', '.join(SPECULATIVE_METHODS)})"
            )
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"draft tokens must be an integer in 1..{MAX_DRAFT_TOKENS}, got {k!r}")
        if self.sampled not in SPECULATIVE_SAMPLED:
            raise ConfigError(
                f"speculative sampled {self.sampled!r} is not one of {', '.join(SPECULATIVE_SAMPLED)}"
            )

    def describe(self) -> str:
        sampled = (
            "sampled requests decode plainly"
            if self.sampled == "plain"
            else "sampled requests verified (the rejection test on the host)"
        )
        return f"speculative {self.method}, {self.draft_tokens} draft token(s) a step, greedy requests; {sampled}"
