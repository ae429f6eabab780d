"""C sources compiled at first use with the system compiler, into a per-user cache.

Shared by the grouped CPU expert kernel (kernels/moe_cpu_grouped.c) and the GIL-free block reader
(edgerun/cache/native_reads.c). A build is keyed by its source, flags, link arguments, the
compiler's version and whatever else the caller names (the CPU, for ``-march=native``), written
to a temporary file and renamed into place, so concurrent builds never see half a library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path


class BuildError(RuntimeError):
    """A C source could not be built or loaded here (no compiler, a compile error)."""


def compiler() -> list[str] | None:
    """The system C compiler as argv (sysconfig's CC, else cc / gcc on PATH), or None."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "")
    for cand in ([cc[0]] if cc else []) + ["cc", "gcc"]:
        path = shutil.which(cand)
        if path:
            return [path] + cc[1:] if cc and cand == cc[0] else [path]
    return None


def machine() -> str:
    """The architecture and, where /proc/cpuinfo says, the CPU's feature flags: a ``-march=native``
    build is for this CPU, so a cache shared with another CPU must not hand it this build."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {flags}"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgerun" / "kernels"


def build(
    source: Path,
    cc: list[str] | None,
    flags: Sequence[str],
    link: Sequence[str] = (),
    key: str = "",
    what: str = "",
) -> ctypes.CDLL:
    """``source`` compiled with ``cc`` (None: no compiler, a BuildError naming ``what``) and
    loaded; reused from ``cache_dir()`` when already built with the same inputs."""
    if cc is None:
        raise BuildError(f"no C compiler found (sysconfig CC, cc, gcc): {what} is built at first use")
    try:
        version = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc[0]} --version failed: {e}") from e
    text = source.read_bytes()
    digest = hashlib.sha256(
        b"\0".join([text, " ".join([*cc, *flags, *link]).encode(), version.encode(), key.encode()])
    ).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{digest}.so"
    if not out.exists():
        try:  # a cache directory that cannot be made (read-only, no inodes, no permission): no build
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        except OSError as e:
            raise BuildError(f"cannot write the build cache {out.parent}: {e.strerror or e}") from e
        os.close(fd)
        try:
            r = subprocess.run(
                [*cc, *flags, str(source), "-o", tmp, *link], capture_output=True, text=True, timeout=300
            )
            if r.returncode:
                raise BuildError(f"{cc[0]} failed on {source.name}: {(r.stderr or r.stdout).strip()[-500:]}")
            os.replace(tmp, out)  # atomic: a concurrent build writes the same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(out))
    except OSError as e:
        raise BuildError(f"loading {out}: {e}") from e
