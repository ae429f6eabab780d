"""The engine thread: it loads the model, then runs up to ``engine.batch`` requests at a time
from a bounded queue.

The event loop submits :class:`Job` s; each job's events (``runner.Event``, or a final
:class:`JobFailed`) come back through the job's ``deliver`` callback, which the loop side makes
thread-safe. The thread advances its running jobs' generators one event each per round, in the
order they started, and takes new jobs from the queue at the start of a round while fewer than
``batch`` run: a batched engine (``engine/batch.py``) then decodes every running request in one
multi-row step per round, and a request still in prefill runs one prompt chunk per round, so a
long prompt does not stall the others' tokens. torch is imported here, by the engine thread, as it loads: the socket answers
``/health`` (503, loading) from the first moment. Cancelling a job (client gone, timeout,
shutdown) takes it out of the queue, or stops its generation at the next token or prefill
chunk; the watchdog is fed at each of them too (and inside a chunk, as its layers return), so a
long prompt keeps it fed while a stuck step starves it. Each job keeps its timeline (arrival,
start, first token) for its answer's ``timings``, the per-request log line and the /metrics
histograms. The engine sits behind the small :class:`Engine` interface (:class:`RunnerEngine`
serves a :class:`~edgerun.engine.runner.Runner`, resident or streaming; tests script their
own). Requests reach it checked (``engine/request.py``).
"""

from __future__ import annotations

import bisect
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgerun.errors import EdgerunError, StorageError

if TYPE_CHECKING:
    from edgerun.engine.request import Limits, Request
    from edgerun.engine.runner import Event, Runner
    from edgerun.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine(Protocol):
    model_id: str
    batch: int  # requests it decodes together (absent: 1, one request at a time)
    tokenizer: Tokenizer | None
    limits: Limits  # what check_request holds requests to, before they are queued
    generate: Callable[[Request], Iterator[Event]]

    def watch(self, ping: Callable[[], None]) -> None:
        """Call ``ping`` (from the engine thread) as a step makes progress inside, so a step
        longer than the watchdog's period keeps it fed and a stuck one does not."""

    def probe(self) -> str:
        """Start-up self-check (kernel probes); raises if the engine cannot serve."""

    def describe(self) -> dict[str, Any]:
        """Provenance for /v1/models and the start-up line; fixed once loaded."""

    def stats(self) -> dict[str, Any]:
        """A snapshot safe to take from another thread while the engine runs:
        ``experts`` (mode label), ``layers`` {layer: {hits, misses, evictions, bytes_read}},
        ``fallbacks`` {kind: times taken}, ``resident_memory_bytes``, ``peak_memory_bytes``;
        optionally ``read_faults`` {kind: count} and ``nonfinite_logits``."""


