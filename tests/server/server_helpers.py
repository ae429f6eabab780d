"""Shared by the server tests: a tiny served model, a daemon subprocess, raw and JSON requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from edgerun.server.client import UnixHTTPConnection

ROOT = Path(__file__).resolve().parents[2]

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."


def build_served_model(out: Path) -> Path:
    """A random qwen3_5_moe checkpoint (HF layout) with a 300-token byte-level BPE and a chat template."""
    from hf_fixtures import build_hf, write_bpe_tokenizer

    build_hf("qwen3_5_moe", out, seed=3, vocab_size=320)
    return write_bpe_tokenizer(out, TEXT, eos_ids=[2])


class Daemon:
    """A daemon subprocess; stderr goes to a file (read it with ``log()``)."""

    def __init__(self, argv: list[str], sock: Path, env: dict[str, str] | None = None, pass_fds=()):
        self.sock = sock
        self.log_path = sock.parent / f"{sock.stem}.log"
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS"):
            if env is None or key not in env:
                full_env.pop(key, None)
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT, pass_fds=pass_fds
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_health(self, status: int = 200, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                code, body = get(self.sock, "/health")
                if code == status:
                    return body
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"no /health {status} within {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()


def serve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "edgerun.cli", "serve", *args]


def request(sock: Path, method: str, path: str, body=None, timeout: float = 60.0) -> tuple[int, dict | str]:
    conn = UnixHTTPConnection(sock, timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        raw = resp.read()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(raw) if ctype.startswith("application/json") else raw.decode()
    finally:
        conn.close()


def get(sock: Path, path: str) -> tuple[int, dict | str]:
    return request(sock, "GET", path, timeout=5.0)


def post(sock: Path, path: str, body) -> tuple[int, dict | str]:
    return request(sock, "POST", path, body)


def stream(sock: Path, path: str, body: dict) -> list[dict | str]:
    """Every SSE data payload, parsed ("[DONE]" kept as a string)."""
    conn = UnixHTTPConnection(sock, 60.0)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode())
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type") == "text/event-stream"
        out = []
        for line in resp:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return out
    finally:
        conn.close()


def raw(sock: Path, data: bytes, timeout: float = 10.0) -> bytes:
    """Send bytes as they are; everything the server answers until it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body[: int(headers.get("content-length", len(body)))]
