"""Model arguments shared by every architecture, and the tensor inventory built from them.

Each architecture file turns an HF ``config.json`` into a :class:`ModelArgs` and lists its
tensors as :class:`TensorSpec` rows. The loader, the bundle converter and the planner all
read that one inventory, so a tensor's shape and category are decided in one place.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgerun.errors import ConfigError

# Categories a tensor can belong to; the planner reports resident bytes by these.
EMBED = "embeddings"
LM_HEAD = "lm_head"
ATTENTION = "attention"
DELTANET = "deltanet"
NORM = "norms"
ROUTER = "routers"
SHARED_EXPERT = "shared_experts"
DENSE_MLP = "dense_mlp"
EXPERT = "experts"
MTP = "mtp"  # the multi-token-prediction head, all of it resident (loaded only for speculative decoding)
CATEGORIES = (EMBED, LM_HEAD, ATTENTION, DELTANET, NORM, ROUTER, SHARED_EXPERT, DENSE_MLP, EXPERT, MTP)

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the internal (canonical) layout."""

    name: str
    shape: tuple[int, ...]
    category: str
    layer: int | None = None  # decoder layer index, None for embeddings / final norm / lm_head


@dataclass(frozen=True)
class ModelArgs:
    """Architecture hyper-parameters. Unknown config keys are ignored; missing required ones are errors."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    layer_types: tuple[str, ...]
    moe_layers: tuple[int, ...]
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True
    intermediate_size: int = 0  # dense MLP of non-MoE layers (qwen3_moe mlp_only_layers)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    attn_output_gate: bool = False  # qwen3_5: q_proj also yields a sigmoid gate on the attention output
    norm_unit_offset: bool = False  # qwen3_5: RMSNorm scales by (1 + weight), weights stored zero-centred
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    mrope_section: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def expert_bytes(self, bytes_per_param: float = 2.0) -> int:
        """Bytes of one routed expert's weights (gate, up, down) at the given width."""
        return int(3 * self.hidden_size * self.moe_intermediate_size * bytes_per_param)


