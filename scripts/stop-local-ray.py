"""Stop routerd's own local Ray head (``make stop``) and everything it started, engines included.

Where the time went (it took 30 s with the default four simulated engines): ``ray start --block``
answers SIGTERM by asking the GCS to drain its node and waiting for the raylet to exit, for up to
``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (30 s) — a drain meant for Ray Serve, and a node holding
detached actors (routerd's engines) never becomes idle, so every stop waited all of it. The raylet, told
SIGTERM itself, shuts down at once: it stops its workers (each engine dies with its actor: parent-death
signal) and exits, which ends the head's wait; the head then stops the rest.

So the raylet and the head get SIGTERM together, and the head's session is waited for until it is
empty. routerd starts the head in a session of its own (``LocalHead.start``), so every process in that
session is the head's: whatever is left after the grace period is SIGKILLed, and nothing is orphaned.
"""

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = 10.0  # the raylet and the head, told SIGTERM, are done in a few seconds
KILL_WAIT_S = 3.0


def stat(pid: int) -> tuple[str, int] | None:
    """(state, session id) of ``pid``, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[3])


def session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := stat(int(entry))) is not None and st[1] == sid and st[0] != "Z":
            out.append(int(entry))
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_empty(sid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else ".routerd/ray/head.json"
    try:
        head = json.loads(Path(path).read_text())
        pid = int(head["pid"])
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{path}: not a head record routerd wrote ({e})", file=sys.stderr)
        return 1
    st = stat(pid)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if st is not None else b""
    if st is None or st[0] == "Z" or b"ray" not in cmdline:
        print(f"the local Ray head (pid {pid}) is not running")
        return 0
    sid = st[1]
    if sid == os.getsid(0) or sid != os.getpgid(pid):
        # Not a session of its own (not started by routerd's LocalHead): stop the head alone.
        signal_all([pid], signal.SIGTERM)
        print(f"sent SIGTERM to the Ray head (pid {pid}); it is not in a session of its own, "
              "so its processes are left to it")
        return 0
    started = time.monotonic()
    raylets = [p for p in session(sid) if comm(p) == "raylet"]
    signal_all([*raylets, pid], signal.SIGTERM)
    left = wait_empty(sid, GRACE_S)
    if left:
        signal_all(left, signal.SIGKILL)
        left = wait_empty(sid, KILL_WAIT_S)
    took = time.monotonic() - started
    if left:
        print(f"the local Ray head's session still has processes after SIGKILL: {left}", file=sys.stderr)
        return 1
    print(f"stopped the local Ray head (pid {pid}), its engines and every process it started "
          f"in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
