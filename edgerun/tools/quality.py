"""Quality probe: perplexity of an edgerun model on a text, and how peaked its routing is.

python -m edgerun.tools.quality --model edgerun/demo --text tests/data/kjv_heldout.txt
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def perplexity(
    model: nn.Module, token_ids: list[int], context: int = 256, stride: int | None = None, batch: int = 8
) -> float:
    """exp(mean next-token NLL) of ``token_ids`` under ``model`` (edgerun's ``forward``, no state).

    Windows of up to ``context`` tokens start every ``stride`` tokens; each target token is scored
    exactly once, in the first window that holds it with its previous token, so it sees between
    ``context - stride`` and ``context - 1`` tokens of history (the first window's targets: fewer).
    ``stride`` None means ``context - 1``: consecutive windows share one token, so every target
    is scored and no target is scored twice (non-overlapping targets, the cheapest exact cover).
    The first token is never a target. Windows run ``batch`` at a time; the NLL is summed in fp64.
    """
    if stride is None:
        stride = context - 1
    if not 1 <= stride <= context - 1:
        raise ValueError(f"stride must be in 1..context-1 ({context - 1}), got {stride}")
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n}")
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    # (start, end, offset of the first scored target in the window); targets are positions 1..n-1.
    windows, scored_to = [], 1
    for start in range(0, n - 1, stride):
        end = min(start + context, n)
        windows.append((start, end, scored_to - start))
        scored_to = end
        if end == n:
            break
    # Only the last window can be shorter; it runs on its own so the others batch.
    tail = windows[-1:] if windows[-1][1] - windows[-1][0] != windows[0][1] - windows[0][0] else []
    body = windows[: len(windows) - len(tail)]
    runs = [body[i : i + batch] for i in range(0, len(body), batch)] + ([tail] if tail else [])
    total = 0.0
    for run in runs:
        x = torch.stack([ids[start:end] for start, end, _ in run])
        logp = F.log_softmax(model(x).float(), dim=-1)
        for row, (start, end, first) in enumerate(run):
            tgt = ids[start + first : end]
            total -= logp[row, first - 1 : end - start - 1].gather(-1, tgt[:, None]).double().sum().item()
    return math.exp(total / (n - 1))


@dataclass
class LayerRouting:
    """One MoE layer's routing over the tokens seen: summed router entropy and top-k counts."""

    num_experts: int
    tokens: int = 0
    entropy_sum: float = 0.0  # nats, over tokens
    counts: list[int] = field(default_factory=list)

    @property
    def entropy_ratio(self) -> float:
        """Mean per-token router entropy / log(E): 1.0 is a uniform (untrained) router."""
        return self.entropy_sum / max(1, self.tokens) / math.log(self.num_experts)

    @property
    def load(self) -> list[float]:
        """Each expert's share of the top-k assignments, times E (1.0 = an even share)."""
        total = max(1, sum(self.counts))
        return [c * self.num_experts / total for c in self.counts]


class RouterProbe:
    """Context manager: while open, every forward of ``model`` adds to per-layer routing stats.
    It hooks each MoE layer's router (``layer.mlp.gate``) and recomputes its fp32 softmax from
    the router's logits."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: list[LayerRouting] = []
        self._handles: list = []

    def __enter__(self) -> RouterProbe:
        for layer in self.model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue
            stats = LayerRouting(gate.num_experts, counts=[0] * gate.num_experts)
            self.layers.append(stats)
            self._handles.append(gate.register_forward_hook(self._hook(stats)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def _hook(stats: LayerRouting):
        def hook(gate, _inputs, out) -> None:
            # out: (weights, ids, logits [N, E + extra]) -> probs [N, E] in fp32
            probs = torch.softmax(out[2][:, : gate.num_experts].float(), dim=-1)
            stats.tokens += probs.shape[0]
            stats.entropy_sum -= (probs * probs.clamp_min(1e-30).log()).sum().item()
            ids = probs.topk(gate.top_k, dim=-1).indices.flatten()
            for e, c in enumerate(torch.bincount(ids, minlength=stats.num_experts).tolist()):
                stats.counts[e] += c

        return hook


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m edgerun.tools.quality", description="perplexity of a text")
    ap.add_argument("--model", type=Path, required=True, help="HF checkpoint or edgerun bundle dir")
    ap.add_argument("--text", type=Path, required=True, help="UTF-8 text file")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--stride", type=int, default=None, help="default: context - 1 (non-overlapping)")
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--routing", action="store_true", help="also print per-layer router entropy and load")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from edgerun.engine.runner import Runner

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    ids = tok.encode(args.text.read_text()).ids[: args.max_tokens]
    model = Runner.load(args.model, device="cpu", dtype=getattr(torch, args.dtype)).model
    with RouterProbe(model) as probe:
        ppl = perplexity(model, ids, context=args.context, stride=args.stride)
    print(f"{args.text}: {len(ids)} tokens, context {args.context}, perplexity {ppl:.3f}")
    if args.routing:
        for i, layer in enumerate(probe.layers):
            load = layer.load
            print(
                f"router {i}: entropy/log(E) {layer.entropy_ratio:.3f}, load min {min(load):.2f} "
                f"max {max(load):.2f} (1.00 = even), unused experts {sum(c == 0 for c in layer.counts)}"
            )


if __name__ == "__main__":
    main()
