"""The queue consumer's read bound against a real redis-server (issue 26): what waits here must not stop
the reading of work that could run.

The stream is one line for every fleet and every job: a job that cannot run now — its fleet saturated,
or between two deliveries after a failure — must not hold up the reading of a job behind it that could.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import redis.asyncio as aioredis

from routerd.client import QueueClient
from routerd.config import parse
from routerd.dataplane.sinks import ForwardResult
from routerd.registry import Instance, InstanceState
from tests.fixtures.redis_server import FakeUpstream, QueueBenchFactory, RedisServer, queue_config

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


class _ByFleet:
    """The engine call of two fleets: fleet ``f``'s calls wait until ``hold`` is set (a saturated fleet),
    fleet ``g``'s are answered at once."""

    def __init__(self, hold: asyncio.Event) -> None:
        self.busy, self.idle = FakeUpstream(hold=hold), FakeUpstream()

    async def forward(self, fleet: str, endpoint: str, body: bytes, sink: Any, *, stream: bool,
                      request_id: str, request: Any = None, **_: Any) -> ForwardResult:
        up = self.busy if fleet == "f" else self.idle
        return await up.forward(fleet, endpoint, body, sink, stream=stream, request_id=request_id,
                                request=request)


async def test_a_saturated_fleets_backlog_does_not_hold_up_an_idle_fleets_job(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """100 jobs for fleet ``f`` (2 slots, its engine not answering) ahead of one job for the idle fleet
    ``g`` in the stream: ``g``'s job is read and answered while ``f``'s all still wait, and what waits
    for ``f`` here stays within its room (the rest set aside, pending in Redis). Once ``f`` answers,
    every job has exactly one result."""
    base = queue_config(redis_server.url)
    cfg = parse({"redis": msgspec.to_builtins(base.redis),
                 "admission": {"max_inflight_per_instance": 2},
                 "fleets": [{"name": "f", "model": "m", "engine": "sim"},
                            {"name": "g", "model": "m2", "engine": "sim"}]}, environ={})
    hold = asyncio.Event()
    up = _ByFleet(hold)
    bench = queue_bench(up, cfg=cfg)
    bench.registry.add(Instance(id="g:0", fleet="g", url="http://127.0.0.1:2", state=InstanceState.READY))
    q = QueueClient(redis_async)
    saturating = await q.submit_many([{**BODY, "prompt": f"p{i}"} for i in range(100)], reply_to="replies")
    idle = await q.submit({**BODY, "model": "m2"}, reply_to="replies")
    await bench.start()
    try:
        res = await q.wait(idle, timeout=30)  # before the fix: never read while f's jobs wait
        assert res.status == "ok"
        assert res.instance == "g:0"
        assert await redis_async.exists(*(f"routerd:done:{j.id}" for j in saturating)) == 0
        # f's 2 running, its room of 2 waiting, and what one read brought in: not the 100
        assert bench.ingress.held < 20, bench.ingress.held
        hold.set()
        results = await q.wait_many(saturating, timeout=30)
    finally:
        hold.set()
        await bench.stop()
    assert all(r.status == "ok" for r in results.values())
    entries = await redis_async.xrange("replies")
    ids = [msgspec.json.decode(f[b"result"])["id"] for _, f in entries]
    assert sorted(ids) == sorted([j.id for j in saturating] + [idle.id])  # exactly one each
    assert (await redis_async.xpending("routerd:requests", "routerd"))["pending"] == 0


async def test_jobs_waiting_for_their_retry_do_not_hold_up_reading(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """Four jobs whose engine calls always fail wait in backoff between their deliveries (20 of them:
    over a minute). The job behind them in the stream is read and answered meanwhile; the four are
    retried and stay pending (nothing lost), still without a result."""
    failing: set[str] = set()
    up = FakeUpstream(fail=lambda job_id, n: job_id in failing)
    # a read bound of 4 jobs: the fleet's 2 slots twice over, in reads of 2
    cfg = queue_config(redis_server.url, read_batch=2, max_deliveries=20)
    cfg = parse({"redis": msgspec.to_builtins(cfg.redis), "admission": {"max_inflight_per_instance": 2},
                 "fleets": [{"name": "f", "model": "m", "engine": "sim"}]}, environ={})
    bench = queue_bench(up, cfg=cfg)
    q = QueueClient(redis_async)
    bad = await q.submit_many([{**BODY, "prompt": f"bad{i}"} for i in range(4)], reply_to="replies")
    failing.update(j.id for j in bad)
    good = await q.submit(BODY, reply_to="replies")
    await bench.start()
    try:
        res = await q.wait(good, timeout=30)  # before the fix: read only once the four are dead
        assert res.status == "ok"
        deadline = asyncio.get_running_loop().time() + 30
        while not all(up.calls[j.id] >= 2 for j in bad):  # each came back for its retry
            assert asyncio.get_running_loop().time() < deadline, up.calls
            await asyncio.sleep(0.05)
    finally:
        await bench.stop()
    assert await redis_async.exists(*(f"routerd:done:{j.id}" for j in bad)) == 0
    pending = await redis_async.xpending_range("routerd:requests", "routerd", min="-", max="+", count=10)
    assert sorted(p["message_id"].decode() for p in pending) == sorted(j.entry for j in bad)
