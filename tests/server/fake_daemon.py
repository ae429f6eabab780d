"""The real daemon around a scripted engine, for the faults a real model will not produce on cue.

The first prompt token picks the behaviour: RAISE fails the request, FATAL kills the engine,
SLOW emits a token every 50 ms, HANG blocks the engine for 4 s inside one step (a stuck device
call); anything else counts up quickly. With ``--tokenize-s S`` it has a tokenizer that takes S
seconds per prompt (a long prompt). Run as a script:
``python tests/server/fake_daemon.py --socket PATH [--load-delay S] [--queue-size N] ...``
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgerun.engine.request import Limits  # noqa: E402
from edgerun.errors import EdgerunError  # noqa: E402
from edgerun.server import daemon  # noqa: E402
from edgerun.server.engine_worker import EngineFailure  # noqa: E402
from edgerun.server.options import ServeOptions  # noqa: E402

RAISE, FATAL, SLOW, HANG = 90, 91, 92, 93
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", type=Path, default=None)
    p.add_argument("--load-delay", type=float, default=0.0)
    p.add_argument("--load-error", default=None)
    p.add_argument("--queue-size", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--grace-period", type=float, default=5.0)
    p.add_argument("--header-timeout", type=float, default=None)
    p.add_argument("--tokenize-s", type=float, default=None)
    ns = p.parse_args()
    opts = ServeOptions(
        socket=ns.socket,
        queue_size=ns.queue_size,
        request_timeout=ns.request_timeout,
        grace_period=ns.grace_period,
        **({"header_timeout": ns.header_timeout} if ns.header_timeout else {}),
    )

    def load(status):
        status("loading the fake engine")
        time.sleep(ns.load_delay)
        if ns.load_error:
            raise RuntimeError(ns.load_error)
        import edgerun.engine.sampler  # noqa: F401  (torch, as a real engine imports it while loading)

        engine = FakeEngine()
        if ns.tokenize_s is not None:
            engine.tokenizer = SlowTokenizer(ns.tokenize_s)
        return engine

    try:
        daemon.hard_exit(daemon.run(opts, load))
    except EdgerunError as exc:  # as edgerun's CLI answers a user error
        print(f"fake daemon: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
