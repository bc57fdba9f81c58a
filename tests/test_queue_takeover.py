"""A dead replica's queue jobs, taken over by the survivor as soon as it is known dead (issue 26).

Two real ``routerd run`` on one Redis consume one stream. One is SIGKILLed holding jobs: its name in
Redis expires within the liveness TTL and the survivor takes its pending jobs over then — not after
``reclaim_idle_ms`` (a minute here, so the old wait fails this test plainly) — and never while it lived.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from routerd.client import QueueClient
from routerd.ingress.queue.liveness import TTL_S
from routerd_bench.scale_replicas import log_events
from tests.fixtures.daemon import RouterdFactory, RouterdProcess
from tests.fixtures.helpers import eventually
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory

RECLAIM_IDLE_MS = 120_000


def _taken_over(rp: RouterdProcess) -> list[str]:
    reclaimed = log_events(rp.log_path, "queue_job_reclaimed")
    return [e["entry"] for e in reclaimed if e.get("how") == "taken_over"]


async def _pending(r: aioredis.Redis, consumer: str) -> list[str]:
    try:
        rows = await r.xpending_range("routerd:requests", "routerd", min="-", max="+", count=1000,
                                      consumername=consumer)
    except ResponseError as e:  # no group yet: a routerd just ready may not have made it (from id 0)
        if "NOGROUP" not in str(e):
            raise
        return []
    return [row["message_id"].decode() for row in rows]


@pytest.mark.timeout(240)
async def test_a_killed_replicas_jobs_are_taken_over_once_it_is_known_dead(
        redis_server: RedisServer, redis_async: aioredis.Redis, routerd_process: RouterdFactory,
        routerd_config: Any, sim_process: SimProcessFactory, tmp_path: Path) -> None:
    # Slowed 25 times while the doomed replica holds the jobs (~15 s of tokens each: still running when
    # the survivor is up and the doomed one is killed); at full speed again for the survivor's runs,
    # which only have to show the jobs were taken over, not wait out another 15 s each.
    sim = await sim_process(model="m", max_num_seqs=64, ttft_ms=5, itl_ms=2)
    await sim.set_faults(slow_factor=25.0)

    def cfg(name: str) -> dict[str, Any]:
        return routerd_config(
            daemon={"state_dir": str(tmp_path / name)},
            redis={"enabled": True, "url": redis_server.url, "consumer": name, "block_ms": 200,
                   "reclaim_idle_ms": RECLAIM_IDLE_MS, "reclaim_interval_s": 0.5},
            fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}])

    # The doomed replica first, so that it surely holds jobs (two started together: either may read
    # all 16); the survivor once it does.
    doomed = await asyncio.to_thread(routerd_process, cfg("a"))
    q = QueueClient(redis_async)
    bodies = [{"model": "m", "prompt": f"job {i}", "max_tokens": 300} for i in range(16)]
    jobs = await q.submit_many(bodies, reply_to="replies")
    deadline = time.monotonic() + 30
    while not await _pending(redis_async, "a"):
        assert time.monotonic() < deadline, doomed.log()
        await asyncio.sleep(0.05)
    survivor = await asyncio.to_thread(routerd_process, cfg("b"))
    await asyncio.sleep(1.5)  # several take-over passes of the survivor while both live
    assert _taken_over(survivor) == [], "jobs of a live consumer were taken over"

    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait(10)
    killed_at = time.monotonic()
    stranded = await _pending(redis_async, "a")
    assert stranded, "it died holding no job"
    await sim.clear_faults()
    # Known dead TTL_S after its last renewal; the jobs then run in a second. The old wait alone is 2
    # minutes.
    results = await q.wait_many(jobs, timeout=RECLAIM_IDLE_MS / 1000 * 0.75)
    took_s = time.monotonic() - killed_at
    assert all(r.status == "ok" for r in results.values()), results
    entries = await redis_async.xrange("replies")
    counts = Counter(msgspec.json.decode(f[b"result"])["id"] for _, f in entries if b"result" in f)
    assert set(counts) == {j.id for j in jobs}
    assert max(counts.values()) == 1  # exactly one each
    assert await eventually(lambda: sorted(_taken_over(survivor)) == sorted(stranded), 10), \
        (stranded, _taken_over(survivor))
    assert await _pending(redis_async, "a") == []
    print(f"{len(stranded)} jobs of the killed replica done {took_s:.1f} s after the kill "
          f"(liveness TTL {TTL_S:g} s, reclaim_idle_ms {RECLAIM_IDLE_MS})")
