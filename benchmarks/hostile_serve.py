"""Hostile clients against a real daemon (issue 19), and what they do to a normal client beside it.

    python benchmarks/hostile_serve.py [--model DIR] [--seconds 20] [--flood 300] [--threads 1] [--json PATH]

Starts ``edgerun serve`` (the demo model by default) on a socket in a temp dir. A normal client
streams greedy completions (``ignore_eos``, ``--tokens`` each) while /health is polled every
100 ms: first alone (unloaded), then for ``--seconds`` beside the attackers, run from another
process: a flood of ``--flood`` connections that never complete a request (half idle, half
dribbling a header byte a second; each reopened as soon as the daemon closes it, or with
``--hold`` opened once), and a loop posting 1 MiB prompts back to back. ``--engine-process off``
serves with the engine in the daemon's process. Reports daemon deaths, /health's worst latency and any
answer but 200, what the 1 MiB prompts got, and for the normal stream, unloaded and loaded: its
decode rate, its gap between tokens (p50 / p99) and its longest silences, and whether its tokens
were the same every time. ``--json PATH`` writes the same figures (and the machine: CPUs, load
average around each phase) as one JSON object, to compare machines.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from edgerun.server.client import UnixHTTPConnection  # noqa: E402

PROMPT = [5, 6, 7, 8]  # token ids: no tokenizer in the measured path


def stream(sock: Path, tokens: int) -> tuple[list[tuple[float, int]], list[int]]:
    """One greedy streamed completion: (arrival time, tokens) of each token-carrying chunk, and
    the ids (none when it was refused or failed)."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    conn = UnixHTTPConnection(sock, 60)
    chunks, ids = [], []
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps({**body, "stream": True, "return_token_ids": True})
        )
        resp = conn.getresponse()
    except OSError:
        return chunks, ids
    for line in resp if resp.status == 200 else ():
        if line.startswith(b"data: {"):
            got = json.loads(line[6:])["choices"][0].get("token_ids", [])
            if got:
                chunks.append((time.perf_counter(), len(got)))
                ids += got
    conn.close()
    return chunks, ids


