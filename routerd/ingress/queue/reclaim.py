"""Taking jobs over: this consumer's own pending jobs after a restart, a dead consumer's at once (its name
gone, :mod:`.liveness`), other consumers' idle ones with ``XAUTOCLAIM``, and keeping the jobs running
here fresh so that nobody takes them over.

Every claim is one more delivery in Redis (``XCLAIM`` without ``JUSTID`` bumps the count), so a job
that crashes routerd on every delivery reaches ``max_deliveries`` and is dead-lettered (see
:mod:`.job`), even across crashes. Keep-alive claims with ``JUSTID``, which does not count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import redis.asyncio as aioredis

from ... import _aio, log
from ...config import RedisConfig
from ...redis_keys import RedisKeys
from .held import Aside, Held, Running, as_str
from .liveness import take_over

_log = log.get("routerd.queue")
_KEEP_ALIVE_PAGE = 1000  # entry ids per XCLAIM JUSTID


class Spawn(Protocol):
    """Start running a claimed entry as its ``delivery``-th delivery (``QueueIngress`` does this)."""

    def __call__(self, entry_id: str, fields: Any, delivery: int) -> None: ...


async def delivery_counts(client: aioredis.Redis, r: RedisConfig, consumer: str,
                          ids: list[str]) -> dict[str, int]:
    """How many times each of ``ids`` (pending for ``consumer``) has been delivered."""
    ordered = sorted(ids, key=_id_key)
    rows = await client.xpending_range(r.stream, r.group, min=ordered[0], max=ordered[-1],
                                       count=len(ids) * 4 + 100, consumername=consumer)
    return {as_str(p["message_id"]): int(p["times_delivered"]) for p in rows}


class Reclaimer:
    """Own-pending recovery, ``XAUTOCLAIM`` of idle jobs, keep-alive; the read loop calls each step."""

    def __init__(self, redis_cfg: Callable[[], RedisConfig], keys: RedisKeys, consumer: str, held: Held, *,
                 want: Callable[[], int], spawn: Spawn, reading: Callable[[], bool],
                 stats: dict[str, int]) -> None:
        self._cfg = redis_cfg
        self._keys = keys
        self._consumer = consumer
        self._held = held
        self._want = want
        self._spawn = spawn
        self._reading = reading
        self._stats = stats
        self._cursor = "0-0"
        self.own_recovered = False

    async def recover_own(self, client: Any) -> None:
        """Take back what this consumer name left pending (a crash or SIGKILL), page by page."""
        r = self._cfg()
        start = "-"
        while self._reading():
            want = self._want()
            if want <= 0:
                return  # continue on a later pass, when capacity frees
            async with _aio.timeout(r.op_timeout_s):
                pending = await client.xpending_range(r.stream, r.group, min=start, max="+",
                                                      count=want, consumername=self._consumer)
            if not pending:
                self.own_recovered = True
                return
            start = "(" + as_str(pending[-1]["message_id"])
            ids = [as_str(p["message_id"]) for p in pending if as_str(p["message_id"]) not in self._held]
            if ids:
                async with _aio.timeout(r.op_timeout_s):
                    entries = await client.xclaim(r.stream, r.group, self._consumer, 0, ids)
                await self._run_claimed(client, entries, reason="recovered")

    async def reclaim(self, client: Any) -> None:
        """Take over the jobs of consumers known dead, then XAUTOCLAIM jobs idle longer than
        ``reclaim_idle_ms`` (a stopped consumer's, or our own)."""
        r = self._cfg()
        want = self._want()
        if want <= 0:
            return
        await self._run_claimed(client, await take_over(client, self._keys, self._consumer, want,
                                                        r.op_timeout_s), reason="taken_over")
        want = self._want()
        if want <= 0:
            return
        async with _aio.timeout(r.op_timeout_s):
            reply = await client.xautoclaim(r.stream, r.group, self._consumer, r.reclaim_idle_ms,
                                            start_id=self._cursor, count=want)
        self._cursor = as_str(reply[0])
        await self._run_claimed(client, reply[1], reason="reclaimed")

    async def _run_claimed(self, client: Any, entries: list[Any], *, reason: str) -> None:
        """Run entries just claimed (each one more delivery in Redis), with their delivery counts."""
        entries = [(as_str(e), f) for e, f in entries if f is not None and as_str(e) not in self._held]
        if not entries:
            return
        r = self._cfg()
        async with _aio.timeout(r.op_timeout_s):
            counts = await delivery_counts(client, r, self._consumer, [e for e, _ in entries])
        for eid, fields in entries:
            self._stats["reclaimed"] += 1
            _log.info("queue_job_reclaimed", entry=eid, how=reason, delivery=counts.get(eid, 0))
            self._spawn(eid, fields, counts.get(eid, 1))

    async def keep_alive(self, client: Any) -> None:
        """Reset the idle time of jobs running here so no consumer's XAUTOCLAIM takes them over."""
        r = self._cfg()
        cutoff = time.monotonic() - r.reclaim_idle_ms / 3000
        jobs: list[Running | Aside] = [*self._held.by_entry.values(), *self._held.aside_entries.values()]
        stale = [j for j in jobs if j.touched < cutoff]
        for page in range(0, len(stale), _KEEP_ALIVE_PAGE):
            some = stale[page:page + _KEEP_ALIVE_PAGE]
            async with _aio.timeout(r.op_timeout_s):
                await client.xclaim(r.stream, r.group, self._consumer, 0, [j.entry_id for j in some],
                                    justid=True)
            now = time.monotonic()
            for j in some:
                j.touched = now


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
