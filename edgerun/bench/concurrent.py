"""Concurrent clients over the daemon's Unix socket: aggregate tok/s, inter-token latency, TTFT.

    edgerun bench concurrent [--model DIR] [--clients 1,4,8] [--batch 8] [--tokens 64] [--rounds 3]
                             [--device cpu|cuda] [--serve-args '--quota 64 --context 2048']

Starts ``edgerun serve --batch B`` on ``--device``, then, for each client count N, ``--rounds`` rounds
of N clients that each stream one greedy request (a prompt of its own, ``ignore_eos``, exactly
``--tokens`` tokens), all sent at once; and the same against a daemon at batch 1 (one request at
a time, the baseline; ``--no-baseline`` skips it), both up at once and their rounds interleaved
(adjacent runs: load on a shared machine falls on both alike). Before any rate is printed, every
request's token ids are checked equal to its prompt's ids run alone on the same daemon: batching
must not change a token (a batch daemon runs its large projections on the tensor-core GEMV, whose
bits are not the batch-1 daemon's, so each daemon is checked against itself).

Per configuration: aggregate tok/s (all tokens of a round over the round's wall time, from the
sends to the last token; median and range over rounds), TTFT (send to first token), and the
inter-token latency as clients see it: a stream chunk of k tokens arriving t after the previous
one counts k gaps of t / k (the daemon gathers tokens for up to 20 ms into one chunk). TTFT and
inter-token p50 / p99 pool every request of every round. With streamed experts, the expert
misses per generated token (from /metrics, around each round): a batch's step reads the union
of its rows' experts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from edgerun.bench.serve_socket import PROMPT, start_daemon, stop_daemon
from edgerun.server.client import UnixHTTPConnection


def stream(sock: Path, body: dict) -> tuple[list[int], float, list[float]]:
    """(token ids, TTFT, per-token gaps) of one streamed request."""
    conn = UnixHTTPConnection(sock, 600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
    resp = conn.getresponse()
    ids, gaps, ttft, last = [], [], None, None
    for line in resp:
        if line.startswith(b"data: [DONE]"):
            break
        if not line.startswith(b"data: {"):
            continue
        got = json.loads(line[6:])["choices"][0].get("token_ids", [])
        if not got:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
            gaps += [0.0] * (len(got) - 1)  # the first chunk's other tokens came with the first
        else:
            gaps += [(now - last) / len(got)] * len(got)
        last = now
        ids += got
    conn.close()
    return ids, ttft or 0.0, gaps


def round_of(sock: Path, bodies: list[dict]) -> tuple[float, list[tuple[list[int], float, list[float]]]]:
    """(wall seconds, each request's result) with every request sent at once."""
    out: list = [None] * len(bodies)

    def client(i: int) -> None:
        out[i] = stream(sock, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def misses(sock: Path) -> float:
    """The daemon's expert-cache misses so far (/metrics; 0 without an expert cache)."""
    conn = UnixHTTPConnection(sock, 60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edgerun_expert_cache_misses_total")
    )


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def measure(socks: dict[int, Path], prompts: list[list[int]], clients: list[int], tokens: int, rounds: int):
    """{batch: {clients: figures}} with each daemon's rounds interleaved with the others' (adjacent
    runs, so load on a shared machine falls on both alike), or a message naming the first
    request whose ids differ from its prompt's ids alone on the same daemon (a batch daemon may
    run other kernels than the batch-1 one: its large projections on the tensor-core GEMV, whose
    bits differ, so each daemon is held to its own requests alone)."""
    base = {
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    bodies = [{**base, "prompt": p} for p in prompts]
    alone = {batch: [stream(sock, b)[0] for b in bodies[: max(clients)]] for batch, sock in socks.items()}
    for sock in socks.values():
        stream(sock, bodies[0])  # warm-up
    out = {b: {n: {"rates": [], "ttft": [], "gaps": [], "misses": 0.0} for n in clients} for b in socks}
    for n in clients:
        for _ in range(rounds):
            for batch, sock in socks.items():
                m0 = misses(sock)
                wall, got = round_of(sock, bodies[:n])
                r = out[batch][n]
                r["misses"] += misses(sock) - m0
                for i, (ids, ttft, g) in enumerate(got):
                    if ids != alone[batch][i]:
                        return (
                            f"batch {batch}, {n} clients: request {i}'s token ids differ from its ids alone"
                        )
                    r["ttft"].append(ttft)
                    r["gaps"] += g
                r["rates"].append(n * tokens / wall)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="edgerun bench concurrent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", type=Path, default=None, help="HF checkpoint or bundle dir (default: the demo model)"
    )
    p.add_argument("--clients", default="1,4,8", help="client counts, comma-separated (default 1,4,8)")
    p.add_argument("--batch", type=int, default=8, help="the daemon's batch (default 8)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="the daemon's torch threads (default: serve's)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the batch-1 daemon")
    p.add_argument("--device", default="cpu", help="the daemons' device (default cpu)")
    p.add_argument(
        "--serve-args", default="", help="more `edgerun serve` options, one string (e.g. '--quota 64')"
    )
    ns = p.parse_args(argv)
    clients = [int(c) for c in ns.clients.split(",")]
    from edgerun.engine.runner import DEMO_MODEL
    from edgerun.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ns.model or DEMO_MODEL)
    prompts = [tok.encode(f"{PROMPT} {i}: ") for i in range(max(clients))]  # a prompt of its own each
    print(
        f"model {ns.model or 'demo'}: {ns.tokens} tokens a request, {ns.rounds} rounds, "
        f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tok, {ns.device}"
        + (f", serve {ns.serve_args}" if ns.serve_args else "")
    )
    batches = [ns.batch] + ([1] if ns.baseline and ns.batch != 1 else [])
    daemons = {}
    try:
        for batch in batches:
            extra = ("--batch", str(batch), *ns.serve_args.split())
            t0 = time.monotonic()
            daemon, sock = start_daemon(ns.model, ns.threads, *extra, device=ns.device, wait=600)
            if daemon is None:
                return 1
            daemons[batch] = (daemon, sock)
            said = (sock.parent / "serve.log").read_text(errors="replace").splitlines()
            print(f"daemon --batch {batch} ready in {time.monotonic() - t0:.1f} s")
            for line in said:  # its start-up probe and fallbacks, as it logged them
                if "probe passed" in line or "fallbacks:" in line:
                    print(f"  {line.strip()}")
        results = measure(
            {b: sock for b, (_, sock) in daemons.items()}, prompts, clients, ns.tokens, ns.rounds
        )
    finally:
        for daemon, sock in daemons.values():
            stop_daemon(daemon, sock)
    if isinstance(results, str):
        print(f"{results}; no rates printed")
        return 1
    for batch, figures in results.items():
        print(f"daemon --batch {batch} (token ids identical to each request alone, every round):")
        for n, r in figures.items():
            rates = r["rates"]
            print(
                f"  {n} client{'s' if n > 1 else ' '}  {statistics.median(rates):7.1f} tok/s aggregate "
                f"({min(rates):.1f}-{max(rates):.1f}), inter-token p50 {1e3 * pct(r['gaps'], 0.5):6.1f} ms "
                f"p99 {1e3 * pct(r['gaps'], 0.99):6.1f} ms, TTFT p50 {1e3 * pct(r['ttft'], 0.5):6.1f} ms "
                f"p99 {1e3 * pct(r['ttft'], 0.99):6.1f} ms"
                + (
                    f", expert misses {r['misses'] / (n * ns.tokens * ns.rounds):.1f}/token"
                    if r["misses"]
                    else ""
                )
            )
    return 0
