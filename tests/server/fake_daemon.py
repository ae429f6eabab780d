"""The real daemon around a scripted engine (``fake_engine.py``), for the faults a real model will
not produce on cue. With ``--tokenize-s S`` it has a tokenizer that takes S seconds per prompt (a
long prompt); ``--engine-process off`` runs the engine in the daemon's process. Run as a script:
``python tests/server/fake_daemon.py --socket PATH [--load-delay S] [--queue-size N] ...``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fake_engine import FakeLoader  # noqa: E402

from edgerun.errors import EdgerunError  # noqa: E402
from edgerun.server import daemon  # noqa: E402
from edgerun.server.options import ServeOptions  # noqa: E402


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
    p.add_argument("--engine-process", choices=("on", "off"), default="on")
    ns = p.parse_args()
    opts = ServeOptions(
        socket=ns.socket,
        queue_size=ns.queue_size,
        request_timeout=ns.request_timeout,
        grace_period=ns.grace_period,
        engine_process=ns.engine_process == "on",
        **({"header_timeout": ns.header_timeout} if ns.header_timeout else {}),
    )
    try:
        daemon.hard_exit(daemon.run(opts, FakeLoader(ns.load_delay, ns.load_error, ns.tokenize_s)))
    except EdgerunError as exc:  # as edgerun's CLI answers a user error
        print(f"fake daemon: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
