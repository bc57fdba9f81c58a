"""One daemon per state dir: ``<state_dir>/routerd.lock``, locked (``flock``) before anything in the dir
is touched and held for the daemon's life.

Without it a second ``routerd run`` on the same config took the first one's embedded Redis for a
leftover and stopped it, took fleet control and restarted an engine before it failed to bind the port.
The kernel lets the lock go with the process however it ends (SIGKILL too), so there is nothing stale
to clean up; the file keeps the holder's pid only to say who it is.

The lock is the daemon's alone: its descriptor is close-on-exec and in no ``pass_fds``, so nothing it
starts holds it — not the embedded redis-server, not the Ray head that outlives it, not its workers
(``[daemon] workers``), which share the dir as the daemon's own children and need no lock of their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_FILE = "routerd.lock"
# EX_TEMPFAIL (sysexits.h): the dir is in use now and free once its daemon stops. systemd/routerd.service
# lists it in RestartPreventExitStatus: restarting every few seconds would not free it.
EXIT_LOCKED = 75


class StateDirLocked(Exception):
    """Another routerd holds ``path``; ``pid`` is the one it recorded (None if unreadable)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        self.path, self.pid = path, pid
        holder = f"routerd pid {pid}" if pid else "another routerd"
        super().__init__(f"{path.parent} is in use by {holder} (it holds {path}); each routerd on a host "
                         f"needs its own [daemon] state_dir")


class StateLock:
    """This process's hold on ``state_dir``: :meth:`acquire` (or :class:`StateDirLocked`), :meth:`release`."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            raise StateDirLocked(self.path, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the pid stays in the file: only the lock says the dir is in use


def _holder(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None
