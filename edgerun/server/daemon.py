"""The daemon's lifecycle, top to bottom (:func:`run`): block the stop signals, take the socket
(systemd's, or bind our own), start the loop and the engine thread, ``READY=1`` once the model
is loaded and probed, serve until SIGTERM, ``STOPPING=1``, drain for the grace period, exit 0.

If the engine cannot continue, ``/health`` answers ``failed`` for a moment and the process exits
non-zero, so systemd restarts it; after a storage fault (an expert block that cannot be read
intact) it stays up, failed and saying why, and stops feeding the watchdog, whose timeout
restarts it. Threads: one asyncio loop (uvloop) for every connection, one
engine thread that owns the model (:mod:`edgerun.server.engine_worker`), by default in a child
process of its own (:mod:`edgerun.server.engine_process`), else in this one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edgerun.errors import EdgerunError, StorageError
from edgerun.server.api import FAILED, STOPPING, ApiOptions, App
from edgerun.server.engine_process import STOP_SIGNALS, ProcessWorker
from edgerun.server.engine_worker import Engine, EngineWorker, WorkerHooks
from edgerun.server.http import Connection, Limits
from edgerun.server.metrics import Metrics
from edgerun.server.options import ServeOptions
from edgerun.server.paths import (
    BACKLOG,
    activated_socket,
    bind_unix_socket,
    default_socket_path,
    peer_uid,
    socket_lock,
)
from edgerun.server.sdnotify import Notifier, watchdog_interval

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2  # 2: a user error, as the CLI exits; not restarted
FAILED_LINGER_S = 1.0  # how long /health reports a failed engine before the process exits
GIL_SWITCH_S = 0.0005

LoadEngine = Callable[[Callable[[str], None]], Engine]


def say(msg: str) -> None:
    """A line on stderr; where nobody reads it any more (a closed pipe, a gone terminal) the
    daemon carries on, and stops when asked, without it."""
    try:  # one write, the newline in it: other threads' lines (the request log) never split it
        sys.stderr.write(f"edgerun serve: {msg}\n")
        sys.stderr.flush()
    except OSError:  # a broken pipe among them
        pass


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed (pip install edgerun[serve]); using asyncio's own loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(opts: ServeOptions, load_engine: LoadEngine, env: Mapping[str, str] = os.environ) -> int:
    """Serve until stopped; returns the exit status."""
    # The engine thread takes the GIL back after every torch op: a busy loop would keep it
    # waiting up to the switch interval (5 ms by default) each time.
    sys.setswitchinterval(GIL_SWITCH_S)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # until the loop's handlers are in place
    try:
        listener = activated_socket(env)
        path, owned = None, listener is None
        if listener is not None and (
            opts.socket is not None
            or opts.socket_group is not None
            or opts.socket_mode != ServeOptions.socket_mode
        ):
            say(  # the socket unit's ListenStream=, SocketMode= and SocketGroup= rule it
                "warning: serving the socket systemd passed (fd 3); serve.yaml's socket, socket_mode "
                "and socket_group apply only to a socket the daemon binds itself"
            )
        if listener is None:
            path = opts.socket or default_socket_path(env)
            listener = bind_unix_socket(path, opts.socket_mode, opts.socket_group)
        daemon = Daemon(opts, load_engine, listener, path if owned else None, env)
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(daemon.main())
        finally:
            loop.close()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return code


def hard_exit(code: int) -> None:
    """Leave without interpreter teardown: torch's alone takes seconds of the stop timeout, and
    an engine thread still inside a step (or still loading) must not be waited for. By now the
    answers are written and the socket is removed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Daemon:
    def __init__(
        self,
        opts: ServeOptions,
        load_engine: LoadEngine,
        listener: socket.socket,
        owned_path: Path | None,
        env: Mapping[str, str],
    ) -> None:
        self.opts = opts
        self.listener = listener
        self.where = str(owned_path or listener.getsockname() or "fd 3")
        self.owned_path = owned_path
        self.owned_inode = os.stat(owned_path).st_ino if owned_path else None
        self.notifier = Notifier.from_env(env)
        self.watchdog = watchdog_interval(env)
        self.limits = Limits(
            max_line=8 * 1024,
            max_header_bytes=opts.max_header_bytes,
            max_headers=opts.max_headers,
            max_body=opts.max_body_bytes,
            idle_timeout=opts.idle_timeout,
            read_timeout=opts.read_timeout,
            header_timeout=opts.header_timeout,
        )
        self.metrics = Metrics()
        every = self.watchdog / 4 if self.watchdog else 1.0
        hooks = WorkerHooks(
            status=lambda msg: self._from_engine(self._on_status, msg),
            ready=lambda engine, probe, info: self._from_engine(self._on_ready, engine, probe, info),
            fatal=lambda exc, loading: self._from_engine(self._on_fatal, exc, loading),
            ping=self._ping,
            ping_every=every,
            log=say,
        )
        worker = ProcessWorker if opts.engine_process else EngineWorker
        self.worker = worker(load_engine, opts.queue_size, hooks)
        api_opts = ApiOptions(opts.default_max_tokens, opts.request_timeout, opts.retry_after)
        self.app = App(self.worker, self.metrics, api_opts)
        self.conns: dict[Connection, None] = {}  # in the order they were accepted
        self.per_uid: Counter[int | None] = Counter()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.failed_code = EXIT_OK
        self.loop_beat = time.monotonic()
        self._last_ping = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future | None = None
        self._hurry: asyncio.Event | None = None

    async def main(self) -> int:
        loop = self._loop = asyncio.get_running_loop()
        self._stop, self._hurry = loop.create_future(), asyncio.Event()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.request_stop, f"signal {signal.Signals(sig).name}", EXIT_OK)
        server = await asyncio.start_unix_server(
            self._accept, sock=self.listener, limit=self.limits.max_line, backlog=BACKLOG
        )
        self.worker.start()  # a thread inherits the blocked signals (they go to this one); a child ignores them
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        say(f"listening on {self.where}; loading the model")
        heartbeat = asyncio.ensure_future(self._heartbeat())

        reason, code = await self._stop
        code = code or self.failed_code  # a SIGTERM after the engine failed still exits non-zero
        t_stop = time.monotonic()
        self.stopping = True
        if self.app.state != FAILED:
            self.app.state, self.app.message = STOPPING, reason
        self.notifier.notify("STOPPING=1", f"STATUS=stopping ({reason})")
        try:
            say(f"stopping ({reason}); draining for up to {self.opts.grace_period:g} s")
            server.close()
            for conn in list(self.conns):
                conn.close_if_idle()
            await self._drain()
        finally:  # whatever failed above, the engine is stopped and the socket removed
            heartbeat.cancel()
            self.worker.stop()
            if not await loop.run_in_executor(None, self.worker.join, 1.0):
                say("the engine did not stop within 1 s; exiting without it")
            self._unlink()
        say(f"stopped in {time.monotonic() - t_stop:.1f} s (exit status {code})")
        return code

    def request_stop(self, reason: str, code: int = EXIT_OK) -> None:
        if not self._stop.done():
            self._stop.set_result((reason, code))
        else:
            self._hurry.set()  # a second SIGTERM/SIGINT: stop waiting for requests

    async def _drain(self) -> None:
        grace = 0.0 if self.app.state == FAILED else self.opts.grace_period
        deadline = time.monotonic() + grace
        while self.app.active and time.monotonic() < deadline and not self._hurry.is_set():
            await asyncio.sleep(0.02)
        if self.app.active:
            say(f"grace period over: cancelling {len(self.app.active)} request(s)")
            self.app.abort_all(503, "the server is shutting down")
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for conn in list(self.conns):
            conn.writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = peer_uid(writer.get_extra_info("socket"))
        if not self._make_room(uid):
            self.metrics.connections["refused"] += 1
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            writer.close()
            return
        conn = Connection(
            reader, writer, self.app.handle, self.limits, lambda: self.stopping, self.metrics.observe, uid
        )
        task = asyncio.current_task()
        self.conns[conn] = None
        self.per_uid[uid] += 1
        self.tasks.add(task)
        self.metrics.open_connections = len(self.conns)
        try:
            await conn.run()
        finally:
            self._forget(conn)
            self.tasks.discard(task)

    def _make_room(self, uid: int | None) -> bool:
        """Room for one more connection from ``uid``: under its own limit and the global one, or
        made by closing the oldest connection that has no request in progress (idle, or still
        sending its head) of that uid (over its limit) or of anyone (over the global limit).
        False when every candidate is answering a request."""
        if self.per_uid[uid] >= self.opts.max_connections_per_uid:
            candidates = (c for c in self.conns if c.uid == uid)
        elif len(self.conns) >= self.opts.max_connections:
            candidates = iter(self.conns)
        else:
            return True
        oldest = next((c for c in candidates if not c.busy), None)
        if oldest is None:
            return False
        oldest.writer.close()
        self._forget(oldest)
        self.metrics.connections["evicted"] += 1
        return True

    def _forget(self, conn: Connection) -> None:
        if conn in self.conns:  # not evicted already
            del self.conns[conn]
            self.per_uid[conn.uid] -= 1
        self.metrics.open_connections = len(self.conns)

    # ---- engine thread -> loop --------------------------------------------------------------

    def _from_engine(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: we are exiting anyway
            pass

    def _on_status(self, msg: str) -> None:
        self.app.message = msg
        self.notifier.notify(f"STATUS={msg}")

    def _on_ready(self, engine: Engine, probe: str, info: dict[str, Any]) -> None:
        if self.stopping:
            return
        info = {**info, "engine_process": self.worker.pid}
        self.app.set_ready(engine, info)
        say(info.get("provenance", f"model {engine.model_id}"))
        say(f"engine {self.worker.describe()}")
        say(probe)
        self.app.message = f"serving {engine.model_id} on {self.where}"
        self.notifier.notify("READY=1", f"STATUS={self.app.message}")
        say(f"ready: {self.app.message}")

    def _on_fatal(self, exc: BaseException, loading: bool) -> None:
        what = "loading the model failed" if loading else "the engine failed"
        message = (
            f"{what}: {type(exc).__name__}: {exc}" if not isinstance(exc, EdgerunError) else f"{what}: {exc}"
        )
        if not loading and not isinstance(exc, EdgerunError):  # a bug: its traceback, once
            log.error(message, exc_info=exc)
        say(message)
        self.app.state, self.app.message = FAILED, message
        self.notifier.notify(f"STATUS={message}")
        self.app.abort_all(503, message)
        # a configuration error is not restarted (2); a device not there yet is (DeviceUnavailable: 1)
        config = loading and isinstance(exc, EdgerunError)
        self.failed_code = getattr(exc, "exit_status", EXIT_CONFIG) if config else EXIT_FAILED
        if not loading and isinstance(exc, StorageError):
            return  # up, failed, saying why in /health and /metrics until the watchdog restarts it
        self._loop.call_later(FAILED_LINGER_S, self.request_stop, message, self.failed_code)

    # ---- watchdog: pinged from the engine thread while the loop is alive too ------------------

    async def _heartbeat(self) -> None:
        every = self.watchdog / 4 if self.watchdog else 1.0
        while True:
            self.loop_beat = time.monotonic()
            await asyncio.sleep(every)

    def _ping(self) -> None:
        if not self.watchdog or self.app.state == FAILED:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog / 4 and now - self.loop_beat < self.watchdog / 2:
            self._last_ping = now
            self.notifier.notify("WATCHDOG=1")

    def _unlink(self) -> None:
        """Remove our socket file, unless another daemon has replaced it since."""
        if self.owned_path is None:
            return
        try:
            with socket_lock(self.owned_path):
                if os.stat(self.owned_path).st_ino == self.owned_inode:
                    os.unlink(self.owned_path)
        except FileNotFoundError:
            pass
        except EdgerunError as exc:  # the lock: another daemon is binding the path now
            say(f"leaving {self.owned_path} in place: {exc}")
