"""HTTP/1.1 on asyncio streams, by hand: request line, headers, ``Content-Length`` bodies,
keep-alive, limits on line, header and body size, and chunked responses for server-sent events.

What it refuses, and how: a malformed request line or header 400, an over-long line 414/431,
too many or too large headers 431, a body over the limit 413 (unread; the connection closes),
a chunked request body 501, a POST without a length 411, an unknown ``Expect`` 417, HTTP other
than 1.0/1.1 505, a request that stalls 408. A framing error closes the connection after the
reply (lingering, so the client can read it); errors inside a well-framed body keep it open.

A connection that has not yet sent a complete request gets ``header_timeout`` (short) to send
its head; one that has been answered waits ``idle_timeout`` for the next. A client that shuts
down its sending side after a request (a half-close) still gets the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import select
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

log = logging.getLogger(__name__)
# one line per request, at INFO: shown by `edgerun serve -v`
request_log = logging.getLogger("edgerun.server.requests")

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
HALF_CLOSED_POLL_S = 0.1


@dataclass(frozen=True)
class Limits:
    max_line: int = 8 * 1024  # request line, and each header line
    max_header_bytes: int = 32 * 1024  # all header lines together
    max_headers: int = 64
    max_body: int = 1024 * 1024
    idle_timeout: float = 60.0  # keep-alive: how long to wait for the next request
    read_timeout: float = 30.0  # once a request has started, to receive all of it
    header_timeout: float = 10.0  # a new connection's wait for its first request; any request's head


if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[Any], seconds: float) -> Any:
        """``await aw`` for at most ``seconds`` (``TimeoutError``), in the calling task:
        ``asyncio.wait_for`` before 3.12 wraps ``aw`` in a task of its own, and a flood of
        connections that never finish their heads paid for that (and its timer) on every one."""
        async with asyncio.timeout(seconds):
            return await aw

else:  # pragma: no cover (3.10 has no asyncio.timeout)
    within = asyncio.wait_for


class HTTPError(Exception):
    """An error answer: status, message, and (for a request field) the field's name."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers, self.close = headers, close


class ClientGone(Exception):
    """The peer closed the connection in the middle of a request."""


_DIRS = re.compile(r"(?<![\w.~:/-])/(?:[^\s/'\"]+/)+(?=[^\s/'\"])")


