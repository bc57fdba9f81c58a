"""One admission scheduler per fleet, shared by both ways in (HTTP and the Redis queue).

A fleet may have ``ready instances × max_inflight_per_instance`` requests dispatched at once. Requests
beyond that wait here, ordered by priority (a larger number is served first), then deadline (sooner
first, none last), then arrival — with aging so a low priority is not starved: a waiter's priority
counts one higher for every ``aging_s`` it has waited. Every waiter ages at the same rate, so ordering
by ``priority - floor(enqueued_at / aging_s)`` (fixed at arrival) is the same as ordering by aged
priority at any later moment: the key never changes and a plain heap works. Whole ``aging_s`` periods
keep equal priorities arriving close together ordered by deadline rather than by arrival.

HTTP requests are bounded (``max_queued`` waiting → 429 with Retry-After; a fleet with no ready
instance for ``waiting_room_s`` → 503 for those waiting, at once when the waiting room is full). Queue
jobs are not refused: the consumer reads from Redis only as many as :meth:`Admission.free_slots`
allows, so the backlog stays in Redis. A waiter whose deadline passes is failed with
:class:`DeadlineExceeded` and never takes a slot.

Time comes from the injected ``clock``; :meth:`sweep` applies deadlines and the waiting room by that
clock (``run`` calls it; tests call it after moving a fake clock).
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
from .errors import DeadlineExceeded, NoReadyInstance, Overloaded, RouterdError
from .registry import Registry

Source = Literal["http", "queue"]


@dataclass(order=True)
class _Waiter:
    key: tuple[float, float, int]
    future: asyncio.Future[None] = field(compare=False)
    source: Source = field(compare=False, default="http")
    enqueued: float = field(compare=False, default=0.0)
    deadline: float | None = field(compare=False, default=None)


@dataclass
class _FleetQueue:
    active: int = 0
    heap: list[_Waiter] = field(default_factory=list)
    queued_http: int = 0
    queued_queue: int = 0
    admitted_total: int = 0
    rejected_total: int = 0
    expired_total: int = 0
    unready_since: float | None = None  # when the fleet last lost its last ready instance


_SLICE_S = 1.0  # a waiter re-checks the clock at least this often (instances may vanish meanwhile)


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
        # asyncio.timeout rather than wait_for: on 3.11 wait_for can lose a cancellation that arrives
        # just as the awaited thing completes (the daemon could then never stop this loop).
        with suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._freed.wait()

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

    def _key(self, priority: int, deadline: float | None, now: float) -> tuple[float, float, int]:
        aged = priority - math.floor(now / self._cfg.aging_s)
        return (-aged, deadline if deadline is not None else math.inf, next(self._seq))

    async def _acquire(self, fleet: str, priority: int, deadline: float | None, source: Source) -> None:
        q = self._fleets.setdefault(fleet, _FleetQueue())
        now = self._clock()
        if deadline is not None and deadline <= now:
            q.expired_total += 1
            raise DeadlineExceeded("the job's deadline passed before it could be dispatched")
        self._note_readiness(fleet, q, now)
        if not q.heap and q.active < self.limit(fleet):
            q.active += 1
            q.admitted_total += 1
            return
        if source == "http" and q.queued_http >= self._cfg.max_queued:
            q.rejected_total += 1
            if q.unready_since is not None:
                raise NoReadyInstance(f"fleet {fleet!r} has no ready instance")
            raise Overloaded(f"fleet {fleet!r} is at capacity ({q.active} in flight, "
                             f"{q.queued_http} waiting)", retry_after_s=self._retry_after(q))
        waiter = _Waiter(key=self._key(priority, deadline, now),
                         future=asyncio.get_running_loop().create_future(), source=source,
                         enqueued=now, deadline=deadline)
        heapq.heappush(q.heap, waiter)
        self._count(q, source, +1)
        try:
            while not waiter.future.done():
                try:
                    async with asyncio.timeout(self._slice(q, waiter)):
                        await asyncio.shield(waiter.future)
                except TimeoutError:
                    self._sweep_fleet(fleet, q, self._clock())
            waiter.future.result()  # raises what sweep decided (deadline, no ready instance)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self._release(fleet)  # admitted, then the caller went away: give the slot back
            waiter.future.cancel()
            raise
        finally:
            self._count(q, source, -1)
            self._dispatch(fleet, q)

    def _slice(self, q: _FleetQueue, w: _Waiter) -> float:
        """How long to wait before the clock must be looked at again for this waiter."""
        now = self._clock()
        until = now + _SLICE_S
        if w.deadline is not None:
            until = min(until, w.deadline)
        if w.source == "http" and q.unready_since is not None:
            until = min(until, max(q.unready_since, w.enqueued) + self._cfg.waiting_room_s)
        return max(0.0, until - now)

    def sweep(self) -> None:
        """Fail waiters whose deadline passed, and HTTP waiters past the waiting room, by the clock."""
        now = self._clock()
        for fleet, q in self._fleets.items():
            self._sweep_fleet(fleet, q, now)

    def _sweep_fleet(self, fleet: str, q: _FleetQueue, now: float) -> None:
        self._note_readiness(fleet, q, now)
        for w in q.heap:
            if w.future.done():
                continue
            err: RouterdError | None = None
            if w.deadline is not None and w.deadline <= now:
                q.expired_total += 1
                err = DeadlineExceeded("the job's deadline passed before it could be dispatched")
            elif (w.source == "http" and q.unready_since is not None
                  and now - max(q.unready_since, w.enqueued) >= self._cfg.waiting_room_s):
                q.rejected_total += 1
                err = NoReadyInstance(f"fleet {fleet!r} has no ready instance")
            if err is not None:
                w.future.set_exception(err)
        while q.heap and q.heap[0].future.done():
            heapq.heappop(q.heap)

    def _note_readiness(self, fleet: str, q: _FleetQueue, now: float) -> None:
        if self._registry.ready_count(fleet) == 0:
            if q.unready_since is None:
                q.unready_since = now
        else:
            q.unready_since = None

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
        now = self._clock()
        for fleet, q in self._fleets.items():
            self._note_readiness(fleet, q, now)
            self._dispatch(fleet, q)
        self._freed.set()
        self._freed = asyncio.Event()

    async def run(self) -> None:
        """Admit waiters when instances become ready (the registry changed); apply the clock."""
        version = self._registry.version
        while True:
            version = await self._registry.wait_changed(version, timeout=_SLICE_S / 2)
            self.dispatch_all()
            self.sweep()