class ConfigReader:
    """Reads typed keys from a config dict and names the key (and the file) in every error."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg = cfg
        self.source = source

    def require(self, key: str, typ: type | tuple[type, ...] = int, aliases: tuple[str, ...] = ()) -> Any:
        for alias in aliases:
            if self.cfg.get(key) is None and self.cfg.get(alias) is not None:
                key = alias
        if key not in self.cfg or self.cfg[key] is None:
            near = difflib.get_close_matches(key, list(self.cfg), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{self.source}: required key {key!r} is missing{hint}")
        return self._typed(key, self.cfg[key], typ)

    def get(self, key: str, default: Any, typ: type | tuple[type, ...] = int) -> Any:
        value = self.cfg.get(key, default)
        if value is None:
            return default
        return self._typed(key, value, typ)

    def _typed(self, key: str, value: Any, typ: type | tuple[type, ...]) -> Any:
        types = typ if isinstance(typ, tuple) else (typ,)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in types:
            raise ConfigError(f"{self.source}: key {key!r} must be {_tname(types)}, got {value!r}")
        if not isinstance(value, types):
            raise ConfigError(f"{self.source}: key {key!r} must be {_tname(types)}, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{self.source}: key {key!r} must not be negative, got {value}")
        if isinstance(value, int) and key in SIZE_LIMITS:
            lo, hi = SIZE_LIMITS[key]
            if not lo <= value <= hi:
                raise ConfigError(f"{self.source}: key {key!r} is {value}; a model's is {lo} to {hi}")
        return value


_HEADS = (1, 4096)
# the sizes a config may give, far past every released model's, so that a damaged or hostile
# config.json is refused by its key before anything is sized from it (a layer count of 10^9
# would build tables of 10^9 entries first); 0 is refused where a division or a loop needs one
SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 4096),
    "hidden_size": (1, 1 << 17),
    "num_attention_heads": _HEADS,
    "num_key_value_heads": _HEADS,
    "head_dim": (1, 4096),
    "num_experts": (1, 1 << 16),
    "num_local_experts": (1, 1 << 16),
    "num_experts_per_tok": (1, 1 << 16),
    "moe_intermediate_size": (1, 1 << 20),
    "intermediate_size": (0, 1 << 20),  # 0: no dense MLP layer
    "shared_expert_intermediate_size": (0, 1 << 20),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, 1 << 24),
    "linear_num_key_heads": _HEADS,
    "linear_num_value_heads": _HEADS,
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_conv_kernel_dim": (1, 64),
    "full_attention_interval": (1, 4096),
    "decoder_sparse_step": (1, 4096),
    "mtp_num_hidden_layers": (0, 16),
}


def _tname(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of an HF config: a nested ``text_config`` wins over the top level,
    but for ``tie_word_embeddings``, which the top level decides (as transformers' multimodal
    model ties its lm_head; its ``save_pretrained`` writes ``false`` inside and ``true`` outside)."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        merged = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        merged.update(inner)
        merged["model_type"] = cfg.get("model_type", inner.get("model_type"))
        if "tie_word_embeddings" in cfg:  # the multimodal model ties (or not) by its own key
            merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        return merged
    return cfg


def rope_settings(
    r: ConfigReader, partial_default: float = 1.0
) -> tuple[float, float, tuple[int, ...] | None]:
    """(rope_theta, partial_rotary_factor, mrope_section) from either the v5 ``rope_parameters``
    dict or the older top-level ``rope_theta`` / ``rope_scaling`` keys, as the reference reads
    them: a ``rope_scaling`` dict replaces ``rope_parameters`` whole, and a key neither holds
    comes from the top level, else the architecture's default (``partial_default``)."""
    key = "rope_scaling" if r.cfg.get("rope_scaling") else "rope_parameters"
    params = r.cfg.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{r.source}: key {key!r} must be a mapping, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"{r.source}: {key}.rope_type {rope_type!r} is not supported (supported: 'default')"
        )
    theta = params.get("rope_theta", r.cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", r.cfg.get("partial_rotary_factor", partial_default))
    section = params.get("mrope_section")
    try:
        theta, partial = float(theta), float(partial)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{r.source}: rope_theta / partial_rotary_factor must be numbers") from exc
    if not 0.0 < partial <= 1.0:
        raise ConfigError(f"{r.source}: partial_rotary_factor must be in (0, 1], got {partial}")
    return theta, partial, tuple(section) if section else None


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def read_json(path: Path, error: type[Exception] = ConfigError) -> Any:
    """``path`` parsed as JSON; text that is not JSON (or nested past the parser's depth, or not
    UTF-8) is ``error`` naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise error(f"{path}: not valid JSON ({type(exc).__name__}: {exc})") from exc


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json found")
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    return cfg


def validate(args: ModelArgs, source: str) -> None:
    """Cross-key checks the reference would otherwise fail on later with a shape error."""

    def bad(msg: str) -> None:
        raise ConfigError(f"{source}: {msg}")

    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
        if getattr(args, key) <= 0:
            bad(f"key {key!r} must be positive, got {getattr(args, key)}")
    if args.num_key_value_heads <= 0 or args.num_attention_heads % args.num_key_value_heads:
        bad(
            f"num_attention_heads ({args.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({args.num_key_value_heads})"
        )
    if args.moe_layers:
        if args.num_experts <= 0 or args.moe_intermediate_size <= 0:
            bad("num_experts and moe_intermediate_size must be positive for MoE layers")
        if not 0 < args.num_experts_per_tok <= args.num_experts:
            bad(
                f"num_experts_per_tok ({args.num_experts_per_tok}) must be in 1..num_experts ({args.num_experts})"
            )
    if len(args.moe_layers) < args.num_hidden_layers and args.intermediate_size <= 0:
        bad("intermediate_size must be positive when some layers use a dense MLP")
    if args.rotary_dim % 2 or args.rotary_dim <= 0:
        bad(
            f"rotary dimension head_dim*partial_rotary_factor = {args.rotary_dim} must be a positive even number"
        )
    if LINEAR_ATTENTION in args.layer_types:
        for key in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ):
            if getattr(args, key) <= 0:
                bad(f"key {key!r} must be positive, got {getattr(args, key)}")
        if args.linear_num_value_heads % args.linear_num_key_heads:
            bad("linear_num_value_heads must be a multiple of linear_num_key_heads")
