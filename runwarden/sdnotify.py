"""systemd's notify protocol, by hand: one datagram per message on $NOTIFY_SOCKET.

Both daemons use it: the node agent (nodeagent/daemon/agent.py) and `controller run` (controller/live/main.py).
A path starting with "@" is an abstract socket. Without $NOTIFY_SOCKET (not under systemd) every
call is a no-op. Errors are swallowed and logged once: the watchdog must never crash a daemon.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        addr = os.environ.get("NOTIFY_SOCKET", "") if address is None else address
        self._address = "\0" + addr[1:] if addr.startswith("@") else addr
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, message: str) -> bool:
        if not self._address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), self._address)
            return True
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify to %r failed: %s", self._address, exc)
                self._warned = True
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for `seconds` more before its start/stop timeout kills the agent (a drain
        after SIGTERM outlasts a short TimeoutStopSec); systemd < 236 ignores it."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1e6))}")


def watchdog_interval_s(environ: dict[str, str] | None = None) -> float | None:
    """Half of systemd's WatchdogSec (from $WATCHDOG_USEC), or None when no watchdog is set."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6 / 2
