"""Streamed prefill, prefetch off vs on (interleaved runs): tok/s, read wait, logits equal.

Needs the synthetic bundle `edgerun bench streaming` leaves in its workdir (synth-int4)."""

import statistics
import sys
import time
from pathlib import Path

import torch

from edgerun.engine.runner import Runner
from edgerun.engine.setup import cache_config

b = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/edgerun-bench/synth-int4")
ids = list(range(100, 356))  # 256 tokens
res = {False: [], True: []}
waits = {False: [], True: []}
outs = {}
for _ in range(4):
    for pf in (False, True):
        run = Runner.load(
            b,
            device="cpu",
            cache=cache_config(b, quota=16, read_mode="direct", prefetch=pf),
            prefill_chunk=256,
        )
        st = run.model.new_state(1, 300)
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = run.prefill(st, ids)
        res[pf].append(len(ids) / (time.perf_counter() - t0))
        waits[pf].append(run.cache.totals().read_seconds)
        outs.setdefault(pf, logits)
        t = run.cache.totals()
        run.cache.close()
print("equal logits", torch.equal(outs[False], outs[True]))
for pf in (False, True):
    xs, w = res[pf], waits[pf]
    print(
        f"prefetch {pf}: prefill {statistics.median(xs):.1f} [{min(xs):.1f}..{max(xs):.1f}] tok/s; read wait {statistics.median(w):.2f} [{min(w):.2f}..{max(w):.2f}] s"
    )
print(t)
