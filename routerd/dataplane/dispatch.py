"""One request's sequence, the same for both ways in: charge its tenant, hold an admission slot, call
the engine (retries and resume are the engine call's), settle the usage, and note what its one log
line says.

The HTTP ingress and the queue differ only in how they read a request into a :class:`Request` and in
where its response goes (a :class:`~routerd.dataplane.sinks.ResponseSink`); everything between is
:meth:`Dispatch.run`. Where they differ in policy, the request says so, not the caller's code path:

* over its tenant's rate limit, a request with waiting ``rooms`` (a queue job) waits until its
  deadline — in its tenant's room while that has space, else it is set aside (:class:`SetAside`, as
  is one that would wait for a slot while its tenant's or its fleet's slot room is full) —
  and its tenant is looked up again when it gets its quota (a reload reaches waiting jobs); any
  other is refused (:class:`RateLimited`, HTTP 429);
* a ``preemptible`` request (a non-streamed queue job: nobody has seen its output) may have its slot
  taken back by admission for a tenant below its share; it then runs again, at most
  ``MAX_PREEMPTIONS`` times, so it is never starved by preemption;
* a ``deadline`` bounds the wait for its quota, for a slot and the whole engine call;
* its ``route`` (:mod:`routerd.surface`) says whether it takes a slot at all (tokenize and
  ``count_tokens`` do not: they are answered while a fleet's slots are full) and whether routing keys
  on its prompt (routes that generate) or places it by load alone (pooling, scoring, tokenizing);
* a route with a hook (:class:`RouteHook`: the Responses API's conversations) has its body prepared
  before it is charged and routed, and its answer observed on its way to the sink.

A refusal made here (rate limit, admission) is counted in ``routerd_requests_total`` here; the engine
call counts every request it was given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from ..errors import PermissionDenied, RouterdError
from ..openai import ChatHead, CompletionHead
from ..plugins import RequestView
from ..routing import RequestViews
from ..surface import Route
from ..telemetry import Telemetry
from ..tenants import RequestFacts, Tenant, inspect
from ..tenants.service import Charge, Tenancy
from ..tracing import Tracing
from .admission import Admission
from .sinks import EngineCall, ForwardResult, ResponseSink
from .slots import Source
from .usage import UsageTap

__all__ = ["MAX_PREEMPTIONS", "Dispatch", "Request", "Rooms", "RouteHook", "SetAside"]

MAX_PREEMPTIONS = 3  # a request's slot is taken back at most this many times, then it runs to its end


@dataclass(slots=True, eq=False)
class Request:
    """One request as a way in read it: what to send where, for whom, how urgent."""

    fleet: str
    endpoint: str
    body: bytes  # the bytes the engine is sent
    head: CompletionHead | ChatHead  # the body's head, decoded once (routing reads it)
    stream: bool
    id: str
    tenant: Tenant
    source: Source
    route: Route  # what the endpoint is (routerd.surface): a slot or not, keyed or not, its stream's shape
    content_type: str = "application/json"  # what the engine is sent (a multipart body's, boundary and all)
    priority: int = 0
    deadline: float | None = None  # epoch seconds: the slot and the whole engine call end by then
    session: str | None = None  # routing's session key; None: the body's ``user``
    rooms: Rooms | None = None  # where it may wait for its quota and a slot; None: refused over its limit
    preemptible: bool = False
    preempted: int = 0  # runs whose slot admission took back (each ran again), set by the dispatch
    context: Any = None  # its route hook's own state, from prepare to observe and finished (RouteHook)
    adapter: str = ""  # the LoRA adapter its model names ("": the fleet's own model): usage per adapter


class Rooms(Protocol):
    """Where a queue job waits (:class:`routerd.ingress.queue.held.Held`): its tenant's room for jobs
    over their rate limit, and for jobs waiting for a slot."""

    def quota(self) -> AbstractContextManager[Callable[[Tenant], bool]]:
        """Around the wait for quota: ``may_wait(tenant)`` says whether it may wait here (else it is
        set aside)."""
        ...

    def slot_room_full(self, *, capped: bool, fleet_free: int) -> bool:
        """Whether to set it aside rather than let it wait for a slot: its tenant is at its
        ``max_concurrent`` (``capped``) with a room's worth of its jobs waiting for a slot already, or
        its fleet has no free slot (``fleet_free``) and a room's worth of the fleet's jobs wait."""
        ...

    def slot(self) -> AbstractContextManager[Callable[[], None]]:
        """Around the wait for a slot: ``granted()`` once the slot is held."""
        ...


class RouteHook(Protocol):
    """What a route may add around the one sequence (the Responses API's stored conversations:
    ``routerd.conversations``), registered in :attr:`Dispatch.hooks` by route path."""

    async def prepare(self, req: Request) -> None:
        """Before the request is charged and routed: it may replace ``req.body`` and ``req.head`` (a
        conversation rehydrated into the input) and ``req.session``, and keep what it needs later in
        ``req.context``; a :class:`RouterdError` refuses it in the route's own error shape. Both ways
        in go through it: a queue job naming the route is prepared as an HTTP request is."""
        ...

    def observe(self, req: Request, sink: ResponseSink) -> ResponseSink:
        """The sink of each run, wrapped to read the answer on its way (to record it)."""
        ...

    async def finished(self, req: Request, result: ForwardResult) -> None:
        """After the engine call returned (``result.ok`` or not); not called for a refusal."""
        ...


class _NoSlot:
    """The admission ticket of a route that takes no engine slot: nothing to wait for."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_SLOT = _NoSlot()


