"""Tokens/s through the daemon's Unix socket against the same generation in-process.

    edgerun bench socket [--model DIR] [--tokens 128] [--rounds 7] [--device cpu|cuda] [--quota Q]
                         [--context 2048]

Starts ``edgerun serve`` on a socket in a temp dir, then alternates rounds: one in-process
``Runner.generate`` and one streamed ``/v1/completions`` of the same greedy request
(``ignore_eos``, so both produce exactly ``--tokens`` tokens), and checks the token ids are
identical. Each rate is tokens over wall time from the call to the last token, prefill included.
Prints the median of each and the socket's cost in percent: from the two medians, and the median
of each round's pair (adjacent runs, so it shrugs off other load on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding edgerun

import torch  # noqa: E402

from edgerun.config import CacheConfig  # noqa: E402
from edgerun.engine.runner import Runner  # noqa: E402
from edgerun.engine.sampler import SamplingParams  # noqa: E402
from edgerun.server.client import UnixHTTPConnection  # noqa: E402

PROMPT = "In the beginning God created the heaven and the earth."


def over_socket(sock: Path, body: dict) -> tuple[float, list[int]]:
    conn = UnixHTTPConnection(sock, 600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
    resp = conn.getresponse()
    ids = []
    for line in resp:
        if line.startswith(b"data: {"):
            ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
        elif line.startswith(b"data: [DONE]"):
            break
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed, ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="edgerun bench socket", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: the demo model)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    p.add_argument("--device", default="cpu", help="both sides' device (default cpu)")
    p.add_argument("--quota", type=int, default=None, help="a bundle's expert slots per layer, both sides")
    p.add_argument(
        "--context",
        type=int,
        default=2048,
        help="both sides' context capacity (default 2048): the attention kernels' tiling follows it, "
        "so the same greedy tokens need the same capacity",
    )
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)

    runner = Runner.load(
        ns.model,
        device=ns.device,
        cache=CacheConfig(ns.quota) if ns.quota else None,
        max_context=ns.context,
    )
    prompt_ids = runner.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=ns.tokens, ignore_eos=True)
    body = {
        "prompt": prompt_ids,
        "max_tokens": ns.tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }

    extra = ("--context", str(ns.context)) + (("--quota", str(ns.quota)) if ns.quota else ())
    daemon, sock = start_daemon(ns.model, ns.threads, *extra, device=ns.device, wait=600)
    if daemon is None:
        return 1
    try:
        over_socket(sock, body)  # warm-up, both sides
        runner.generate_ids(prompt_ids, params)
        local, remote = [], []
        loop_cpu = client_cpu = socket_wall = 0.0
        for _ in range(ns.rounds):
            t0 = time.perf_counter()
            expected = runner.generate_ids(prompt_ids, params)
            local.append(ns.tokens / (time.perf_counter() - t0))
            loop0, client0 = thread_cpu(daemon.pid), time.process_time()
            elapsed, ids = over_socket(sock, body)
            loop_cpu += thread_cpu(daemon.pid) - loop0
            client_cpu += time.process_time() - client0
            socket_wall += elapsed
            remote.append(ns.tokens / elapsed)
            if ids != expected:
                at = next(
                    (i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected))
                )
                print(
                    f"round {len(remote)}: token ids differ from in-process generation at position {at} "
                    f"(socket {ids[at : at + 5]}, in-process {expected[at : at + 5]}; "
                    f"{len(ids)} vs {len(expected)} tokens)",
                    file=sys.stderr,
                )
                return 1
    finally:
        stop_daemon(daemon, sock)
    a, b = statistics.median(local), statistics.median(remote)
    print(
        f"model {ns.model or 'demo'}: {ns.tokens} tokens, {ns.rounds} rounds (median), "
        f"prompt {len(prompt_ids)} tok, {ns.device}, {torch.get_num_threads()} threads"
    )
    print(f"  in-process   {a:8.1f} tok/s   (rounds: {', '.join(f'{x:.0f}' for x in local)})")
    print(f"  over socket  {b:8.1f} tok/s   (rounds: {', '.join(f'{x:.0f}' for x in remote)})")
    paired = statistics.median(1 - r / x for x, r in zip(local, remote))
    print(
        f"  socket cost  {100 * (a - b) / a:+.1f} % of the medians, {100 * paired:+.1f} % median of paired rounds"
    )
    print("  (identical token ids in every round)")
    n = ns.tokens * ns.rounds
    share = 100 * (loop_cpu + client_cpu) / socket_wall
    print(
        f"  CPU of the socket path: daemon event loop {1e6 * loop_cpu / n:.0f} us/token, "
        f"client {1e6 * client_cpu / n:.0f} us/token = {share:.1f} % of the streaming wall time"
    )
    return 0


def start_daemon(
    model: Path | None, threads: int | None, *extra: str, device: str = "cpu", wait: float = 120
):
    """(``edgerun serve`` on ``device`` on a socket in a temp dir, ready; its socket), or (None,
    None) with its log printed when it did not come up within ``wait`` seconds."""
    tmp = Path(tempfile.mkdtemp(prefix="edgerun-bench-"))
    sock = tmp / "edgerun.sock"
    argv = [sys.executable, "-m", "edgerun.cli", "serve", "--socket", str(sock), "--device", device, *extra]
    argv += ["--model", str(Path(model).resolve())] if model else []  # the daemon runs from ROOT
    argv += ["--threads", str(threads)] if threads else []
    log = open(tmp / "serve.log", "wb")
    daemon = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        },
    )
    deadline = time.monotonic() + wait
    while not sock.exists() or over_health(sock) != 200:
        if daemon.poll() is not None or time.monotonic() > deadline:
            print((tmp / "serve.log").read_text(), file=sys.stderr)
            daemon.kill()
            daemon.wait()
            shutil.rmtree(tmp, ignore_errors=True)
            return None, None
        time.sleep(0.1)
    return daemon, sock


def stop_daemon(daemon: subprocess.Popen, sock: Path) -> None:
    """SIGTERM ``daemon`` (a drain), wait for it, and remove its temp dir (socket, log)."""
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(60)
    shutil.rmtree(sock.parent, ignore_errors=True)


def thread_cpu(pid: int) -> float:
    """CPU seconds of the daemon's main thread, which runs the event loop (Linux /proc: the
    scheduler's nanoseconds where the kernel keeps them, else clock ticks of 10 ms)."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def over_health(sock: Path) -> int:
    try:
        conn = UnixHTTPConnection(sock, 5)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return 0
