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

    def __init__(self, environ: Mapping[str, str] | None = None, *, sock: socket.socket | None = None,
                 watchdog_interval_s: float | None = None) -> None:
        """From ``$NOTIFY_SOCKET``/``$WATCHDOG_USEC``, or over ``sock``, a connected datagram socket (a
        worker's pair to its daemon, routerd/workers.py), pinging every ``watchdog_interval_s``."""
        self._addr: str | bytes | None = None
        self._sock: socket.socket | None = None
        self.watchdog_interval_s: float | None = None
        if sock is not None:
            self._sock = sock
            self.watchdog_interval_s = watchdog_interval_s
            return
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        if path.startswith("@"):
            self._addr = b"\0" + path[1:].encode()  # abstract namespace
        elif path.startswith("/"):
            self._addr = path
        if self._addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            # systemd recommends pinging at half the timeout.
            self.watchdog_interval_s = int(usec) / 1_000_000 / 2

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> bool:
        if self._sock is None:
            return False
        data = "\n".join(fields).encode()
        try:
            if self._addr is None:
                self._sock.send(data)
            else:
                self._sock.sendto(data, self._addr)
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
