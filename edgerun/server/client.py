"""A client for the daemon over its Unix socket (stdlib ``http.client``): ``edgerun chat``, and
``edgerun generate --socket``."""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgerun.errors import DaemonUnavailable, EdgerunError
from edgerun.server.paths import UntrustedSocket, check_owner, check_peer, find_socket, trusted_uids


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket that this user, root or the service account owns (and its
    directory), served by a process running as one of them: checked before a byte is sent."""

    def __init__(
        self, path: str | Path, timeout: float | None = None, trusted: frozenset[int] | None = None
    ) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = Path(path)
        self.trusted = trusted

    def connect(self) -> None:
        trusted = trusted_uids() if self.trusted is None else self.trusted
        if os.path.lexists(self.unix_path):  # a missing one fails to connect, with its own error
            check_owner(self.unix_path, trusted)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.unix_path))
        try:
            check_peer(self.sock, self.unix_path, trusted)
        except UntrustedSocket:
            self.sock.close()
            self.sock = None
            raise


class ServerError(EdgerunError):
    """The daemon's refusal (4xx: the request; the command exits 2) or failure (5xx, or an error
    event inside a stream: exits 1)."""

    def __init__(self, status: int, body: Any, streaming: bool = False) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        message = err.get("message") if isinstance(err, dict) else None
        what = "the stream failed" if streaming else f"server answered {status}"
        super().__init__(f"{what}: {message or body}")
        self.status, self.body = status, body
        self.exit_status = 1 if streaming or status >= 500 else 2


class Client:
    def __init__(self, path: str | Path | None = None, timeout: float | None = 600.0) -> None:
        self.path = Path(path) if path else find_socket()
        self.timeout = timeout

    def _send(self, method: str, url: str, body: Any = None) -> tuple[UnixHTTPConnection, Any]:
        conn = UnixHTTPConnection(self.path, self.timeout)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, url, body=data, headers=headers)
            return conn, conn.getresponse()
        except (http.client.HTTPException, ConnectionResetError, BrokenPipeError) as exc:
            conn.close()  # connected, then no answer
            raise DaemonUnavailable(
                f"the daemon at {self.path} closed the connection without answering ({type(exc).__name__})"
            ) from None
        except OSError as exc:  # missing, refused, a path too long for a socket, ...
            conn.close()
            raise DaemonUnavailable(
                f"cannot connect to {self.path}: {exc.strerror or exc}; is `edgerun serve` running?"
            ) from None

    def stream(self, url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The server-sent events of a ``stream: true`` request, up to ``data: [DONE]``."""
        conn, resp = self._send("POST", url, {**body, "stream": True})
        try:
            if resp.status >= 400:
                try:
                    body = json.loads(resp.read() or b"{}")
                except ValueError:
                    body = {}
                raise ServerError(resp.status, body)
            try:
                for line in resp:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ServerError(200, event, streaming=True)
                    yield event
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise DaemonUnavailable(
                    f"the stream from {self.path} broke: {type(exc).__name__}: {exc}"
                ) from None
            raise DaemonUnavailable(
                f"the daemon at {self.path} ended the stream before it finished (no [DONE])"
            )
        finally:
            conn.close()


def _delta(event: dict[str, Any]) -> str:
    choices = event.get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


def _sampling(ns: Any) -> dict[str, Any]:
    body = {
        "max_tokens": ns.max_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "seed": ns.seed,
        "stream_options": {"include_usage": True},
    }
    if getattr(ns, "stop", None):
        body["stop"] = list(ns.stop)
    if getattr(ns, "ignore_eos", False):
        body["ignore_eos"] = True
    return {k: v for k, v in body.items() if v is not None}


def _print_stream(
    events: Iterator[dict[str, Any]], show_ids: bool = False
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Print the text as it comes; returns the stream's ``usage`` and ``timings``."""
    usage = timings = None
    for event in events:
        text = _delta(event)
        if show_ids:
            text = "".join(f"{t} " for t in (event.get("choices") or [{}])[0].get("token_ids", []))
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
    sys.stdout.write("\n")
    sys.stdout.flush()
    return usage, timings


def summary_line(usage: dict[str, Any], timings: dict[str, Any] | None) -> str:
    """What ``edgerun generate`` prints after the text, from the daemon's usage and timings."""
    line = f"prompt {usage['prompt_tokens']} tok, generated {usage['completion_tokens']} tok"
    if timings:
        line += (
            f", TTFT {timings['ttft_ms']:.0f} ms (queue {timings['queue_ms']:.0f} ms), "
            f"prefill {timings['prompt_per_second']:.1f} tok/s, "
            f"decode {timings['predicted_per_second']:.1f} tok/s"
        )
    return line


def generate_over_socket(ns: Any) -> int:
    """``edgerun generate --socket PATH ...``: the same flags, answered by the daemon."""
    if (ns.prompt is None) == (ns.token_ids is None):
        raise EdgerunError("give either a prompt or --token-ids (exactly one)")
    client = Client(ns.socket)
    body = _sampling(ns)
    if ns.token_ids is not None:
        try:
            ids = [int(t) for t in ns.token_ids.replace(",", " ").split()]
        except ValueError as exc:
            raise EdgerunError(f"--token-ids must be integers separated by commas: {exc}") from exc
        body.update(prompt=ids, return_token_ids=True)
        usage, timings = _print_stream(client.stream("/v1/completions", body), show_ids=True)
    elif getattr(ns, "chat", False):
        body["messages"] = [{"role": "user", "content": ns.prompt}]
        usage, timings = _print_stream(client.stream("/v1/chat/completions", body))
    else:
        body["prompt"] = ns.prompt
        usage, timings = _print_stream(client.stream("/v1/completions", body))
    if usage and not getattr(ns, "quiet", False):
        print(f"[{summary_line(usage, timings)}]", file=sys.stderr)
    return 0


def chat(ns: Any) -> int:
    """One message (``edgerun chat "hi"``), or a conversation read from stdin line by line."""
    client = Client(ns.socket)
    history: list[dict[str, str]] = [{"role": "system", "content": ns.system}] if ns.system else []

    def turn(text: str) -> None:
        history.append({"role": "user", "content": text})
        body = {**_sampling(ns), "messages": history}
        reply = []
        for event in client.stream("/v1/chat/completions", body):
            piece = _delta(event)
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})

    if ns.message:
        turn(ns.message)
        return 0
    interactive = sys.stdin.isatty()
    failed = 0
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in ("/quit", "/exit"):
            return 1 if failed else 0
        if line.strip() == "/reset":
            del history[1 if ns.system else 0 :]
            continue
        if line.strip():
            kept = len(history)
            try:
                turn(line.rstrip("\n"))
            except EdgerunError as exc:  # one failed turn ends neither the conversation nor its history
                del history[kept:]
                sys.stdout.write("\n")
                print(
                    f"edgerun chat: error: {exc} (the message was dropped; the conversation goes on)",
                    file=sys.stderr,
                )
                failed += 1
