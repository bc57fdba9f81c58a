"""One job's life: decode and validate, attempts under admission, redelivery with backoff, the result,
or the dead-letter stream.

A failed run (engine died, no instance) is redelivered here with backoff until ``max_deliveries``,
then it goes to the dead-letter stream with its history. Its backoff holds nothing: the job is set
aside (:mod:`.held`) until it is due, and the claim that brings it back (``XCLAIM``) bumps its delivery
count in Redis, so the count survives a crash. A message that cannot be a valid job goes there at
once, with an error result when its ``reply_to`` was readable: decoding and validating are
deterministic, so the same bytes would fail the same way on every delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import redis.asyncio as aioredis

from ... import log
from ...config import Config, FleetConfig
from ...dataplane.dispatch import Dispatch, Request, SetAside
from ...errors import BadRequest, DeadlineExceeded, PermissionDenied, RouterdError, error_type
from ...queue_wire import (
    Attempt,
    InvalidJob,
    Job,
    Result,
    clip,
    decode_job,
    error_result,
    is_json,
    json_encode,
    not_json,
    now_ms,
    salvage,
)
from ...redis_keys import RedisKeys
from ...surface import ROUTES, Body, route_for
from ...tenants.service import Tenancy
from ...tracing import Traced, Tracing
from ..validate import read_body
from .held import Held, Room, Running, fleet_room, tenant_room
from .results import REDIS_DOWN, JobStore
from .sinks import BufferSink, ReplyRefused, StreamSink

_log = log.get("routerd.queue")


class _Retry(Exception):
    """This delivery failed in a way another delivery may not (engine died, no instance)."""

    def __init__(self, error: str, instance: str = "", attempts: int = 0) -> None:
        super().__init__(error)
        self.error, self.instance, self.attempts = error, instance, attempts


class _Dead(Exception):
    """This job cannot succeed on any delivery (say its ``reply_to`` is not a stream): dead-letter it."""

    def __init__(self, reason: str, *, reply_usable: bool = True, code: int = 400) -> None:
        super().__init__(reason)
        self.reason, self.reply_usable, self.code = reason, reply_usable, code


class _SetAside(Exception):
    """Set the job aside (see :mod:`.held`): its tenant is over its rate limit (or at its
    ``max_concurrent``) or its fleet has no free slot, and that room here is full, or a drain began —
    it comes back when there is room, when its deadline passes or when cancelled; or (``room`` None)
    its delivery failed — it comes back at ``deadline``, the end of its backoff, as the next delivery."""

    def __init__(self, room: Room | None, deadline: float | None) -> None:
        super().__init__(room)
        self.room, self.deadline = room, deadline


class _Rooms:
    """:class:`routerd.dataplane.dispatch.Rooms` of one job: its tenant's and its fleet's rooms among
    the held jobs; ``full`` says which one was full when the job was set aside."""

    __slots__ = ("_fleet", "_fleet_size", "_held", "_running", "_size", "_tenant", "full")

    def __init__(self, held: Held, running: Running, tenant: str, size: int, fleet: str,
                 fleet_size: Callable[[str], int]) -> None:
        self._held, self._running, self._tenant, self._size = held, running, tenant, size
        self._fleet, self._fleet_size = fleet, fleet_size
        self.full: Room = tenant_room(tenant)

    def quota(self) -> AbstractContextManager[Callable[[object], bool]]:
        return self._held.quota_room(self._running, self._tenant, self._size)

    def slot_room_full(self, *, capped: bool, fleet_free: int) -> bool:
        if capped and self._held.slot_by[self._tenant] >= self._size:
            self.full = tenant_room(self._tenant)
            return True
        if fleet_free <= 0 and self._held.fleet_room_full(self._fleet, self._fleet_size(self._fleet),
                                                          returned=self._running.returned):
            self.full = fleet_room(self._fleet)
            return True
        return False

    def slot(self) -> AbstractContextManager[Callable[[], None]]:
        return self._held.slot_room(self._tenant, self._fleet)


class JobRunner:
    """Runs held jobs to their one result; ``QueueIngress`` owns the task each :meth:`run` runs in."""

    def __init__(self, cfg: Callable[[], Config], client: Callable[[], aioredis.Redis], store: JobStore,
                 held: Held, keys: RedisKeys, consumer: str, *, dispatch: Dispatch, stats: dict[str, int],
                 rng: random.Random, tenancy: Tenancy, tracing: Tracing,
                 fleet_room_size: Callable[[str], int], serves: Callable[[str], bool] | None = None) -> None:
        """``fleet_room_size(fleet)``: how many of the fleet's jobs may wait here for a slot;
        ``serves(fleet)``: whether the fleet is one of the fleets there are (None: every configured one)."""
        self._cfg = cfg
        self._client = client
        self._store = store
        self._held = held
        self._keys = keys
        self._consumer = consumer
        self._dispatch = dispatch
        self._stats = stats
        self._rng = rng
        self._tenancy = tenancy
        self._tracing = tracing  # a job's span from its read to its acknowledgement
        self._fleet_room_size = fleet_room_size
        self._serves = serves

    async def run(self, running: Running, raw: bytes | None) -> None:
        read_ns = time.time_ns()
        traced: Traced | None = None
        try:
            valid = await self._validated(running, raw)
            if valid is None:
                return
            job, fleet = valid
            traced = self._traced(job, fleet, running, read_ns)
            try:
                await self._deliver(running, job, raw or b"", fleet)
            except _SetAside as e:  # before release (finally): the entry stays this consumer's
                retry = e.room is None  # a retry counts its delivery; a room gives it back
                await self._store.set_aside(running.entry_id, job.id, running.delivery, give_back=not retry)
                self._held.put_aside(running, e.room, e.deadline, delivery=running.delivery + retry)
                self._stats["redelivered" if retry else "set_aside"] += 1
            except asyncio.CancelledError:
                # A producer's cancel (and only that) becomes the job's result; shutdown propagates.
                task = asyncio.current_task()
                if not running.cancel_requested or task is None or task.cancelling() > 1:
                    raise
                task.uncancel()
                self._stats["cancelled"] += 1
                await self._acknowledge(running, job, error_result(
                    job.id, "the job was cancelled", "CancelledError", 499, attempts=running.delivery))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — one job's bug must not end the consumer
            # It stays pending: reclaimed after reclaim_idle_ms, counted, dead-lettered at the limit
            # (checked before decoding, in _validated, so a crash anywhere cannot loop forever).
            _log.exception("queue_job_crashed", entry=running.entry_id, job_id=running.job_id)
            if running.job_id and not running.finishing:
                with contextlib.suppress(*REDIS_DOWN):
                    await self._record_failure(running, running.job_id, f"routerd: {e!r}")
        finally:
            self._held.release(running)
            if traced is not None:
                traced.end()

    def _traced(self, job: Job, fleet: str, running: Running, read_ns: int) -> Traced | None:
        """The job's span, from its read to its acknowledgement, in the producer's trace if it has one."""
        traced = self._tracing.job(job.traceparent, job.tracestate, entry=running.entry_id,
                                   stream=self._cfg().redis.stream, read_ns=read_ns)
        if traced is not None:
            self._tracing.note(**{"routerd.queue.job_id": job.id, "routerd.endpoint": job.endpoint,
                                  "routerd.fleet": fleet, "routerd.tenant": job.tenant,
                                  "routerd.stream": job.stream,
                                  "gen_ai.request.model": str(job.body.get("model", "")),
                                  "gen_ai.operation.name": _operation(job.endpoint)})
        return traced

    async def _validated(self, running: Running, raw: bytes | None) -> tuple[Job, str] | None:
        """The job and its fleet, or None once a message that can never run was dead-lettered."""
        cfg = self._cfg()
        r = cfg.redis
        if running.delivery > r.max_deliveries:  # it crashed routerd on every delivery so far
            job_id, reply_to = salvage(raw or b"")
            await self._dead(running, raw or b"", f"delivered {running.delivery - 1} times without a "
                             f"result (max_deliveries = {r.max_deliveries})", job_id, reply_to, code=502)
            return None
        try:
            if raw is None:
                raise InvalidJob("the stream entry has no `job` field")
            job = decode_job(raw)
        except InvalidJob as e:
            await self._dead(running, raw or b"", e.reason, e.job_id, e.reply_to, code=400)
            return None
        self._held.name(running, job.id)
        problem, code, reply_to = _body_problem(running, job, msgpack=not is_json(raw)), 400, job.reply_to
        model = str(job.body.get("model", ""))
        fleet = cfg.fleet_for_model(model)
        adapter = None
        if fleet is None and (fleet := cfg.fleet_for_adapter(model)) is not None:
            adapter = model  # a LoRA adapter of that fleet, declared in the config
        if fleet is not None and self._serves is not None and not self._serves(fleet.name):
            fleet = None  # only this process's file has it: the controller's fleets are the fleets
        owned = self._keys.reserved(job.reply_to)
        if problem is None and owned is not None:  # a result there would break what routerd keeps in it
            problem, reply_to = f"reply_to {clip(job.reply_to, 100)!r} is routerd's own key: {owned}", ""
        elsewhere = self._keys.elsewhere(job.reply_to)
        if problem is None and elsewhere is not None:  # on a cluster, out of the scripts' reach
            problem, reply_to = f"reply_to {clip(job.reply_to, 100)!r} is {elsewhere}", ""
        if problem is None and fleet is None:
            model = clip(repr(job.body.get("model")), 200)
            problem, code = f"body.model: no fleet serves model {model}", 404
        if problem is None and fleet is not None:
            try:
                self._tenancy.check_fleet(self._tenancy.named(job.tenant), fleet.name, adapter)
            except RouterdError as e:
                problem, code = e.message, e.status
        if problem is not None or fleet is None:
            await self._dead(running, raw, problem or "", job.id, reply_to, code=code)
            return None
        return job, fleet.name

    async def _deliver(self, running: Running, job: Job, raw: bytes, fleet: str) -> None:
        """Run this delivery of the job to its result or dead letter; after a retryable failure raise
        :class:`_SetAside` for its backoff (the next delivery comes back when it is over)."""
        max_deliveries = self._cfg().redis.max_deliveries
        if running.delivery > max_deliveries:
            await self._dead(running, raw, f"delivered {running.delivery - 1} times without a result "
                             f"(max_deliveries = {max_deliveries})", job.id, job.reply_to, code=502)
            return
        try:
            with self._tracing.span("routerd.queue.delivery", {"routerd.queue.delivery": running.delivery}):
                result = await self._attempt(running, job, fleet)
        except _Retry as e:
            await self._record_failure(running, job.id, e.error, e.instance)
            # 0.2 s doubling to 10 s, jittered: from the delivery count, which survives a restart
            backoff = min(0.2 * 2 ** min(running.delivery - 1, 10), 10.0) * (0.5 + self._rng.random())
            deadline = job.deadline_epoch_s(running.entry_id)
            retry_at = time.time() + backoff
            raise _SetAside(None, retry_at if deadline is None else min(retry_at, deadline)) from None
        except _Dead as e:
            await self._dead(running, raw, e.reason, job.id, job.reply_to if e.reply_usable else "",
                             code=e.code)
        else:
            await self._acknowledge(running, job, result)

    async def _attempt(self, running: Running, job: Job, fleet: str) -> Result | None:
        """One delivery of ``job``: the pre-dispatch check, admission, the engine call. None = duplicate.

        The check (already done? cancelled?) comes before admission so that its Redis round trip does
        not hold an engine slot; it also marks the job running.
        """
        deadline = job.deadline_epoch_s(running.entry_id)
        state = await self._store.begin(job.id, running.entry_id, job.reply_to)
        if isinstance(state, str) and state.startswith("refused: "):
            raise _Dead(f"reply_to {clip(job.reply_to, 100)!r} is not a key routerd's Redis user may "
                        f"write ({clip(state.removeprefix('refused: '), 200)})", reply_usable=False)
        if isinstance(state, str):
            raise _Dead(f"reply_to {clip(job.reply_to, 100)!r} holds a {state}, not a stream: it cannot "
                        "take the result", reply_usable=False)
        if state == 1:
            self._stats["duplicates"] += 1
            return None
        if state == 2:
            self._stats["cancelled"] += 1
            return error_result(job.id, "the job was cancelled", "CancelledError", 499)
        self._held.admitted(running)
        # The tenant is looked up again when the job gets its quota (a reload reaches waiting jobs); one
        # removed by a reload: the default's.
        tenant = self._tenancy.tenant(job.tenant) or self._tenancy.directory.default
        route = ROUTES[job.endpoint]  # checked when it was read (_body_problem)
        read = running.head if running.head is not None else read_body(route, running.body)
        # Over its limit it waits, not failing — here while its tenant's room has space (read_batch
        # jobs), else set aside.
        rooms = _Rooms(self._held, running, job.tenant, self._cfg().redis.read_batch, fleet,
                       self._fleet_room_size)
        req = Request(fleet=fleet, endpoint=job.endpoint, body=running.body, head=read.head,
                      stream=read.stream, id=job.id, tenant=tenant, source="queue", route=route,
                      priority=job.priority, deadline=deadline, session=job.session or read.session,
                      rooms=rooms, preemptible=not read.stream, preempted=running.preempted,
                      adapter=_adapter(self._cfg().fleet(fleet), read.head.model))
        try:
            return await self._run(running, job, req, rooms)
        except DeadlineExceeded as e:
            self._stats["expired"] += 1
            return error_result(job.id, e.message, e.type, e.status, attempts=running.delivery - 1)
        except TimeoutError:
            self._stats["expired"] += 1
            return error_result(job.id, "the job's deadline passed while it ran", "DeadlineExceededError",
                                504, attempts=running.delivery)

    async def _run(self, running: Running, job: Job, req: Request, rooms: _Rooms) -> Result:
        """The dispatch (quota, slot, engine call — again when admission takes a non-streamed job's slot
        back), its response into the job's result or reply stream; a failure another delivery may not
        have raises :class:`_Retry`."""
        sinks: list[BufferSink | StreamSink] = []

        def sink() -> BufferSink | StreamSink:  # one per run: a preempted run's output is dropped
            if req.stream:
                sinks.append(StreamSink(self._store, job.id, job.reply_to, running.delivery,
                                        self._on_instance(job.id)))
            else:
                sinks.append(BufferSink(_ignore))  # the result names the instance a moment later anyway
            return sinks[-1]

        line: dict[str, Any] = {}
        started = time.monotonic()
        preempted = req.preempted  # across deliveries: a job is preempted at most MAX_PREEMPTIONS times
        try:
            out = await self._dispatch.run(req, sink, line)
        except SetAside as e:
            raise _SetAside(rooms.full, req.deadline) from e
        except PermissionDenied as e:  # a reload took the fleet from its tenant while it waited
            raise _Dead(e.message, code=403) from None
        except ReplyRefused as e:  # the engine call ended with it: the engine aborts the generation
            reason = f"reply_to {clip(e.reply_to, 100)!r} refused a chunk: {e.error}"
            if e.permanent:
                raise _Dead(reason, reply_usable=False) from None
            raise _Retry(reason) from None
        except DeadlineExceeded:
            raise  # the job's result: expired
        except RouterdError as e:
            if e.retryable or e.status >= 500:
                raise _Retry(f"{e.type}: {e.message}", getattr(e, "instance", "")) from None
            self._log_done(running, job, req.fleet, started, line)
            return error_result(job.id, e.message, e.type, e.status, attempts=running.delivery)
        finally:
            self._stats["preempted"] += req.preempted - preempted
            running.preempted = req.preempted
        last = sinks[-1]
        mid_stream_failure = isinstance(last, StreamSink) and last.status == 200 and (
            last.failed or not out.ok)
        if mid_stream_failure or (not out.ok and (out.status >= 500 or out.status == 0)):
            raise _Retry(out.error or f"upstream status {out.status}", out.instance, out.attempts)
        self._log_done(running, job, req.fleet, started, line)
        return last.result(job.id, out.instance, out.attempts, out.status)

    def _log_done(self, running: Running, job: Job, fleet: str, started: float,
                  line: dict[str, Any]) -> None:
        """The job's line in the log, as the HTTP ingress writes one per request: where it ran, how it
        ended and why that instance (a retried delivery has its failures logged apart)."""
        _log.info("queue_job", job_id=job.id, entry=running.entry_id, delivery=running.delivery,
                  fleet=fleet, endpoint=job.endpoint, stream=job.stream,
                  duration_ms=round((time.monotonic() - started) * 1000, 2), **line)

    def _on_instance(self, job_id: str) -> Callable[[str], None]:
        def note(instance: str) -> None:
            self._store.writer.send("HSET", self._keys.status(job_id), "instance", instance)
        return note

    async def _record_failure(self, running: Running, job_id: str, error: str, instance: str = "") -> None:
        _log.warning("queue_job_attempt_failed", job_id=job_id, entry=running.entry_id,
                     delivery=running.delivery, instance=instance, error=error)
        await self._store.record_failure(job_id, Attempt(
            at_ms=now_ms(), consumer=self._consumer, delivery=running.delivery, instance=instance,
            error=error))

    async def _acknowledge(self, running: Running, job: Job, result: Result | None) -> None:
        """The job's one result stored and its entry acknowledged (``XACK``), in one step."""
        running.finishing = True
        if result is not None and result.status == "error" and self._tracing.on:
            self._tracing.failed(str((result.error or {}).get("message", "error")))
        with self._tracing.span("routerd.queue.finish", {"routerd.queue.result": result.status
                                                          if result is not None else "duplicate"}):
            await self._store.acknowledge(running.entry_id, job.id, job.reply_to, result,
                                          delivery=running.delivery)
        self._stats["done"] += 1

    async def _dead(self, running: Running, raw: bytes, reason: str, job_id: str | None,
                    reply_to: str | None, *, code: int) -> None:
        """Dead-letter the message with its reason and history, and store an error result when its id
        is known (sent to ``reply_to`` too unless that is empty)."""
        running.finishing = True
        _log.warning("queue_job_dead", entry=running.entry_id, job_id=job_id, reason=reason)
        if reply_to and (self._keys.reserved(reply_to) or self._keys.elsewhere(reply_to)) is not None:
            reply_to = ""  # an invalid job's salvaged reply_to is checked here: nothing writes there
        result = None
        if job_id:
            result = error_result(job_id, reason, error_type(code) if code < 500 else "DeadLetterError",
                                  code, attempts=max(running.delivery - 1, 0))
        if self._tracing.on:
            self._tracing.failed(reason, **{"routerd.queue.dead": True})
        with self._tracing.span("routerd.queue.finish", {"routerd.queue.result": "dead"}):
            await self._store.acknowledge(running.entry_id, job_id or "", reply_to or "", result,
                                          delivery=running.delivery, dead_reason=reason, raw=raw)
        self._stats["dead"] += 1


