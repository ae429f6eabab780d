"""Where the daemon's Unix socket lives, how the client finds it, and binding it safely.

Daemon: ``$RUNTIME_DIRECTORY/edgerun.sock`` under systemd (``RuntimeDirectory=edgerun`` gives
``/run/edgerun``), else ``$XDG_RUNTIME_DIR/edgerun.sock``, else ``/tmp/edgerun-$UID/edgerun.sock``.
The client looks in the private places first (``$RUNTIME_DIRECTORY``, ``$XDG_RUNTIME_DIR``), then
at the system service's ``/run/edgerun/edgerun.sock``, and only then under ``/tmp``, where anyone
can create a directory first. It talks only to a socket that it, root or the service account owns,
in a directory one of them owns, served by a process running as one of them (``SO_PEERCRED``).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import pwd
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from edgerun.errors import DaemonUnavailable, EdgerunError

log = logging.getLogger(__name__)

SOCKET_NAME = "edgerun.sock"
SYSTEM_SOCKET = Path("/run/edgerun") / SOCKET_NAME
SERVICE_USER = "edgerun"  # systemd/edgerun.service's User=
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
LOCK_WAIT_S = 5.0
# connections the kernel queues for accept(): a flood must not fill it before the daemon can close
# its connections (a full queue fails a client's connect at once, with EAGAIN)
BACKLOG = socket.SOMAXCONN


class UntrustedSocket(EdgerunError):
    """A socket that someone other than this user, root or the service account could have put
    there, or that such a process serves: the client sends it nothing."""


def _user_tmp_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"edgerun-{os.getuid()}"


def default_socket_path(env: Mapping[str, str] = os.environ) -> Path:
    """The path the daemon binds when neither --socket nor the config names one."""
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / SOCKET_NAME
    return _user_tmp_dir() / SOCKET_NAME


def find_socket(env: Mapping[str, str] = os.environ, trusted: frozenset[int] | None = None) -> Path:
    """The socket a client should talk to: the first candidate that exists, checked
    (:func:`check_owner`): one that fails the check is an error, never skipped for the next."""
    private = [Path(env[k].split(":")[0]) for k in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR") if env.get(k)]
    candidates = [d / SOCKET_NAME for d in private] + [SYSTEM_SOCKET, _user_tmp_dir() / SOCKET_NAME]
    for path in candidates:
        if os.path.lexists(path):
            check_owner(path, trusted_uids() if trusted is None else trusted)
            return path
    tried = ", ".join(dict.fromkeys(str(p) for p in candidates))
    raise DaemonUnavailable(f"no edgerun socket found (tried {tried}); is the daemon running? pass --socket")


def trusted_uids() -> frozenset[int]:
    """Who may own the socket a client talks to, and run the daemon behind it: root, this user,
    and the system service's account (when it exists)."""
    uids = {0, os.getuid()}
    with contextlib.suppress(KeyError):
        uids.add(pwd.getpwnam(SERVICE_USER).pw_uid)
    return frozenset(uids)


def _trusted_text(trusted: frozenset[int]) -> str:
    return f"this client trusts uids {', '.join(map(str, sorted(trusted)))} (root, you, {SERVICE_USER!r})"


def check_owner(path: Path, trusted: frozenset[int]) -> None:
    """Refuse a socket, or a directory holding it, that an untrusted uid owns (symlinks resolved)."""
    real = Path(os.path.realpath(path))
    for p in (real.parent, real):
        owner = os.stat(p).st_uid
        if owner not in trusted:
            raise UntrustedSocket(
                f"{p} is owned by uid {owner}: {_trusted_text(trusted)}; refusing to send it "
                "anything (remove it, or pass --socket)"
            )


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``; None where the
    platform has none)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]  # pid, uid, gid


def check_peer(sock: socket.socket, path: Path, trusted: frozenset[int]) -> None:
    uid = peer_uid(sock)
    if uid is not None and uid not in trusted:
        raise UntrustedSocket(
            f"{path} is served by a process of uid {uid}: {_trusted_text(trusted)}; refusing to send it anything"
        )


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


@contextlib.contextmanager
def socket_lock(path: Path) -> Iterator[None]:
    """Held (``flock`` on ``PATH.lock`` beside the socket) while a daemon checks, replaces and
    binds its socket path, or removes it: two daemons cannot both find one socket stale."""
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise EdgerunError(f"cannot open the socket's lock file {lock}: {exc.strerror}") from None
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EdgerunError(
                        f"{lock} is still locked after {LOCK_WAIT_S:g} s: another process is "
                        f"binding or removing {path}"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def bind_unix_socket(
    path: Path, mode: int = 0o660, group: str | int | None = None, backlog: int = BACKLOG
) -> socket.socket:
    """Bind and listen on ``path``, under its lock (:func:`socket_lock`). A socket file nobody
    listens on (a dead daemon's) is replaced; a live one, or a file that is not a socket, is an
    error."""
    path = Path(path)
    gid = resolve_group(group)
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise EdgerunError(f"socket path {path} is longer than {_SUN_PATH_MAX} bytes (AF_UNIX limit)")
    if path.parent == _user_tmp_dir():
        _private_dir(path.parent)
    elif not path.parent.is_dir():
        raise EdgerunError(f"socket directory {path.parent} does not exist")
    with socket_lock(path):
        return _bind(path, mode, gid, backlog)


def _bind(path: Path, mode: int, gid: int | None, backlog: int) -> socket.socket:
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
