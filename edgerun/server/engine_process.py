"""The engine in a process of its own (``serve --engine-process on``, the default): the model and
its :class:`~edgerun.server.engine_worker.EngineWorker` run in a child started with
multiprocessing's ``spawn`` (torch after ``fork`` is unsafe), so a client that keeps the event
loop busy cannot take the GIL from generation.

The daemon talks to :class:`ProcessWorker` as to an ``EngineWorker``: ``submit``, ``cancel``,
``stop``, ``depth``, ``counters``. Requests are parsed, checked and tokenized in the daemon (the
child sends its tokenizer and limits once loaded) and go to the child over one pipe; each job's
events, the worker's hooks (status, ready, fatal, watchdog pings, log lines, a job's start and
end) and /metrics snapshots come back over it, pickled. The daemon holds the queue's bound (429)
itself. A child that dies fails the engine (``/health`` 503, the watchdog stops, exit 1); a
daemon that dies takes the child with it (``PR_SET_PDEATHSIG``, and the pipe's end).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgerun.errors import EdgerunError
from edgerun.server.engine_worker import (
    DECODE,
    PREFILL,
    Counters,
    Engine,
    EngineWorker,
    Job,
    JobFailed,
    QueueFull,
    WorkerHooks,
    engine_failed,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from edgerun.engine.request import Limits
    from edgerun.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# what stops the daemon (a drain): SIGHUP too, which a closed terminal sends its process group
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
CHILD_QUEUE = 1 << 20  # the daemon bounds the queue; the child's never refuses what it was sent
STATS_TIMEOUT_S = 2.0  # /metrics waits this long for the child's snapshot, then shows the last one
STOP_KILL_S = 1.0  # after this, a child that has not stopped is killed


class EngineDied(RuntimeError):
    """The engine's process ended without being asked to (killed, crashed, out of memory)."""


@dataclass(frozen=True)
class EngineSpec:
    """What the daemon needs of the loaded engine to check and tokenize requests itself."""

    model_id: str
    batch: int
    limits: Limits
    tokenizer: Tokenizer | None


