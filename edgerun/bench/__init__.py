"""Reproducible benchmarks, run as ``edgerun bench NAME [options]`` (or the scripts in
``benchmarks/``); every figure quoted in docs/benchmarks.md comes from one of them.

Each module has ``main(argv) -> int`` and says in its docstring what it measures and against
which bound. Importing this package imports none of them (nor torch).
"""

from __future__ import annotations

# name -> (module, what it measures)
BENCHES = {
    "decode": (
        "edgerun.bench.decode",
        "decode on a CUDA GPU at the Qwen3.6-35B-A3B geometry: resident and streamed under budgets, "
        "each against its bound measured in the same run",
    ),
    "prefill": (
        "edgerun.bench.prefill",
        "time to first token for long prompts on a CUDA GPU at the Qwen3.6-35B-A3B geometry, resident "
        "and streamed, against the storage bound",
    ),
    "streaming": (
        "edgerun.bench.streaming",
        "streaming vs resident on this machine's CPU, misses/token (LRU, Belady), read bandwidth vs the disk",
    ),
    "speculative": (
        "edgerun.bench.speculative",
        "speculative decoding with the MTP head against plain decoding on this machine's CPU: decode "
        "tok/s, acceptance, tokens per step, greedy output checked equal",
    ),
    "socket": (
        "edgerun.bench.serve_socket",
        "tokens/s through the daemon's Unix socket against the same generation in-process",
    ),
    "concurrent": (
        "edgerun.bench.concurrent",
        "1, 4, 8 concurrent clients over the socket, batched and one at a time: aggregate tok/s, "
        "inter-token latency, TTFT, token ids checked against each request alone",
    ),
}
