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

A fleet that scales to zero (:class:`routerd.elastic.Elastic`) is woken by the first request that finds
it without a ready instance; that request and those after it wait here as above — HTTP ones for the
waiting room, then 503 with a ``Retry-After`` of the expected start-up left, queue jobs until ready or
their deadline — and the queue path reads jobs for it as if one instance were coming
(:meth:`Admission.intake_limit`), since its jobs are what wakes it.

With tenants, each tenant's work in a fleet waits in a line of its own, ordered as above; when a
slot frees, :func:`routerd.tenants.fairshare.pick` chooses whose line is served: weighted fair share
of the slots between the tenants that wait, work-conserving (the proof is in that module). A tenant
at its ``max_concurrent`` waits, and each may fill only its weight's part of ``max_queued`` with HTTP
waiters, so a flood from one cannot refuse another. With tenants a fleet admits about what its
engines run at once (``engine_queue_per_instance``, 0 by default): a request admitted beyond that
would wait in the engine's own first-come queue, where no share or priority applies. Without tenants
there is one line, and each step is the single-line case of the same code.

Several routerd processes sharing one Redis (workers, replicas: :mod:`routerd.peers`) share each fleet's
bounds rather than multiply them: a process may hold its part of the fleet's slots (``ceil(limit /
processes)``), or more while the others leave slots unused — the fleet's limit less what they have in
flight on its instances (``Instance.inflight_elsewhere``, published every 0.1 s; the limit is recomputed
at least every second) — and its part of ``max_queued`` waiters (``ceil(max_queued / processes)``,
likewise each tenant's part of it). The borrowing can overshoot the fleet's limit for as long as the
others' figures lag — when idle processes get busy at once, by at most ``limit × (1 - 1/processes)``
until the borrowed requests end — and never by more. Fair share between tenants is each process's own:
with each tenant's requests spread over the processes (a load balancer in front), each process serves
them in their weights' ratio and so does the fleet; a tenant that reaches only one process gets at most
that process's part of the fleet.

Time comes from the injected ``clock``; :meth:`sweep` applies deadlines and the waiting room by that
clock (``run`` calls it; tests call it after moving a fake clock).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import suppress
from typing import TYPE_CHECKING

from ..config import AdmissionConfig
from ..errors import NoReadyInstance, Overloaded, RouterdError
from ..registry import InstanceState, Registry
from ..tenants.fairshare import Line, Share, pick, victim
from .slots import FleetSlots, Source, Waiter

if TYPE_CHECKING:
    from ..elastic import Elastic

__all__ = ["Admission", "Source"]


class _Ticket:
    """``async with admission.ticket(...)``: a slot from entry to exit (a plain class rather than an
    ``asynccontextmanager``: this is on every request's path)."""

    __slots__ = ("_adm", "_args", "_fleet", "_held", "_line", "_preempt")

    def __init__(self, adm: Admission, fleet: str, priority: int, deadline: float | None, source: Source,
                 tenant: str, preempt: Callable[[], bool] | None) -> None:
        self._adm, self._fleet, self._preempt = adm, fleet, preempt
        self._args = (priority, deadline, source, tenant)
        self._line: Line[Waiter] | None = None
        self._held = 0

    async def __aenter__(self) -> None:
        self._line = line = await self._adm._acquire(self._fleet, *self._args)
        if self._preempt is not None:
            self._held = next(self._adm._served)
            line.preemptible[self._held] = self._preempt

    async def __aexit__(self, *exc: object) -> None:
        assert self._line is not None
        if self._held:
            self._line.preemptible.pop(self._held, None)
        self._adm._release(self._fleet, self._line)


_DEFAULT_SHARE = Share()
_SLICE_S = 1.0  # run() applies the clock (deadlines, the waiting room) at least twice per this
_LIMIT_TTL_S = 1.0  # capacities come from scrapes, which do not change the registry's version


class Admission:
    """Per-fleet bounded priority admission. Use :meth:`ticket` around one request's whole life."""

    def __init__(self, registry: Registry, cfg: AdmissionConfig,
                 clock: Callable[[], float] = time.monotonic, *, elastic: Elastic | None = None,
                 shares: Mapping[str, Share] | None = None) -> None:
        """``elastic`` starts fleets scaled to zero on demand (None: every fleet is fixed); ``shares``:
        the ``[[tenants]]``' weights and concurrency bounds (None: no tenants are configured)."""
        self._registry = registry
        self._clock = clock
        self._elastic = elastic
        self._fleets: dict[str, FleetSlots] = {}
        self._seq = itertools.count()
        self._served = itertools.count(1)
        self._freed = asyncio.Event()
        self._tenant_active: dict[str, int] = {}  # tenant → slots held, all fleets (max_concurrent)
        self.update_config(cfg, shares)

    def update_config(self, cfg: AdmissionConfig, shares: Mapping[str, Share] | None = None) -> None:
        """Bounds and tenants' shares (start-up and reload), applied together; unknown names weigh 1."""
        self._cfg = cfg
        self._shares: dict[str, Share] = dict(shares or {})
        self._tenants_configured = configured = shares is not None
        q_in_engine = cfg.engine_queue_per_instance
        self._engine_queue: int | None = (q_in_engine if q_in_engine is not None
                                          else (0 if configured else None))
        self._preempting = configured and cfg.preempt_queue_jobs
        total = sum(s.weight for s in self._shares.values()) or 1.0
        # tenant → HTTP waiters it may have per fleet
        self._http_parts = {name: max(1, int(cfg.max_queued * s.weight / total))
                            for name, s in self._shares.items()} if len(self._shares) > 1 else {}
        for q in self._fleets.values():
            for name, line in q.lines.items():
                line.weight = self._share(name).weight
        self.dispatch_all()

    @property
    def tenants_configured(self) -> bool:
        """Whether ``[[tenants]]`` are configured (fair share between them applies)."""
        return self._tenants_configured

    def _share(self, tenant: str) -> Share:
        return self._shares.get(tenant) or _DEFAULT_SHARE

    # limits ------------------------------------------------------------------------------------
    def limit(self, fleet: str) -> int:
        """Slots of ``fleet``: per ready instance ``max_inflight_per_instance``, or its capacity plus
        ``engine_queue_per_instance`` when that is lower."""
        per_instance = self._cfg.max_inflight_per_instance
        extra = self._engine_queue
        if extra is None:
            return self._part(fleet, self._registry.ready_count(fleet) * per_instance)
        return self._part(fleet, sum(min(per_instance, inst.capacity + extra)
                                     for inst in self._registry.instances(fleet)
                                     if inst.state is InstanceState.READY))

    def _part(self, fleet: str, limit: int) -> int:
        """This process's slots of a fleet of ``limit``: all of them alone; with other processes its
        part, or what they leave unused when that is more (the module docstring)."""
        processes = self._registry.processes
        if processes <= 1 or limit <= 0:
            return limit
        elsewhere = sum(inst.inflight_elsewhere for inst in self._registry.instances(fleet))
        return min(limit, max(-(-limit // processes), limit - elsewhere))

    def _room(self, bound: int) -> int:
        """This process's part of a waiting-room bound shared by every process."""
        processes = self._registry.processes
        return bound if processes <= 1 else -(-bound // processes)

    def _slots(self, fleet: str, q: FleetSlots, now: float) -> int:
        """:meth:`limit` for the request path: recomputed when the registry changed (an instance came,
        went or changed state) and at least every ``_LIMIT_TTL_S`` (a scrape revealed a capacity)."""
        version = self._registry.version
        if q.version != version or now >= q.fresh_until:
            q.ready = self._registry.ready_count(fleet)
            q.limit = self.limit(fleet)
            q.version, q.fresh_until = version, now + _LIMIT_TTL_S
        return q.limit

    def intake_limit(self, fleet: str) -> int:
        """What the queue path may read for ``fleet``: its limit, or one instance's worth while it has
        no ready instance but starts one on demand (its jobs wait here and wake it)."""
        limit = self.limit(fleet)
        if limit == 0 and self._elastic is not None and self._elastic.standby(fleet):
            return self._cfg.max_inflight_per_instance
        return limit

    def intake(self, fleet: str) -> tuple[int, int]:
        """The queue path's read for ``fleet``: its :meth:`intake_limit` and the slots of it a new
        request could take now without waiting (the limit computed once for both)."""
        limit = self.intake_limit(fleet)
        q = self._fleets.get(fleet)
        taken = (q.active + q.queued_http + q.queued_queue) if q else 0
        return limit, max(0, limit - taken)

    def free_slots(self, fleet: str) -> int:
        """Slots a new request could take now without waiting (the queue path pulls this many)."""
        return self.intake(fleet)[1]

    def stats(self, fleet: str) -> dict[str, int]:
        return (self._fleets.get(fleet) or FleetSlots()).stats(self.limit(fleet))

    def tenant_stats(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        """``(tenant, fleet, {active, queued, admitted_total, slot_seconds})`` for every line."""
        now = self._clock()
        for fleet, q in self._fleets.items():
            for name, figures in q.tenant_stats(now):
                yield name, fleet, figures

    async def wait_freed(self, timeout: float) -> None:
        """Wait until some slot is released (or the registry changes); the queue consumer's pacing."""
        # asyncio.timeout rather than wait_for: on 3.11 wait_for can lose a cancellation that arrives
        # just as the awaited thing completes (the daemon could then never stop this loop).
        with suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._freed.wait()

    # the ticket --------------------------------------------------------------------------------
    def ticket(self, fleet: str, *, priority: int = 0, deadline: float | None = None,
               source: Source = "http", tenant: str = "default",
               preempt: Callable[[], bool] | None = None) -> _Ticket:
        """Hold one dispatch slot of ``fleet`` for ``tenant`` for the body of the ``async with``.

        ``deadline`` is on this admission's clock (monotonic seconds). Raises :class:`Overloaded`,
        :class:`NoReadyInstance` or :class:`DeadlineExceeded` instead of admitting. ``preempt``: the
        slot may be taken back for a tenant below its share — admission calls it to abort the work
        (it returns False when too late), and the slot is free once the body has left.
        """
        return _Ticket(self, fleet, priority, deadline, source, tenant, preempt)

    def _key(self, priority: int, deadline: float | None, now: float) -> tuple[float, float, int]:
        aged = priority - math.floor(now / self._cfg.aging_s)
        return (-aged, deadline if deadline is not None else math.inf, next(self._seq))

    async def _acquire(self, fleet: str, priority: int, deadline: float | None, source: Source,
                       tenant: str) -> Line[Waiter]:
        q = self._fleets.get(fleet) or self._fleets.setdefault(fleet, FleetSlots())
        now = self._clock()
        if deadline is not None and deadline <= now:
            raise q.expired()
        self._note_readiness(fleet, q, now)
        if q.unready_since is not None and self._elastic is not None:
            self._elastic.wake(fleet)  # a fleet scaled to zero starts an instance now
        line = q.lines.get(tenant)
        if line is None:
            line = q.lines[tenant] = Line(tenant, self._share(tenant).weight, now)
        if not q.waiting and q.active < q.limit and not self._capped(tenant):
            self._grant(q, line, now)
            return line
        if source == "http":
            self._check_room(fleet, q, line)
        waiter = Waiter(key=self._key(priority, deadline, now),
                         future=asyncio.get_running_loop().create_future(), source=source,
                         enqueued=now, deadline=deadline)
        if line.top() is None:
            line.join(q.waiting.values(), now, q.credit(line))
            q.waiting[tenant] = line
        heapq.heappush(line.heap, waiter)
        self._registry.queued[fleet] = q.count(line, source, +1)  # the autoscaler's demand
        if q.active < q.limit:  # slots may be free while other tenants wait at their max_concurrent
            self._dispatch(fleet, q)
        elif self._preempting:
            self._preempt_for(q, line, now, q.credit(line) / 2 if source == "http" else None)
        timer = self._timer(fleet, q, waiter, now)
        try:
            await waiter.future  # its result, or what sweep decided (deadline, no ready instance)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self._release(fleet, line)  # admitted, then the caller went away: give the slot back
            waiter.future.cancel()
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._registry.queued[fleet] = q.count(line, source, -1)
            if q.waiting and q.active < q.limit:
                self._dispatch(fleet, q)
        return line

    def _check_room(self, fleet: str, q: FleetSlots, line: Line[Waiter]) -> None:
        """An HTTP request may wait if the fleet's waiting room, and its tenant's part of it, have room."""
        if q.queued_http < self._room(self._cfg.max_queued) \
                and line.queued_http < self._room(self._http_parts.get(line.tenant, self._cfg.max_queued)):
            return
        q.rejected_total += 1
        if q.unready_since is not None:
            raise self._no_ready(fleet)
        raise Overloaded(f"fleet {fleet!r} is at capacity ({q.active} in flight, "
                         f"{q.queued_http} waiting)", retry_after_s=q.retry_after())

    def _timer(self, fleet: str, q: FleetSlots, w: Waiter, now: float) -> asyncio.TimerHandle | None:
        """A wake-up for this waiter's deadline or waiting room, when it has one; anything else that
        changes (instances leaving, the waiting room starting later) :meth:`run` sees within
        ``_SLICE_S / 2``."""
        until = w.deadline
        if w.source == "http" and q.unready_since is not None:
            room = max(q.unready_since, w.enqueued) + self._cfg.waiting_room_s
            until = room if until is None else min(until, room)
        if until is None:
            return None
        return asyncio.get_running_loop().call_later(max(0.0, until - now) + 0.001, self._sweep_one, fleet)

    def _sweep_one(self, fleet: str) -> None:
        q = self._fleets.get(fleet)
        if q is not None:
            self._sweep_fleet(fleet, q, self._clock())

    def sweep(self) -> None:
        """Fail waiters whose deadline passed, and HTTP waiters past the waiting room, by the clock."""
        now = self._clock()
        for fleet, q in self._fleets.items():
            self._sweep_fleet(fleet, q, now)

    def shed(self, source: Source, error: Callable[[], RouterdError]) -> int:
        """Fail every waiter of ``source`` with ``error()`` (on drain: HTTP waiters are answered 503
        rather than cut off when the listener closes); how many were failed."""
        return sum(q.shed(source, error) for q in self._fleets.values())

    def _sweep_fleet(self, fleet: str, q: FleetSlots, now: float) -> None:
        self._note_readiness(fleet, q, now)
        q.sweep(now, self._cfg.waiting_room_s, lambda: self._no_ready(fleet))

    def _note_readiness(self, fleet: str, q: FleetSlots, now: float) -> None:
        self._slots(fleet, q, now)
        if q.ready == 0:
            if q.unready_since is None:
                q.unready_since = now
        else:
            q.unready_since = None

    def _no_ready(self, fleet: str) -> NoReadyInstance:
        """The waiting room ran out: 503, with the start-up time left as ``Retry-After`` when the fleet
        is starting an instance."""
        eta = self._elastic.wake(fleet) if self._elastic is not None else None
        if eta is None:
            return NoReadyInstance(f"fleet {fleet!r} has no ready instance")
        return NoReadyInstance(f"fleet {fleet!r} is starting an instance (expected ready in {eta:.0f}s)",
                               retry_after_s=max(1.0, eta))

    def _preempt_for(self, q: FleetSlots, line: Line[Waiter], now: float, margin: float | None) -> None:
        """``line`` waits below its share on a full fleet (or, with ``margin``, behind over time): abort
        the most recently started preemptible request of the tenant furthest above its share (its slot
        comes here once its holder left)."""
        while (over := victim(q.lines.values(), line, q.limit, now, margin)) is not None:
            _, abort = over.preemptible.popitem()  # the most recent: the least work lost
            if abort():
                q.preempted_total += 1
                return

    def capped(self, tenant: str) -> bool:
        """Whether ``tenant``'s next request would wait for its ``max_concurrent`` (the queue then sets
        the job aside rather than hold it, once enough of its jobs wait)."""
        return self._capped(tenant)

    def _capped(self, tenant: str) -> bool:
        """Whether ``tenant`` holds its ``max_concurrent`` slots already (all fleets)."""
        cap = self._share(tenant).max_concurrent
        return cap > 0 and self._tenant_active.get(tenant, 0) >= cap

    def _grant(self, q: FleetSlots, line: Line[Waiter], now: float) -> None:
        q.active += 1
        q.admitted_total += 1
        line.take(now, next(self._served))
        self._tenant_active[line.tenant] = self._tenant_active.get(line.tenant, 0) + 1

    def _release(self, fleet: str, line: Line[Waiter]) -> None:
        q = self._fleets[fleet]
        q.active -= 1
        line.give_back(self._clock())
        tenant = line.tenant
        was_capped = self._capped(tenant)
        self._tenant_active[tenant] -= 1
        self._dispatch(fleet, q)
        if was_capped:  # its waiters in other fleets may go now
            for name, other in self._fleets.items():
                if other is not q and tenant in other.waiting:
                    self._dispatch(name, other)
        self._freed.set()
        self._freed = asyncio.Event()

    def _dispatch(self, fleet: str, q: FleetSlots) -> None:
        waiting = q.waiting
        if not waiting:
            return
        now = self._clock()
        limit = self._slots(fleet, q, now)
        while q.active < limit and waiting:
            line = pick(waiting.values(), now, self._capped) if len(waiting) > 1 \
                else next(iter(waiting.values()))
            waiter = line.top() if line is not None else None
            if line is None or waiter is None or self._capped(line.tenant):
                break
            heapq.heappop(line.heap)
            if waiter.deadline is not None and waiter.deadline <= now:  # never takes a slot
                waiter.future.set_exception(q.expired())
            else:
                self._grant(q, line, now)
                waiter.future.set_result(None)
            if line.top() is None:
                del waiting[line.tenant]
        q.prune()

    def dispatch_all(self) -> None:
        now = self._clock()
        for fleet, q in self._fleets.items():
            q.version = -1  # the registry or the config changed: recompute the limit
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
