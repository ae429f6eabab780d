"""sd_notify(3) without libsystemd: one datagram to ``$NOTIFY_SOCKET``; a no-op outside systemd."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None) -> None:
        # "@name" is an abstract-namespace socket: a leading NUL on the wire
        self.address = "\0" + address[1:] if address and address.startswith("@") else address or None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Notifier:
        return cls(env.get("NOTIFY_SOCKET"))

    def notify(self, *assignments: str) -> bool:
        """Send ``READY=1``, ``STATUS=...`` etc. in one datagram; False when not under systemd."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(self.address)
                s.sendall("\n".join(assignments).encode())
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between the pings systemd expects (``WatchdogSec=``), or None when it expects none."""
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6
