"""Damage a bundle under a running daemon and report what clients see.

    python benchmarks/bundle_damage.py [--read-mode direct|buffered|auto] [--rounds 2] [--out DIR]

Converts the shipped demo model to an int4 bundle, records the greedy answers of an undamaged
daemon to a few prompts, then for each case starts ``edgerun serve`` on a fresh copy of the
bundle (experts streamed with a quota of 2 slots of 16 per layer, so blocks keep being read from
disk), checks one answer, damages the bundle under it and sends the prompts ``--rounds`` times
while a thread polls ``/health``. Per case it reports: answers identical to the undamaged ones,
silent wrong answers (200 with other tokens), failed requests and what the client saw, the
slowest ``/health`` answer and its last status, whether the daemon died (exited before it was
told to stop), whether it still fed the systemd watchdog after the first failure, and what a
restart on the damaged bundle does (what systemd's restart would meet). Bounded: a handful of
daemons, each request a few dozen tokens, everything on a local socket; about a minute on a
2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.bundle.reader import Bundle
from edgerun.engine.runner import DEMO_MODEL
from edgerun.server.client import UnixHTTPConnection

PROMPTS = [
    "In the beginning",
    "And God said, Let there be light",
    "The earth was without form",
    "And the evening and the morning were the first day",
    "Let the waters under the heaven be gathered together",
    "And God made two great lights",
]
MAX_TOKENS = 24
WATCHDOG_S = 1.0


def call(
    sock: Path, method: str, path: str, body: dict | None = None, timeout: float = 60
) -> tuple[int, dict]:
    conn = UnixHTTPConnection(sock, timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode())
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"text": raw.decode(errors="replace")}
    finally:
        conn.close()


def complete(sock: Path, prompt: str) -> tuple[int, list[int] | str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, answer = call(sock, "POST", "/v1/completions", {**body, "return_token_ids": True})
    if status == 200:
        return status, answer["choices"][0]["token_ids"]
    return status, answer.get("error", {}).get("message", str(answer))


class Daemon:
    """``edgerun serve`` on ``bundle``, with a notify socket that counts watchdog pings and a
    thread polling /health."""

    def __init__(self, bundle: Path, work: Path, read_mode: str) -> None:
        self.sock, self.log = work / "s.sock", work / "daemon.log"
        for p in (self.sock, work / "notify"):
            p.unlink(missing_ok=True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(work / "notify"))
        self.notify.settimeout(0.05)
        self.pings: list[float] = []
        self.health: list[tuple[float, int, str]] = []  # (seconds to answer, status, state)
        self.stopped = threading.Event()
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(work / "notify"),
            "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6)),
        }
        argv = [sys.executable, "-m", "edgerun.cli", "serve", "--model", str(bundle), "--quota", "2"]
        argv += [
            "--read-mode",
            read_mode,
            "--socket",
            str(self.sock),
            "--device",
            "cpu",
            "--threads",
            "1",
        ]
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=env)
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._listen, self._poll)]

    def wait_ready(self, timeout: float = 90) -> bool:
        """True once /health is 200; False if the daemon exited first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if call(self.sock, "GET", "/health", timeout=5)[0] == 200:
                    for t in self.threads:
                        t.start()
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def _listen(self) -> None:
        while not self.stopped.is_set():
            try:
                if b"WATCHDOG=1" in self.notify.recv(4096).split(b"\n"):
                    self.pings.append(time.monotonic())
            except OSError:
                pass

    def _poll(self) -> None:
        while not self.stopped.is_set() and self.proc.poll() is None:
            t0 = time.monotonic()
            try:
                status, body = call(self.sock, "GET", "/health", timeout=10)
                self.health.append((time.monotonic() - t0, status, body.get("status", "?")))
            except OSError:
                self.health.append((time.monotonic() - t0, 0, "no answer"))
            time.sleep(0.05)

    def stop(self) -> int:
        self.stopped.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.notify.close()


def overwrite_block(b: Bundle, layer: int, expert: int) -> str:
    lay = b.layouts[layer]
    with open(b.expert_path(layer), "r+b") as f:
        f.seek(expert * lay.block_bytes)
        f.write(os.urandom(lay.block_bytes))
    return f"layer {layer} expert {expert}'s block overwritten in place (random bytes)"


def nan_scales(b: Bundle, layer: int, expert: int) -> str:
    lay = b.layouts[layer]
    c = next(c for c in lay.components if c.name == "gate_up.scales")
    with open(b.expert_path(layer), "r+b") as f:
        f.seek(expert * lay.block_bytes + c.offset)
        f.write(b"\x7f" * c.nbytes)  # e4m3 NaN
    return f"layer {layer} expert {expert}'s gate_up scales set to NaN in place"


def nan_sidecar(b: Bundle, layer: int, expert: int) -> str:
    side = b.root / b.manifest.layer(layer).sidecar.file
    with open(side, "r+b") as f:
        f.write(b"\xff" * side.stat().st_size)  # fp32 NaN
    return f"layer {layer}'s sidecar (global scales) set to NaN in place"


