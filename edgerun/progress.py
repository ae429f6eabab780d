"""Progress on long work (convert, ``verify --deep``, loading a model, the benchmarks): a tqdm bar
on stderr, shown only when stderr is a terminal or the user asked (``--progress``), so it never
mixes into output a program reads (JSON on stdout, a log file). tqdm rather than a bar of our own:
it does the rate, the ETA, the terminal width and the redraw throttling, and is a small,
dependency-free, well-kept package. Imports no torch."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def shown(stream: TextIO | None = None, force: bool | None = None) -> bool:
    """Whether a bar is drawn on ``stream`` (default stderr): ``force`` if given, else only on a
    terminal."""
    stream = sys.stderr if stream is None else stream
    if force is not None:
        return force
    return bool(getattr(stream, "isatty", lambda: False)())


def byte_bar(total: int, desc: str, stream: TextIO | None = None, force: bool | None = None) -> tqdm:
    """A bar counting bytes (binary units, rate and ETA); a no-op object when not :func:`shown`."""
    stream = sys.stderr if stream is None else stream
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream,
        disable=not shown(stream, force),
        dynamic_ncols=True,
        leave=False,
        mininterval=0.2,
    )


def add_progress_argument(p) -> None:
    p.add_argument(
        "--progress",
        action="store_true",
        default=None,
        help="draw progress bars on stderr even when it is not a terminal (default: only on a terminal)",
    )
