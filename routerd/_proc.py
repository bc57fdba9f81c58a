"""The children routerd starts and stops itself (the embedded redis-server, the keying process, the
workers): out of the terminal's reach, and never outliving routerd.

A terminal sends Ctrl-C (SIGINT), Ctrl-\\ (SIGQUIT) and Ctrl-Z (SIGTSTP) to its whole foreground process
group. routerd answers SIGINT with an ordered drain, in which these children are still needed (the
drain acknowledges queue jobs in the embedded Redis) and then stopped in order; so each child runs in a
session of its own, and the signal reaches routerd alone. The other half: a routerd that is SIGKILLed
cannot stop them, so each gets SIGTERM when it dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP})


def die_with_parent() -> None:
    """This process gets SIGTERM when the thread that started it ends (its parent's death, in routerd,
    where children are started from the event loop's thread). Runs in the child: before exec, or first
    thing in a spawned interpreter."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def terminal_signals_blocked() -> Iterator[None]:
    """Around starting a child that cannot be given ``start_new_session`` (a ``multiprocessing`` spawn):
    the child inherits the blocked mask, so a Ctrl-C before it has left the group (:func:`leave_terminal`)
    stays pending instead of interrupting it. The parent misses nothing: a signal sent to the process is
    taken by another thread meanwhile, or delivered here once unblocked (the resource tracker of
    ``multiprocessing`` starts its child the same way)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def leave_terminal(parent_pid: int) -> None:
    """First thing in a child started under :func:`terminal_signals_blocked`: a session of its own, death
    with its parent, and the terminal signals sent to the group meanwhile dropped before they are
    unblocked. A parent already gone by now is not there to stop it: then the child exits at once."""
    os.setsid()
    die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(0)  # orphaned before PR_SET_PDEATHSIG was set: nobody would stop it
    for sig in TERMINAL_SIGNALS:
        handler = signal.signal(sig, signal.SIG_IGN)  # ignoring discards what is pending
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)
