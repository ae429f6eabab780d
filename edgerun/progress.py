"""Progress on long work (convert, ``verify --deep``, loading a model, the benchmarks): a tqdm bar
on stderr, shown only when stderr is a terminal or the user asked (``--progress``), so it never
mixes into output a program reads (JSON on stdout, a log file). tqdm rather than a bar of our own:
it does the rate, the ETA, the terminal width and the redraw throttling, and is a small,
dependency-free, well-kept package. Imports no torch."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
# whether loading (Runner.load and what it calls) draws bars: None = only on a terminal; set by
# the command for the work it runs (``showing``), so the loaders need no flag of their own
_LOADING: ContextVar[bool | None] = ContextVar("edgerun_loading_progress", default=None)


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


@contextmanager
def showing(force: bool | None) -> Iterator[None]:
    """Within the block, loading bars follow ``force`` (a command's ``--progress``)."""
    token = _LOADING.set(force)
    try:
        yield
    finally:
        _LOADING.reset(token)


def iterate(items: Iterable[T], total: int, desc: str, unit: str) -> Iterable[T]:
    """``items`` with a counting bar on stderr while loading (see :func:`showing`)."""
    return tqdm(
        items,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not shown(sys.stderr, _LOADING.get()),
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