def truncate(b: Bundle, layer: int, expert: int) -> str:
    f = b.expert_path(layer)
    os.truncate(f, f.stat().st_size // 2)
    return f"{f.name} truncated to half"


def strip_checksums(path: Path) -> None:
    """What a bundle converted before block checksums looks like."""
    doc = json.loads((path / "manifest.json").read_text())
    for rec in doc["layers"]:
        rec.pop("block_xxh3", None)
    (path / "manifest.json").write_text(json.dumps(doc))


CASES = [  # (name, damage, older bundle without checksums)
    ("overwrite block", overwrite_block, False),
    ("NaN scales", nan_scales, False),
    ("NaN scales, older bundle", nan_scales, True),
    ("NaN sidecar", nan_sidecar, False),
    ("truncate", truncate, False),
]


def run_case(name, damage, old, bundle: Path, work: Path, want: dict[str, list[int]], ns) -> dict:
    copy = work / "bundle"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(bundle, copy)
    if old:
        strip_checksums(copy)
    d = Daemon(copy, work, ns.read_mode)
    out = {"case": name, "identical": 0, "wrong": 0, "failed": 0, "saw": {}, "died": False}
    try:
        if not d.wait_ready():
            raise SystemExit(f"{name}: the undamaged daemon did not start:\n{d.log.read_text()}")
        assert complete(d.sock, PROMPTS[0])[1] == want[PROMPTS[0]], "undamaged answer differs"
        b = Bundle.open(copy)
        out["damage"] = damage(b, b.args.moe_layers[-1], 3)
        first_failure = None
        for _ in range(ns.rounds):
            for prompt in PROMPTS:
                status, got = complete(d.sock, prompt)
                if status == 200:
                    out["identical" if got == want[prompt] else "wrong"] += 1
                else:
                    out["failed"] += 1
                    first_failure = first_failure or time.monotonic()
                    key = f"{status} {got[:90]}"
                    out["saw"][key] = out["saw"].get(key, 0) + 1
        time.sleep(2 * WATCHDOG_S)
        out["died"] = d.proc.poll() is not None
        out["pings_after_failure"] = sum(t > first_failure + 0.1 for t in d.pings) if first_failure else None
        out["health_max_s"] = max((h[0] for h in d.health), default=None)
        out["health_last"] = d.health[-1][1:] if d.health else None
        metrics = call(d.sock, "GET", "/metrics")[1].get("text", "") if not out["died"] else ""
        out["metrics"] = [
            line
            for line in metrics.splitlines()
            if line.startswith(("edgerun_expert_read_faults_total", "edgerun_nonfinite_logits_total"))
            or line.startswith('edgerun_fallbacks_total{kind="unchecked_blocks"}')
        ]
    finally:
        out["exit"] = d.stop()
    again = Daemon(copy, work, ns.read_mode)
    try:
        if again.wait_ready():
            results = [complete(again.sock, p) for p in PROMPTS]
            ok = sum(s == 200 and got == want[p] for p, (s, got) in zip(PROMPTS, results))
            bad = [got for s, got in results if s != 200]
            out["restart"] = f"starts; {ok}/{len(PROMPTS)} identical" + (
                f"; first error: {bad[0][:90]}" if bad else ""
            )
        else:
            tail = [ln for ln in again.log.read_text().splitlines() if "error" in ln or "failed" in ln]
            out["restart"] = f"refused, exit {again.proc.returncode}: {(tail or ['?'])[-1][:160]}"
    finally:
        again.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--read-mode", default="direct", choices=("direct", "buffered", "auto"))
    p.add_argument("--rounds", type=int, default=2, help="times each prompt is sent after the damage")
    p.add_argument("--out", type=Path, default=None, help="work dir (default: a temp dir, removed)")
    ns = p.parse_args()
    work = ns.out or Path(tempfile.mkdtemp(prefix="edgerun-damage-"))
    try:
        bundle = work / "pristine"
        if not (bundle / "manifest.json").is_file():
            convert(DEMO_MODEL, bundle, ConvertOptions("int4", 32))
        ref = Daemon(bundle, work, ns.read_mode)
        try:
            assert ref.wait_ready(), ref.log.read_text()
            want = {prompt: complete(ref.sock, prompt)[1] for prompt in PROMPTS}
        finally:
            ref.stop()
        results = [run_case(*case, bundle, work, want, ns) for case in CASES]
    finally:
        if ns.out is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"read mode {ns.read_mode}, {ns.rounds} x {len(PROMPTS)} requests after the damage, {MAX_TOKENS} tokens each"
    )
    for r in results:
        print(json.dumps(r, indent=1))
    deaths = sum(r["died"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    print(f"daemon deaths {deaths}, silent wrong answers {wrong}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
