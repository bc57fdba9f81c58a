"""systemd's notify protocol without a dependency: one datagram per message to ``$NOTIFY_SOCKET``.

``READY=1`` tells systemd (``Type=notify``) that start-up finished, ``WATCHDOG=1`` keeps
``WatchdogSec`` from restarting us, ``RELOADING=1``/``STOPPING=1`` bracket reload and drain, and
``STATUS=`` is the line ``systemctl status`` shows. Outside systemd (no ``$NOTIFY_SOCKET``) every call
is a no-op, so the daemon calls it unconditionally.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    """Sends sd_notify messages; sends never block (a full socket drops the message, as libsystemd does)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if path.startswith("@"):
            self._addr = b"\0" + path[1:].encode()  # abstract namespace
        elif path.startswith("/"):
            self._addr = path
        self._sock: socket.socket | None = None
        if self._addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_interval_s: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            # systemd recommends pinging at half the timeout.
            self.watchdog_interval_s = int(usec) / 1_000_000 / 2

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> bool:
        if self._sock is None or self._addr is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self._addr)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError, OSError):
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload (systemd ≥ 253) match this to the reload it asked for.
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
