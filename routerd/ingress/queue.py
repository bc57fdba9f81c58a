"""The Redis queue consumer: jobs in from a stream, exactly one result per job id out.

routerd reads ``routerd:requests`` as a member of a consumer group under a stable name, so after a
crash it finds its own unacknowledged jobs again at start; other consumers' jobs are taken over with
``XAUTOCLAIM`` once idle for ``reclaim_idle_ms`` (jobs running here are kept fresh with ``XCLAIM
JUSTID`` so nobody takes them over). Reads follow capacity: a read asks for at most what the fleets'
admission can take now, so the backlog stays in Redis and routerd's memory does not grow with it.

A job is acknowledged only inside the script that stores its result (see ``_queue_store``). A failed
run (engine died, no instance) is redelivered here with backoff — ``XCLAIM`` bumps its delivery count,
so the count survives a crash — until ``max_deliveries``, then it goes to the dead-letter stream with
its history. A message that cannot be a valid job goes there at once, with an error result when its
``reply_to`` was readable. Redis outages pause reading (backoff, reconnect); finished results wait in
the writer and are stored when Redis returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from .. import _aio, log
from .._aio import wait_for
from ..admission import Admission
from ..config import Config
from ..errors import DeadlineExceeded, RouterdError
from ..jobs import (
    Attempt,
    InvalidJob,
    Job,
    Result,
    body_problem,
    clip,
    decode_job,
    error_result,
    json_encode,
    now_ms,
    salvage,
)
from ..keys import Keys
from ..redis_server import redis_client
from ..registry import Registry
from ._queue_sink import BufferSink, Forwarder, ForwardOutcome, ReplyRefused, ResponseSink, StreamSink
from ._queue_store import REDIS_DOWN, JobStore

_log = log.get("routerd.queue")
_HELD_PER_SLOT = 2
__all__ = ["ForwardOutcome", "Forwarder", "QueueIngress", "ResponseSink"]


class _Retry(Exception):
    """This delivery failed in a way another delivery may not (engine died, no instance)."""

    def __init__(self, error: str, instance: str = "", attempts: int = 0) -> None:
        super().__init__(error)
        self.error, self.instance, self.attempts = error, instance, attempts


class _Dead(Exception):
    """This job cannot succeed on any delivery (say its ``reply_to`` is not a stream): dead-letter it."""

    def __init__(self, reason: str, *, reply_usable: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.reply_usable = reason, reply_usable


@dataclass
class _Running:
    entry_id: str
    task: asyncio.Task[None] | None = None
    job_id: str = ""
    delivery: int = 1
    touched: float = 0.0
    cancel_requested: bool = False
    finishing: bool = False
    unadmitted: bool = True  # read, but not yet counted by admission (see QueueIngress._want)
    body: bytes = b""  # the job's body as sent to the engine, encoded once


class QueueIngress:
    """Consumes the request stream; the daemon runs :meth:`run` in its TaskGroup."""

    def __init__(self, cfg: Config, redis_factory: Callable[[], aioredis.Redis],
                 upstream: Forwarder | Callable[[], Forwarder],
                 admission: Admission | Callable[[], Admission], registry: Registry, *,
                 consumer: str | None = None, rng: random.Random | None = None) -> None:
        """``upstream`` and ``admission`` may be given as factories: the daemon builds the data plane
        after Redis, so they are resolved when :meth:`run` starts."""
        self._cfg = cfg
        self._redis_factory = redis_factory
        self._client: aioredis.Redis | None = None
        self._upstream_arg = upstream
        self._admission_arg = admission
        self.registry = registry
        self.consumer = consumer or cfg.redis.consumer or socket.gethostname()
        self.keys = Keys.from_config(cfg.redis)
        self._rng = rng or random.Random()
        self._store = JobStore(self.client, self.keys, self.consumer, lambda: self._cfg.redis,
                               rng=self._rng)
        self._writer = self._store.writer
        self._running: dict[str, _Running] = {}  # by entry id
        self._by_job: dict[str, _Running] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._unadmitted = 0
        self._intake = True
        self._idle = asyncio.Event()
        self._idle.set()
        self._group_ready = False
        self._own_recovered = False
        self._next_reclaim = 0.0
        self._reclaim_cursor = "0-0"
        self.paused = False
        self.stats = {"read": 0, "done": 0, "dead": 0, "redelivered": 0, "reclaimed": 0,
                      "duplicates": 0, "cancelled": 0, "expired": 0}
        # Sampled from Redis by _depth_loop for /metrics: the scrape itself never waits on Redis.
        self.depth: dict[str, int] = {}

    @classmethod
    def from_config(cls, cfg: Config, *, url: str, registry: Registry,
                    upstream_factory: Callable[[], Forwarder],
                    admission_factory: Callable[[], Admission]) -> QueueIngress:
        """The daemon's constructor: a Redis client for ``url`` built from ``[redis]``."""
        return cls(cfg, lambda: redis_client(url, cfg.redis), upstream_factory, admission_factory,
                   registry)

    async def __aenter__(self) -> QueueIngress:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(*REDIS_DOWN):
                await wait_for(client.aclose(), self._cfg.redis.op_timeout_s)

    @property
    def _upstream(self) -> Forwarder:
        arg = self._upstream_arg
        return arg() if callable(arg) else arg

    @property
    def _admission(self) -> Admission:
        arg = self._admission_arg
        return arg if isinstance(arg, Admission) else arg()

    # lifecycle -----------------------------------------------------------------------------------
    def client(self) -> aioredis.Redis:
        if self._client is None:
            self._client = self._redis_factory()
        return self._client

    def update_config(self, cfg: Config) -> None:
        self._cfg = cfg

    def stop_intake(self) -> None:
        """Stop reading and reclaiming; jobs already read run to completion (see :meth:`wait_idle`)."""
        self._intake = False

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is held here; False if some still are after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    @property
    def held(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        """Read, reclaim and listen for cancels until intake stops and the last job is done."""
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [tg.create_task(self._writer.run(), name="queue-writer"),
                           tg.create_task(self._cancel_listener(), name="queue-cancels"),
                           tg.create_task(self._depth_loop(), name="queue-depth")]
                await self._read_loop()
                await self._drain_held()
                await self._writer.command("PING")  # FIFO: every result queued before it is stored
                for t in helpers:
                    t.cancel()
        finally:
            jobs = list(self._tasks)
            for t in jobs:
                t.cancel()
            try:
                if jobs:  # let them unwind (release slots, close engine connections) before Redis goes
                    await asyncio.wait(jobs, timeout=5.0)
            finally:
                if self._client is not None:
                    client, self._client = self._client, None
                    with contextlib.suppress(*REDIS_DOWN):
                        await wait_for(client.aclose(), 2.0)  # closing sockets; the stop is bounded

    async def _drain_held(self) -> None:
        """Wait for the jobs still held, keeping them fresh meanwhile: a drain can outlast
        ``reclaim_idle_ms``, and another consumer must not take over (and run again) a job that
        is still running here."""
        while not self._idle.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._cfg.redis.reclaim_interval_s):
                    await self._idle.wait()
            if not self._idle.is_set():
                with contextlib.suppress(*REDIS_DOWN, redis.exceptions.ResponseError):
                    await self._keep_alive(self.client())

    async def _depth_loop(self, interval_s: float = 5.0) -> None:
        """Sample the stream's length, the group's pending count and the dead letters for /metrics."""
        while True:
            try:
                async with _aio.timeout(self._cfg.redis.op_timeout_s):
                    pipe = self.client().pipeline(transaction=False)
                    pipe.xlen(self.keys.stream)
                    pipe.xpending(self.keys.stream, self.keys.group)
                    pipe.xlen(self.keys.dead)
                    length, pending, dead = await pipe.execute()
                npending = int(pending["pending"]) if isinstance(pending, dict) else 0
                self.depth = {"stream": int(length), "pending": npending,
                              "backlog": max(0, int(length) - npending), "dead": int(dead)}
            except (*REDIS_DOWN, redis.exceptions.ResponseError):
                pass  # no group yet, or Redis away: the read loop reports that; keep the last sample
            except Exception:  # noqa: BLE001 — loop boundary: a metrics sample must not end the consumer
                _log.exception("queue_depth_failed")
            await asyncio.sleep(interval_s)

    # reading -------------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        backoff = 0.1
        while self._intake:
            try:
                await self._read_once()
                if self.paused:
                    _log.info("queue_resumed", consumer=self.consumer)
                self.paused = False
                backoff = 0.1
            except REDIS_DOWN as e:
                self._group_ready = False
                if not self.paused:
                    _log.warning("queue_paused_redis_unavailable", error=repr(e))
                self.paused = True
                await asyncio.sleep(backoff * (0.5 + self._rng.random()))
                backoff = min(backoff * 2, 2.0)
            except redis.exceptions.ResponseError as e:
                self._group_ready = False  # NOGROUP: the stream or group was deleted; create it again
                if "NOGROUP" not in str(e):
                    _log.error("queue_read_failed", error=repr(e))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
            except Exception:  # noqa: BLE001 — loop boundary: log, pause, go on reading
                _log.exception("queue_read_failed")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _want(self) -> int:
        """How many jobs to read now: what the fleets can admit, minus what is read but not admitted.

        Jobs whose result is being stored no longer hold an engine slot, so they count only against
        the memory bound: ``_HELD_PER_SLOT`` × the fleets' admission limit (at least one read batch).
        """
        fleets = [f.name for f in self._cfg.fleets]
        free = sum(self._admission.free_slots(f) for f in fleets) - self._unadmitted
        limit = sum(self._admission.limit(f) for f in fleets)
        bound = max(_HELD_PER_SLOT * limit, self._cfg.redis.read_batch) if limit else 0
        return max(0, min(self._cfg.redis.read_batch, free, bound - self.held))

    async def _read_once(self) -> None:
        r = self._cfg.redis
        client: Any = self.client()
        if not self._group_ready:
            await self._ensure_group(client)
        if not self._own_recovered:
            await self._recover_own(client)
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + r.reclaim_interval_s
            await self._keep_alive(client)
            await self._reclaim(client)
        want = self._want()
        if want <= 0:
            await self._admission.wait_freed(min(1.0, r.reclaim_interval_s))
            return
        async with _aio.timeout(r.op_timeout_s + r.block_ms / 1000):
            reply = await client.xreadgroup(r.group, self.consumer, {r.stream: ">"}, count=want,
                                            block=r.block_ms)
        if not self._intake:
            return  # read while intake stopped: left pending; this consumer name recovers them on start
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self.stats["read"] += 1
                self._spawn(_s(entry_id), fields, 1)

    async def _ensure_group(self, client: Any) -> None:
        r = self._cfg.redis
        try:
            async with _aio.timeout(r.op_timeout_s):
                await client.xgroup_create(r.stream, r.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    async def _recover_own(self, client: Any) -> None:
        """Take back what this consumer name left pending (a crash or SIGKILL), page by page."""
        r = self._cfg.redis
        start = "-"
        while self._intake:
            want = self._want()
            if want <= 0:
                return  # continue on a later pass, when capacity frees
            async with _aio.timeout(r.op_timeout_s):
                pending = await client.xpending_range(r.stream, r.group, min=start, max="+",
                                                      count=want, consumername=self.consumer)
            if not pending:
                self._own_recovered = True
                return
            start = "(" + _s(pending[-1]["message_id"])
            ids = [_s(p["message_id"]) for p in pending if _s(p["message_id"]) not in self._running]
            if ids:
                async with _aio.timeout(r.op_timeout_s):
                    entries = await client.xclaim(r.stream, r.group, self.consumer, 0, ids)
                await self._run_claimed(client, entries, reason="recovered")

    async def _reclaim(self, client: Any) -> None:
        """XAUTOCLAIM jobs idle longer than ``reclaim_idle_ms`` (a stopped consumer's, or our own)."""
        r = self._cfg.redis
        want = self._want()
        if want <= 0:
            return
        async with _aio.timeout(r.op_timeout_s):
            reply = await client.xautoclaim(r.stream, r.group, self.consumer, r.reclaim_idle_ms,
                                            start_id=self._reclaim_cursor, count=want)
        self._reclaim_cursor = _s(reply[0])
        await self._run_claimed(client, reply[1], reason="reclaimed")

    async def _run_claimed(self, client: Any, entries: list[Any], *, reason: str) -> None:
        """Run entries just claimed (each one more delivery in Redis), with their delivery counts."""
        entries = [(_s(e), f) for e, f in entries if f is not None and _s(e) not in self._running]
        if not entries:
            return
        async with _aio.timeout(self._cfg.redis.op_timeout_s):
            counts = await self._delivery_counts(client, [e for e, _ in entries])
        for eid, fields in entries:
            self.stats["reclaimed"] += 1
            _log.info("queue_job_reclaimed", entry=eid, how=reason, delivery=counts.get(eid, 0))
            self._spawn(eid, fields, counts.get(eid, 1))

    async def _delivery_counts(self, client: aioredis.Redis, ids: list[str]) -> dict[str, int]:
        r = self._cfg.redis
        ordered = sorted(ids, key=_id_key)
        rows = await client.xpending_range(r.stream, r.group, min=ordered[0], max=ordered[-1],
                                           count=len(ids) * 4 + 100, consumername=self.consumer)
        return {_s(p["message_id"]): int(p["times_delivered"]) for p in rows}

    async def _keep_alive(self, client: Any) -> None:
        """Reset the idle time of jobs running here so no consumer's XAUTOCLAIM takes them over."""
        r = self._cfg.redis
        cutoff = time.monotonic() - r.reclaim_idle_ms / 3000
        stale = [e for e, j in self._running.items() if j.touched < cutoff]
        if stale:
            async with _aio.timeout(r.op_timeout_s):
                await client.xclaim(r.stream, r.group, self.consumer, 0, stale, justid=True)
            now = time.monotonic()
            for e in stale:
                if e in self._running:
                    self._running[e].touched = now

    # cancels -------------------------------------------------------------------------------------
    async def _cancel_listener(self) -> None:
        """Cancel running jobs named on the cancel channel (the key covers jobs not yet running)."""
        backoff = 0.1
        while True:
            pubsub: Any = self.client().pubsub()
            try:
                async with _aio.timeout(self._cfg.redis.op_timeout_s):
                    await pubsub.subscribe(self.keys.cancel_channel)
                backoff = 0.1
                while True:
                    async with _aio.timeout(self._cfg.redis.op_timeout_s + 1.0):
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        job_id = _text(msg["data"])
                        if job_id is not None:  # anyone can PUBLISH here: no job id is not UTF-8
                            self.cancel_local(job_id)
            except REDIS_DOWN:
                pass
            except Exception:  # noqa: BLE001 — loop boundary: a bad message must not end the consumer
                _log.exception("queue_cancel_listener_failed")
            finally:
                with contextlib.suppress(*REDIS_DOWN):
                    await wait_for(pubsub.aclose(), 1.0)
            await asyncio.sleep(backoff * (0.5 + self._rng.random()))
            backoff = min(backoff * 2, 2.0)

    def cancel_local(self, job_id: str) -> bool:
        """Cancel job ``job_id`` if it is held here (waiting for admission or running)."""
        running = self._by_job.get(job_id)
        if running is None or running.finishing or running.task is None or running.cancel_requested:
            return False
        running.cancel_requested = True
        running.task.cancel()
        return True

    # one job -------------------------------------------------------------------------------------
    def _spawn(self, entry_id: str, fields: Mapping[Any, Any], delivery: int) -> None:
        raw = fields.get(b"job", fields.get("job"))
        raw = raw.encode() if isinstance(raw, str) else raw
        running = _Running(entry_id, delivery=delivery, touched=time.monotonic())
        self._running[entry_id] = running
        self._idle.clear()
        self._unadmitted += 1
        task = asyncio.create_task(self._job(running, raw), name=f"job-{entry_id}")
        running.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _job(self, running: _Running, raw: bytes | None) -> None:
        try:
            valid = await self._validated(running, raw)
            if valid is None:
                return
            job, fleet = valid
            try:
                await self._deliveries(running, job, raw or b"", fleet)
            except asyncio.CancelledError:
                # A producer's cancel (and only that) becomes the job's result; shutdown propagates.
                task = asyncio.current_task()
                if not running.cancel_requested or task is None or task.cancelling() > 1:
                    raise
                task.uncancel()
                self.stats["cancelled"] += 1
                await self._finish(running, job, error_result(
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
            if running.unadmitted:
                running.unadmitted = False
                self._unadmitted -= 1
            self._running.pop(running.entry_id, None)
            if self._by_job.get(running.job_id) is running:
                del self._by_job[running.job_id]
            if not self._running:
                self._idle.set()

    async def _validated(self, running: _Running, raw: bytes | None) -> tuple[Job, str] | None:
        """The job and its fleet, or None once a message that can never run was dead-lettered.

        Everything here is deterministic (the same bytes fail the same way on every delivery), so a
        failure dead-letters at once, with an error result when an id could be read — never a retry.
        """
        r = self._cfg.redis
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
        running.job_id = job.id
        self._by_job[job.id] = running
        fleet = self._cfg.fleet_for_model(str(job.body.get("model", "")))
        problem, code, reply_to = body_problem(job), 400, job.reply_to
        if problem is None and job.reply_to in (r.stream, r.dead_stream):
            problem, reply_to = f"reply_to {job.reply_to!r} is one of routerd's own streams", ""
        if problem is None and fleet is None:
            model = clip(repr(job.body.get("model")), 200)
            problem, code = f"body.model: no fleet serves model {model}", 404
        if problem is None:
            try:
                running.body = json_encode(job.body)
            except (TypeError, ValueError, RecursionError) as e:  # msgpack can carry what JSON cannot
                problem = clip(f"body: cannot be sent as JSON: {e}")
        if problem is not None or fleet is None:
            await self._dead(running, raw, problem or "", job.id, reply_to, code=code)
            return None
        return job, fleet.name

    async def _deliveries(self, running: _Running, job: Job, raw: bytes, fleet: str) -> None:
        """Run the job, redelivering after retryable failures until it has a result or is dead."""
        r = self._cfg.redis
        backoff = 0.2
        while True:
            if running.delivery > r.max_deliveries:
                await self._dead(running, raw, f"delivered {running.delivery - 1} times without a result "
                                 f"(max_deliveries = {r.max_deliveries})", job.id, job.reply_to, code=502)
                return
            try:
                result = await self._attempt(running, job, fleet)
            except _Retry as e:
                await self._record_failure(running, job.id, e.error, e.instance)
            except _Dead as e:
                await self._dead(running, raw, e.reason, job.id, job.reply_to if e.reply_usable else "",
                                 code=400)
                return
            else:
                await self._finish(running, job, result)
                return
            await asyncio.sleep(backoff * (0.5 + self._rng.random()))
            backoff = min(backoff * 2, 10.0)
            running.delivery = await self._redeliver(running)
            if running.delivery == 0:
                return  # another consumer owns it now (or it was deleted)
            self.stats["redelivered"] += 1

    async def _attempt(self, running: _Running, job: Job, fleet: str) -> Result | None:
        """One delivery of ``job``: the pre-dispatch check, admission, the engine call. None = duplicate.

        The check (already done? cancelled?) comes before admission so that its Redis round trip does
        not hold an engine slot; it also marks the job running.
        """
        deadline = job.deadline_epoch_s(running.entry_id)
        mono_deadline = None if deadline is None else time.monotonic() + (deadline - time.time())
        state = await self._store.begin(job.id, running.entry_id, job.reply_to)
        if isinstance(state, str):
            raise _Dead(f"reply_to {clip(job.reply_to, 100)!r} holds a {state}, not a stream: it cannot "
                        "take the result", reply_usable=False)
        if state == 1:
            self.stats["duplicates"] += 1
            return None
        if state == 2:
            self.stats["cancelled"] += 1
            return error_result(job.id, "the job was cancelled", "CancelledError", 499)
        if running.unadmitted:  # from here on admission counts it (active or waiting)
            running.unadmitted = False
            self._unadmitted -= 1
        try:
            async with self._admission.ticket(fleet, priority=job.priority, deadline=mono_deadline,
                                              source="queue"):
                if deadline is None:
                    return await self._forward(running, job, fleet)
                async with asyncio.timeout(deadline - time.time()):
                    return await self._forward(running, job, fleet)
        except DeadlineExceeded as e:
            self.stats["expired"] += 1
            return error_result(job.id, e.message, e.type, e.status, attempts=running.delivery - 1)
        except TimeoutError:
            self.stats["expired"] += 1
            return error_result(job.id, "the job's deadline passed while it ran", "DeadlineExceededError",
                                504, attempts=running.delivery)

    async def _forward(self, running: _Running, job: Job, fleet: str) -> Result:
        run_no = running.delivery
        sink: BufferSink | StreamSink
        if job.stream:
            sink = StreamSink(self._store, job.id, job.reply_to, run_no, self._on_instance(job.id))
        else:
            sink = BufferSink(_ignore)  # the result names the instance a moment later anyway
        try:
            out = await self._upstream.forward(fleet, job.endpoint, running.body, sink,
                                               stream=job.stream, request_id=job.id)
        except ReplyRefused as e:  # the engine call ended with it: the engine aborts the generation
            reason = f"reply_to {clip(e.reply_to, 100)!r} refused a chunk: {e.error}"
            if e.permanent:
                raise _Dead(reason, reply_usable=False) from None
            raise _Retry(reason) from None
        except RouterdError as e:
            if e.retryable or e.status >= 500:
                raise _Retry(f"{e.type}: {e.message}", getattr(e, "instance", "")) from None
            return error_result(job.id, e.message, e.type, e.status, attempts=run_no)
        mid_stream_failure = isinstance(sink, StreamSink) and sink.status == 200 and (
            sink.failed or not out.ok)
        if mid_stream_failure or (not out.ok and (out.status >= 500 or out.status == 0)):
            raise _Retry(out.error or f"upstream status {out.status}", out.instance, out.attempts)
        return sink.result(job.id, out.instance, out.attempts, out.status)

    def _on_instance(self, job_id: str) -> Callable[[str], None]:
        def note(instance: str) -> None:
            self._writer.send("HSET", self.keys.status(job_id), "instance", instance)
        return note

    async def _record_failure(self, running: _Running, job_id: str, error: str,
                              instance: str = "") -> None:
        _log.warning("queue_job_attempt_failed", job_id=job_id, entry=running.entry_id,
                     delivery=running.delivery, instance=instance, error=error)
        await self._store.record_failure(job_id, Attempt(
            at_ms=now_ms(), consumer=self.consumer, delivery=running.delivery, instance=instance,
            error=error))

    async def _redeliver(self, running: _Running) -> int:
        """XCLAIM the entry again (its delivery count goes up in Redis); 0 if it is no longer ours."""
        r = self._cfg.redis
        client: Any = self.client()
        try:
            async with _aio.timeout(r.op_timeout_s):
                # Without JUSTID, XCLAIM counts a delivery: the count survives if routerd dies now.
                got = await client.xclaim(r.stream, r.group, self.consumer, 0, [running.entry_id])
                if not got:
                    return 0
                counts = await self._delivery_counts(client, [running.entry_id])
        except REDIS_DOWN:
            return running.delivery + 1  # Redis will count it when it is back; keep trying meanwhile
        running.touched = time.monotonic()
        return counts.get(running.entry_id, running.delivery + 1)

    async def _finish(self, running: _Running, job: Job, result: Result | None) -> None:
        running.finishing = True
        await self._store.finish(running.entry_id, job.id, job.reply_to, result,
                                 delivery=running.delivery)
        self.stats["done"] += 1

    async def _dead(self, running: _Running, raw: bytes, reason: str, job_id: str | None,
                    reply_to: str | None, *, code: int) -> None:
        """Dead-letter the message with its reason and history, and store an error result when its id
        is known (sent to ``reply_to`` too unless that is empty)."""
        running.finishing = True
        _log.warning("queue_job_dead", entry=running.entry_id, job_id=job_id, reason=reason)
        result = None
        if job_id:
            result = error_result(job_id, reason, "BadRequestError" if code < 500 else "DeadLetterError",
                                  code, attempts=max(running.delivery - 1, 0))
        await self._store.finish(running.entry_id, job_id or "", reply_to or "", result,
                                 delivery=running.delivery, dead_reason=reason, raw=raw)
        self.stats["dead"] += 1


def _ignore(_: str) -> None:
    pass


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(value: Any) -> str | None:
    """A producer's string; None when it is bytes that are not UTF-8."""
    try:
        return _s(value)
    except UnicodeDecodeError:
        return None


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
