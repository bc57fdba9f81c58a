"""The Redis queue consumer: jobs in from a stream, exactly one result per job id out.

routerd reads ``routerd:requests`` as a member of a consumer group under a stable name, so after a
crash it finds its own unacknowledged jobs again at start; it holds that name in Redis while it lives
(:mod:`.liveness`), and the jobs of a consumer whose name is gone are taken over at once; other
consumers' jobs are taken over with ``XAUTOCLAIM`` once idle for ``reclaim_idle_ms`` (jobs running here
are kept fresh with ``XCLAIM JUSTID`` so nobody takes them over) — see :mod:`.reclaim`. Reads follow
capacity: a read asks for at most what the fleets' admission can take now, so the backlog stays in
Redis and routerd's memory does not grow with it. The stream is one line for every fleet: a job read
for a saturated fleet waits in that fleet's room (its limit, plus ``read_ahead_jobs`` with tenants) and
beyond it is set aside, so one fleet's backlog never stops the reading for a fleet with free slots; a
job between deliveries is set aside for its backoff (:mod:`.held`).

Each job read runs in a task of its own (:mod:`.job`); a job is acknowledged only inside the script
that stores its result (``JobStore.acknowledge``, :mod:`.store`). A job whose tenant is over its rate
limit holds no slot, and beyond a room of ``read_batch`` per tenant it is set aside — pending in
Redis, a small record here —
and brought back by :meth:`QueueIngress._aside_loop`, so one limited tenant's backlog never stops the
reading of the others' work (see :mod:`.held`). Redis outages pause reading (backoff, reconnect); finished
results wait in the writer and are stored when Redis returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from ... import _aio, log
from ..._aio import wait_for
from ...config import Config
from ...dataplane.admission import Admission
from ...dataplane.dispatch import Dispatch
from ...redis_conn import RedisConn
from ...redis_keys import RedisKeys
from ...tenants.service import Tenancy
from ...tracing import Tracing
from .cancel import cancel_local, listen_for_cancels
from .held import Held, Room, Running, as_str
from .job import JobRunner
from .liveness import RENEW_S, ConsumerName
from .reclaim import Reclaimer
from .results import REDIS_DOWN, JobStore

_log = log.get("routerd.queue")
_HELD_PER_SLOT = 2
# Jobs set aside (over their tenant's rate limit, pending in Redis) this consumer keeps a record of,
# ~0.5 KB each: beyond it, reading stops until some come back.
_ASIDE_MAX_JOBS = 50_000


class QueueIngress:
    """Consumes the request stream; the daemon runs :meth:`run` in its TaskGroup."""

    def __init__(self, cfg: Config, redis_factory: Callable[[], aioredis.Redis], *, dispatch: Dispatch,
                 admission: Admission, tenancy: Tenancy, tracing: Tracing, consumer: str | None = None,
                 rng: random.Random | None = None, serves: Callable[[str], bool] | None = None) -> None:
        """``serves(fleet)``: whether the fleet is one of the fleets there are — a follower's are the
        controller's (routerd/peers/fleet_state.py); None: every configured fleet."""
        self._cfg = cfg
        self.tenancy = tenancy  # the data plane's: its tenants decide which jobs may run
        self._redis_factory = redis_factory
        self._client: aioredis.Redis | None = None
        self._admission = admission
        self.consumer = consumer or cfg.redis.consumer_name
        self.keys = RedisKeys.from_config(cfg.redis)
        self._rng = rng or random.Random()
        self._store = JobStore(self.client, self.keys, self.consumer, lambda: self._cfg.redis,
                               rng=self._rng)
        self._writer = self._store.writer
        self._held = Held()
        self._tasks: set[asyncio.Task[None]] = set()
        self._intake = True
        self._group_ready = False
        self._next_reclaim = 0.0
        self.paused = False
        self.stats = {"read": 0, "done": 0, "dead": 0, "redelivered": 0, "reclaimed": 0,
                      "duplicates": 0, "cancelled": 0, "expired": 0, "preempted": 0, "set_aside": 0}
        # Sampled from Redis by _depth_loop for /metrics: the scrape itself never waits on Redis.
        self.depth: dict[str, int] = {}
        self._name = ConsumerName(self.keys, self.consumer)  # held from before the first read
        self._reclaimer = Reclaimer(lambda: self._cfg.redis, self.keys, self.consumer, self._held,
                                    want=self._want, spawn=self._spawn, reading=lambda: self._intake,
                                    stats=self.stats)
        self._jobs = JobRunner(lambda: self._cfg, self.client, self._store, self._held, self.keys,
                               self.consumer, dispatch=dispatch, stats=self.stats, rng=self._rng,
                               tenancy=tenancy, tracing=tracing, fleet_room_size=self._fleet_room,
                               serves=serves)

    @classmethod
    def from_config(cls, cfg: Config, *, redis: RedisConn, dispatch: Dispatch, admission: Admission,
                    tenancy: Tenancy, tracing: Tracing,
                    serves: Callable[[str], bool] | None = None) -> QueueIngress:
        """The assembly's constructor: its reads on the process's Redis (blocking up to ``block_ms``)."""
        return cls(cfg, redis.blocking, dispatch=dispatch, admission=admission,
                   tenancy=tenancy, tracing=tracing, serves=serves)

    async def __aenter__(self) -> QueueIngress:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(*REDIS_DOWN):
                await wait_for(client.aclose(), self._cfg.redis.op_timeout_s)

    # lifecycle -----------------------------------------------------------------------------------
    def client(self) -> aioredis.Redis:
        if self._client is None:
            self._client = self._redis_factory()
        return self._client

    def update_config(self, cfg: Config) -> None:
        self._cfg = cfg

    def stop_intake(self) -> None:
        """Stop reading and reclaiming; jobs already read run to completion (see :meth:`wait_idle`),
        but those waiting for their tenant's quota are set aside at once: they stay pending, their
        delivery given back, for the next start (or another consumer) to run."""
        self._intake = False
        self._held.closing = True
        self.tenancy.look_again()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is held here; False if some still are after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._held.idle.wait()
        except TimeoutError:
            return False
        return True

    @property
    def held(self) -> int:
        return len(self._held)

    def cancel_local(self, job_id: str) -> bool:
        """Cancel job ``job_id`` if it is held here (waiting for admission or running)."""
        return cancel_local(self._held, job_id)

    async def run(self) -> None:
        """Read, reclaim and listen for cancels until intake stops and the last job is done."""
        try:
            async with asyncio.TaskGroup() as tg:
                cancels = listen_for_cancels(self.client, self.keys, self._held,
                                             op_timeout_s=lambda: self._cfg.redis.op_timeout_s,
                                             rng=self._rng)
                helpers = [tg.create_task(self._writer.run(), name="queue-writer"),
                           tg.create_task(cancels, name="queue-cancels"),
                           tg.create_task(self._depth_loop(), name="queue-depth"),
                           tg.create_task(self._aside_loop(), name="queue-aside"),
                           tg.create_task(self._keep_name(), name="queue-name")]
                await self._read_loop()
                await self._drain_held()
                await self._writer.command("PING")  # FIFO: every result queued before it is stored
                for t in helpers:
                    t.cancel()
            # Drained, renewals over: what is left pending here (set aside) is taken over at once.
            await self._name.release(self.client(), self._cfg.redis.op_timeout_s)
        finally:
            jobs = list(self._tasks)
            for t in jobs:
                t.cancel()
            try:
                if jobs:  # let them unwind (release slots, close engine connections) before Redis goes
                    await asyncio.wait(jobs, timeout=5.0)
                if all(t.done() for t in jobs):
                    # Cut short (routerd's stop cancels its loops once the drain is over, often while
                    # this one still waits on a read): no job runs under the name any more, so it is let
                    # go now rather than left to lapse TTL_S later, when a restart under the same name
                    # would read nothing until then. Already released on the way above: no-op.
                    await self._name.release(self.client(), self._cfg.redis.op_timeout_s)
            finally:
                if self._client is not None:
                    client, self._client = self._client, None
                    with contextlib.suppress(*REDIS_DOWN):
                        await wait_for(client.aclose(), 2.0)  # closing sockets; the stop is bounded

    async def _drain_held(self) -> None:
        """Wait for the jobs still held, keeping them fresh meanwhile: a drain can outlast
        ``reclaim_idle_ms``, and another consumer must not take over (and run again) a job that
        is still running here."""
        idle = self._held.idle
        while not idle.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._cfg.redis.reclaim_interval_s):
                    await idle.wait()
            if not idle.is_set():
                with contextlib.suppress(*REDIS_DOWN, redis.exceptions.ResponseError):
                    await self._reclaimer.keep_alive(self.client())

    async def _keep_name(self) -> None:
        """Renew this consumer's name while it is held, through the drain too (run() ends this after)."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                await self._name.renew(self.client(), self._cfg.redis.op_timeout_s)
            except (*REDIS_DOWN, redis.exceptions.ResponseError):
                pass  # the read loop reports an outage; renewed on the next pass
            except Exception:  # noqa: BLE001 — loop boundary: the name is renewed again next time
                _log.exception("queue_name_renew_failed")

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
        """How many jobs to read now: what the fleets can take — their free slots, and with tenants the
        space in their rooms — minus what is read but not yet admitted.

        Jobs waiting in a fleet's room are bounded by the room (beyond it they are set aside), so a
        saturated fleet's never count against the read bound of the others; jobs waiting for their
        tenant's quota hold no slot either. What else is held here (running, or storing its result)
        counts against the memory bound: ``_HELD_PER_SLOT`` × the fleets' admission limit (at least
        one read batch).
        """
        held = self._held
        if held.set_aside >= _ASIDE_MAX_JOBS:
            return 0
        # With tenants, jobs wait in admission beyond the free slots: fair share chooses between the
        # tenants whose jobs it has read, and a stream is read in order.
        ahead = self._cfg.redis.read_ahead_jobs if self._admission.tenants_configured else 0
        limit = takes = 0
        for f in self._cfg.fleets:
            lim, free = self._admission.intake(f.name)  # a fleet at zero: one instance's
            limit += lim
            takes += free
            if ahead and lim:
                takes += max(0, self._fleet_room(f.name, lim) - held.in_room(("fleet", f.name)))
        bound = max(_HELD_PER_SLOT * limit, self._cfg.redis.read_batch) + ahead if limit else 0
        counted = self.held - held.parked - held.waiting
        return max(0, min(self._cfg.redis.read_batch, takes - held.unadmitted, bound - counted))

    def _fleet_room(self, fleet: str, limit: int | None = None) -> int:
        """How many of ``fleet``'s jobs may wait here for a slot: one round of its limit, plus
        ``read_ahead_jobs`` with tenants (fair share sees that many); beyond it they are set aside."""
        lim = self._admission.intake_limit(fleet) if limit is None else limit
        ahead = self._cfg.redis.read_ahead_jobs if self._admission.tenants_configured else 0
        return max(lim, 1) + ahead

    def _room_size(self, room: Room) -> int:
        kind, name = room
        return self._cfg.redis.read_batch if kind == "tenant" else self._fleet_room(name)

    async def _wait_for_room(self, timeout: float) -> None:
        """Until a slot is freed, a job read here leaves the read bound (admitted, set aside, ended) or
        ``timeout`` seconds pass."""
        waits = [asyncio.ensure_future(self._admission.wait_freed(timeout)),
                 asyncio.ensure_future(self._held.moved.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _aside_loop(self) -> None:
        """Bring set-aside jobs back (read again from the stream, same delivery) when their tenant's
        room has space, their deadline has passed or their producer cancelled them."""
        backoff = 0.1
        while True:
            wait = min(max(self._held.next_deadline - time.time(), 0.01), 1.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._held.wake.wait()
            self._held.wake.clear()
            try:
                while self._intake and await self._bring_back():
                    pass
                backoff = 0.1
            except (*REDIS_DOWN, redis.exceptions.ResponseError):
                await asyncio.sleep(backoff * (0.5 + self._rng.random()))  # the read loop reports it
                backoff = min(backoff * 2, 2.0)
            except Exception:  # noqa: BLE001 — loop boundary: the jobs stay set aside, tried again
                _log.exception("queue_aside_failed")
                await asyncio.sleep(1.0)

    async def _bring_back(self) -> int:
        """One batch of due set-aside jobs spawned again; how many were due."""
        r = self._cfg.redis
        back = self._held.due(self._room_size, limit=r.read_batch)
        if not back:
            return 0
        client: Any = self.client()
        try:
            async with _aio.timeout(r.op_timeout_s):
                pipe = client.pipeline(transaction=False)
                for a in back:
                    pipe.xpending_range(r.stream, r.group, min=a.entry_id, max=a.entry_id, count=1,
                                        consumername=self.consumer)
                ours = [a for a, rows in zip(back, await pipe.execute(), strict=True) if rows]
                # Claimed (not JUSTID): the delivery given back when it was set aside counts again.
                claimed = await client.xclaim(r.stream, r.group, self.consumer, 0,
                                              [a.entry_id for a in ours]) if ours else []
        except BaseException:
            self._held.restore(back)
            raise
        found = {as_str(e): f for e, f in claimed if f is not None}
        for a in back:
            if a.entry_id in found:
                self._spawn(a.entry_id, found[a.entry_id], a.delivery, preempted=a.preempted, returned=True)
            else:  # another consumer took it over, or it was deleted: not ours to run
                self._held.gone(a.entry_id)
        return len(back)

    async def _read_once(self) -> None:
        r = self._cfg.redis
        client: Any = self.client()
        if not self._group_ready:
            await self._ensure_group(client)
        if not self._name.held and not await self._name.take(client, r.op_timeout_s):
            await asyncio.sleep(1.0)  # another live process holds the name: nothing is ours to read
            return
        if not self._reclaimer.own_recovered:
            await self._reclaimer.recover_own(client)
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + r.reclaim_interval_s
            await self._reclaimer.keep_alive(client)
            await self._reclaimer.reclaim(client)
        self._held.moved.clear()
        want = self._want()
        if want <= 0:
            await self._wait_for_room(min(1.0, r.reclaim_interval_s))
            return
        async with _aio.timeout(r.op_timeout_s + r.block_ms / 1000):
            reply = await client.xreadgroup(r.group, self.consumer, {r.stream: ">"}, count=want,
                                            block=r.block_ms)
        if not self._intake:
            return  # read while intake stopped: left pending; this consumer name recovers them on start
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self.stats["read"] += 1
                self._spawn(as_str(entry_id), fields, 1)

    async def _ensure_group(self, client: Any) -> None:
        r = self._cfg.redis
        try:
            async with _aio.timeout(r.op_timeout_s):
                await client.xgroup_create(r.stream, r.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def _spawn(self, entry_id: str, fields: Mapping[Any, Any], delivery: int, *, preempted: int = 0,
               returned: bool = False) -> None:
        """Hold the entry and run it as a job in a task this consumer owns (``returned``: brought back
        from being set aside)."""
        raw = fields.get(b"job", fields.get("job"))
        raw = raw.encode() if isinstance(raw, str) else raw
        running = Running(entry_id, delivery=delivery, touched=time.monotonic(), preempted=preempted,
                          returned=returned)
        self._held.add(running)
        task = asyncio.create_task(self._jobs.run(running, raw), name=f"job-{entry_id}")
        running.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
