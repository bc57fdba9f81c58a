"""One admission scheduler per fleet, shared by both ways in (HTTP and the Redis queue).

A fleet may have ``ready instances × max_inflight_per_instance`` requests dispatched at once. Requests
beyond that wait here, ordered by priority, then deadline, then arrival — with aging so a low priority
is not starved: a waiter's effective priority grows by one every ``aging_s`` seconds. Because every
waiter ages at the same rate, ``priority - enqueued_at / aging_s`` orders them for all time, so a plain
heap works.

HTTP requests are bounded (``max_queued`` → 429 with Retry-After; no ready instance for longer than
``waiting_room_s`` → 503). Queue jobs are not: the consumer reads from Redis only as many as
:meth:`Admission.free_slots` allows, so the backlog stays in Redis.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Literal

from .config import AdmissionConfig
from .errors import DeadlineExceeded, NoReadyInstance, Overloaded
from .registry import Registry

Source = Literal["http", "queue"]


@dataclass(order=True)
class _Waiter:
    key: tuple[float, float, int]
    future: asyncio.Future[None] = field(compare=False)
    source: Source = field(compare=False, default="http")


@dataclass
class _FleetQueue:
    active: int = 0
    heap: list[_Waiter] = field(default_factory=list)
    queued_http: int = 0
    queued_queue: int = 0
    admitted_total: int = 0
    rejected_total: int = 0
    expired_total: int = 0


class Admission:
    """Per-fleet bounded priority admission. Use :meth:`ticket` around one request's whole life."""

    def __init__(self, registry: Registry, cfg: AdmissionConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._cfg = cfg
        self._clock = clock
        self._fleets: dict[str, _FleetQueue] = {}
        self._seq = itertools.count()
        self._freed = asyncio.Event()

    def update_config(self, cfg: AdmissionConfig) -> None:
        self._cfg = cfg
        self.dispatch_all()

    # limits ------------------------------------------------------------------------------------
    def limit(self, fleet: str) -> int:
        return self._registry.ready_count(fleet) * self._cfg.max_inflight_per_instance

    def free_slots(self, fleet: str) -> int:
        """Slots a new request could take now without waiting (the queue path pulls this many)."""
        q = self._fleets.get(fleet)
        active = q.active if q else 0
        waiting = (q.queued_http + q.queued_queue) if q else 0
        return max(0, self.limit(fleet) - active - waiting)

    def stats(self, fleet: str) -> dict[str, int]:
        q = self._fleets.get(fleet) or _FleetQueue()
        return {"active": q.active, "queued_http": q.queued_http, "queued_queue": q.queued_queue,
                "limit": self.limit(fleet), "admitted_total": q.admitted_total,
                "rejected_total": q.rejected_total, "expired_total": q.expired_total}

    async def wait_freed(self, timeout: float) -> None:
        """Wait until some slot is released (or the registry changes); the queue consumer's pacing."""
        event = self._freed
        with suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    # the ticket --------------------------------------------------------------------------------
    @asynccontextmanager
    async def ticket(self, fleet: str, *, priority: int = 0, deadline: float | None = None,
                     source: Source = "http") -> AsyncIterator[None]:
        """Hold one dispatch slot of ``fleet`` for the body of the ``async with``.

        ``deadline`` is on this admission's clock (monotonic seconds). Raises :class:`Overloaded`,
        :class:`NoReadyInstance` or :class:`DeadlineExceeded` instead of admitting.
        """
        await self._acquire(fleet, priority, deadline, source)
        try:
            yield
        finally:
            self._release(fleet)

    async def _acquire(self, fleet: str, priority: int, deadline: float | None, source: Source) -> None:
        q = self._fleets.setdefault(fleet, _FleetQueue())
        now = self._clock()
        if deadline is not None and deadline <= now:
            q.expired_total += 1
            raise DeadlineExceeded("the job's deadline passed before it could be dispatched")
        if not q.heap and q.active < self.limit(fleet):
            q.active += 1
            q.admitted_total += 1
            return
        cfg = self._cfg
        no_ready = self._registry.ready_count(fleet) == 0
        if source == "http" and q.queued_http >= cfg.max_queued and not no_ready:
            q.rejected_total += 1
            raise Overloaded(f"fleet {fleet!r} is at capacity ({q.active} in flight, "
                             f"{q.queued_http} waiting)", retry_after_s=self._retry_after(q))
        wait_until = deadline if deadline is not None else math.inf
        if source == "http" and no_ready:
            wait_until = min(wait_until, now + cfg.waiting_room_s)
        waiter = _Waiter(
            key=(-(priority - now / cfg.aging_s), deadline if deadline is not None else math.inf,
                 next(self._seq)),
            future=asyncio.get_running_loop().create_future(),
            source=source,
        )
        heapq.heappush(q.heap, waiter)
        self._count(q, source, +1)
        try:
            timeout = None if wait_until == math.inf else max(0.0, wait_until - now)
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return  # admitted in the same instant the timer fired: keep the slot
            waiter.future.cancel()
            if deadline is not None and self._clock() >= deadline - 1e-3:
                q.expired_total += 1
                raise DeadlineExceeded("the job's deadline passed before it could be dispatched") from None
            q.rejected_total += 1
            raise NoReadyInstance(f"fleet {fleet!r} has no ready instance") from None
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(fleet)  # admitted, then the caller went away: give the slot back
            waiter.future.cancel()
            raise
        finally:
            self._count(q, source, -1)
            self._dispatch(fleet, q)

    def _retry_after(self, q: _FleetQueue) -> float:
        return max(1.0, min(30.0, q.queued_http / max(q.active, 1)))

    @staticmethod
    def _count(q: _FleetQueue, source: Source, delta: int) -> None:
        if source == "http":
            q.queued_http += delta
        else:
            q.queued_queue += delta

    def _release(self, fleet: str) -> None:
        q = self._fleets[fleet]
        q.active -= 1
        self._dispatch(fleet, q)
        self._freed.set()
        self._freed = asyncio.Event()

    def _dispatch(self, fleet: str, q: _FleetQueue) -> None:
        limit = self.limit(fleet)
        while q.heap and q.active < limit:
            waiter = heapq.heappop(q.heap)
            if waiter.future.done():
                continue
            q.active += 1
            q.admitted_total += 1
            waiter.future.set_result(None)
        while q.heap and q.heap[0].future.done():
            heapq.heappop(q.heap)

    def dispatch_all(self) -> None:
        for fleet, q in self._fleets.items():
            self._dispatch(fleet, q)
        self._freed.set()
        self._freed = asyncio.Event()

    async def run(self) -> None:
        """Admit waiters when instances become ready (the registry changed)."""
        version = self._registry.version
        while True:
            version = await self._registry.wait_changed(version, timeout=1.0)
            self.dispatch_all()
