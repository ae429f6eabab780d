"""How well a layer's experts are predicted from an earlier layer's residual stream, by distance:
the question behind prefetching more than one layer ahead. A decode step reads one layer's
misses after the previous layer's lookup; a read takes about a millisecond on the GPU machines'
disks and a layer's compute a tenth of that, so a prefetch one layer ahead overlaps little. Here
layer j's router (after j's own MLP norm) is applied to the residual stream layer i's MLP reads,
for every MoE layer i and j = the next ``--ahead`` MoE layers, and the guesses are scored against
the experts j's router chose for the same token:

  recall@k   of j's top_k experts, the share among the top_k guessed
  recall@2k  of them, the share among the 2 x top_k surest guesses (a wider prefetch's reach)
  precision  of the top_k guessed, the share j used (= recall@k: both sets have top_k)
  first      of the single surest guess, the share j used

    python benchmarks/prefetch_ahead.py --model BUNDLE_OR_CHECKPOINT [--text FILE | --prompt 256]
        [--ahead 4] [--quota Q] [--device cuda] [--json out.json]

One prefill over the text (or over random token ids, for random-weight models), through the
model's forward path: a forward pre-hook on each MoE layer's ``post_attention_layernorm`` keeps the
residual stream and a forward hook on its router the experts chosen, row by row. A bundle's
experts stream through a cache of ``--quota`` slots a layer (default: every expert).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from edgerun.bundle.format import MANIFEST
from edgerun.bundle.reader import Bundle
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.setup import cache_config


def capture(model) -> tuple[dict[int, list], dict[int, list], list]:
    """Hooks keeping, per MoE layer, the residual rows its MLP norm reads and the ids its router
    chose (one entry per forward call, in call order)."""
    residual: dict[int, list] = {}
    chosen: dict[int, list] = {}
    handles = []
    for i, block in enumerate(model.model.layers):
        gate = getattr(block.mlp, "gate", None)
        if gate is None or not hasattr(gate, "select"):
            continue
        residual[i], chosen[i] = [], []

        def keep_x(_m, inputs, i=i):
            residual[i].append(inputs[0].reshape(-1, inputs[0].shape[-1]).detach().float().cpu())

        def keep_ids(_m, _inputs, out, i=i):
            chosen[i].append(out[1].detach().cpu())

        handles.append(block.post_attention_layernorm.register_forward_pre_hook(keep_x))
        handles.append(gate.register_forward_hook(keep_ids))
    return residual, chosen, handles


def score(model, residual: dict[int, list], chosen: dict[int, list], ahead: int) -> list[dict]:
    """Per distance d (1..ahead): the guesses of layer j = the d-th MoE layer after i, from i's
    residual rows, against j's own choices, averaged over every (i, token)."""
    layers = sorted(residual)
    for i in layers:
        if not residual[i] or len(residual[i]) != len(chosen[i]):
            raise RuntimeError(
                f"layer {i}: {len(residual[i])} residual captures against {len(chosen[i])} router calls "
                "(the forward path did not call the MLP norm and the router as modules)"
            )
    x = {i: torch.cat(residual[i]) for i in layers}
    ids = {i: torch.cat(chosen[i]) for i in layers}
    rows = {x[i].shape[0] for i in layers}
    if len(rows) != 1:
        raise RuntimeError(f"layers captured different row counts: {sorted(rows)}")
    out = []
    for d in range(1, ahead + 1):
        per = {"k": [], "2k": [], "first": []}
        for a, i in enumerate(layers[:-d]):
            j = layers[a + d]
            block = model.model.layers[j]
            gate = block.mlp.gate
            w = next(p for p in gate.parameters())
            with torch.no_grad():
                logits = gate.logits(x[i].to(w.device, w.dtype), norm=block.post_attention_layernorm)
            k = ids[j].shape[1]
            probs = logits[:, : gate.num_experts].float()
            guess = torch.topk(probs, min(2 * k, gate.num_experts), dim=-1).indices.cpu()
            actual = ids[j]
            hit_k = (guess[:, :k, None] == actual[:, None, :]).any(-1).sum(-1).float() / k
            hit_2k = (guess[:, :, None] == actual[:, None, :]).any(-2).sum(-1).float() / k
            first = (guess[:, :1] == actual).any(-1).float()
            per["k"].append(hit_k.mean().item())
            per["2k"].append(hit_2k.mean().item())
            per["first"].append(first.mean().item())
        if per["k"]:
            out.append(
                {
                    "ahead": d,
                    "pairs": len(per["k"]),
                    "recall_k": statistics.fmean(per["k"]),
                    "recall_2k": statistics.fmean(per["2k"]),
                    "first": statistics.fmean(per["first"]),
                    "recall_k_min": min(per["k"]),
                    "recall_k_max": max(per["k"]),
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="an edgerun bundle or HF checkpoint")
    p.add_argument("--text", type=Path, default=None, help="text to prefill (default: random ids)")
    p.add_argument("--prompt", type=int, default=256, help="random token ids without --text")
    p.add_argument("--ahead", type=int, default=4)
    p.add_argument("--quota", type=int, default=None, help="a bundle's cache slots a layer (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args(argv)
    cache = None
    if (ns.model / MANIFEST).is_file():  # a bundle: its experts stream through a cache
        n = ns.quota or Bundle.open(ns.model).args.num_experts
        cache = cache_config(ns.model, quota=n, prefetch=False)
    # the model's forward path (graphs off), in the dtype the engine picks for the device
    runner = Runner.load(ns.model, device=ns.device, cache=cache, kernels=KernelPolicy(graphs="off"))
    if ns.text is not None:
        prompt = runner.tokenizer.encode(ns.text.read_text())
    else:
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, runner.args.vocab_size, (ns.prompt,), generator=gen).tolist()
    residual, chosen, handles = capture(runner.model)
    try:
        for _ in runner.generate(runner.request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))):
            pass
    finally:
        for h in handles:
            h.remove()
    rows = score(runner.model, residual, chosen, ns.ahead)
    print(f"{ns.model}: {len(prompt)} tokens, {len(residual)} MoE layers")
    print("| layers ahead | pairs | recall@k | recall@2k | surest guess used | recall@k by layer (min-max) |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['ahead']} | {r['pairs']} | {r['recall_k']:.3f} | {r['recall_2k']:.3f} | {r['first']:.3f} | "
            f"{r['recall_k_min']:.3f}-{r['recall_k_max']:.3f} |"
        )
    if ns.json:
        ns.json.write_text(json.dumps({"argv": sys.argv, "tokens": len(prompt), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
