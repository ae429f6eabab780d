"""A scripted engine for the fake daemon (``fake_daemon.py``), in a module of its own so that it
pickles to the engine's process by name.

The first prompt token picks the behaviour: RAISE fails the request, FATAL fails the engine, DIE
kills the engine's process (SIGKILL, as the kernel's OOM killer would), SLOW emits a token every
50 ms, HANG blocks the engine for 4 s inside one step (a stuck device call); anything else counts
up quickly.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from edgerun.engine.request import Limits
from edgerun.server.engine_worker import EngineFailure

RAISE, FATAL, SLOW, HANG, DIE = 90, 91, 92, 93, 94
VOCAB, CONTEXT = 97, 64


@dataclass
class Stats:  # what the daemon reads of runner.GenerationStats
    prompt_tokens: int
    generated_tokens: int
    decode_s: float = 0.0
    decode_tps: float = 0.0


@dataclass
class Event:  # runner.Event's shape, without importing torch (so this daemon starts at once)
    text: str
    token_id: int | None = None
    finish_reason: str | None = None
    stats: Stats | None = None
    prefilled: int = 0


class FakeEngine:
    model_id = "fake"
    tokenizer = None
    limits = Limits(VOCAB, CONTEXT)

    def generate(self, request):
        ids, params = request.prompt_ids, request.params
        if ids[0] == RAISE:
            raise RuntimeError("injected engine error reading /srv/edgerun/private/L03.bin")
        if ids[0] == FATAL:
            raise EngineFailure("injected: the device is lost")
        if ids[0] == DIE:
            os.kill(os.getpid(), signal.SIGKILL)
        if ids[0] == HANG:
            time.sleep(4.0)
        for i in range(params.max_tokens):
            if ids[0] == SLOW:
                time.sleep(0.05)
            yield Event("", (ids[-1] + i + 1) % VOCAB)
        yield Event("", None, "length", Stats(len(ids), params.max_tokens))

    def watch(self, ping) -> None:
        pass  # its steps are a sleep: no progress inside them to report

    def probe(self) -> str:
        return "fake probe passed"

    def describe(self) -> dict:
        return {"provenance": "fake engine", "fallbacks": [{"kind": "cpu_reference", "reason": "test"}]}

    def stats(self) -> dict:
        return {
            "experts": "fake",
            "layers": {0: dict(hits=3, misses=1, evictions=0, bytes_read=4096)},
            "fallbacks": {"cpu_reference": 2},
        }


class SlowTokenizer:
    """Token i is the byte i % VOCAB; each prompt takes ``seconds`` (the GIL released)."""

    max_token_bytes = 1
    roles = frozenset({"user"})

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def encode(self, text: str) -> list[int]:
        time.sleep(self.seconds)
        return [b % VOCAB for b in text.encode()]


@dataclass(frozen=True)
class FakeLoader:
    load_delay: float = 0.0
    load_error: str | None = None
    tokenize_s: float | None = None

    def __call__(self, status) -> FakeEngine:
        status("loading the fake engine")
        time.sleep(self.load_delay)
        if self.load_error:
            raise RuntimeError(self.load_error)
        import edgerun.engine.sampler  # noqa: F401  (torch, as a real engine imports it while loading)

        engine = FakeEngine()
        if self.tokenize_s is not None:
            engine.tokenizer = SlowTokenizer(self.tokenize_s)
        return engine
