"""The engine in a process of its own (``ProcessWorker``): a request's greedy tokens through the
child equal those of the engine in this process, and cancelling crosses the boundary (a queued
request leaves the queue, a decoding one stops at its next token), counted in the child's
counters as in one process. The daemon around it (a killed child, an orphaned one, the
watchdog) is tested in test_server_lifecycle.py."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

from fake_engine import SLOW, FakeLoader

from edgerun.engine.request import check_request
from edgerun.engine.sampler import SamplingParams
from edgerun.server.cli import EngineLoader
from edgerun.server.engine_process import ProcessWorker
from edgerun.server.engine_worker import DECODE, QUEUED, EngineWorker, Job, JobFailed, WorkerHooks
from edgerun.server.options import ServeOptions


class Harness:
    """A worker of either kind, its hooks recorded and each job's items in a queue."""

    def __init__(self, worker_cls, load) -> None:
        self.ready = threading.Event()
        self.spec = None
        self.lines: list[str] = []
        self.failures: list[BaseException] = []
        hooks = WorkerHooks(
            status=lambda msg: None,
            ready=self._ready,
            fatal=lambda exc, loading: (self.failures.append(exc), self.ready.set()),
            log=self.lines.append,
        )
        self.worker = worker_cls(load, 4, hooks)

    def _ready(self, engine, probe, info) -> None:
        self.spec = engine
        self.ready.set()

    async def start(self) -> None:
        self.worker.start()
        assert await asyncio.to_thread(self.ready.wait, 60), "the engine did not load"
        assert not self.failures, self.failures

    def submit(self, prompt: list[int], max_tokens: int) -> tuple[Job, queue.Queue]:
        items: queue.Queue = queue.Queue()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        job = Job(check_request(prompt, params, self.spec.limits), items.put, f"job{prompt[0]}")
        self.worker.submit(job)
        return job, items

    async def stop(self) -> None:
        self.worker.stop()
        assert await asyncio.to_thread(self.worker.join, 5.0)


def _take(items: queue.Queue, timeout: float = 30.0):
    item = items.get(timeout=timeout)
    assert not isinstance(item, JobFailed), item
    return item


def _greedy(worker_cls, model) -> list[int]:
    async def run() -> list[int]:
        h = Harness(worker_cls, EngineLoader(ServeOptions(model=model, device="cpu", threads=1)))
        await h.start()
        _, items = h.submit([5, 6, 7, 8, 9], 16)
        ids = []
        while (event := await asyncio.to_thread(_take, items)).finish_reason is None:
            ids.append(event.token_id)
        await h.stop()
        return ids

    return asyncio.run(run())


def test_greedy_tokens_through_the_child_equal_in_process(served_model):
    in_process = _greedy(EngineWorker, served_model)
    assert len(in_process) == 16
    assert _greedy(ProcessWorker, served_model) == in_process


def test_cancel_crosses_the_process_boundary():
    async def run() -> None:
        h = Harness(ProcessWorker, FakeLoader())  # batch 1: a second request waits in the queue
        await h.start()
        decoding, items = h.submit([SLOW], 60)  # a token every 50 ms: 3 s in all
        queued, _ = h.submit([SLOW + 1], 4)
        for _ in range(2):
            await asyncio.to_thread(_take, items)
        assert [j.phase for j in h.worker.running] == [DECODE] and h.worker.depth == 1

        h.worker.cancel(queued)
        assert h.worker.depth == 0
        t0 = time.monotonic()
        h.worker.cancel(decoding)
        while h.worker.running:  # the child's end message, at its next token
            assert time.monotonic() - t0 < 1.0, "the decode went on after its cancel"
            await asyncio.sleep(0.01)
        await h.worker.engine_stats(None)
        c = h.worker.counters
        assert (c.cancelled[DECODE], c.cancelled[QUEUED] + h.worker.dropped) == (1, 1)
        assert c.requests == 1  # the queued one never reached the engine
        assert any("cancelled in decode after" in line for line in h.lines), h.lines
        await h.stop()

    asyncio.run(run())


def test_a_loader_that_cannot_cross_fails_loading_by_name():
    async def run() -> None:
        h = Harness(ProcessWorker, lambda status: None)  # a lambda does not pickle
        h.worker.start()
        assert h.ready.is_set() and len(h.failures) == 1
        assert "serve with --engine-process off" in str(h.failures[0])
        h.worker.stop()
        assert h.worker.join(1.0)

    asyncio.run(run())


def test_the_daemons_process_checks_requests_without_torch():
    """The daemon's process (socket, loop, request checks) never imports torch: the engine's
    process samples. A request's sampling parameters are built and refused there all the same,
    and what the engine's process sends back (events with their stats, a non-finite-logits
    error) unpickles there without torch."""
    import pickle
    import subprocess
    import sys

    from edgerun.engine.runner import Event, GenerationStats
    from edgerun.engine.sampler import NonFiniteLogits
    from edgerun.engine.speculative import SpeculativeStats

    sent = pickle.dumps(
        [
            Event("x", 5, "length", GenerationStats(3, 1, speculative=SpeculativeStats(1))),
            NonFiniteLogits("nan"),
        ]
    )
    code = (
        "import pickle, sys\n"
        "import edgerun.server.daemon, edgerun.server.engine_process\n"
        "event, error = pickle.loads(sys.stdin.buffer.read())\n"
        "assert event.stats.speculative.steps == 1 and 'nan' in str(error), (event, error)\n"
        "from edgerun.server.api import ApiOptions, HTTPError, _sampling\n"
        "params, _ = _sampling({'max_tokens': 5, 'temperature': 0.5, 'top_k': 3}, False, 3, 100, ApiOptions())\n"
        "try:\n"
        "    _sampling({'top_p': 0}, False, 3, 100, ApiOptions())\n"
        "except HTTPError as exc:\n"
        "    refused = exc.status\n"
        "print(params.max_tokens, params.top_k, refused, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=sent, capture_output=True, check=True
    ).stdout.decode()
    assert out.split() == ["5", "3", "400", "False"]
