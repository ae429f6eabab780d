"""What a decode step and a device-decided speculative step launch, counted on the CPU (issue 17).

    TRITON_INTERPRET=1 python benchmarks/spec_launch_census.py [--ks 1,2,3] [--model BUNDLE --quota Q]

A tiny qwen3_5_moe with an MTP head (one DeltaNet and one attention layer, 16 experts top 2;
int4 experts, int8 dense weights) is converted to a bundle, or ``--model`` names one (the demo
converted with ``--quant int4``: about 10 minutes here), and loaded through the expert cache
with every expert held (the table-mode kernels, as ``serve`` runs a bundle); its decoder runs the
CUDA path's operations on the CPU under Triton's interpreter (graphs off). Each part of a step is
run once while every Triton launch and every torch operation that is not a view, an allocation
or a no-op (``.to`` a tensor's own dtype) is counted: what the step would launch on a GPU, one
kernel each (a count, not a time; a first plain step runs uncounted, as the graphs' warm-up).
The parts: a plain one-row step; for each K, the verify window of K + 1 rows, the MTP head's
catch-up window of K + 1 rows, one of its K - 1 one-row draft steps, and the whole
device-decided step (``engine/spec_steps.SpecSteps``). Deterministic.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]

VIEWS = {  # views and allocations: no kernel
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "t",
    "transpose", "permute", "as_strided", "detach", "alias", "_reshape_alias", "unbind", "split",
    "chunk", "narrow", "lift_fresh", "empty", "empty_like", "empty_strided", "set_", "resolve_conj",
    "resolve_neg", "is_same_size", "split_with_sizes", "view_as", "new_empty",
}  # fmt: skip
V = 48  # the tiny model's vocabulary
PROMPT = [5, 17, 3, 44, 9]


def bundle(root: Path) -> Path:
    from tokenizers import Tokenizer, models

    from edgerun.bundle.convert import ConvertOptions, convert
    from hf_fixtures import add_mtp, build_hf

    layers = ["linear_attention", "full_attention"]
    build_hf("qwen3_5_moe", root / "hf", seed=7, hidden_size=32, moe_intermediate_size=16,
             shared_expert_intermediate_size=16, num_hidden_layers=2, layer_types=layers, num_experts=16,
             num_attention_heads=2, num_key_value_heads=1, linear_num_value_heads=2, vocab_size=V)  # fmt: skip
    fused = add_mtp(root / "hf", root / "fused-mtp", seed=3, fused=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")).save(
        str(fused / "tokenizer.json")
    )
    convert(fused, root / "int4", ConvertOptions("int4", 16, dense="int8", dense_group=0))
    return root / "int4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument(
        "--model", type=Path, default=None,
        help="a bundle with an MTP head to count instead (e.g. the demo converted with --quant int4)",
    )  # fmt: skip
    ap.add_argument("--quota", type=int, default=16, help="expert slots a layer (every expert: table mode)")
    ns = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the Triton kernels on the CPU)")
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode

    from edgerun.config import CacheConfig
    from edgerun.engine.graphs import DecodeGraphs
    from edgerun.engine.policy import Resolved
    from edgerun.engine.runner import Runner
    from edgerun.engine.spec_steps import SpecSteps, _run
    from edgerun.engine.speculative import SpeculativeConfig
    from edgerun.engine.streaming import hold_mtp_experts
    from edgerun.kernels.moe import MoeKernelPolicy
    from edgerun.models.layers import verify_window

    counts: collections.Counter = collections.Counter()
    inside = [False]  # within a Triton kernel: the interpreter's own torch calls are not launches

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            out = func(*args, **(kwargs or {}))
            # an op that hands back its own input unchanged (``.to`` of the dtype it has) runs no
            # kernel; an in-place op (``copy_``) returns its input too, and does
            noop = out is (args[0] if args else None) and not name.endswith("_")
            if not inside[0] and name not in VIEWS and not noop:
                counts[f"torch {name}"] += 1
            return out

    real = interp.InterpretedFunction.run

    def run(self, *a, **k):
        counts[f"triton {self.fn.__name__}"] += 1
        inside[0] = True
        try:
            return real(self, *a, **k)
        finally:
            inside[0] = False

    interp.InterpretedFunction.run = run

    def census(label: str, fn) -> None:
        counts.clear()
        with torch.inference_mode(), Count():
            fn()
        tri = sum(v for k, v in counts.items() if k.startswith("triton"))
        tor = sum(counts.values()) - tri
        print(f"{label}: {tri + tor} launches ({tri} Triton, {tor} torch)")
        print("    " + ", ".join(f"{k} x{v}" for k, v in counts.most_common()))

    ks = [int(k) for k in ns.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = ns.model or bundle(Path(tmp))
        policy = Resolved(MoeKernelPolicy("triton"), graphs=False, dense="triton")
        cpu = torch.device("cpu")
        runner = Runner.load(
            path,
            device="cpu",
            dtype=torch.float32,
            cache=CacheConfig(ns.quota),
            speculative=SpeculativeConfig("mtp", 1),
        )
        runner.kernels = policy
        runner.model.use_kernels(True)
        hold_mtp_experts(runner.model, runner.cache, policy.moe, cpu)  # as on CUDA
        d = runner.decoder = DecodeGraphs(
            runner.model, runner.args, runner.cache, policy, cpu, 32, runner.steps
        )
        with torch.inference_mode():
            runner.prefill(d.reset(), PROMPT)
            _run(d)  # a first step allocates what the graphs' replays then reuse: not counted
        census("plain one-row step", lambda: _run(d))
        for k in ks:
            with torch.inference_mode():
                state = d.reset()
                t0 = int(runner.prefill(state, PROMPT).argmax())
                d.draft_step().reset()
                chain = SpecSteps(d, d.draft_step(), k)
                chain.start(state.pos, t0, [(t0 + 1 + j) % runner.args.vocab_size for j in range(k)])

            def verify(chain=chain):
                with verify_window():
                    _run(chain.verify)

            census(f"K={k}: verify window, {k + 1} rows", verify)
            census(
                f"K={k}: the MTP head's catch-up window, {k + 1} rows",
                lambda chain=chain: _run(chain.catch_up),
            )
            if k > 1:
                census(f"K={k}: one of the head's {k - 1} draft steps", lambda chain=chain: _run(chain.head))
            census(f"K={k}: the whole device-decided step", chain._ops)


if __name__ == "__main__":
    main()