def measure(sock: Path, seconds: float, tokens: int) -> dict:
    """Streams for ``seconds``. Tokens that come within 20 ms share a chunk, so a token's gap is
    its chunk's gap from the one before, shared among the chunk's tokens; a silence is a chunk's
    whole gap (what a reader waits). Also each stream's decode rate, and its ids."""
    token_gaps, silences, rates, outputs = [], [], [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        chunks, ids = stream(sock, tokens)
        outputs.append(ids)  # one refused or cut short counts below as not the expected tokens
        if len(chunks) < 2:
            time.sleep(0.1)
            continue
        for (t0, _), (t1, n) in zip(chunks, chunks[1:]):
            token_gaps += [(t1 - t0) / n] * n
            silences.append(t1 - t0)
        rates.append((len(ids) - chunks[0][1]) / (chunks[-1][0] - chunks[0][0]))
    return dict(token_gaps=token_gaps, silences=silences, rates=rates, outputs=outputs)


class HealthPoller(threading.Thread):
    def __init__(self, sock: Path) -> None:
        super().__init__(daemon=True)
        self.sock, self.latencies, self.statuses, self.stop = sock, [], Counter(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                conn = UnixHTTPConnection(self.sock, 10)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
            except OSError as exc:
                status = type(exc).__name__
            self.latencies.append(time.perf_counter() - t0)
            self.statuses[status] += 1
            time.sleep(0.1)


def flood(sock: Path, n: int, hold: bool, until: float, out) -> None:
    """``n`` connections that never send a complete request, reopened whenever closed (with
    ``hold``, opened once)."""
    conns: list[tuple[socket.socket, bool]] = []
    opened = 0
    next_byte = time.monotonic()
    while time.monotonic() < until:
        alive = []
        for s, slow in conns:
            try:
                closed = s.recv(65536, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                s.close()
            else:
                alive.append((s, slow))
        conns = alive
        while len(conns) < n and not (hold and opened >= n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(sock))
            except OSError:  # the accept queue is full: try again on the next round
                s.close()
                break
            slow = opened % 2 == 1
            if slow:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
            conns.append((s, slow))
            opened += 1
        if time.monotonic() >= next_byte:
            next_byte += 1.0
            for s, slow in conns:
                if slow:
                    try:
                        s.send(b"x")
                    except OSError:
                        pass
        time.sleep(0.05)
    for s, _ in conns:
        s.close()
    out.put(("flood connections opened", opened))


def big_prompts(sock: Path, until: float, out) -> None:
    """1 MiB prompts (within the default 1 MiB body limit), one after another."""
    body = json.dumps({"prompt": "the " * ((1 << 20) // 4 - 64), "max_tokens": 4}).encode()
    statuses: Counter = Counter()
    while time.monotonic() < until:
        conn = UnixHTTPConnection(sock, 60)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            statuses[resp.status] += 1
        except OSError as exc:
            statuses[type(exc).__name__] += 1
        finally:
            conn.close()
    out.put(("1 MiB prompts answered", dict(statuses)))


def attack(sock: Path, n: int, hold: bool, big: bool, seconds: float, out) -> None:
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=flood, args=(sock, n, hold, until, out))] if n else []
    threads += [threading.Thread(target=big_prompts, args=(sock, until, out))] if big else []
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def cpu_seconds(daemon: psutil.Process) -> dict[str, float]:
    """CPU time (user + system) so far of the daemon's process (the loop, HTTP, tokenizing) and
    of its children (the engine's process)."""

    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    try:
        return {"daemon": used(daemon), "engine": sum(used(c) for c in daemon.children())}
    except psutil.Error:
        return {"daemon": float("nan"), "engine": float("nan")}


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else float("nan")


def summary(ns, argv, engine: str, deaths: int, wrong: int, results: dict, ratio: float) -> dict:
    """The run as one JSON object: what ran, on what, and each phase's figures (times in ms)."""
    phases = {}
    for phase, r in results.items():
        phases[phase] = {
            "streams": len(r["outputs"]),
            "tok_s_median": statistics.median(r["rates"] or [0]),
            "token_gap_ms": {q: 1000 * pct(r["token_gaps"], n) for q, n in (("p50", 50), ("p99", 99))},
            "silence_ms": {"p99": 1000 * pct(r["silences"], 99), "max": 1000 * max(r["silences"] or [0])},
            "health_max_ms": 1000 * max(r["health"].latencies),
            "health_answers": {str(k): v for k, v in r["health"].statuses.items()},
            "attackers": r["extra"],
            "loadavg_1m": {"before": r["load"][0][0], "after": r["load"][1][0]},
            "cpu_cores": r["cpu"],  # CPU seconds per second of the phase: the daemon's, the engine's
        }
    return {
        "command": ["benchmarks/hostile_serve.py", *(sys.argv[1:] if argv is None else argv)],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "flood": {"connections": ns.flood, "reopened": not ns.hold},
        "big_prompts": ns.big,
        "seconds": ns.seconds,
        "engine": engine,
        "daemon_deaths": deaths,
        "wrong_streams": wrong,
        "phases": phases,
        "token_gap_p99_ratio": ratio,
        "target_ratio": 2.0,
        "health_within_1s": all(
            p["health_max_ms"] < 1000 and set(p["health_answers"]) == {"200"} for p in phases.values()
        ),
        "met": ratio <= 2.0 and not deaths and not wrong,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: the demo model)")
    p.add_argument("--seconds", type=float, default=20.0, help="how long the attack (and each measure) runs")
    p.add_argument("--flood", type=int, default=300, help="connections in the flood (0: none)")
    p.add_argument("--hold", action="store_true", help="open the flood once; do not reopen what closes")
    p.add_argument("--no-big", dest="big", action="store_false", help="no 1 MiB prompt loop")
    p.add_argument("--tokens", type=int, default=64, help="tokens per normal streamed request")
    p.add_argument("--threads", type=int, default=1, help="the daemon's torch threads")
    p.add_argument(
        "--engine-process",
        choices=("on", "off"),
        default=None,
        help="serve's --engine-process (default: its own)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    ns = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="edgerun-hostile-"))
    sock = tmp / "edgerun.sock"
    cmd = [sys.executable, "-m", "edgerun.cli", "serve", "--socket", str(sock), "--device", "cpu"]
    cmd += ["--threads", str(ns.threads)] + (["--model", str(ns.model)] if ns.model else [])
    cmd += ["--engine-process", ns.engine_process] if ns.engine_process else []
    log = open(tmp / "daemon.log", "wb")
    daemon = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not start:\n{(tmp / 'daemon.log').read_text()}")
            try:
                conn = UnixHTTPConnection(sock, 5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        stream(sock, ns.tokens)  # warm-up

        results = {}
        for phase in ("unloaded", "loaded"):
            t0, load_before = time.monotonic(), os.getloadavg()
            cpu_before = cpu_seconds(psutil.Process(daemon.pid))
            health = HealthPoller(sock)
            health.start()
            attacker, out = None, multiprocessing.Queue()
            if phase == "loaded":
                args = (sock, ns.flood, ns.hold, ns.big, ns.seconds, out)
                attacker = multiprocessing.Process(target=attack, args=args)
                attacker.start()
                time.sleep(1.0)  # the flood is in place
            results[phase] = measure(sock, ns.seconds - (1.0 if attacker else 0.0), ns.tokens)
            if attacker:
                attacker.join()
            cpu_after, wall = cpu_seconds(psutil.Process(daemon.pid)), time.monotonic() - t0
            health.stop.set()
            health.join()
            results[phase].update(
                health=health,
                extra=dict(out.get(timeout=60) for _ in range(bool(ns.flood) + ns.big)) if attacker else {},
                load=(load_before, os.getloadavg()),
                cpu={k: (cpu_after[k] - cpu_before[k]) / wall for k in cpu_after},
            )

        deaths = 0 if daemon.poll() is None else 1
        flood_kind = "held" if ns.hold else "reopened"
        attacks = [f"{ns.flood}-connection flood ({flood_kind})"] * bool(ns.flood) + [
            "1 MiB prompt loop"
        ] * ns.big
        engine = next(
            (line for line in (tmp / "daemon.log").read_text().splitlines() if " engine " in line), ""
        )
        print(
            f"edgerun hostile_serve: {' + '.join(attacks)}, {ns.seconds:g} s; {engine.removeprefix('edgerun serve: ')}"
        )
        print(f"daemon deaths: {deaths}")
        reference = results["unloaded"]["outputs"][0]
        wrong = sum(ids != reference for r in results.values() for ids in r["outputs"])
        print(f"normal streams refused, failed or with other tokens than the first: {wrong}")
        for phase, r in results.items():
            health = r["health"]
            print(
                f"{phase}: {len(r['outputs'])} streams, {statistics.median(r['rates'] or [0]):.0f} tok/s; "
                f"token gap p50 {1000 * pct(r['token_gaps'], 50):.1f} ms, p99 {1000 * pct(r['token_gaps'], 99):.1f} ms; "
                f"silence p99 {1000 * pct(r['silences'], 99):.0f} ms, max {1000 * max(r['silences'] or [0]):.0f} ms; "
                f"/health max {1000 * max(health.latencies):.0f} ms, answers {dict(health.statuses)}; "
                f"CPU: daemon {r['cpu']['daemon']:.2f}, engine {r['cpu']['engine']:.2f} cores; "
                f"load average {r['load'][0][0]:.1f} -> {r['load'][1][0]:.1f}"
                + "".join(f"; {k}: {v}" for k, v in r["extra"].items())
            )
        ratio = pct(results["loaded"]["token_gaps"], 99) / pct(results["unloaded"]["token_gaps"], 99)
        print(f"token gap p99 loaded / unloaded: {ratio:.2f}x")
        if ns.json:
            ns.json.write_text(
                json.dumps(summary(ns, argv, engine, deaths, wrong, results, ratio), indent=2) + "\n"
            )
        return 1 if deaths or wrong else 0
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
