"""The engine thread around a scripted engine whose prefill chunks the test releases one by one:
a cancelled prefill stops between chunks and is counted by phase, the watchdog hook is pinged
after every chunk and not while a chunk is stuck, and each request's timeline (queue, TTFT,
prefill) reaches its timings, the /metrics histograms and its log line."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import pytest
from fake_engine import Event  # runner.Event's shape

from edgerun.engine.request import Limits, Request
from edgerun.server.engine_worker import DECODE, PREFILL, QUEUED, EngineWorker, Histogram, Job, WorkerHooks
from edgerun.server.metrics import Metrics, render

CHUNK, CHUNKS = 4, 10
PROMPT = tuple(range(CHUNK * CHUNKS))


@dataclass
class Params:
    max_tokens: int = 2


@dataclass
class Stats:
    prompt_tokens: int
    generated_tokens: int
    decode_s: float = 0.01
    decode_tps: float = 100.0


class ChunkedEngine:
    """Prefills ``CHUNK`` tokens a chunk, then decodes; each step (chunk or token) waits for the
    test's ``release``."""

    model_id = "chunked"
    tokenizer = None
    limits = Limits(1000, 1000)

    def __init__(self) -> None:
        self.release = threading.Semaphore(0)
        self.steps_started: list[int] = []  # the worker's ping count as each step starts
        self.chunks_run = 0
        self.closed = threading.Event()
        self.pings: list[float] = []

    def _step(self) -> None:
        self.steps_started.append(len(self.pings))
        assert self.release.acquire(timeout=10), "the test never released the step"

    def generate(self, request: Request):
        try:
            for start in range(0, len(request.prompt_ids), CHUNK):
                self._step()
                self.chunks_run += 1
                yield Event("", prefilled=min(start + CHUNK, len(request.prompt_ids)))
            for i in range(request.params.max_tokens):
                self._step()
                yield Event("x", 7 + i)
            yield Event("", None, "length", Stats(len(request.prompt_ids), request.params.max_tokens))
        finally:
            self.closed.set()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.release.release()

    def watch(self, ping) -> None:
        pass  # a step here is one wait: nothing inside it to report

    def probe(self) -> str:
        return "ok"

    def describe(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {}


@pytest.fixture
def worker():
    engine = ChunkedEngine()
    ready, lines = threading.Event(), []
    hooks = WorkerHooks(
        status=lambda msg: None,
        ready=lambda *args: ready.set(),
        fatal=lambda exc, loading: lines.append(f"fatal: {exc}"),
        ping=lambda: engine.pings.append(time.monotonic()),
        ping_every=0.05,
        log=lines.append,
    )
    w = EngineWorker(lambda status: engine, 4, hooks)
    w.thread.start()
    assert ready.wait(10)
    w.engine, w.lines = engine, lines
    yield w
    w.stop()
    w.thread.join(5)


def submit(worker: EngineWorker) -> tuple[Job, list]:
    items: list = []
    job = Job(Request(PROMPT, Params()), items.append, "cmpl-test", arrived=time.monotonic())
    worker.submit(job)
    return job, items


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_cancelled_prefill_stops_between_chunks_and_is_counted(worker):
    engine = worker.engine
    job, items = submit(worker)
    engine.run(1)
    wait_for(lambda: len(engine.steps_started) == 2, "the second chunk did not start")
    worker.cancel(job)  # the client left (or the grace period ended) during the second chunk
    engine.run(CHUNKS)  # the engine may run on, if the worker does not stop it
    assert engine.closed.wait(10), "the generation was not closed"
    wait_for(lambda: not worker.running, "the job did not end")
    assert engine.chunks_run == 2 < CHUNKS  # the chunk under way finished; no other started
    assert items == []  # nothing reached the client: no token, no answer
    c = worker.counters
    assert c.cancelled == {QUEUED: 0, PREFILL: 1, DECODE: 0} and c.prompt_tokens == 2 * CHUNK
    assert c.ttft.snapshot()[2] == 0  # no first token, no TTFT observed
    assert worker.lines == [
        "request cmpl-test: prompt 40 tok; cancelled in prefill after 8 of 40 prompt tokens"
    ]

    text = render(Metrics(), worker, 0, {}, "ready", {})
    assert 'edgerun_requests_cancelled_total{phase="prefill"} 1' in text
    assert 'edgerun_requests_cancelled_total{phase="decode"} 0' in text
    assert f"edgerun_prompt_tokens_total {2 * CHUNK}" in text


def test_a_cancelled_decode_and_a_dropped_queued_job_count_in_their_phases(worker):
    engine = worker.engine
    job, items = submit(worker)
    queued, _ = submit(worker)
    worker.cancel(queued)  # never started
    engine.run(CHUNKS + 1)  # the prefill and the first token
    wait_for(lambda: len(engine.steps_started) == CHUNKS + 2, "the second token did not start")
    worker.cancel(job)
    engine.run(5)
    assert engine.closed.wait(10)
    wait_for(lambda: not worker.running, "the job did not end")
    assert [i.token_id for i in items] == [7, 8]  # the step under way finished; no final item
    assert job.phase == DECODE and worker.counters.cancelled == {QUEUED: 0, PREFILL: 0, DECODE: 1}
    assert worker.counters.prompt_tokens == len(PROMPT) and worker.counters.ttft.snapshot()[2] == 1
    text = render(Metrics(), worker, 0, {}, "ready", {})
    assert 'edgerun_requests_cancelled_total{phase="queued"} 1' in text
    assert worker.lines[-1].endswith("cancelled in decode after 2 tokens")


def test_the_watchdog_is_pinged_after_every_chunk_and_not_while_one_is_stuck(worker):
    engine = worker.engine
    job, items = submit(worker)
    engine.run(3)
    wait_for(lambda: len(engine.steps_started) == 4, "the fourth chunk did not start")
    # the fourth chunk is stuck (not released): the engine thread must not ping meanwhile
    stuck = len(engine.pings)
    time.sleep(0.3)  # six idle-loop ping periods
    assert len(engine.pings) == stuck, "pinged while a prefill chunk was stuck"
    engine.run(CHUNKS + 2)
    wait_for(lambda: any(getattr(i, "finish_reason", None) for i in items), "the job did not finish")
    at = engine.steps_started
    assert len(at) == CHUNKS + 2 and all(b > a for a, b in zip(at, at[1:])), at  # a ping between steps


def test_timings_histograms_and_log_line_of_a_finished_request(worker):
    engine = worker.engine
    job, items = submit(worker)
    for _ in range(CHUNKS):
        time.sleep(0.02)  # the prefill takes at least CHUNKS x 20 ms
        engine.run(1)
    engine.run(2)
    wait_for(lambda: any(getattr(i, "finish_reason", None) for i in items), "the job did not finish")
    final = items[-1]
    t = job.timings(final.stats)
    assert 0 <= t["queue_ms"] < t["ttft_ms"] and t["prompt_ms"] >= CHUNKS * 20 * 0.5
    assert t["ttft_ms"] == pytest.approx(t["queue_ms"] + t["prompt_ms"], abs=0.01)
    assert t["prompt_n"] == len(PROMPT) and t["predicted_n"] == 1 and t["predicted_per_second"] == 100.0
    assert t["prompt_per_second"] == pytest.approx(len(PROMPT) / (t["prompt_ms"] / 1e3), rel=1e-3)
    c = worker.counters
    buckets, total, count = c.ttft.snapshot()
    assert count == 1 and total == pytest.approx(job.ttft_s)
    assert c.prefill.snapshot()[2] == 1 and c.last_prefill_tps == pytest.approx(
        t["prompt_per_second"], rel=1e-3
    )
    wait_for(lambda: worker.lines, "no log line")
    assert re.fullmatch(
        r"request cmpl-test: prompt 40 tok, generated 2 tok \(length\); queue \d+ ms, TTFT \d+ ms, "
        r"prefill [0-9.]+ tok/s \(\d+ ms\), decode 100\.0 tok/s",
        worker.lines[-1],
    ), worker.lines

    text = render(Metrics(), worker, 0, {}, "ready", {})
    assert "# TYPE edgerun_time_to_first_token_seconds histogram" in text
    assert 'edgerun_time_to_first_token_seconds_bucket{le="+Inf"} 1' in text
    assert "edgerun_time_to_first_token_seconds_count 1" in text
    assert "# TYPE edgerun_request_prefill_seconds histogram" in text
    assert "edgerun_request_prefill_seconds_count 1" in text


def test_histogram_buckets_are_cumulative_and_span_10_ms_to_a_minute():
    h = Histogram()
    assert h.bounds[0] == 0.01 and h.bounds[-1] == 60.0 and list(h.bounds) == sorted(h.bounds)
    for v in (0.005, 0.01, 0.2, 100.0):
        h.observe(v)
    buckets, total, count = h.snapshot()
    assert dict(buckets)[0.01] == 2 and dict(buckets)[0.25] == 3 and dict(buckets)[60.0] == 3
    assert buckets[-1] == (float("inf"), 4) and count == 4 and total == pytest.approx(100.215)


def test_the_answer_carries_timings_beside_usage():
    """The OpenAI answer keeps its shape; ``timings`` (llama.cpp's name) is one more field."""
    from edgerun.server.api import _Reply

    job = Job(Request((1, 2, 3), Params()), lambda item: None, "cmpl-x", arrived=10.0)
    job.started, job.first_token = 10.5, 12.5
    reply = _Reply("m", False, False, job)
    reply.add(Event("hi", 5))
    reply.add(Event("", None, "length", Stats(3, 2, decode_s=0.25, decode_tps=4.0)))
    whole = reply.whole()
    assert whole["id"] == "cmpl-x" and whole["usage"]["completion_tokens"] == 2
    assert whole["timings"] == {
        "queue_ms": 500.0,
        "ttft_ms": 2500.0,
        "prompt_n": 3,
        "prompt_ms": 2000.0,
        "prompt_per_second": 1.5,
        "predicted_n": 1,
        "predicted_ms": 250.0,
        "predicted_per_second": 4.0,
    }


def test_the_real_engine_pings_after_every_layer_of_a_prefill_chunk():
    """One chunk may outlast WatchdogSec: RunnerEngine pings as each decoder layer returns, so
    the pings follow the layers' progress (a layer that never returns stops them)."""
    from edgerun.engine.runner import Runner
    from edgerun.engine.sampler import SamplingParams
    from edgerun.server.engine_worker import RunnerEngine

    runner = Runner.load(None, device="cpu", prefill_chunk=64)
    engine = RunnerEngine(runner, None, "demo", None, None)
    pings, before_layer = [], []
    layers = runner.model.model.layers
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: before_layer.append(len(pings)))
    engine.watch(lambda: pings.append(1))
    events = engine.generate(runner.request(list(range(3, 43)), SamplingParams(max_tokens=2)))
    assert next(events).prefilled == 40  # the whole prompt in one chunk
    assert before_layer == list(range(len(layers)))  # a ping as each layer returned, none ahead
    assert len(pings) == len(layers)
    events.close()


