"""Small asyncio helpers shared across components: deadlines that never lose a cancellation.

``asyncio.wait_for`` on Python 3.11 swallows a cancellation that arrives after the awaited thing has
finished but before ``wait_for`` resumes (fixed in 3.12, gh-86296): it returns the result instead. A
control loop cancelled that way keeps running, and the TaskGroup that owns it never finishes shutting
down. redis-py 8.1 calls ``asyncio.wait_for`` around every command it sends, so *any* redis.asyncio
call can eat a cancel this way; with a busy queue writer it happened on about one shutdown in three,
and the daemon then never exited (issue 9).

``timeout``/``timeout_at`` are ``asyncio.timeout`` plus a check on leaving the block: a cancellation
of the current task requested while the block ran, that neither reached the block's caller nor was
withdrawn (``uncancel``), is raised there — also when the block ended with another exception. Wrap
every call into such a library in them. ``wait_for`` is the same for one awaitable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


def _cancel_requests() -> int:
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


class Deadline:
    """``async with Deadline(when):`` — ``asyncio.timeout_at(when)`` that never loses a cancel."""

    def __init__(self, when: float | None) -> None:
        self._timeout = asyncio.Timeout(when)
        self._before = 0

    async def __aenter__(self) -> asyncio.Timeout:
        self._before = _cancel_requests()
        return await self._timeout.__aenter__()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._timeout.__aexit__(et, e, tb)  # may turn our own expiry into TimeoutError
        if et is not asyncio.CancelledError and _cancel_requests() > self._before:
            raise asyncio.CancelledError from e  # a library swallowed it (see the module docstring)


def timeout_at(when: float | None) -> Deadline:
    """``asyncio.timeout_at`` that re-raises a cancellation swallowed inside the block."""
    return Deadline(when)


def timeout(delay: float | None) -> Deadline:
    """``asyncio.timeout`` that re-raises a cancellation swallowed inside the block."""
    return Deadline(None if delay is None else asyncio.get_running_loop().time() + delay)


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw`` with a deadline; raises TimeoutError like ``asyncio.wait_for``, never loses a cancel."""
    async with timeout_at(None if timeout is None else asyncio.get_running_loop().time() + timeout):
        return await aw


async def overslept(delay_s: float, clock: Callable[[], float] = time.monotonic) -> float:
    """``asyncio.sleep(delay_s)``; returns how much later than asked it woke (0 if on time).

    A periodic pass that wakes late says this process's own loop was held up that long (a starved
    machine, a long GC pause, SIGSTOP, a frozen cgroup): whatever it should have heard from others
    meanwhile (scrapes, pings) says nothing of them. Its callers count their ages and silences again
    from the end of such a stall rather than judging others by it (issue 20's static rotation, issue
    26's worker watchdog).
    """
    start = clock()
    await asyncio.sleep(delay_s)
    return max(0.0, clock() - start - delay_s)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout: float) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait up to ``timeout`` seconds for them to end; return those still running.

    A task still running then ignored its cancellation (or lost it, as above): nothing will end it,
    and a TaskGroup or ``asyncio.run`` waiting for it waits forever. The caller decides what to do.
    """
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    if not pending:
        return set()
    _, still = await asyncio.wait(pending, timeout=timeout)
    return still


def where(task: asyncio.Task[Any]) -> str:
    """A task's name and the chain of coroutines it is suspended in, innermost last (``get_stack``
    shows only the outermost frame of a suspended coroutine)."""
    steps: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(steps) < 12:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            steps.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return f"{task.get_name()}: " + " > ".join(steps)


class Naps:
    """Sleeps that another task may cut short, by key.

    A watcher that slows down while what it watches is idle (the scraper, the heartbeats) naps with
    :meth:`nap`; whoever sees it busy again — the watcher's own ``run()`` loop, which wakes anyway —
    ends the nap with :meth:`wake`. A plain future and one timer per nap: no task, no exception.
    """

    def __init__(self) -> None:
        self._naps: dict[Hashable, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._naps)

    def napping(self) -> list[Hashable]:
        return list(self._naps)

    async def nap(self, key: Hashable, seconds: float) -> None:
        """Sleep ``seconds``, or until ``wake(key)``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(max(0.0, seconds), _settle, fut)
        self._naps[key] = fut
        try:
            await fut
        finally:
            timer.cancel()
            if self._naps.get(key) is fut:
                del self._naps[key]

    def wake(self, key: Hashable) -> None:
        fut = self._naps.get(key)
        if fut is not None:
            _settle(fut)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