def _body_problem(running: Running, job: Job, *, msgpack: bool) -> str | None:
    """What is wrong with the job's OpenAI body — the HTTP ingress's check, on the JSON bytes the
    engine would be sent (kept in ``running.body``) — or None."""
    try:
        running.body = json_encode(job.body)
    except (TypeError, ValueError, RecursionError) as e:  # msgpack can carry what JSON cannot
        return clip(f"body: cannot be sent as JSON: {e}")
    changed = not_json(job.body) if msgpack else None  # or carry it changed: bytes as base64 text
    if changed is not None:
        return f"{changed} (the engine would not be sent what the job holds)"
    route = route_for(job.endpoint)
    if route is None:
        return clip(f"endpoint: {job.endpoint!r} is not a route routerd serves; a job may name any of: "
                    f"{', '.join(p for p, r in ROUTES.items() if r.body is Body.JSON)}", 600)
    if route.body is not Body.JSON:
        return f"endpoint: {job.endpoint} takes a multipart form (an audio file): send it over HTTP"
    try:
        running.head = read_body(route, running.body)  # kept: each delivery's routing reads it
    except BadRequest as e:
        return clip(f"body.{e.param}: {e.message}" if e.param else f"body: {e.message}")
    return None


def _operation(endpoint: str) -> str:
    """OpenTelemetry's ``gen_ai.operation.name`` of a job's route."""
    if "chat" in endpoint or endpoint.startswith("/v1/messages") or endpoint == "/v1/responses":
        return "chat"
    if endpoint == "/v1/completions":
        return "text_completion"
    return "embeddings" if endpoint == "/v1/embeddings" else endpoint.rsplit("/", 1)[-1]


def _ignore(_: str) -> None:
    pass


def _adapter(fleet: FleetConfig | None, model: str) -> str:
    """The LoRA adapter a job's model names on its fleet ("": the fleet's own model), for its usage."""
    return model if fleet is not None and model != fleet.model else ""