class ProcessWorker:
    """``EngineWorker``'s loop-side interface, the worker itself in a spawned child. ``load``
    must pickle (a module-level function or object): the child calls it to load the engine."""

    def __init__(self, load: Callable[[Callable[[str], None]], Engine], capacity: int, hooks: WorkerHooks):
        self.load = load
        self.capacity = capacity
        self.hooks = hooks
        self.counters = Counters()  # the child's, as of the last snapshot (each /metrics takes one)
        self.dropped = 0
        self.batch = 1
        self.running: list[Job] = []  # taken by the child's engine, not yet ended
        self.pid: int | None = None
        self._queued: dict[int, Job] = {}  # sent, not yet taken
        self._jobs: dict[int, Job] = {}  # sent, not yet ended
        self._keys: dict[Job, int] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the books above: the loop and the pipe's reader
        self._send_lock = threading.Lock()
        self._stats: Any = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._ready = self._stopping = self._failed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._reader = threading.Thread(target=self._read, name="edgerun-engine-pipe", daemon=True)

    # ---- the loop's side ------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return len(self._queued)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        every = self.hooks.ping_every
        self._proc = ctx.Process(
            target=child_main, args=(child, self.load, every, os.getpid()), name="edgerun-engine", daemon=True
        )
        try:
            self._proc.start()
        except Exception as exc:  # e.g. a loader that does not pickle
            child.close()
            self._failed = True
            what = f"{type(exc).__name__}: {exc}"
            err = EdgerunError(
                f"the engine's process could not be started ({what}); serve with --engine-process off"
            )
            self.hooks.fatal(err, True)
            return
        child.close()
        self.pid = self._proc.pid
        self._reader.start()

    def describe(self) -> str:
        return f"in a process of its own (pid {self.pid}, spawned; engine_process on)"

    def submit(self, job: Job) -> None:
        with self._lock:
            if len(self._queued) >= self.capacity:
                raise QueueFull(f"{len(self._queued)} requests are waiting (queue size {self.capacity})")
            key = next(self._ids)
            self._queued[key] = self._jobs[key] = job
            self._keys[job] = key
        if not self._send(("submit", key, job.request, job.id, job.arrived)):
            job.deliver(JobFailed(503, "the engine process is gone"))

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._lock:
            key = self._keys.get(job)
            if key is None:  # over already (or never sent)
                return
            self._queued.pop(key, None)
        self._send(("cancel", key))

    def stop(self) -> None:
        self._stopping = True
        self._send(("stop",))

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the child to stop, else kill it; whether it stopped."""
        if self._proc is None or self._proc.pid is None:
            return True
        self._proc.join(timeout)
        stopped = not self._proc.is_alive()
        if not stopped:
            self._proc.kill()
            self._proc.join(STOP_KILL_S)
        self._reader.join(STOP_KILL_S)  # its last lines (requests cancelled by the stop) are said
        return stopped

    async def engine_stats(self, engine: Engine | None) -> dict[str, Any] | None:
        """A snapshot of the child's engine statistics and worker counters (``counters``,
        ``dropped`` updated); the last one if the child does not answer in time."""
        key = next(self._ids)
        done = self._waiting[key] = asyncio.get_running_loop().create_future()
        try:
            if self._send(("stats", key)):
                await asyncio.wait_for(done, STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiting.pop(key, None)
        return self._stats

    def _send(self, msg: tuple) -> bool:
        if self._conn is None or self._failed and msg[0] != "stop":
            return False
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError):  # the child is gone: the reader reports it
            return False

    # ---- the pipe's reader thread -----------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that does not unpickle here: the rest still can
                log.exception("an unreadable message from the engine process")
                continue
            try:
                self._dispatch(*msg)
            except Exception:
                log.exception("handling a message from the engine process")
        self._died()

    def _dispatch(self, kind: str, *args: Any) -> None:
        h = self.hooks
        if kind == "event":
            key, item, first_token = args
            job = self._jobs.get(key)
            if job is not None:
                if first_token is not None and job.first_token is None:
                    job.first_token, job.phase = first_token, DECODE
                job.deliver(item)
        elif kind == "ping":
            h.ping()
        elif kind == "start":
            key, started = args
            with self._lock:
                job = self._jobs.get(key)
                self._queued.pop(key, None)
                if job is not None:
                    job.started, job.phase = started, PREFILL
                    self.running.append(job)
        elif kind == "end":
            with self._lock:
                job = self._jobs.pop(args[0], None)
                self._queued.pop(args[0], None)
                if job is not None:
                    self._keys.pop(job, None)
                    if job in self.running:
                        self.running.remove(job)
        elif kind == "log":
            h.log(args[0])
        elif kind == "stats":
            key, self._stats, self.counters, self.dropped = args
            done = self._waiting.get(key)
            if done is not None:
                self._loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        elif kind == "status":
            h.status(args[0])
        elif kind == "ready":
            spec, probe, info = args
            self.batch, self._ready = spec.batch, True
            h.ready(spec, probe, info)
        elif kind == "fatal":
            exc, loading = args
            self._fail(exc, loading)
        else:
            raise ValueError(f"unknown message {kind!r} from the engine process")

    def _died(self) -> None:
        """The pipe has closed: fine if asked to stop or already failed, else the child died."""
        if self._stopping or self._failed:
            return
        self._failed = True
        self._proc.join(STOP_KILL_S)
        code = self._proc.exitcode
        how = (
            "still running, its pipe closed"
            if code is None
            else f"killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exit status {code}"
        )
        self._fail(EngineDied(f"the engine process (pid {self.pid}) died: {how}"), not self._ready)

    def _fail(self, exc: BaseException, loading: bool) -> None:
        """The running requests fail, then the engine: in that order, as in one process, so
        nobody hears of the failure while /health still answers ok."""
        self._failed = True
        for job in list(self.running):
            job.deliver(engine_failed(exc))
        self.hooks.fatal(exc, loading)


# ---- the child ------------------------------------------------------------------------------


def child_main(conn: Connection, load: Callable, ping_every: float, parent: int) -> None:
    """The engine process: an ``EngineWorker`` whose hooks and job events go up the pipe, fed
    by the requests that come down it. It ignores the daemon's stop signals (the daemon drains
    and stops it; a closed terminal's SIGHUP reaches the whole process group) and dies with the
    daemon."""
    _die_with(parent)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:  # tqdm's default lock is a multiprocessing one, which this process would leave behind
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    lock = threading.Lock()
    keys: dict[Job, int] = {}
    jobs: dict[int, Job] = {}
    engine: list[Engine] = []
    last_ping = [0.0]

    def send(msg: tuple) -> None:
        try:
            with lock:
                conn.send(msg)
        except (OSError, ValueError):
            pass  # the daemon is gone: the main thread sees the pipe close and exits

    def ping() -> None:
        now = time.monotonic()
        if now - last_ping[0] >= ping_every / 2:  # the daemon pings systemd every ping_every
            last_ping[0] = now
            send(("ping",))

    def snapshot(key: int) -> None:
        try:
            stats = engine[0].stats() if engine else None
        except Exception:  # /metrics goes on without them; the engine is not failed for it
            log.exception("the engine's statistics could not be taken")
            stats = None
        send(("stats", key, stats, worker.counters, worker.dropped))

    def ready(e: Engine, probe: str, info: dict[str, Any]) -> None:
        engine.append(e)
        spec = EngineSpec(e.model_id, getattr(e, "batch", 1), e.limits, e.tokenizer)
        send(("ready", spec, probe, info))

    def fatal(exc: BaseException, loading: bool) -> None:
        if not loading:
            # a bug: its traceback; a named fault (storage): the daemon's one line
            if not isinstance(exc, EdgerunError):
                log.error("the engine failed", exc_info=exc)
            snapshot(-1)  # its last counts (read faults, failures) stay in /metrics
        send(("fatal", _portable(exc), loading))

    def deliver(key: int, item: Any) -> None:
        if isinstance(item, JobFailed) and item.engine:
            return  # the daemon tells the running requests, as it takes the fatal message
        job = jobs.get(key)
        send(("event", key, item, job.first_token if job is not None else None))

    def end(job: Job) -> None:
        key = keys.pop(job, None)
        if key is not None:
            jobs.pop(key, None)
            send(("end", key))

    hooks = WorkerHooks(
        status=lambda msg: send(("status", msg)),
        ready=ready,
        fatal=fatal,
        ping=ping,
        ping_every=ping_every,
        log=lambda line: send(("log", line)),
        start=lambda job: send(("start", keys.get(job), job.started)),
        end=end,
    )
    worker = EngineWorker(load, CHILD_QUEUE, hooks)
    worker.start()
    while True:
        try:
            kind, *args = conn.recv()
        except (EOFError, OSError):  # the daemon is gone
            _exit(0)
        if kind == "submit":
            key, request, rid, arrived = args
            job = Job(request, lambda item, key=key: deliver(key, item), rid, arrived=arrived)
            jobs[key], keys[job] = job, key
            worker.submit(job)
        elif kind == "cancel":
            job = jobs.get(args[0])
            if job is not None:
                worker.cancel(job)
        elif kind == "stats":
            snapshot(args[0])
        elif kind == "stop":
            worker.stop()
            worker.join(STOP_KILL_S)
            _exit(0)


def _die_with(parent: int) -> None:
    """SIGKILL this process when the daemon dies (Linux); the daemon may have died already."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the pipe's end stops it
    if os.getppid() != parent:
        _exit(0)


def _exit(code: int) -> None:
    """As the daemon leaves: no interpreter teardown (torch's takes seconds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it crosses a pipe intact, else a RuntimeError that says what it was."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
