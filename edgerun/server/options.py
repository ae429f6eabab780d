"""What ``edgerun serve`` runs with: defaults, then ``--config serve.yaml``, then command-line flags.

Until ``ServeConfig`` joins ``edgerun/config.py`` it lives here; the YAML keys are the field
names below (see docs/serving.md). Unknown keys are errors that suggest the nearest valid one.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from edgerun.budget.cpu_split import MODES as CPU_EXPERTS
from edgerun.cache.policy import CACHE_POLICIES, PREFETCH_AHEAD
from edgerun.cache.reader import READERS
from edgerun.config import SpeculativeConfig, parse_bytes
from edgerun.engine.policy import DENSE_ACTS, DENSE_KERNELS, EXPERT_ACTS, EXPERT_KERNELS, GRAPH_MODES
from edgerun.engine.setup import DTYPES
from edgerun.errors import ConfigError
from edgerun.flags import RENAMED_KEYS, TORCH_DEVICES, deprecated
from edgerun.models.providers import ProviderPolicy

SLOT_POOLS = ("device", "mapped")
TIER_READS = ("in-place", "copy")
DEFAULT_BATCH = 4  # requests decoding together on the CPU unless serve's batch says


@dataclass(frozen=True)
class ServeOptions:
    # HF checkpoint or edgerun bundle dir (a bundle's experts stream with a quota or a profile);
    # None: the shipped demo model
    model: Path | None = None
    served_model_name: str | None = None  # the id clients send as "model"; default: the dir's name
    profile: Path | None = None  # configs/*.yaml (DeviceProfile): every model is planned against it
    quota: int | None = None  # expert slots per MoE layer (bundle); None with a profile: the plan's quotas
    host_quota: int | None = None  # CUDA, with quota: a pinned host tier of this many experts a layer
    read_mode: str | None = None  # streamed expert reads: direct | buffered | auto (the default)
    read_depth: int | None = (
        None  # expert reads in flight; None: one per staging buffer (CUDA from a virtio disk: 2)
    )
    reader: str | None = None  # the reads' system call: preadv | io_uring | auto; None: preadv
    read_pieces: int | None = (
        None  # native reader: parts of a block read at once; None: 1 (CUDA from a virtio disk: 2)
    )
    prefetch: bool | None = (
        None  # expert reads before the router asks (next layer predicted); None: on for CPU slots, off on CUDA
    )
    prefetch_ahead: int | None = None  # with prefetch: streamed layers a decode step reads ahead, 1 or 2
    cache_policy: str | None = None  # streamed experts: lfu-bypass | lfu | lru; None: the cache's default
    warm: Path | None = (
        None  # warm-set JSON (`edgerun trace --frequencies`): each layer's most used preloaded
    )
    trace: Path | None = None  # route trace: with a profile, per-layer quotas from its miss curves
    # auto (Triton or torch's CPU kernels where the start-up probe passes) | reference | triton | cpu
    # | cpu_grouped
    expert_kernel: str = "auto"
    graphs: str = "auto"  # CUDA graph capture of the decode step: auto | on | off (same step, eager)
    dense_kernel: str = "auto"  # decode norms + DeltaNet step: auto (fused where probed) | torch | triton
    dense_act: str = "bf16"  # int8: W4A8 in the decode GEMV of the int4 projections of many rows (CUDA)
    expert_act: str = "bf16"  # int8: W4A8 in the routed experts' gate_up (CUDA, int4 g32 experts)
    slot_pool: str | None = None  # CUDA slots: device | mapped; None: mapped on unified profiles
    tier_reads: str | None = None  # pinned host tier -> GPU: in-place | copy; None: in-place where it can
    cpu_experts: str | None = None  # far tier experts on the CPU: auto | off | on; None: off
    device: str | None = None  # "cpu" | "cuda"; None: cuda if available
    dtype: str = "auto"
    context: int | None = None  # max context per request; None: the model's
    prefill_chunk: int = 512
    threads: int | None = (
        None  # torch CPU threads; None: 1 up to 100M params, else one per core (engine/setup.py)
    )
    socket: Path | None = None  # None: paths.default_socket_path()
    socket_mode: int = 0o660
    socket_group: str | None = None
    queue_size: int = 16  # requests waiting for the engine before 429
    # requests decoding together (continuous batching); None: DEFAULT_BATCH on the CPU, 1 on CUDA
    # (opt-in there). With a profile, the plan is made for this batch.
    batch: int | None = None
    # a CUDA batch's large int4 projections: "planes", the tensor-core GEMV (its cost hardly grows
    # with a step's rows; slower than "rows" at one row), or "rows", qgemv (faster alone, ~2.4x
    # the cost at 4 rows); either way for every row count, so a request's tokens never depend on
    # its neighbours
    batch_gemv: str = "planes"
    # a CUDA batch's prompts that arrive together prefill in this many lanes at once (1: one after
    # another; engine/graphs.PrefillLanes). None: up to config.DEFAULT_PREFILL_LANES on CUDA where
    # the plan has room (every expert held, the lanes' pools beside them), 1 on the CPU
    prefill_lanes: int | None = None
    max_connections: int = 256
    max_connections_per_uid: int = 64  # per client uid (SO_PEERCRED); past it, its oldest idle one closes
    request_timeout: float = 300.0  # seconds, queueing included
    grace_period: float = 30.0  # SIGTERM: seconds to let running requests finish
    default_max_tokens: int = 256
    max_body_bytes: int = 1024 * 1024
    max_header_bytes: int = 32 * 1024
    max_headers: int = 64
    idle_timeout: float = 60.0  # keep-alive connections
    read_timeout: float = 30.0  # to receive one whole request
    header_timeout: float = 10.0  # a new connection's first request's head; any request's head
    retry_after: int = 1  # seconds, in 429 / 503 answers
    providers: ProviderPolicy | None = None  # which external architecture providers may load the model
    # the engine (model + decode loop) in a spawned child process, so a busy event loop cannot
    # slow generation through the GIL; False: a thread of the daemon's process
    engine_process: bool = True
    speculative: str | None = None  # "mtp": draft with the model's MTP head, verify in one step; None: off
    draft_tokens: int | None = None  # with speculative: tokens drafted a step, 1..4 (default 1)
    speculative_sampled: str | None = None  # with speculative: plain (default) or verify (config.py)

    def __post_init__(self) -> None:
        if self.read_depth is not None and self.read_depth < 1:
            raise ConfigError(f"serve option 'read_depth' must be at least 1, got {self.read_depth}")
        if self.prefetch_ahead is not None and self.prefetch_ahead not in PREFETCH_AHEAD:
            raise ConfigError(f"serve option 'prefetch_ahead' must be 1 or 2, got {self.prefetch_ahead}")
        if self.cache_policy is not None and self.cache_policy not in CACHE_POLICIES:
            raise ConfigError(
                f"serve option 'cache_policy' must be one of {', '.join(CACHE_POLICIES)}, got {self.cache_policy!r}"
            )
        if self.read_pieces is not None and not 1 <= self.read_pieces <= 64:
            raise ConfigError(f"serve option 'read_pieces' must be 1..64, got {self.read_pieces}")
        if self.batch is not None and self.batch < 1:
            raise ConfigError(f"serve option 'batch' must be at least 1, got {self.batch}")
        if self.batch_gemv not in ("planes", "rows"):
            raise ConfigError(
                f"serve option 'batch_gemv' must be 'planes' or 'rows', got {self.batch_gemv!r}"
            )
        if self.prefill_lanes is not None and self.prefill_lanes < 1:
            raise ConfigError(f"serve option 'prefill_lanes' must be at least 1, got {self.prefill_lanes}")
        # what the engine would refuse only once the model is loaded, said before anything loads
        if self.speculative is not None and self.batch is not None and self.batch > 1:
            raise ConfigError(
                "serve options 'speculative' and 'batch' above 1 do not combine yet; choose one"
            )
        if (self.prefill_lanes or 1) > 1 and self.device == "cpu":
            raise ConfigError("serve option 'prefill_lanes' above 1 needs CUDA (lanes are CUDA streams)")
        if (self.prefill_lanes or 1) > 1 and self.batch == 1:
            raise ConfigError("serve option 'prefill_lanes' above 1 needs a batch above 1 ('batch')")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"serve option 'threads' must be at least 1, got {self.threads}")
        for name in (
            "queue_size",
            "prefill_chunk",
            "max_connections",
            "max_connections_per_uid",
            "default_max_tokens",
            "max_body_bytes",
            "max_headers",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"serve option {name!r} must be at least 1, got {getattr(self, name)}")
        for name in ("request_timeout", "grace_period", "idle_timeout", "read_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"serve option {name!r} must be positive, got {getattr(self, name)}")
        if self.read_mode not in (None, "auto", "direct", "buffered"):
            raise ConfigError(
                f"serve option 'read_mode' must be auto, direct or buffered, got {self.read_mode!r}"
            )
        for name, valid in (
            ("reader", READERS),
            ("expert_kernel", EXPERT_KERNELS),
            ("graphs", GRAPH_MODES),
            ("dense_kernel", DENSE_KERNELS),
            ("dense_act", DENSE_ACTS),
            ("expert_act", EXPERT_ACTS),
            ("slot_pool", SLOT_POOLS),
            ("tier_reads", TIER_READS),
            ("cpu_experts", CPU_EXPERTS),
        ):
            value = getattr(self, name)
            if value is not None and value not in valid:
                raise ConfigError(f"serve option {name!r} must be one of {', '.join(valid)}, got {value!r}")
        if self.device not in (None, *TORCH_DEVICES):
            raise ConfigError(f"serve option 'device' must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"serve option 'dtype' must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.speculative_config()
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(
                f"serve option 'socket_mode' must be a permission mode like 0660, got {self.socket_mode}"
            )

    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding these options ask for (None: off); bad values are named."""
        if self.speculative is None:
            if self.draft_tokens is not None:
                raise ConfigError("serve option 'draft_tokens' needs 'speculative: mtp'")
            if self.speculative_sampled is not None:
                raise ConfigError("serve option 'speculative_sampled' needs 'speculative: mtp'")
            return None
        return SpeculativeConfig(
            self.speculative,
            1 if self.draft_tokens is None else self.draft_tokens,
            self.speculative_sampled or "plain",
        )

    def merged(self, overrides: dict[str, Any]) -> ServeOptions:
        """These options with the non-None values of ``overrides`` on top."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


_PATHS = ("model", "profile", "socket", "warm", "trace")
_SIZES = ("max_body_bytes", "max_header_bytes")


def _convert(key: str, value: Any, source: str) -> Any:
    expected = {f.name: f.type for f in fields(ServeOptions)}[key]
    if value is None:
        return None
    if key in _PATHS:
        return Path(str(value)).expanduser()
    if key == "providers":
        return ProviderPolicy.from_mapping(value, f"{source}: providers")
    if key in _SIZES:
        return parse_bytes(value, key, source)
    if key == "socket_mode":
        text = str(value) if isinstance(value, str) else f"{value:o}"  # YAML reads 0660 as octal
        if not text.isdigit() or any(ch > "7" for ch in text):
            raise ConfigError(f"{source}: key 'socket_mode' must be octal like '0660', got {value!r}")
        return int(text, 8)
    if "bool" in expected and isinstance(value, bool):
        return value
    if "float" in expected and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if "int" in expected and isinstance(value, int) and not isinstance(value, bool):
        return value
    if "str" in expected and isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{source}: key {key!r} must be {expected.split(' |')[0]}, got {value!r}")


def load_serve_config(path: str | Path) -> dict[str, Any]:
    """The options a serve.yaml sets, converted and checked (not yet merged)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: serve config not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a serve config must be a mapping of keys to values")
    valid = [f.name for f in fields(ServeOptions)]
    out = {}
    for key, value in raw.items():
        if key in RENAMED_KEYS:
            new = RENAMED_KEYS[key]
            if new in raw:
                raise ConfigError(
                    f"{path}: keys {key!r} and {new!r} are one setting ({key!r} is its old name)"
                )
            deprecated(f"edgerun serve: {path}", f"key {key!r}", f"{new!r}")
            key = new
        if key not in valid:
            near = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (valid keys: {', '.join(valid)})"
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
        out[key] = _convert(key, value, str(path))
    return out