class RoundsEngine(ChunkedEngine):
    """Two requests at a time, no step waiting for the test; every event it makes is logged as
    (prompt's first id, what)."""

    model_id = "rounds"
    batch = 2

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[int, str]] = []

    def generate(self, request: Request):
        name = request.prompt_ids[0]
        try:
            for start in range(0, len(request.prompt_ids), CHUNK):
                self.log.append((name, "chunk"))
                yield Event("", prefilled=min(start + CHUNK, len(request.prompt_ids)))
            for i in range(request.params.max_tokens):
                self.log.append((name, "token"))
                yield Event("x", 7 + i)
            yield Event("", None, "length", Stats(len(request.prompt_ids), request.params.max_tokens))
        finally:
            self.log.append((name, "closed"))


def test_requests_run_a_batch_at_a_time_a_long_prompt_interleaved_with_the_others_tokens():
    engine, ready = RoundsEngine(), threading.Event()
    hooks = WorkerHooks(
        status=lambda m: None, ready=lambda *a: ready.set(), fatal=lambda e, l: None, ping_every=0.05
    )
    w = EngineWorker(lambda status: engine, 4, hooks)
    jobs, items = [], {}
    # submitted before the engine loads: the first round takes two, the third waits for a slot
    for name, prompt_len, tokens in ((1, CHUNK, 6), (2, 5 * CHUNK, 2), (3, CHUNK, 1)):
        items[name] = []
        job = Job(
            Request((name,) * prompt_len, Params(tokens)),
            items[name].append,
            f"r{name}",
            arrived=time.monotonic(),
        )
        w.submit(job)
        jobs.append(job)
    w.thread.start()
    try:
        assert ready.wait(10)
        wait_for(
            lambda: all(any(getattr(i, "finish_reason", None) for i in items[n]) for n in items),
            "not all ended",
        )
    finally:
        w.stop()
        w.thread.join(5)
    log = engine.log
    # request 1 decodes while request 2 is still in its prompt: one chunk of 2 per round
    assert log[:8] == [(1, "chunk"), (2, "chunk")] + [(1, "token"), (2, "chunk")] * 3, log
    # request 3 starts only when a slot frees: after request 1 (which ends first) is closed
    assert log.index((3, "chunk")) > log.index((1, "closed")), log
    assert w.counters.queue.snapshot()[2] == 3 and w.counters.inter_token.snapshot()[2] == 5 + 1
    assert not w.running and w.batch == 2


def test_a_storage_fault_that_fails_the_engine_counts_its_running_requests_failed(worker):
    """A fatal fault (the bundle can no longer be read intact) fails every running request with
    the engine: each counts in the failures /metrics shows."""
    from edgerun.errors import StorageError

    engine = worker.engine
    real = engine._step

    def broken():
        real()
        if engine.chunks_run == 1:
            raise StorageError("experts/L00.bin: expert 3's block fails its checksum")

    engine._step = broken
    job, items = submit(worker)
    engine.run(3)
    wait_for(lambda: any(line.startswith("fatal: ") for line in worker.lines), "the engine did not fail")
    assert worker.counters.failed == 1 and any(getattr(i, "status", None) for i in items)
