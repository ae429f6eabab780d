"""A CPU engine's memory over many requests whose prompts all differ in length: does it level
off? (oneDNN's and ideep's per-shape caches: ``engine/setup.SHAPE_CACHES``.)

    python benchmarks/cpu_memory_by_prompt_length.py [--model DIR] [--dtype bfloat16]
        [--requests 80] [--max-prompt 700] [--every 8]

Runs ``--requests`` greedy requests of 16 tokens, each with a random prompt of 1..``--max-prompt``
token ids (seeded), in one process, and prints the process's RSS and malloc's bytes in use
(glibc ``mallinfo2``) after every ``--every``-th request. Set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``
/ ``LRU_CACHE_CAPACITY`` in the environment to compare other bounds (the engine keeps a value set
there).
"""

from __future__ import annotations

import argparse
import ctypes
import random


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_in_use_mib() -> float:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF checkpoint or bundle (default: the demo model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--max-prompt", type=int, default=700)
    ap.add_argument("--every", type=int, default=8)
    a = ap.parse_args()

    from edgerun.engine.params import SamplingParams
    from edgerun.engine.setup import runtime

    runner = runtime("cpu", a.dtype, 1, None, None, None, None).load(a.model, max_context=4096)
    print(f"loaded: RSS {rss_mib():.1f} MiB, malloc in use {malloc_in_use_mib():.1f} MiB")
    rng = random.Random(1)
    vocab = runner.args.vocab_size
    for i in range(1, a.requests + 1):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, a.max_prompt))]
        runner.generate_ids(ids, SamplingParams(max_tokens=16, ignore_eos=True))
        if i % a.every == 0 or i == a.requests:
            print(
                f"after {i:4d} requests: RSS {rss_mib():.1f} MiB, malloc in use {malloc_in_use_mib():.1f} MiB"
            )


if __name__ == "__main__":
    main()
