"""A prompt's Gated DeltaNet delta rule on a CUDA GPU: fla-core's chunked kernels
(kernels/delta_chunk.py, the engine's choice where its probe passes) against the torch chunked
reference, at Qwen3.6-35B-A3B's DeltaNet geometry (16 key / 32 value heads of 128), for several
prompt lengths: milliseconds a call (mean of 10 after a warm-up) and the error of the output and
final state relative to the reference's scale.

    python benchmarks/bench_delta_chunk.py [--tokens 512,1024,4096]

Needs CUDA and fla-core (``pip install 'edgerun[gpu]'``).
"""

from __future__ import annotations

import argparse
import time

import torch

from edgerun.kernels.delta_chunk import delta_rule_fla, fla_version, random_inputs, reference_bthk
from edgerun.kernels.dense_reference import DeltaDims


def timed(fn, args: tuple, n: int = 10) -> float:
    fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,1024,4096")
    ns = ap.parse_args()
    if not torch.cuda.is_available() or fla_version() is None:
        raise SystemExit("needs a CUDA device and fla-core installed")
    print(f"{torch.cuda.get_device_name()}, fla-core {fla_version()}, torch {torch.__version__}")
    g = torch.Generator(device="cuda").manual_seed(0)
    dims = DeltaDims(16, 32, 128, 128, 4)  # Qwen3.6-35B-A3B's
    for T in (int(t) for t in ns.tokens.split(",")):
        args = random_inputs(dims, T, g)
        want, want_s = reference_bthk(*args)
        got, got_s = delta_rule_fla(*args)
        err = float((got - want).abs().max() / want.abs().max())
        err_s = float((got_s - want_s).abs().max() / want_s.abs().max())
        fla_ms, ref_ms = timed(delta_rule_fla, args), timed(reference_bthk, args)
        print(
            f"T={T}: fla-core {fla_ms:.3f} ms, torch reference {ref_ms:.3f} ms, error {err:.1e} (state {err_s:.1e})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
