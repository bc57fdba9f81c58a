"""The backstop of a stop: a timer that ends the process when stopping overruns its bound.

Its own module because it is the one piece of stopping that works outside the event loop's order of
things (it exits from a timer callback, whatever the tasks are doing); the daemon arms it when a drain
begins and again, sooner, on a second TERM/INT.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable

from . import _aio, log

_logger = log.get("routerd.daemon")


class StopDeadline:
    """The hard bound on stopping: once armed, the process exits when it fires, whatever is stuck.

    Every step of the stop is bounded on its own; this is the backstop for what no step can bound
    from inside the event loop: a task that ignores (or lost) its cancellation keeps the TaskGroup,
    and then ``asyncio.run``'s own clean-up, waiting forever. It logs every unfinished task and where
    it waits, then exits 1 — a stop that needed it is a bug to report, not a clean stop.
    """

    def __init__(self, exit_fn: Callable[[int], object] = os._exit) -> None:
        self._exit = exit_fn
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, delay_s: float, reason: str) -> None:
        """Fire ``delay_s`` seconds from now, unless already due sooner."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s
        if self._handle is not None:
            if self._handle.when() <= when:
                return
            self._handle.cancel()
        self._handle = loop.call_at(when, self.fire, reason)

    def fire(self, reason: str) -> None:
        tasks = sorted(_aio.where(t) for t in asyncio.all_tasks() if not t.done())
        _logger.error("stop_forced", reason=reason, unfinished=len(tasks), tasks=tasks[:50])
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream must not stop the exit
                stream.flush()
        self._exit(1)
