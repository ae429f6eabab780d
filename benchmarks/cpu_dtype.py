"""CPU decode tok/s in fp32 and bf16 compute, to settle the CPU's default dtype
(``kernels/cpu_features.py``'s ``DEFAULT_DTYPE``: bf16 with AMX, fp32 otherwise).

    python benchmarks/cpu_dtype.py [--model DIR] [--rounds 3] [--tokens 64] [--threads N] [--json PATH]
    python benchmarks/cpu_dtype.py --synth DIR [--layers 2] [--experts 128] [--dense bf16,int4]

Prints the CPU's flags as ``cpu_features`` reads them (AMX tile / bf16, AVX512-BF16) beside
torch's own view, the dtype ``--dtype auto`` picks here and why, then for each configuration
the decode tok/s of greedy ``--tokens`` (after a ``--prompt``-token prompt), median and range of
``--rounds`` interleaved rounds (every configuration once a round; a warm-up round first,
not counted), and how many greedy tokens bf16 shares with fp32 (bf16 rounds differently: a
count, not a check). Each configuration is loaded once, through the entry points' own
``setup.runtime`` (``--device cpu``), before the rounds.

Configurations: the model (default: the embedded demo) resident in fp32 and bf16; with the
demo, also its int4 bundle (``convert --quant int4``, into a temporary directory) with every
expert cached, so the experts run in the int4 CPU kernels. ``--synth DIR``: instead, a
synthetic Qwen3-30B-A3B-geometry int4 bundle (``configs/models/qwen3-30b-a3b.json`` cut to
``--layers`` layers and ``--experts`` experts, random weights, ``edgerun.tools.synth_bundle``),
one per ``--dense`` format (bf16: plain bf16 projections and lm_head, which fp32 compute upcasts;
int4: through the int4 CPU kernels, bf16 activations either way), written into DIR once and
reused. Threads: edgerun's default unless ``--threads`` (one for the demo, else one per core),
with ``OMP_WAIT_POLICY=PASSIVE`` as the CLI sets it. The GPU is never used.

Defaults keep a run under 3 minutes (``--synth``: two bundles of about 1.5 GB at 2 layers of 128
experts, written in ~15 s each on 2 cores; both dtypes of both loaded peak at ~13 GB resident).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as edgerun's CLI, before torch loads OpenMP

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from edgerun.bundle.convert import ConvertOptions, convert  # noqa: E402
from edgerun.bundle.format import read_manifest  # noqa: E402
from edgerun.config import CacheConfig  # noqa: E402
from edgerun.engine.provenance import provenance  # noqa: E402
from edgerun.engine.runner import DEMO_MODEL  # noqa: E402
from edgerun.engine.sampler import SamplingParams  # noqa: E402
from edgerun.engine.setup import default_dtype, runtime  # noqa: E402
from edgerun.kernels import cpu_features  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN3_30B = ROOT / "configs" / "models" / "qwen3-30b-a3b.json"
DTYPES = ("float32", "bfloat16")


def cpu_report() -> dict:
    """The CPU as ``cpu_features`` sees it, torch's view beside it, and ``auto``'s choice."""
    f = cpu_features.read()
    seen = {name: name in f.flags for name in cpu_features.FLAGS}
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")
    torch_view = {p.strip("_"): getattr(torch.cpu, p)() for p in probes if hasattr(torch.cpu, p)}
    return {
        "model": f.model,
        "cores": len(os.sched_getaffinity(0)),
        "flags": seen,
        "bf16_hardware": f.bf16_hardware,
        "auto_dtype": default_dtype("cpu"),
        "auto_line": f.describe(f.default_dtype()),
        "torch": torch.__version__,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_view": torch_view,
    }


def synth(root: Path, layers: int, experts: int, dense: str) -> Path:
    from edgerun.tools.synth_bundle import synth_bundle, with_layers

    config = with_layers(json.loads(QWEN3_30B.read_text()), layers)
    config["num_experts"] = experts
    out = root / f"qwen3-30b-a3b-L{layers}-E{experts}-int4-dense-{dense}"
    t0 = time.perf_counter()
    synth_bundle(out, config, "int4", dense=dense)
    print(f"{out}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def configurations(ns: argparse.Namespace, tmp: Path) -> list[tuple[str, Path | None, bool]]:
    """(name, model dir or None for the demo, every expert cached from a bundle)."""
    if ns.synth is not None:
        ns.synth.mkdir(parents=True, exist_ok=True)
        return [
            (f"int4 experts, {d} dense", synth(ns.synth, ns.layers, ns.experts, d), True) for d in ns.dense
        ]
    out = [("resident", ns.model, False)]
    if ns.model is None:
        bundle = tmp / "demo-int4"
        convert(DEMO_MODEL, bundle, ConvertOptions("int4"))
        out.append(("int4 experts (bundle)", bundle, True))
    return out


def load(model: Path | None, dtype: str, bundle: bool, threads: int | None):
    rt = runtime("cpu", dtype, threads)
    cache = None
    if bundle:
        experts = max(r.num_experts for r in read_manifest(model).layers)
        cache = CacheConfig(experts)  # every expert cached: the compute, not the reads
    return rt.load(model, progress=False, cache=cache)


def decode(runner, prompt: list[int], n: int) -> tuple[list[int], float]:
    tokens, stats = [], None
    for ev in runner.generate(runner.request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))):
        if ev.token_id is not None:
            tokens.append(ev.token_id)
        stats = ev.stats or stats
    return tokens, stats.decode_tps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="an HF checkpoint or bundle (default: the demo)")
    ap.add_argument(
        "--synth", type=Path, default=None, help="write/reuse synthetic Qwen3-30B-A3B int4 bundles here"
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dense", default="bf16,int4", help="synthetic bundles' dense formats, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=None, help="default: 64, 32 with --synth")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: edgerun's)")
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args(argv)
    ns.tokens = ns.tokens or (32 if ns.synth is not None else 64)
    ns.dense = [d.strip() for d in ns.dense.split(",") if d.strip()]
    if ns.synth is not None and ns.model is not None:
        ap.error("give --model or --synth, not both")
    if bad := [d for d in ns.dense if d not in ("bf16", "int4")]:
        ap.error(f"--dense {','.join(bad)}: each must be bf16 or int4")

    cpu = cpu_report()
    print(f"cpu: {cpu['model']}, {cpu['cores']} cores; flags (/proc/cpuinfo): "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["flags"].items()))  # fmt: skip
    print(f"torch {cpu['torch']}: capability {cpu['torch_capability']}, "
          + ", ".join(f"{k} {v}" for k, v in cpu["torch_view"].items()))  # fmt: skip
    print(f"--dtype auto here: {cpu['auto_dtype']} ({cpu['auto_line']})", flush=True)
    load_avg = os.getloadavg()[0]  # a shared machine: say how busy it was

    with tempfile.TemporaryDirectory(prefix="edgerun-cpu-dtype-") as tmp:
        runners, lines = {}, {}
        for name, model, bundle in configurations(ns, Path(tmp)):
            for dtype in DTYPES:
                t0 = time.perf_counter()
                r = runners[(name, dtype)] = load(model, dtype, bundle, ns.threads)
                lines[(name, dtype)] = provenance(r, model)
                print(f"loaded {name}, {dtype} in {time.perf_counter() - t0:.1f} s:\n  {lines[(name, dtype)]}",
                      flush=True)  # fmt: skip
        vocab = next(iter(runners.values())).args.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(ns.prompt)]
        rates: dict = {k: [] for k in runners}
        tokens: dict = {}
        t0 = time.perf_counter()
        for i in range(ns.rounds + 1):  # interleaved; round 0 warms up
            for key, r in runners.items():
                got, rate = decode(r, prompt, ns.tokens)
                if i:
                    rates[key].append(rate)
                if tokens.setdefault(key, got) != got:
                    raise SystemExit(f"{key}: two rounds decoded different greedy tokens")
        wall = time.perf_counter() - t0

    threads = torch.get_num_threads()
    print(f"\n{ns.rounds} rounds of {ns.tokens} tokens, {threads} threads, load average {load_avg:.2f} at the "
          f"start, {wall:.0f} s of rounds; decode tok/s, median (range):")  # fmt: skip
    results = []
    for name in dict.fromkeys(k[0] for k in runners):
        fp32, bf16 = (rates[(name, d)] for d in DTYPES)
        same = sum(a == b for a, b in zip(tokens[(name, "float32")], tokens[(name, "bfloat16")]))
        for dtype, rs in zip(DTYPES, (fp32, bf16)):
            results.append({
                "configuration": name, "dtype": dtype, "rates": rs, "median": statistics.median(rs),
                "min": min(rs), "max": max(rs), "startup": lines[(name, dtype)],
            })  # fmt: skip
            print(f"  {name:32s} {dtype:9s} {statistics.median(rs):8.1f} ({min(rs):.1f}-{max(rs):.1f})")
        ratio = statistics.median(bf16) / statistics.median(fp32)
        print(f"  {name:32s} bf16 / fp32 {ratio:.2f}x; greedy tokens equal {same}/{ns.tokens}")
        results[-1]["bf16_over_fp32"] = ratio
        results[-1]["tokens_equal_fp32"] = same
    if ns.json:
        result = {
            "command": " ".join(["python", "benchmarks/cpu_dtype.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "threads": threads, "load_average": load_avg, "rounds": ns.rounds,
            "tokens": ns.tokens, "prompt": ns.prompt, "results": results,
        }  # fmt: skip
        ns.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