class SetAside(Exception):  # not an error: the request waits elsewhere
    """The request is over its tenant's limit (or at its ``max_concurrent``) and its tenant's room is
    full, or a drain began: it is to wait elsewhere (a queue job: pending in Redis) and come back."""


class _Preempt:
    """Admission's way to take a running request's slot back: while the engine call runs it cancels it
    (closing the connection: the engine aborts the generation), and :meth:`absorbed` tells that
    cancellation from any other (a shutdown arriving as well is not swallowed)."""

    __slots__ = ("_cancelling", "_fired", "_task")

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._fired = False

    def arm(self) -> None:
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling() if self._task is not None else 0

    def disarm(self) -> None:
        self._task = None

    def __call__(self) -> bool:
        if self._task is None or self._fired:
            return False  # not in the engine call (waiting, or storing its result): too late
        self._fired = True
        self._task.cancel()
        return True

    @property
    def fired(self) -> bool:
        return self._fired

    def absorbed(self) -> bool:
        """After a CancelledError: True if it was this preemption alone (it is undone)."""
        task = asyncio.current_task()
        return self._fired and task is not None and task.uncancel() <= self._cancelling


class Dispatch:
    """Both ways in call :meth:`run`; one per data plane."""

    def __init__(self, *, views: RequestViews, admission: Admission, engine: EngineCall, tenancy: Tenancy,
                 telemetry: Telemetry, tracing: Tracing, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._views = views
        self._admission = admission
        self._engine = engine
        self._tenancy = tenancy
        self._telemetry = telemetry
        self._tracing = tracing  # spans of the rate-limit and admission waits, the usage
        self._clock = clock
        self._wall = wall
        self.hooks: dict[str, RouteHook] = {}  # by route path: what a route adds (RouteHook)

    async def run(self, req: Request, sink: Callable[[], ResponseSink],
                  line: dict[str, Any]) -> ForwardResult:
        """Charge, admit and forward ``req``; ``sink()`` gives the sink of each run (a preempted one
        runs again into a fresh one). The fields of the request's log line go into ``line``: who, how
        long it waited for a slot, and (returned or raised) how it ended.

        Raises the :class:`RouterdError` of a refusal (rate limit, admission) or of the engine call;
        the usage is settled however it ends. One coroutine for the whole sequence: this is every
        request's path, and each coroutine more costs it."""
        if self._tenancy.directory.configured:
            line["tenant"] = req.tenant.name
        route = req.route
        hook = self.hooks.get(route.path)
        forwarded = False  # refusals before the engine call are counted here, the rest by upstream
        tracing = self._tracing
        try:
            if hook is not None:
                await hook.prepare(req)
                sink = _observed(hook, req, sink)
            view = await self._view(req)
            facts = inspect(req.body, view)  # the view's estimate: the body is decoded once
            while True:
                forwarded = False
                preempt = _Preempt() if req.preemptible and route.slot and req.preempted < MAX_PREEMPTIONS \
                    else None
                rooms = req.rooms
                if rooms is None:  # RateLimited: 429
                    charge = await tracing.timed("routerd.rate_limit", self._tenancy.charge(
                        req.tenant, req.fleet, facts, req.adapter), req.tenant.limited)
                    priority = req.priority
                else:
                    charge = await tracing.timed("routerd.rate_limit",
                                                 self._wait_for_quota(req, rooms, facts), req.tenant.limited)
                    priority = req.tenant.priority(req.priority)  # the tenant's ceiling (max_priority)
                tap = UsageTap(sink(), headers=charge.grant.headers())
                result: ForwardResult | None = None
                waited = self._clock()
                deadline = None if req.deadline is None else \
                    time.monotonic() + (req.deadline - self._wall())  # admission's clock
                try:
                    async with tracing.waiting("routerd.admission",
                                               self._ticket(req, priority, deadline, preempt)):
                        line["admission_ms"] = round((self._clock() - waited) * 1000, 2)  # queued here
                        forwarded = True
                        call = self._engine.forward(req.fleet, req.endpoint, facts.body, tap,
                                                    stream=req.stream, request_id=req.id, request=view,
                                                    route=route, content_type=req.content_type)
                        # bounded by the deadline and preemptible while it runs, when it is either
                        result = await (call if req.deadline is None and preempt is None
                                        else self._bounded(call, req.deadline, preempt))
                except asyncio.CancelledError:
                    if preempt is None or not preempt.absorbed():
                        raise
                    req.preempted += 1  # taken back for a tenant below its share: it runs again
                    continue
                finally:
                    if preempt is not None and preempt.fired:
                        self._tenancy.withdraw(charge)  # the run that ends it is what counts
                    usage = tap.usage(result.usage if result is not None else None)
                    self._tenancy.settle(charge, usage, status=tap.status,
                                         ok=result is not None and result.ok)
                    if tracing.on:
                        tracing.usage(usage)
                note_outcome(line, result)
                if hook is not None:
                    await hook.finished(req, result)
                return result
        except RouterdError as e:
            line["status"], line["error"] = e.status, e.message
            if "attempts" in e.data:
                line["attempts"] = e.data["attempts"]
            if not forwarded:
                self._telemetry.count_request(req.fleet, "", e.status, route.label)
            raise

    def _ticket(self, req: Request, priority: int, deadline: float | None,
                preempt: _Preempt | None) -> AbstractAsyncContextManager[None]:
        """The admission ticket of one run (a queue job's waited for in its slot room); a route that
        takes no slot has nothing to wait for."""
        if not req.route.slot:
            return _NO_SLOT
        ticket = self._admission.ticket(req.fleet, priority=priority, deadline=deadline, source=req.source,
                                        tenant=req.tenant.name, preempt=preempt)
        return ticket if req.rooms is None else _InRoom(req.rooms.slot(), ticket)

    async def _view(self, req: Request) -> RequestView:
        """What routing sees of ``req``: a generating route keyed on its prompt (the engine's own block
        keys when its fleet publishes them); any other placed by load, its input counted, not keyed."""
        views = self._views
        view = views.build(req.fleet, req.endpoint, req.head, session=req.session, priority=req.priority)
        if req.route.generates:
            return await views.with_engine_keys(view, req.head)
        return msgspec.structs.replace(view, block_keys=()) if view.block_keys else view

    async def _bounded(self, call: Coroutine[Any, Any, ForwardResult], deadline: float | None,
                       preempt: _Preempt | None) -> ForwardResult:
        if preempt is not None:
            preempt.arm()
        try:
            if deadline is None:
                return await call
            async with asyncio.timeout(deadline - self._wall()):
                return await call
        finally:
            if preempt is not None:
                preempt.disarm()

    async def _wait_for_quota(self, req: Request, rooms: Rooms, facts: RequestFacts) -> Charge:
        """A queue job's charge: over its tenant's limit it waits in its tenant's room, until its
        deadline (:class:`DeadlineExceeded`), or is set aside (:class:`SetAside`). Its tenant is the
        current config's when it gets its quota: one a reload took the fleet from is refused
        (:class:`PermissionDenied`), one removed by a reload is the default's."""
        with rooms.quota() as may_wait:
            charge = await self._tenancy.wait_for_quota(req.tenant.name, req.fleet, facts, req.deadline,
                                                        may_wait=may_wait, adapter=req.adapter)
        if charge is None:
            raise SetAside(req.tenant.name)
        req.tenant = tenant = charge.tenant
        try:
            self._tenancy.check_fleet(tenant, req.fleet)  # a reload took the fleet while it waited
        except PermissionDenied:
            self._tenancy.withdraw(charge)
            raise
        if req.route.slot and rooms.slot_room_full(capped=self._admission.capped(tenant.name),
                                fleet_free=self._admission.free_slots(req.fleet)):
            self._tenancy.withdraw(charge)  # a room's worth waits already: it would hold up the others
            raise SetAside(tenant.name)
        return charge


def _observed(hook: RouteHook, req: Request,
              sink: Callable[[], ResponseSink]) -> Callable[[], ResponseSink]:
    return lambda: hook.observe(req, sink())


def note_outcome(line: dict[str, Any], result: ForwardResult) -> None:
    """What the request's log line says of how the engine call ended: where, after how many attempts
    and resumes, how soon (and how long it waited for a LoRA slot first), and why that instance
    (matched blocks, wait and TTFT of the best two)."""
    line["status"], line["instance"], line["attempts"] = result.status, result.instance, result.attempts
    line["ttfb_ms"] = round(result.ttfb_s * 1000, 2)
    if result.slot_wait_s:
        line["slot_wait_ms"] = round(result.slot_wait_s * 1000, 2)
    if result.resumes:
        line["resumes"] = result.resumes
    if result.error:
        line["error"] = result.error
    if result.decision is not None:
        line.update(result.decision.log_fields())


class _InRoom:
    """An admission ticket waited for in a queue job's slot room (``Rooms.slot``): counted there until
    the slot is held. (An HTTP request takes the ticket alone.)"""

    __slots__ = ("_room", "_ticket")

    def __init__(self, room: AbstractContextManager[Callable[[], None]],
                 ticket: AbstractAsyncContextManager[None]) -> None:
        self._room, self._ticket = room, ticket

    async def __aenter__(self) -> None:
        granted = self._room.__enter__()
        try:
            await self._ticket.__aenter__()
        except BaseException:
            self._room.__exit__(None, None, None)
            raise
        granted()

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self._ticket.__aexit__(*exc)
        finally:
            self._room.__exit__(None, None, None)
