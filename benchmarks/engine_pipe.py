"""What one token costs to cross from the engine's process to the daemon (``serve
--engine-process on``): the child pickles a token's message, as ``engine_process.child_main``
sends it, down a ``multiprocessing`` pipe; the daemon's reader thread unpickles it.

    python benchmarks/engine_pipe.py [--tokens 20000]

Reports, per token, the wall time of a stream sent back to back and the CPU time each side
spent (send: the engine's process; receive: the daemon's), and the bytes of one message.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgerun.engine.runner import Event  # noqa: E402


def message(i: int) -> tuple:
    return ("event", 7, Event(" word", 1000 + i % 5000), None)


def child(conn, tokens: int) -> None:
    lock = threading.Lock()
    t0 = time.process_time()
    for i in range(tokens):
        with lock:
            conn.send(message(i))
    conn.send(("done", time.process_time() - t0))


def run(tokens: int) -> tuple[float, float, float]:
    ctx = multiprocessing.get_context("spawn")
    parent, end = ctx.Pipe()
    proc = ctx.Process(target=child, args=(end, tokens))
    proc.start()
    end.close()
    first = parent.recv()  # the child is up: time from its first message on
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(tokens - 1):
        parent.recv()
    wall, recv_cpu = time.perf_counter() - t0, time.thread_time() - c0
    _, send_cpu = parent.recv()
    proc.join()
    assert first[0] == "event"
    n = tokens - 1
    return wall / n, send_cpu / tokens, recv_cpu / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    ns = p.parse_args(argv)
    runs = [run(ns.tokens) for _ in range(ns.repeat)]
    size = len(pickle.dumps(message(0), protocol=pickle.HIGHEST_PROTOCOL))
    print(f"edgerun engine_pipe: {ns.tokens} token messages of {size} bytes, {ns.repeat} runs")
    for name, k in (("wall per token", 0), ("send CPU per token", 1), ("receive CPU per token", 2)):
        us = [r[k] * 1e6 for r in runs]
        print(f"{name}: median {statistics.median(us):.1f} us (range {min(us):.1f} to {max(us):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
