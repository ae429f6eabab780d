"""Route traces: which experts each token was routed to, per MoE layer, as JSON Lines.

Line 1, the header::

    {"edgerun_route_trace": 1, "model": {"name": "qwen3.6-35b-a3b", "model_type": "qwen3_5_moe"},
     "num_layers": 40, "moe_layers": [0, 1, ..., 39], "num_experts": 256, "top_k": 8}

Then one line per token, in decode order, with one list of ``top_k`` distinct expert ids per MoE
layer (in ``moe_layers`` order, each in router order)::

    {"experts": [[17, 3, 250, 9, 41, 77, 120, 5], [...], ...]}

A token line may carry ``"seq": N`` (which request it belongs to) and ``"step": N`` (tokens
computed in one forward, e.g. a prefill chunk, share a step: the cache fetches their experts
together). Without ``step`` every token is its own step. A line may carry ``"predicted"``: one
list of ``top_k`` ids for each MoE layer after the first, the experts the prefetcher predicts
for it from the previous MoE layer's residual stream (``edgerun simulate --prefetch`` replays
them), and ``"predicted2"``: one list for each MoE layer after the second, predicted from the
residual stream two MoE layers before it (a prefetch two layers ahead). Readers keep lines in
file order, since the expert cache persists across requests. See docs/planning.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from edgerun.errors import ConfigError
from edgerun.models.args import ModelArgs

FORMAT_KEY = "edgerun_route_trace"
FORMAT_VERSION = 1

TokenRoutes = tuple[tuple[int, ...], ...]  # one tuple of expert ids per MoE layer


@dataclass(frozen=True)
class TraceHeader:
    model_name: str
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int

    @classmethod
    def for_model(cls, args: ModelArgs, name: str) -> TraceHeader:
        return cls(
            name,
            args.model_type,
            args.num_hidden_layers,
            args.moe_layers,
            args.num_experts,
            args.num_experts_per_tok,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            FORMAT_KEY: FORMAT_VERSION,
            "model": {"name": self.model_name, "model_type": self.model_type},
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
        }

    def check_matches(self, args: ModelArgs, source: str = "route trace") -> None:
        """The trace must come from a model with this routing geometry."""
        ours = TraceHeader.for_model(args, self.model_name)
        for key in ("model_type", "moe_layers", "num_experts", "top_k"):
            if getattr(self, key) != getattr(ours, key):
                raise ConfigError(
                    f"{source}: trace {key} is {getattr(self, key)!r} but the model's is {getattr(ours, key)!r}"
                )


@dataclass(frozen=True)
class RouteTrace:
    header: TraceHeader
    tokens: tuple[TokenRoutes, ...]
    source: str = ""
    steps: tuple[int, ...] = ()  # per token; empty: each token is its own step
    predicted: tuple[TokenRoutes | None, ...] = ()  # per token, MoE layers after the first; empty: none
    predicted2: tuple[TokenRoutes | None, ...] = ()  # per token, MoE layers after the second (two ahead)

    def step_ids(self) -> tuple[int, ...]:
        return self.steps or tuple(range(len(self.tokens)))


def _header_from_dict(raw: Any, where: str) -> TraceHeader:
    if not isinstance(raw, dict) or raw.get(FORMAT_KEY) is None:
        raise ConfigError(f"{where}: not an edgerun route trace header (no {FORMAT_KEY!r} key)")
    if raw[FORMAT_KEY] != FORMAT_VERSION:
        raise ConfigError(f"{where}: route trace version {raw[FORMAT_KEY]!r} is not supported (expected 1)")
    model = raw.get("model") or {}
    for key, most in (("num_layers", 4096), ("num_experts", 1 << 16), ("top_k", 1 << 16)):
        if not isinstance(raw.get(key), int) or isinstance(raw[key], bool) or not 0 < raw[key] <= most:
            raise ConfigError(
                f"{where}: header key {key!r} must be an integer in 1..{most}, got {raw.get(key)!r}"
            )
    moe = raw["moe_layers"] if "moe_layers" in raw else list(range(raw["num_layers"]))
    if not isinstance(moe, list) or not all(isinstance(i, int) and 0 <= i < raw["num_layers"] for i in moe):
        raise ConfigError(f"{where}: header key 'moe_layers' must list layer indices below num_layers")
    if raw["top_k"] > raw["num_experts"]:
        raise ConfigError(f"{where}: top_k {raw['top_k']} exceeds num_experts {raw['num_experts']}")
    return TraceHeader(
        str(model.get("name", "")),
        str(model.get("model_type", "")),
        raw["num_layers"],
        tuple(moe),
        raw["num_experts"],
        raw["top_k"],
    )


def _token_from_dict(raw: Any, h: TraceHeader, where: str, key: str = "experts") -> TokenRoutes:
    skip = {"experts": 0, "predicted": 1, "predicted2": 2}[key]  # MoE layers before the first listed
    layers = h.moe_layers[skip:]
    lists = raw.get(key) if isinstance(raw, dict) else None
    if not isinstance(lists, list) or len(lists) != len(layers):
        after = {0: "", 1: " after the first", 2: " after the second"}[skip]
        raise ConfigError(f"{where}: {key!r} must hold {len(layers)} lists, one per MoE layer{after}")
    out = []
    for layer, ids in zip(layers, lists):
        if (
            not isinstance(ids, list)
            or len(ids) != h.top_k
            or len(set(ids)) != h.top_k
            or not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < h.num_experts for e in ids)
        ):
            raise ConfigError(
                f"{where}: layer {layer} must list {h.top_k} distinct expert ids in 0..{h.num_experts - 1}, "
                f"got {ids!r}"
            )
        out.append(tuple(ids))
    return tuple(out)


def read_trace(path: str | Path) -> RouteTrace:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: route trace not found")
    header, tokens, steps = None, [], []
    predicted: dict[str, list] = {"predicted": [], "predicted2": []}
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from exc
            except RecursionError:
                raise ConfigError(f"{where}: not valid JSON (nested too deeply)") from None
            if header is None:
                header = _header_from_dict(raw, where)
            else:
                tokens.append(_token_from_dict(raw, header, where))
                for key, rows in predicted.items():
                    has = isinstance(raw, dict) and key in raw
                    rows.append(_token_from_dict(raw, header, where, key) if has else None)
                step = raw.get("step", len(tokens) - 1)
                if not isinstance(step, int) or (steps and step < steps[-1]):
                    raise ConfigError(
                        f"{where}: 'step' must be a non-decreasing integer on every line, got {step!r}"
                    )
                steps.append(step)
    if header is None:
        raise ConfigError(f"{path}: empty route trace (no header line)")
    kept = {key: tuple(rows) if any(p is not None for p in rows) else () for key, rows in predicted.items()}
    return RouteTrace(header, tuple(tokens), str(path), tuple(steps), **kept)


class RouteTraceWriter:
    """Streams a trace: the header on open, one line per :meth:`add`."""

    def __init__(self, path: str | Path, header: TraceHeader) -> None:
        self.header = header
        self.count = 0
        self._f: TextIO = Path(path).open("w")
        self._f.write(json.dumps(header.to_dict()) + "\n")

    def add(
        self,
        experts: Sequence[Sequence[int]],
        seq: int | None = None,
        step: int | None = None,
        predicted: Sequence[Sequence[int]] | None = None,
        predicted2: Sequence[Sequence[int]] | None = None,
    ) -> None:
        line: dict[str, Any] = {"experts": [[int(e) for e in ids] for ids in experts]}
        if seq is not None:
            line["seq"] = seq
        if step is not None:
            line["step"] = step
        if predicted is not None:
            line["predicted"] = [[int(e) for e in ids] for ids in predicted]
        if predicted2 is not None:
            line["predicted2"] = [[int(e) for e in ids] for ids in predicted2]
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
        self.count += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RouteTraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_trace(path: str | Path, trace: RouteTrace) -> None:
    with RouteTraceWriter(path, trace.header) as w:
        steps = trace.steps or (None,) * len(trace.tokens)
        predicted = trace.predicted or (None,) * len(trace.tokens)
        predicted2 = trace.predicted2 or (None,) * len(trace.tokens)
        for token, step, pred, pred2 in zip(trace.tokens, steps, predicted, predicted2, strict=True):
            w.add(token, step=step, predicted=pred, predicted2=pred2)