def hide_dirs(message: str) -> str:
    """The message with every absolute path cut to its last part: a server error's text goes to
    the client, the daemon's file layout stays in its log."""
    return _DIRS.sub("", message)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape; a server error (5xx) names files without their directories."""
    if status >= 500:
        message = hide_dirs(message)
    kind = {
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
        504: "timeout",
    }.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Request:
    method: str
    target: str
    path: str
    version: str  # "HTTP/1.1" | "HTTP/1.0"
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "
    body: bytes = b""
    received: float = field(default_factory=time.monotonic)  # when it had fully arrived

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


class Input:
    """A StreamReader plus bytes read ahead (by the disconnect watcher) that belong to the next request."""

    def __init__(self, reader: asyncio.StreamReader, max_line: int) -> None:
        self.reader = reader
        self.head = b""
        self.max_line = max_line
        self.overflowed = False  # read-ahead past the bound was dropped: the connection must close

    async def wait_data(self) -> bool:
        if not self.head:
            self.head = await self.reader.read(65536)
        return bool(self.head)

    async def readline(self) -> bytes:
        i = self.head.find(b"\n")
        if i >= 0:
            line, self.head = self.head[: i + 1], self.head[i + 1 :]
        else:
            prefix, self.head = self.head, b""
            try:
                line = prefix + await self.reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                raise ClientGone from exc
            except asyncio.LimitOverrunError:
                line = b""  # longer than the reader's limit
        if not line or len(line) > self.max_line:
            raise _TooLong
        return line

    async def readexactly(self, n: int) -> bytes:
        take, self.head = self.head[:n], self.head[n:]
        try:
            return take + await self.reader.readexactly(n - len(take)) if n > len(take) else take
        except asyncio.IncompleteReadError as exc:
            raise ClientGone from exc

    async def wait_eof(self) -> None:
        """Returns when the peer has sent all it will (EOF), keeping what it sent meanwhile, or
        once that passes the bound: then the rest stays unread (``overflowed``: the connection
        closes after this answer) and the caller, as after a half-close, polls for the hang-up."""
        while data := await self.reader.read(65536):
            self.head += data
            if len(self.head) > 4 * self.max_line:
                self.overflowed = True
                return


class _TooLong(Exception):
    pass


def _parse_request_line(line: bytes) -> tuple[str, str, str]:
    parts = line.rstrip(b"\r\n").split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]):
        raise HTTPError(400, f"malformed request line {line[:80]!r}", close=True)
    method, target, version = parts
    if not (m := _VERSION.fullmatch(version)):
        raise HTTPError(400, f"malformed HTTP version {version[:20]!r}", close=True)
    if m.groups() not in ((b"1", b"1"), (b"1", b"0")):
        raise HTTPError(505, f"HTTP version {version.decode()} is not supported (use HTTP/1.1)", close=True)
    if not target.startswith(b"/") or not target.isascii() or _BAD_VALUE.search(target):
        raise HTTPError(400, f"request target must be an absolute path, got {target[:80]!r}", close=True)
    return method.decode(), target.decode(), version.decode()


def _parse_header(line: bytes) -> tuple[str, str]:
    if line[:1] in (b" ", b"\t"):
        raise HTTPError(400, "obsolete header line folding is not accepted", close=True)
    name, sep, value = line.rstrip(b"\r\n").partition(b":")
    if not sep or not _TOKEN.fullmatch(name):
        raise HTTPError(400, f"malformed header line {line[:80]!r}", close=True)
    value = value.strip(b" \t")
    if _BAD_VALUE.search(value):
        raise HTTPError(400, f"header {name.decode()!r} contains control characters", close=True)
    return name.decode().lower(), value.decode("latin-1")


async def _read_head(inp: Input, limits: Limits) -> tuple[str, str, str, dict[str, str]]:
    try:
        line = await inp.readline()
        for _ in range(4):  # RFC 9112 2.2: ignore empty lines before the request line
            if line.strip(b"\r\n"):
                break
            line = await inp.readline()
    except _TooLong:
        raise HTTPError(414, f"request line longer than {limits.max_line} bytes", close=True) from None
    method, target, version = _parse_request_line(line)
    headers: dict[str, str] = {}
    total = 0
    while True:
        try:
            line = await inp.readline()
        except _TooLong:
            raise HTTPError(
                431, f"a header line is longer than {limits.max_line} bytes", close=True
            ) from None
        total += len(line)
        if total > limits.max_header_bytes:
            raise HTTPError(431, f"headers exceed {limits.max_header_bytes} bytes", close=True)
        if line in (b"\r\n", b"\n"):
            return method, target, version, headers
        if len(headers) >= limits.max_headers:
            raise HTTPError(431, f"more than {limits.max_headers} header fields", close=True)
        name, value = _parse_header(line)
        if name in headers:
            if name == "content-length" and headers[name] != value:
                raise HTTPError(400, "conflicting Content-Length headers", close=True)
            if name != "content-length":
                headers[name] += ", " + value
        else:
            headers[name] = value


def _body_length(method: str, headers: dict[str, str], limits: Limits) -> int:
    if "transfer-encoding" in headers:
        if "content-length" in headers:
            raise HTTPError(400, "both Transfer-Encoding and Content-Length given", close=True)
        raise HTTPError(
            501, "Transfer-Encoding request bodies are not supported; send Content-Length", close=True
        )
    length = headers.get("content-length")
    if length is None:
        if method in ("POST", "PUT", "PATCH"):
            raise HTTPError(411, "a request body needs a Content-Length header", close=True)
        return 0
    if not (length.isascii() and length.isdigit()):
        raise HTTPError(
            400, f"Content-Length must be a non-negative integer, got {length[:40]!r}", close=True
        )
    n = int(length)
    if n > limits.max_body:
        raise HTTPError(
            413, f"request body of {n} bytes exceeds the limit of {limits.max_body} bytes", close=True
        )
    return n


async def read_request(inp: Input, writer: asyncio.StreamWriter, limits: Limits) -> Request:
    """The request whose first bytes have arrived, within ``read_timeout``."""

    async def read() -> Request:
        try:
            method, target, version, headers = await within(_read_head(inp, limits), limits.header_timeout)
        except asyncio.TimeoutError:
            raise HTTPError(
                408, f"request head not received within {limits.header_timeout:g} s", close=True
            ) from None
        n = _body_length(method, headers, limits)
        expect = headers.get("expect", "").lower()
        if expect and expect != "100-continue":
            raise HTTPError(417, f"unsupported Expect: {expect[:40]!r}", close=True)
        if expect and n and version == "HTTP/1.1":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await inp.readexactly(n) if n else b""
        path = unquote(target.partition("?")[0])
        if any(c < " " or c == "\x7f" for c in path):  # %0a etc.: no path has them, and the log must not
            raise HTTPError(400, "the request path decodes to control characters", close=True)
        return Request(method, target, path, version, headers, body)

    try:
        return await within(read(), limits.read_timeout)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"request not received within {limits.read_timeout:g} s", close=True) from None


class Exchange:
    """The answer side of one request: a whole response, or a chunked event stream."""

    def __init__(self, conn: Connection, request: Request, keep_alive: bool) -> None:
        self.conn = conn
        self.request = request
        self.keep_alive = keep_alive
        self.status: int | None = None  # set once the head is written
        self._chunked = False
        self._watcher: asyncio.Task | None = None

    @property
    def started(self) -> bool:
        return self.status is not None

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        self.status = status
        lines = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "Server: edgerun",
            f"Date: {formatdate(usegmt=True)}",
            *(f"{k}: {v}" for k, v in headers),
            f"Connection: {'keep-alive' if self.keep_alive and not self.conn.inp.overflowed else 'close'}",
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _write(self, data: bytes) -> None:
        writer = self.conn.writer
        if writer.transport.is_closing():
            raise ConnectionResetError("client closed the connection")
        writer.write(data)
        await writer.drain()

    async def send(
        self, status: int, body: bytes, content_type: str, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        head = self._head(
            status, [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers]
        )
        await self._write(head if self.request.method == "HEAD" else head + body)

    async def send_json(self, status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> None:
        await self.send(status, json.dumps(obj).encode() + b"\n", "application/json", headers)

    async def send_error(self, err: HTTPError) -> None:
        if err.close:
            self.keep_alive = False
        await self.send_json(
            err.status, error_body(err.status, err.message, err.param, err.code), err.headers
        )

    async def start_stream(self, content_type: str = "text/event-stream") -> None:
        # HTTP/1.0 has no chunked coding: the stream ends when the connection does
        self._chunked = self.request.version == "HTTP/1.1"
        self.keep_alive = self.keep_alive and self._chunked
        headers = [("Content-Type", content_type), ("Cache-Control", "no-cache")]
        if self._chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        await self._write(self._head(200, headers))

    async def write(self, data: bytes) -> None:
        if data:
            await self._write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    async def end_stream(self) -> None:
        if self._chunked:
            await self._write(b"0\r\n\r\n")

    def watch_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` if the client closes the connection before the response is done."""

        async def watch() -> None:
            await self.conn.inp.wait_eof()
            self.keep_alive = False  # nothing more will come, or nothing more will be read
            while not self.conn.peer_gone():  # a half-close: it still reads, so it gets its answer
                await asyncio.sleep(HALF_CLOSED_POLL_S)

        self._watcher = asyncio.ensure_future(watch())
        self._watcher.add_done_callback(lambda t: None if t.cancelled() else callback())

    async def finish(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            # the reader allows one waiter: let the watcher's read unwind before the next request
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watcher
            if self._watcher.done() and not self._watcher.cancelled():
                self.keep_alive = False  # the client has gone


Handler = Callable[[Request, Exchange], Awaitable[None]]
Observer = Callable[[str, int], None]  # (path, status) after each response


class Connection:
    """One client connection: requests in order, one at a time (keep-alive, no pipelining overlap)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        limits: Limits,
        closing: Callable[[], bool],
        observe: Observer,
        uid: int | None = None,
    ) -> None:
        self.inp = Input(reader, limits.max_line)
        self.writer = writer
        self.handler = handler
        self.limits = limits
        self.closing = closing
        self.observe = observe
        self.uid = uid
        self.idle = True  # waiting for a request's first byte
        self.busy = False  # a complete request is being answered
        self.requests = 0  # complete requests received

    def close_if_idle(self) -> None:
        if self.idle:
            self.writer.close()

    def peer_gone(self) -> bool:
        """True once the client has closed its end entirely (POLLHUP), not just its sending side."""
        sock = self.writer.get_extra_info("socket")
        if sock is None or self.writer.transport.is_closing():
            return True
        poll = select.poll()
        poll.register(sock.fileno(), 0)  # POLLHUP and POLLERR are always reported
        return bool(poll.poll(0))

    async def run(self) -> None:
        try:
            while await self._one():
                pass
        except (ConnectionError, ClientGone):
            pass
        finally:
            self.writer.close()

    async def _one(self) -> bool:
        """Serve one request; False when the connection should close."""
        self.idle, self.busy = True, False
        wait = self.limits.idle_timeout if self.requests else self.limits.header_timeout
        try:
            if not await within(self.inp.wait_data(), wait):
                return False
        except asyncio.TimeoutError:
            return False
        self.idle = False
        try:
            req = await read_request(self.inp, self.writer, self.limits)
        except HTTPError as err:
            ex = Exchange(self, Request("?", "", "", "HTTP/1.1", {}), keep_alive=False)
            await ex.send_error(err)
            self.observe("", err.status)
            await self._linger()
            return False
        self.busy = True
        self.requests += 1
        ex = Exchange(self, req, keep_alive=req.keep_alive and not self.closing())
        started = time.monotonic()
        try:
            await self.handler(req, ex)
        except HTTPError as err:
            if ex.started:
                raise ConnectionResetError from err
            await ex.send_error(err)
        except (ConnectionError, ClientGone):
            ex.keep_alive = False
        except Exception as exc:  # a bug answers 500 and is logged; the daemon keeps serving
            log.exception("%s %s failed", req.method, req.path)
            if ex.started:
                ex.keep_alive = False
            else:
                await ex.send_error(HTTPError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await ex.finish()
            self.observe(req.path, ex.status or 499)  # 499: client closed before any answer
            request_log.info(
                "%s %s -> %d in %.3f s (uid %s)",
                req.method,
                req.path[:100],
                ex.status or 499,
                time.monotonic() - started,
                self.uid,
            )
        return ex.keep_alive and not self.closing() and not self.inp.overflowed

    async def _linger(self) -> None:
        """Half-close and discard what the client still sends, so it can read our error reply
        instead of a reset (closing a Unix socket with unread data resets the peer)."""
        with contextlib.suppress(Exception):
            self.writer.write_eof()

            async def drain_input() -> None:
                while await self.inp.reader.read(65536):
                    pass

            await within(drain_input(), 2.0)
