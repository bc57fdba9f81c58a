"""A consumer runs nothing under a name another live process holds (routerd/ingress/queue/liveness.py).

In-process consumers against a real redis-server, with the fake engine call: a newcomer under a name
whose holder still drains leaves the name's jobs to that holder until it lets go, then reads; a holder
that is a process of this host no longer running is taken over at once.
The same with real processes (a workers daemon SIGKILLed and started again at once) is in
tests/test_workers.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import redis.asyncio as aioredis
import structlog

from routerd.client import QueueClient
from routerd.config import parse
from tests.fixtures.redis_server import FakeUpstream, QueueBenchFactory, RedisServer, queue_config
from tests.test_queue import BODY, until

KEY = "routerd:consumer:c1"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


async def test_a_newcomer_leaves_a_draining_holders_jobs_to_it_and_reads_once_it_let_go(
        queue_bench: QueueBenchFactory, redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    # Six slots: the holder, running six, has no read of the stream in flight when it stops (a read
    # then would leave what it got pending under the name until the holder lets go). No XAUTOCLAIM.
    cfg = parse({"redis": {"url": redis_server.url, "consumer": "c1", "block_ms": 200,
                           "reclaim_idle_ms": 600_000, "op_timeout_s": 2.0},
                 "admission": {"max_inflight_per_instance": 6},
                 "fleets": [{"name": "f", "model": "m", "engine": "sim"}]}, environ={})
    hold = asyncio.Event()
    old_engine, new_engine = FakeUpstream(hold=hold), FakeUpstream()
    old = queue_bench(old_engine, consumer="c1", cfg=cfg)
    q = QueueClient(redis_async)
    first = await q.submit_many([{**BODY, "prompt": f"old {i}"} for i in range(6)], reply_to="replies")
    await old.start()
    await until(lambda: _running(old_engine, 6))
    old.ingress.stop_intake()  # draining, as an orphaned worker or a slow stop does: its jobs still run
    new = queue_bench(new_engine, consumer="c1", cfg=cfg)
    with structlog.testing.capture_logs() as logs:
        await new.start()
        try:
            await until(lambda: _event(logs, "queue_consumer_name_busy"))  # it found the holder
            later = await q.submit_many([{**BODY, "prompt": f"new {i}"} for i in range(4)],
                                        reply_to="replies")
            hold.set()  # the holder finishes its own and lets go of the name
            results = await q.wait_many(first + later, timeout=20)
            assert {r.status for r in results.values()} == {"ok"}
            await asyncio.wait_for(old.task, 10)  # type: ignore[arg-type]
            assert _event_now(logs, "queue_consumer_name_free")
        finally:
            await new.stop()
    assert sum(old_engine.calls.values()) == 6  # every job ran exactly once: the holder's by the holder,
    assert sum(new_engine.calls.values()) == 4  # the later ones by the newcomer
    assert new.ingress.stats["reclaimed"] == 0
    busy = [e["holder"] for e in logs if e["event"] == "queue_consumer_name_busy"]
    assert busy == [old.ingress._name.value]
    assert not await redis_async.exists(KEY)  # let go at the end of each one's drain


async def test_a_holder_that_is_a_gone_process_of_this_host_is_taken_over_at_once(
        queue_bench: QueueBenchFactory, redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """The name's key names a process of this host that no longer runs (SIGKILLed, its key left to
    expire): its successor recovers the name's jobs at once, not after the key's TTL."""
    cfg = queue_config(redis_server.url, reclaim_idle_ms=600_000)
    hold = asyncio.Event()
    crashed = queue_bench(FakeUpstream(hold=hold), consumer="c1", cfg=cfg)
    q = QueueClient(redis_async)
    jobs = await q.submit_many([BODY] * 5, reply_to="replies")
    await crashed.start()
    await until(lambda: _running(crashed.upstream, 5))
    await crashed.crash()
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()  # a pid of this host that no longer runs
    # "<random> <boot id>/<pid namespace> <pid> <hostname>": a process of this host, gone
    boot = BOOT_ID.read_text().strip()  # noqa: ASYNC240  # a /proc file: no disk wait
    left = f"0123456789abcdef {boot}/{os.readlink('/proc/self/ns/pid')} {gone.pid} {socket.gethostname()}"
    await redis_async.set(KEY, left)  # as a SIGKILL leaves it (no TTL here: only the take-over frees it)
    engine = FakeUpstream()
    again = queue_bench(engine, consumer="c1", cfg=cfg)
    with structlog.testing.capture_logs() as logs:
        await again.start()
        try:
            results = await q.wait_many(jobs, timeout=20)
        finally:
            await again.stop()
    assert {r.status for r in results.values()} == {"ok"}
    assert again.ingress.stats["reclaimed"] == 5
    assert [e["previous"] for e in logs if e["event"] == "queue_consumer_name_taken_over"] == [left]


async def _running(engine: FakeUpstream, n: int) -> bool:
    return sum(engine.calls.values()) >= n


async def _event(logs: list[dict[str, object]], event: str) -> bool:
    return _event_now(logs, event)


def _event_now(logs: list[dict[str, object]], event: str) -> bool:
    return any(e["event"] == event for e in logs)
