"""How a bundle stores its resident (dense) weights (format v2): which of them ``--dense`` may
quantize, with which scheme and group, and the tensors (names, dtypes, shapes, bytes) a quantized
weight is stored as. Pure arithmetic, no torch: convert, the reader, verify and the planner share
it, so a weight's stored size is decided in one place.

Quantized: the 2-D linear weights of attention (q/k/v/o_proj), Gated DeltaNet (in_proj_qkv,
in_proj_z, in_proj_a, in_proj_b, out_proj), the shared expert and a dense MLP (gate/up/down_proj),
and an untied lm_head (its own scheme, ``--lm-head``). Everything else stays plain at the dense
dtype: the embedding table (a tied lm_head is that table), norms, conv1d, biases, dt_bias, A_log,
the router ``mlp.gate.weight`` and ``mlp.shared_expert_gate.weight`` (the runtime fuses them into
one float GEMV that decides the top-k).

Shape legend: R = rows (output features), C = columns (input features), g = group, G = C // g.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from edgerun.bundle.layout import DEFAULT_GROUP, INT4_GROUPS
from edgerun.errors import ConfigError
from edgerun.models.args import TensorSpec

PLAIN = "bf16"  # not quantized: stored plain at the bundle's dense dtype (the CLI's name for it)
SCHEMES = (PLAIN, "int8", "int4")


def add_dense_arguments(parser, default: str | None = PLAIN, what: str = "") -> None:
    """``--dense``, ``--lm-head`` and ``--dense-group``, as every command that takes them names
    them (convert, plan, bench decode, synth_bundle); ``what`` ends the ``--dense`` help."""
    parser.add_argument(
        "--dense",
        choices=SCHEMES,
        default=default,
        help="resident linear weights (attention, DeltaNet, shared expert, dense MLP): bf16 keeps them "
        f"plain at the dense dtype (the default); int8 / int4 quantize them as the experts are{what}",
    )
    parser.add_argument(
        "--lm-head",
        choices=SCHEMES,
        default=None,
        help="an untied lm_head's scheme (default: --dense's); refused for tied embeddings",
    )
    parser.add_argument(
        "--dense-group",
        type=int,
        default=None,
        help="group size of the quantized dense weights (default: int4 32, int8 0 = per row)",
    )


QUANTIZED = ("int8", "int4")
LINEAR, LM_HEAD = "linear", "lm_head"
LM_HEAD_WEIGHT = "lm_head.weight"
SCALES, GLOBAL = ".scales", ".global"  # stored beside a quantized X.weight: X.weight.scales, X.weight.global
LINEAR_LEAVES = frozenset(
    f"{module}.weight"
    for module in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
        "linear_attn.in_proj_b", "linear_attn.out_proj",
        "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )
)  # fmt: skip
_ITEMSIZE = {"U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def role(name: str, shape: tuple[int, ...]) -> str | None:
    """``linear`` or ``lm_head`` for a weight ``--dense`` / ``--lm-head`` quantizes; None for one
    that stays plain."""
    if len(shape) != 2:
        return None
    if name == LM_HEAD_WEIGHT:
        return LM_HEAD
    parts = name.split(".", 3)  # model.layers.{i}.{leaf}
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LINEAR_LEAVES:
        return LINEAR
    return None


def check_scheme(scheme: str, key: str = "--dense") -> str:
    if scheme not in SCHEMES:
        raise ConfigError(f"{key} {scheme!r} is not supported (supported: {', '.join(SCHEMES)})")
    return scheme


def group_error(scheme: str, group: int) -> str | None:
    """Why ``group`` is not a group size of ``scheme``; None when it is."""
    if scheme == PLAIN:
        return None if group == 0 else "bf16 (plain) takes 0"
    if scheme == "int4" and group not in INT4_GROUPS:
        return f"int4 takes {' or '.join(map(str, INT4_GROUPS))}"
    if group < 0:
        return "int8 takes 0 (one scale per row) or a positive group size"
    return None


def check_group(scheme: str, group: int | None, key: str = "--dense-group") -> int:
    """The effective group of ``scheme`` (None: the scheme's default: int4 32, int8 0 = per row)."""
    check_scheme(scheme)
    if scheme == PLAIN:
        return 0
    g = DEFAULT_GROUP[scheme] if group is None else group
    why = group_error(scheme, g)
    if why is not None:
        raise ConfigError(f"{key} {g}: {why}")
    return g


@dataclass(frozen=True)
class DenseScheme:
    """What ``--dense`` / ``--lm-head`` / ``--dense-group`` resolve to: a scheme and a group (int8
    0: per row) for the linear weights and for an untied lm_head."""

    linear: str = PLAIN
    linear_group: int = 0
    lm_head: str = PLAIN
    lm_head_group: int = 0

    @classmethod
    def resolve(
        cls, dense: str = PLAIN, lm_head: str | None = None, group: int | None = None, tied: bool = False
    ) -> DenseScheme:
        """``lm_head`` None follows ``dense``; with tied embeddings the lm_head is the embedding
        table, which stays plain, so an explicit ``lm_head`` is refused. ``group`` None: each
        scheme's default; given, it applies to every quantized weight."""
        check_scheme(dense)
        if lm_head is not None:
            check_scheme(lm_head, "--lm-head")
            if tied:
                raise ConfigError(
                    f"--lm-head {lm_head}: this model ties its lm_head to the embedding table "
                    "(tie_word_embeddings), which stays plain; drop --lm-head"
                )
        head = PLAIN if tied else (dense if lm_head is None else lm_head)
        if group is not None and dense == PLAIN and head == PLAIN:
            raise ConfigError(f"--dense-group {group}: no dense weight is quantized (--dense {dense})")
        return cls(dense, check_group(dense, group), head, check_group(head, group))

    def for_role(self, which: str) -> tuple[str, int]:
        return (self.lm_head, self.lm_head_group) if which == LM_HEAD else (self.linear, self.linear_group)

    @property
    def quantized(self) -> bool:
        return self.linear != PLAIN or self.lm_head != PLAIN

    def label(self) -> str:
        """``bf16``, ``int4 g32``, ``int4 g32, lm_head int8 per row`` ..."""
        lin = scheme_label(self.linear, self.linear_group)
        if (self.lm_head, self.lm_head_group) == (self.linear, self.linear_group):
            return lin
        return f"{lin}, lm_head {scheme_label(self.lm_head, self.lm_head_group)}"

    def key(self) -> dict[str, object]:
        return {
            "linear": self.linear,
            "linear_group": self.linear_group,
            "lm_head": self.lm_head,
            "lm_head_group": self.lm_head_group,
        }


def scheme_label(scheme: str, group: int) -> str:
    if scheme == PLAIN:
        return PLAIN
    return f"{scheme} {'per row' if group == 0 else f'g{group}'}"


@dataclass(frozen=True)
class Part:
    """One tensor of dense.safetensors (safetensors dtype code)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def quantized_parts(name: str, shape: tuple[int, ...], scheme: str, group: int) -> tuple[Part, ...]:
    """The stored tensors of weight ``name`` [R, C], in file order: int8: ``name`` I8 [R, C],
    ``name.scales`` F32 [R, G] (G = 1 for group 0); int4: ``name`` U8 [R, C/2] (two columns per
    byte), ``name.scales`` U8 [R, G] (e4m3 codes), ``name.global`` F32 [1]."""
    R, C = shape
    G = C // group if group else 1
    if scheme == "int8":
        return Part(name, "I8", (R, C)), Part(name + SCALES, "F32", (R, G))
    if scheme == "int4":
        return (
            Part(name, "U8", (R, C // 2)),
            Part(name + SCALES, "U8", (R, G)),
            Part(name + GLOBAL, "F32", (1,)),
        )
    raise ConfigError(f"{name}: {scheme!r} is not a quantized dense scheme ({', '.join(QUANTIZED)})")


def check_weight(name: str, shape: tuple[int, ...], scheme: str, group: int) -> None:
    """Refuse a weight whose columns the group does not divide, naming what would."""
    C = shape[1]
    if C % group == 0 if group else scheme == "int8":  # int4 groups are even: whole bytes per row
        return
    if scheme == "int4":
        fits = [str(g) for g in INT4_GROUPS if C % g == 0]
    else:
        fits = ["0 (per row)"] + [str(g) for g in (2**k for k in range(4, 13)) if g <= C and C % g == 0]
    hint = (
        f"{scheme} group sizes that divide it: {', '.join(fits)}"
        if fits
        else f"no {scheme} group size ({', '.join(map(str, INT4_GROUPS))}) divides it; int8 with one "
        "scale per row (group 0) fits any width"
    )
    raise ConfigError(
        f"cannot quantize tensor {name!r} of shape {list(shape)} as {scheme} with group {group}: "
        f"{C} columns are not a whole number of groups; {hint}"
    )


def dense_targets(specs: Iterable[TensorSpec], scheme: DenseScheme) -> dict[str, tuple[str, int]]:
    """canonical name -> (scheme, group) of every weight ``scheme`` quantizes, each checked."""
    out = {}
    for s in specs:
        which = role(s.name, s.shape)
        if which is None:
            continue
        sch, group = scheme.for_role(which)
        if sch != PLAIN:
            check_weight(s.name, s.shape, sch, group)
            out[s.name] = (sch, group)
    return out


def quantized_nbytes(shape: tuple[int, ...], scheme: str, group: int) -> int:
    """Bytes of a quantized weight: weight + scales (+ 4 for int4's global)."""
    return sum(p.nbytes for p in quantized_parts("w", shape, scheme, group))
