"""Where the daemon's Unix socket lives, how the client finds it, and binding it safely.

Daemon: ``$RUNTIME_DIRECTORY/edgerun.sock`` under systemd (``RuntimeDirectory=edgerun`` gives
``/run/edgerun``), else ``$XDG_RUNTIME_DIR/edgerun.sock``, else ``/tmp/edgerun-$UID/edgerun.sock``.
The client looks in the same places, then at the system service's ``/run/edgerun/edgerun.sock``.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from edgerun.errors import EdgerunError

log = logging.getLogger(__name__)

SOCKET_NAME = "edgerun.sock"
SYSTEM_SOCKET = Path("/run/edgerun") / SOCKET_NAME
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


def _user_tmp_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"edgerun-{os.getuid()}"


def default_socket_path(env: Mapping[str, str] = os.environ) -> Path:
    """The path the daemon binds when neither --socket nor the config names one."""
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / SOCKET_NAME
    return _user_tmp_dir() / SOCKET_NAME


def find_socket(env: Mapping[str, str] = os.environ) -> Path:
    """The socket a client should talk to: the first candidate that exists."""
    candidates = [default_socket_path(env)]
    if env.get("XDG_RUNTIME_DIR"):
        candidates.append(Path(env["XDG_RUNTIME_DIR"]) / SOCKET_NAME)
    candidates += [_user_tmp_dir() / SOCKET_NAME, SYSTEM_SOCKET]
    for path in candidates:
        if path.exists():
            return path
    tried = ", ".join(dict.fromkeys(str(p) for p in candidates))
    raise EdgerunError(f"no edgerun socket found (tried {tried}); is the daemon running? pass --socket")


def _private_dir(path: Path) -> None:
    """Create the per-user fallback directory 0700, and refuse one somebody else planted in /tmp."""
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise EdgerunError(
            f"{path}: must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); remove it or pass --socket"
        )


def _is_live(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # a full backlog times out, EACCES hides the owner: leave it alone
        return True
    finally:
        probe.close()
    return True


def resolve_group(group: str | int | None) -> int | None:
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise EdgerunError(f"socket group {group!r} does not exist") from None


def bind_unix_socket(
    path: Path, mode: int = 0o660, group: str | int | None = None, backlog: int = 128
) -> socket.socket:
    """Bind and listen on ``path``. A socket file nobody listens on (a dead daemon's) is replaced;
    a live one, or a file that is not a socket, is an error."""
    path = Path(path)
    gid = resolve_group(group)
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise EdgerunError(f"socket path {path} is longer than {_SUN_PATH_MAX} bytes (AF_UNIX limit)")
    if path.parent == _user_tmp_dir():
        _private_dir(path.parent)
    elif not path.parent.is_dir():
        raise EdgerunError(f"socket directory {path.parent} does not exist")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise EdgerunError(f"{path} exists and is not a socket; refusing to replace it")
        if _is_live(path):
            raise EdgerunError(f"{path}: another daemon is already serving on this socket")
        log.warning("%s: replacing a stale socket (no process listens on it)", path)
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, -1, gid)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise EdgerunError(f"cannot listen on {path}: {exc}") from exc
    return sock


def activated_socket(env: Mapping[str, str] = os.environ) -> socket.socket | None:
    """The listening socket systemd passed (``LISTEN_PID``/``LISTEN_FDS``, first fd is 3), if any."""
    if env.get("LISTEN_PID") != str(os.getpid()):
        return None
    count = int(env.get("LISTEN_FDS", "0") or 0)
    if count < 1:
        return None
    if count > 1:
        log.warning("socket activation passed %d fds; serving on the first (fd 3) only", count)
    sock = socket.socket(fileno=3)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise EdgerunError(f"socket activation: fd 3 is {sock.family!r}/{sock.type!r}, not a Unix stream")
    return sock
