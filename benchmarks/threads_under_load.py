"""The demo model's CPU decode speed, idle and beside a bounded busy loop, under each thread
setting: a thread per core with OpenMP's default wait (what a plain ``import torch`` gets), with
it spinning (ACTIVE) and sleeping (PASSIVE: edgerun's default unless the user set it), and
edgerun's default thread count (one thread for a model this small, engine/setup.py).
Interleaved rounds; median and range per cell.

    python benchmarks/threads_under_load.py [--rounds 3] [--tokens 128] [--load N] [--model DIR [--quota N]]

``--model``: another model instead of the demo (a bundle streams, or is fully cached, at
``--quota``); for one over 100M parameters edgerun's default is the PASSIVE row, and the last row
is ``--threads 1`` instead.

Load: N processes (default: one per core) each spinning for the whole ``edgerun generate`` run,
started before and stopped after it (a robot's other work, bounded).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time

CORES = str(os.cpu_count())
SETTINGS = {  # an empty OMP_WAIT_POLICY is libgomp's default (spin a while, then sleep)
    "torch's default: a thread per core, OpenMP's default wait": (
        {"OMP_WAIT_POLICY": ""},
        ["--threads", CORES],
    ),
    "a thread per core, OMP_WAIT_POLICY=ACTIVE": ({"OMP_WAIT_POLICY": "ACTIVE"}, ["--threads", CORES]),
    "a thread per core, OMP_WAIT_POLICY=PASSIVE (edgerun, models > 100M)": ({}, ["--threads", CORES]),
    "edgerun's default for the demo (8M: one thread)": ({}, []),
}
ONE_THREAD = "--threads 1 (a large model; edgerun's default is the PASSIVE row)"


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def decode_tps(env: dict, extra: list[str], tokens: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "edgerun",
        "generate",
        "-q",
        "--max-tokens",
        str(tokens),
        "--ignore-eos",
        *extra,
    ]
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [*cmd, "In the beginning"], capture_output=True, text=True, env={**base, **env}, timeout=900
    )
    m = re.search(r"decode ([\d.]+) tok/s", out.stderr)
    if out.returncode or not m:
        raise RuntimeError(out.stderr[-2000:])
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--load", type=int, default=os.cpu_count())
    ap.add_argument("--model", default=None, help="default: the demo")
    ap.add_argument("--quota", type=int, default=None, help="with --model: a bundle's expert slots per layer")
    a = ap.parse_args()
    settings = dict(SETTINGS)
    model = []
    if a.model is not None:
        settings.pop(list(SETTINGS)[-1])
        settings[ONE_THREAD] = ({}, ["--threads", "1"])
        model = ["--model", a.model, *(["--quota", str(a.quota)] if a.quota else [])]
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.rounds):
        for loaded in (False, True):
            for name, (env, extra) in settings.items():
                stop = mp.Event()
                procs = [mp.Process(target=_spin, args=(stop,)) for _ in range(a.load if loaded else 0)]
                for p in procs:
                    p.start()
                time.sleep(0.2 if procs else 0)
                try:
                    tps = decode_tps(env, [*extra, *model], a.tokens)
                finally:
                    stop.set()
                    for p in procs:
                        p.join()
                results.setdefault((name, "loaded" if loaded else "idle"), []).append(tps)
    print(
        f"{a.model or 'the demo'}: {os.cpu_count()} cores, load {a.load} spinning processes, "
        f"{a.rounds} interleaved rounds, {a.tokens} tokens"
    )
    print("| setting | idle tok/s, median (range) | loaded tok/s, median (range) |")
    print("| --- | --- | --- |")
    for name in settings:
        cells = []
        for cond in ("idle", "loaded"):
            v = results[(name, cond)]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