class EngineFailure(EdgerunError):
    """The engine cannot continue (device lost, state corrupt): the daemon exits to be restarted."""


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` ends the engine: a lost device, out of memory, or a storage fault (the
    bundle can no longer be read intact)."""
    if isinstance(exc, (EngineFailure, MemoryError, StorageError)):
        return True
    accel = getattr(sys.modules.get("torch"), "AcceleratorError", ())  # a device error: CUDA's state is lost
    return isinstance(exc, accel) or (isinstance(exc, RuntimeError) and "CUDA error" in str(exc))


class RunnerEngine:
    """The daemon's engine: a :class:`Runner` (dense weights resident, routed experts resident
    or streamed through its expert cache), with the provenance, probe and statistics the daemon
    reports. Requests go straight to the runner's ``generate``."""

    def __init__(
        self, runner: Runner, model_dir: Path | None, model_id: str, profile: str | None, plan: str | None
    ) -> None:
        self.runner = runner
        self.model_dir = model_dir
        self.model_id = model_id
        self.profile = profile
        self.plan = plan
        self.tokenizer = runner.tokenizer
        self.limits = runner.limits
        self.generate = runner.generate
        self.batch = runner.batch.size if runner.batch is not None else 1

    def watch(self, ping: Callable[[], None]) -> None:
        """Ping after each decoder layer of an eager forward (a prefill chunk, an eager decode
        step): one prompt chunk may outlast WatchdogSec (a streamed prefill on a small board),
        while a layer that never returns stops the pings. A replayed decode graph runs no hook;
        its steps are short, and the worker pings between them."""
        for layer in self.runner.model.model.layers:
            layer.register_forward_hook(lambda *_: ping())

    def probe(self) -> str:
        import torch

        # on CUDA the decode state is static and its graphs are captured for its size: build it
        # now at a size most requests fit, so the first request does not pay for it
        if self.runner.batch is not None:  # every request runs as a row of the batch
            try:
                line = f"probe passed on {self.runner.device}: {self.runner.probe_batch()}"
            except EdgerunError as exc:
                raise EngineFailure(f"start-up probe: {exc}") from exc
        else:
            size = min(self.limits.max_context, 4096) if self.runner.device.type == "cuda" else 2
            state = self.runner.new_state(size)
            logits = self.runner.prefill(state, [0])
            logits = torch.stack([logits, self.runner.decode_step(state, int(torch.argmax(logits)))])
            if not bool(torch.isfinite(logits).all()):
                raise EngineFailure("start-up probe: prefill/decode produced non-finite logits")
            line = f"probe passed: prefill + one decode step on {self.runner.device}, logits finite"
        # and every prompt length's prefill graph, so no first request of a length pays for one
        captured = self.runner.capture_prefill()
        return f"{line}; {captured}" if captured else line

    def provenance(self) -> str:
        from edgerun.engine.provenance import provenance

        return provenance(self.runner, self.model_dir, self.profile or "none", self.plan)

    def describe(self) -> dict[str, Any]:
        import torch

        r, a = self.runner, self.runner.args
        return {
            "model_dir": str(self.model_dir or "demo"),
            "model_type": a.model_type,
            "layers": a.num_hidden_layers,
            "experts": a.num_experts,
            "experts_per_token": a.num_experts_per_tok,
            "params": sum(p.numel() for p in r.model.parameters()),
            "dtype": str(next(r.model.parameters()).dtype).removeprefix("torch."),
            "device": str(r.device),
            "threads": torch.get_num_threads(),
            "max_context": r.max_context,
            "device_profile": self.profile,
            "bundle": str(self.model_dir) if self._bundle_manifest() else None,
            "bundle_hash": self._bundle_hash(),
            "plan": self.plan,
            "batch": self.batch,
            "expert_mode": "streamed" if r.cache else "resident",
            "expert_quota": r.cache.quotas if r.cache else None,
            "kernels": r.kernel_summary(),
            "cpu": r.kernels.cpu or None,  # the CPU's bf16 hardware and why the compute dtype is what it is
            "fallbacks": [f"{k}: {v}" for k, v in r.fallbacks().items()],
            "load": r.load_summary,
            "architecture_provider": r.provider.as_dict() if r.provider else None,
            "provenance": self.provenance(),
        }

    def _bundle_manifest(self) -> Path | None:
        m = self.model_dir / "manifest.json" if self.model_dir else None
        return m if m is not None and m.is_file() else None

    def _bundle_hash(self) -> str | None:
        """The bundle's identity: sha256 of its manifest (which holds every file's hash)."""
        import hashlib

        m = self._bundle_manifest()
        return hashlib.sha256(m.read_bytes()).hexdigest()[:16] if m else None

    def stats(self) -> dict[str, Any]:
        import psutil
        import torch

        from edgerun.engine.runner import peak_memory

        cache = self.runner.cache
        resident = psutil.Process().memory_info().rss
        if self.runner.device.type == "cuda":
            resident += torch.cuda.memory_allocated(self.runner.device)
        layers = {}
        far = cache.far_reads() if cache else {}  # one device sync for every layer's far counter
        for layer in self.runner.args.moe_layers:
            st = cache.layer_stats(layer, far) if cache else None
            layers[layer] = {
                "hits": st.hits if st else 0,
                "misses": st.misses if st else 0,
                "evictions": st.evictions if st else 0,
                "passed": st.passed if st else 0,
                "bytes_read": st.bytes_read if st else 0,
                **{
                    k: getattr(st, k) if st else 0
                    for k in (
                        "prefetch_issued",
                        "prefetch_useful",
                        "prefetch_wasted",
                        "prefetch_bytes",
                        "verify_windows",
                        "window_experts",
                        "tier_copies",
                        "far_reads",
                        "cpu_pairs",
                    )
                },
            }
        return {
            "experts": "streamed" if cache else "resident",
            "layers": layers,
            "fallbacks": self.runner.fallback_counts(),
            "decode_steps": self.runner.decode_counts(),
            "prefill_chunks": self.runner.prefill_counts(),
            "graph_captures": self.runner.capture_counts(),
            "batch_steps": self.runner.batch.stats.sizes if self.runner.batch is not None else {},
            "read_faults": cache.read_faults() if cache else {},
            "reads": cache.reads_by_backend() if cache else {},
            "disk": cache.disk_time() if cache else {},
            "nonfinite_logits": self.runner.nonfinite_logits,
            "sampled_tokens": dict(self.runner.sampled),
            "resident_memory_bytes": resident,
            "peak_memory_bytes": peak_memory(self.runner.device),
            **({"speculative": self._speculative()} if self.runner.speculative else {}),
        }

    def _speculative(self) -> dict[str, Any]:
        r = self.runner
        t = r.spec_totals
        return {
            "draft_tokens": r.speculative.draft_tokens,
            **{k: getattr(t, k) for k in ("steps", "device_steps", "drafted", "accepted", "emitted")},
            "plain_requests": r.spec_plain_requests,
            "acceptance": t.acceptance,
            "tokens_per_step": t.tokens_per_step,
            "speedup": r.last_speedup,
            "row_step_seconds": r.row_step_s,
        }


QUEUED, PREFILL, DECODE = "queued", "prefill", "decode"  # a job's phase; a cancellation names it


@dataclass(eq=False)
class Job:
    """One request for the engine. The loop sets the first fields; the engine thread writes the
    rest, which the loop reads once the job's final item has come (or its first token has)."""

    request: Request  # checked before it was queued
    deliver: Callable[[Any], None]  # thread-safe: hands one Event, or a JobFailed, to the handler
    id: str = ""  # the response's id, for the log line
    arrived: float = field(default_factory=time.monotonic)  # when the daemon had the whole request
    cancelled: bool = False
    phase: str = QUEUED
    prefilled: int = 0  # prompt tokens through the model so far
    started: float | None = None  # when the engine took it
    first_token: float | None = None  # when its first token (or its end, if none) came out
    # the engine thread's own: the job's events, tokens delivered, when the last one came out
    events: Any = None
    tokens: int = 0
    last_token: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.started is None else self.started - self.arrived

    @property
    def prefill_s(self) -> float | None:
        """From the engine taking the request to its first token (state set-up, prefill, sample)."""
        return None if self.first_token is None else self.first_token - self.started

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    @property
    def prefill_tps(self) -> float:
        return len(self.request.prompt_ids) / self.prefill_s if self.prefill_s else 0.0

    def timings(self, stats: Any) -> dict[str, Any]:
        """The request's times, for its response: llama.cpp's ``timings`` fields (prompt_*: the
        prefill, predicted_*: the decode steps after the first token) plus queue and TTFT, all
        measured from the daemon's clock except the decode's, which is the engine's own."""
        return {
            "queue_ms": _ms(self.queue_s),
            "ttft_ms": _ms(self.ttft_s),
            "prompt_n": len(self.request.prompt_ids),
            "prompt_ms": _ms(self.prefill_s),
            "prompt_per_second": round(self.prefill_tps, 3),
            # the decode steps after the first token (which prefill produced): n / ms = per_second
            "predicted_n": max(stats.generated_tokens - 1, 0) if stats else 0,
            "predicted_ms": _ms(stats.decode_s if stats else 0.0),
            "predicted_per_second": round(stats.decode_tps, 3) if stats else 0.0,
        }

    def summary(self, stats: Any, finish: str | None, tokens: int) -> str:
        """The per-request log line (``finish`` None: cancelled, after ``tokens`` tokens)."""
        n = len(self.request.prompt_ids)
        head = f"request {self.id or '-'}: prompt {n} tok"
        if finish is None:
            done = f"{self.prefilled} of {n} prompt tokens" if self.phase == PREFILL else f"{tokens} tokens"
            return f"{head}; cancelled in {self.phase} after {done}"
        t = self.timings(stats)
        return (
            f"{head}, generated {stats.generated_tokens if stats else 0} tok ({finish}); queue {t['queue_ms']:.0f} ms, "
            f"TTFT {t['ttft_ms']:.0f} ms, prefill {t['prompt_per_second']:.1f} tok/s "
            f"({t['prompt_ms']:.0f} ms), decode {t['predicted_per_second']:.1f} tok/s"
        )


def _ms(seconds: float | None) -> float:
    return round(seconds * 1e3, 3) if seconds is not None else 0.0


@dataclass
class JobFailed:
    status: int
    message: str
    engine: bool = False  # the engine failed, not only this request


def engine_failed(exc: BaseException) -> JobFailed:
    """What each running request gets when ``exc`` ends the engine."""
    return JobFailed(500, f"engine failed: {type(exc).__name__}: {exc}", engine=True)


class QueueFull(Exception):
    pass


# seconds: from a short prompt on a GPU to a long one streamed on a small board
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# seconds between two tokens of one request: a resident decode step on a GPU to a streamed one
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """A Prometheus histogram: the engine thread observes, the loop takes snapshots."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    def __getstate__(self) -> dict[str, Any]:  # a copy for another process: counts, not the lock
        with self._lock:
            return {"bounds": self.bounds, "_counts": list(self._counts), "_sum": self._sum}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def snapshot(self) -> tuple[list[tuple[float, int]], float, int]:
        """Cumulative (upper bound, count) pairs ending at +inf, the sum, and the count."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, n = [], 0
        for bound, count in zip((*self.bounds, float("inf")), counts):
            n += count
            cumulative.append((bound, n))
        return cumulative, total, n


@dataclass
class Counters:
    """Written only by the engine thread; the loop reads them for /metrics."""

    requests: int = 0
    failed: int = 0
    # by phase; every key there from the start, so the loop's reads never see the dict grow
    cancelled: dict[str, int] = field(default_factory=lambda: dict.fromkeys((QUEUED, PREFILL, DECODE), 0))
    prompt_tokens: int = 0  # through the model: a prefill cancelled midway counts its chunks run
    generated_tokens: int = 0
    prefill_s: float = 0.0  # engine start to first token, summed
    decode_s: float = 0.0
    last_prefill_tps: float = 0.0
    last_decode_tps: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)  # arrival to first token
    prefill: Histogram = field(default_factory=Histogram)  # engine start to first token
    queue: Histogram = field(default_factory=Histogram)  # arrival to the engine taking it
    inter_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))  # token to token


@dataclass
class WorkerHooks:
    """How the engine thread reports to the daemon; each is called from the engine thread."""

    status: Callable[[str], None]
    ready: Callable[[Engine, str, dict[str, Any]], None]  # (engine, probe line, engine.describe())
    fatal: Callable[[BaseException, bool], None]  # (exception, during_load)
    ping: Callable[[], None] = lambda: None  # watchdog
    ping_every: float = 1.0
    log: Callable[[str], None] = lambda line: None  # one line per request the engine took
    start: Callable[[Job], None] = lambda job: None  # the engine took the job (its prefill begins)
    end: Callable[[Job], None] = lambda job: None  # the job is over (finished, failed, or cancelled)


class EngineWorker:
    def __init__(self, load: Callable[[Callable[[str], None]], Engine], capacity: int, hooks: WorkerHooks):
        self.load = load
        self.capacity = capacity
        self.hooks = hooks
        self.counters = Counters()
        self.dropped = 0  # jobs cancelled while still queued (the loop's count; the engine never saw them)
        self.pid: int | None = None  # the engine's own process: none, it is this one
        self.batch = 1  # the engine's, once loaded
        self.running: list[Job] = []  # taken by the engine (prefill or decode), in the order taken
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.thread = threading.Thread(target=self._main, name="edgerun-engine", daemon=True)

    # ---- the loop's side ------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the engine to stop; whether it did."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def describe(self) -> str:
        return "in the daemon's process (engine_process off: clients busying the event loop slow it through the GIL)"

    async def engine_stats(self, engine: Engine | None) -> dict[str, Any] | None:
        """The engine's ``stats()``, for /metrics; this worker's ``counters`` are current."""
        return engine.stats() if engine is not None else None

    def submit(self, job: Job) -> None:
        with self._cond:
            if len(self._queue) >= self.capacity:
                raise QueueFull(f"{len(self._queue)} requests are waiting (queue size {self.capacity})")
            self._queue.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cond:
            if job not in self._queue:
                return
            self._queue.remove(job)
            self.dropped += 1
        self.hooks.end(job)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # ---- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            engine = self.load(self.hooks.status)
            engine.watch(self.hooks.ping)
            self.hooks.status("running start-up probes")
            probe = engine.probe()
            info = engine.describe()
            self.batch = getattr(engine, "batch", 1)
        except BaseException as exc:
            self.hooks.fatal(exc, True)
            return
        self.hooks.ready(engine, probe, info)
        try:
            while self._round(engine):
                pass
        finally:
            for job in list(self.running):
                if job.cancelled:  # by the drain's end (shutdown): counted and logged as any other
                    self._advance(job)
                self._end(job)

    def _round(self, engine: Engine) -> bool:
        """Take queued jobs while fewer than ``batch`` run, then advance each running job by
        one event. False once stopping (or the engine failed)."""
        with self._cond:
            if not self._queue and not self.running and not self._stopping:
                self._cond.wait(self.hooks.ping_every)
            if self._stopping:
                return False
            taken = []
            while self._queue and len(self.running) + len(taken) < self.batch:
                taken.append(self._queue.popleft())
        self.hooks.ping()
        for job in taken:
            if job.cancelled:  # cancelled between leaving the queue and here
                self.counters.cancelled[QUEUED] += 1
                self.hooks.end(job)
                continue
            self._start(engine, job)
        for job in list(self.running):
            try:
                done = self._advance(job)
            except BaseException as exc:
                for other in self.running:
                    other.deliver(engine_failed(exc))
                self.counters.failed += len(self.running)  # each running request failed with it
                self.hooks.fatal(exc, False)
                return False
            self.hooks.ping()
            if done:
                self._end(job)
        return True

    def _start(self, engine: Engine, job: Job) -> None:
        self.counters.requests += 1
        job.started, job.phase = time.monotonic(), PREFILL
        self.counters.queue.observe(job.queue_s)
        self.hooks.start(job)
        job.events = engine.generate(job.request)
        self.running.append(job)

    def _end(self, job: Job) -> None:
        close = getattr(job.events, "close", None)
        if close is not None:
            close()  # a generator: stops its generation, and its state (its batch slot) goes with it
        self.running.remove(job)
        self.hooks.end(job)

    def _advance(self, job: Job) -> bool:
        """The job's next event, delivered; True when the job is over (finished, failed or
        cancelled). Raises what ends the engine (``is_fatal``)."""
        from edgerun.engine.sampler import SamplingError

        c = self.counters
        if job.cancelled:
            c.cancelled[job.phase] += 1
            self.hooks.log(job.summary(None, None, job.tokens))
            return True
        try:
            event = next(job.events, None)
            if event is None:
                raise RuntimeError("the engine ended a request without a finish reason")
            if not (event.text or event.token_id is not None or event.finish_reason is not None):
                self._prefilled(job, event.prefilled)  # a prefill chunk done
                return False
            if job.first_token is None:
                self._first_token(job)
            if event.token_id is not None:
                now = time.monotonic()
                if job.last_token is not None:
                    c.inter_token.observe(now - job.last_token)
                job.last_token = now
                job.tokens += 1
                c.generated_tokens += 1
            job.deliver(event)
            if event.finish_reason is None:
                return False
            stats = event.stats
            if stats is not None:
                c.generated_tokens += stats.generated_tokens - job.tokens  # EOS, as usage counts it
                c.decode_s += stats.decode_s
                c.last_decode_tps = stats.decode_tps
            self.hooks.log(job.summary(stats, event.finish_reason, job.tokens))
        except SamplingError as exc:
            c.failed += 1
            job.deliver(JobFailed(400, str(exc)))
        except Exception as exc:
            if is_fatal(exc):
                raise
            c.failed += 1
            log.exception("request failed in the engine")
            job.deliver(JobFailed(500, f"engine error: {type(exc).__name__}: {exc}"))
        return True

    def _prefilled(self, job: Job, upto: int) -> None:
        """Count the prompt tokens through the model, as they go (``upto``: so far)."""
        upto = min(upto, len(job.request.prompt_ids))
        self.counters.prompt_tokens += max(upto - job.prefilled, 0)
        job.prefilled = max(job.prefilled, upto)

    def _first_token(self, job: Job) -> None:
        c = self.counters
        job.first_token, job.phase = time.monotonic(), DECODE
        self._prefilled(job, len(job.request.prompt_ids))  # all of it, whether or not chunks said so
        c.ttft.observe(job.ttft_s)
        c.prefill.observe(job.prefill_s)
        c.prefill_s += job.prefill_s
        c.last_prefill_tps = job.prefill_tps
