"""The engine thread: it loads the model, then runs requests one at a time from a bounded queue.

The event loop submits :class:`Job` s; each job's events (``runner.Event``, or a final
:class:`JobFailed`) come back through the job's ``deliver`` callback, which the loop side makes
thread-safe. torch is imported here, by the engine thread, as it loads: the socket answers
``/health`` (503, loading) from the first moment. Cancelling a job (client gone, timeout,
shutdown) takes it out of the queue, or stops its generation at the next token or prefill
chunk; the watchdog is fed at each of them too. The engine sits behind the small :class:`Engine`
interface (:class:`RunnerEngine` serves a :class:`~edgerun.engine.runner.Runner`, resident or
streaming; tests script their own). Requests reach it checked (``engine/request.py``).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
    tokenizer: Tokenizer | None
    limits: Limits  # what check_request holds requests to, before they are queued
    generate: Callable[[Request], Iterator[Event]]

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

    def probe(self) -> str:
        import torch

        # on CUDA the decode state is static and its graphs are captured for its size: build it
        # now at a size most requests fit, so the first request does not pay for it
        size = min(self.limits.max_context, 4096) if self.runner.device.type == "cuda" else 2
        state = self.runner.new_state(size)
        logits = self.runner.prefill(state, [0])
        logits = torch.stack([logits, self.runner.decode_step(state, int(torch.argmax(logits)))])
        if not bool(torch.isfinite(logits).all()):
            raise EngineFailure("start-up probe: prefill/decode produced non-finite logits")
        return f"probe passed: prefill + one decode step on {self.runner.device}, logits finite"

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
            "expert_mode": "streamed" if r.cache else "resident",
            "expert_quota": r.cache.quotas if r.cache else None,
            "kernels": r.kernel_summary(),
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
        for layer in self.runner.args.moe_layers:
            st = cache.layer_stats(layer) if cache else None
            layers[layer] = {
                "hits": st.hits if st else 0,
                "misses": st.misses if st else 0,
                "evictions": st.evictions if st else 0,
                "bytes_read": st.bytes_read if st else 0,
            }
        return {
            "experts": "streamed" if cache else "resident",
            "layers": layers,
            "fallbacks": self.runner.fallback_counts(),
            "decode_steps": self.runner.decode_counts(),
            "read_faults": cache.read_faults() if cache else {},
            "nonfinite_logits": self.runner.nonfinite_logits,
            "resident_memory_bytes": resident,
            "peak_memory_bytes": peak_memory(self.runner.device),
        }


@dataclass(eq=False)
class Job:
    request: Request  # checked before it was queued
    deliver: Callable[[Any], None]  # thread-safe: hands one Event, or a JobFailed, to the handler
    cancelled: bool = False


@dataclass
class JobFailed:
    status: int
    message: str


class QueueFull(Exception):
    pass


@dataclass
class Counters:
    """Written only by the engine thread; the loop reads them for /metrics."""

    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    last_prefill_tps: float = 0.0
    last_decode_tps: float = 0.0


@dataclass
class WorkerHooks:
    """How the engine thread reports to the daemon; each is called from the engine thread."""

    status: Callable[[str], None]
    ready: Callable[[Engine, str, dict[str, Any]], None]  # (engine, probe line, engine.describe())
    fatal: Callable[[BaseException, bool], None]  # (exception, during_load)
    ping: Callable[[], None] = lambda: None  # watchdog
    ping_every: float = 1.0


class EngineWorker:
    def __init__(self, load: Callable[[Callable[[str], None]], Engine], capacity: int, hooks: WorkerHooks):
        self.load = load
        self.capacity = capacity
        self.hooks = hooks
        self.counters = Counters()
        self.dropped = 0  # jobs cancelled while still queued (the loop's count; the engine never saw them)
        self.running: Job | None = None
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.thread = threading.Thread(target=self._main, name="edgerun-engine", daemon=True)

    # ---- the loop's side ------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return len(self._queue)

    def submit(self, job: Job) -> None:
        with self._cond:
            if len(self._queue) >= self.capacity:
                raise QueueFull(f"{len(self._queue)} requests are waiting (queue size {self.capacity})")
            self._queue.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self.dropped += 1

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # ---- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            engine = self.load(self.hooks.status)
            self.hooks.status("running start-up probes")
            probe = engine.probe()
            info = engine.describe()
        except BaseException as exc:
            self.hooks.fatal(exc, True)
            return
        self.hooks.ready(engine, probe, info)
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    self._cond.wait(self.hooks.ping_every)
                if self._stopping:
                    return
                job = self._queue.popleft() if self._queue else None
            self.hooks.ping()
            if job is None:
                continue
            if job.cancelled:  # cancelled between leaving the queue and here
                self.counters.cancelled += 1
                continue
            try:
                self._run(engine, job)
            except BaseException as exc:
                job.deliver(JobFailed(500, f"engine failed: {type(exc).__name__}: {exc}"))
                self.hooks.fatal(exc, False)
                return

    def _run(self, engine: Engine, job: Job) -> None:
        from edgerun.engine.sampler import SamplingError

        c = self.counters
        c.requests += 1
        c.prompt_tokens += len(job.request.prompt_ids)
        self.running = job
        events = None
        try:
            events = engine.generate(job.request)
            finished = False
            tokens = 0
            for event in events:
                if event.token_id is not None:
                    tokens += 1
                    c.generated_tokens += 1
                if event.text or event.token_id is not None or event.finish_reason is not None:
                    job.deliver(event)  # not a prefill chunk's empty event
                self.hooks.ping()
                if event.finish_reason is not None:
                    finished = True
                    if event.stats is not None:
                        s = event.stats
                        c.generated_tokens += s.generated_tokens - tokens  # EOS, as usage counts it
                        c.prefill_s += s.prefill_s
                        c.decode_s += s.decode_s
                        c.last_prefill_tps, c.last_decode_tps = s.prefill_tps, s.decode_tps
                if job.cancelled and not finished:
                    c.cancelled += 1
                    break
            if not finished and not job.cancelled:
                raise RuntimeError("the engine ended a request without a finish reason")
        except SamplingError as exc:
            c.failed += 1
            job.deliver(JobFailed(400, str(exc)))
        except Exception as exc:
            if is_fatal(exc):
                raise
            c.failed += 1
            log.exception("request failed in the engine")
            job.deliver(JobFailed(500, f"engine error: {type(exc).__name__}: {exc}"))
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # a generator: stops its generation
            self.running = None
