"""The queue path through real components: simulated engines in their own processes, the real data
plane (router, upstream over HTTP, static-fleet health), a real redis-server — and, for the crash test,
the consumer itself in a subprocess that is SIGKILLed mid-run.

Every result is checked one for one: the simulated engine's text depends only on (prompt, max_tokens),
so each job's result must be exactly ``expected_text`` for its own prompt.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from routerd.client import QueueClient, Submitted
from routerd.config import Config, parse
from routerd.ingress.queue import QueueIngress
from routerd.sim_tokens import expected_text
from routerd_bench.queue import queue_path, start_engines, wait_http, wait_ready
from tests.fixtures.helpers import starts
from tests.fixtures.redis_server import RedisServer

pytestmark = pytest.mark.slow


class Engines:
    def __init__(self, procs: list[subprocess.Popen[bytes]], urls: list[str]) -> None:
        self.procs, self.urls = procs, urls


@pytest.fixture
@starts("subprocess")
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    ttft_ms, itl_ms = getattr(request, "param", (0.0, 0.0))
    procs, urls = start_engines(2, "m", 256, ttft_ms=ttft_ms, itl_ms=itl_ms)
    try:
        asyncio.run(wait_http(urls, 30))
        yield Engines(procs, urls)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(10)


def e2e_config(redis_url: str, urls: list[str], **redis: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"url": redis_url, "consumer": "e2e", "block_ms": 200,
                                "reclaim_idle_ms": 1000, "reclaim_interval_s": 0.25,
                                "max_deliveries": 5}
    settings.update(redis)
    return {"redis": settings, "admission": {"max_inflight_per_instance": 128},
            "routing": {"scrape_interval_s": 0.1, "stale_after_s": 1.0, "retry_backoff_ms": 5},
            "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": urls,
                        "max_num_seqs": 256}]}


@pytest.fixture
async def consumer(redis_server: RedisServer, engines: Engines) -> AsyncIterator[QueueIngress]:
    cfg: Config = parse(e2e_config(redis_server.url, engines.urls), environ={})
    async with queue_path(cfg, redis_server.url) as routerd:
        ingress = routerd.queue
        assert ingress is not None
        await wait_ready(routerd.registry, ["f"], 15)
        task = asyncio.create_task(ingress.run())
        try:
            yield ingress
        finally:
            ingress.stop_intake()
            await asyncio.wait_for(task, 30)


def jobs_spec(n: int, stream_every: int = 0) -> list[dict[str, Any]]:
    """``n`` jobs. The fault tests size theirs so that the fault lands about a fifth of the way in: jobs
    done, jobs in flight (all the fleet admits, 2 × 128 here) and hundreds still unread in the stream —
    the fault meets work in every stage and reading goes on after it. More jobs only take longer."""
    return [{"model": "m", "prompt": f"job {i} says hello", "max_tokens": 1 + i % 4,
             **({"stream": True} if stream_every and i % stream_every == 0 else {})} for i in range(n)]


async def check_one_for_one(r: aioredis.Redis, jobs: list[Submitted], bodies: list[dict[str, Any]],
                            reply_to: str) -> None:
    entries = await r.xrange(reply_to)
    results = [msgspec.json.decode(f[b"result"]) for _, f in entries if b"result" in f]
    counts = Counter(res["id"] for res in results)
    assert set(counts) == {j.id for j in jobs}
    assert max(counts.values()) == 1  # exactly one result per job id
    by_id = {res["id"]: res for res in results}
    chunks: dict[str, list[str]] = {}
    for _, f in entries:
        if b"chunk" in f:
            c = msgspec.json.decode(f[b"chunk"])
            chunks.setdefault(c["id"], []).append((c["delivery"], c["seq"], c["data"]["choices"][0]["text"]))
    for job, body in zip(jobs, bodies, strict=True):
        res = by_id[job.id]
        assert res["status"] == "ok", res
        want = expected_text(0, body["prompt"], body["max_tokens"])
        if body.get("stream"):
            run = res["response"]["delivery"]
            got = [(seq, text) for d, seq, text in chunks[job.id] if d == run]
            assert [s for s, _ in got] == list(range(len(got)))
            assert "".join(t for _, t in got) == want
        else:
            assert res["response"]["choices"][0]["text"] == want
    info = await r.xpending("routerd:requests", "routerd")
    assert info["pending"] == 0


async def wait_progress(r: aioredis.Redis, reply_to: str, n: int, timeout: float) -> None:
    """Until ``reply_to`` holds ``n`` entries (results and chunks): the run is well under way."""
    deadline = time.monotonic() + timeout
    while int(await r.xlen(reply_to)) < n:
        assert time.monotonic() < deadline, f"fewer than {n} replies arrived"
        await asyncio.sleep(0.02)


async def test_10000_jobs_checked_one_for_one(redis_server: RedisServer, redis_async: aioredis.Redis,
                                              consumer: QueueIngress) -> None:
    bodies = jobs_spec(10_000)
    q = QueueClient(redis_async)
    started = time.perf_counter()
    jobs = await q.submit_many(bodies, reply_to="replies")
    await q.wait_many(jobs, timeout=60)
    elapsed = time.perf_counter() - started
    await check_one_for_one(redis_async, jobs, bodies, "replies")
    print(f"10000 jobs in {elapsed:.2f}s = {10_000 / elapsed:.0f} jobs/s")


@pytest.mark.parametrize("engines", [(2.0, 20.0)], indirect=True)
async def test_engine_killed_mid_run(redis_server: RedisServer, redis_async: aioredis.Redis,
                                     engines: Engines, consumer: QueueIngress) -> None:
    bodies = jobs_spec(1000, stream_every=5)
    q = QueueClient(redis_async)
    jobs = await q.submit_many(bodies, reply_to="replies")
    await wait_progress(redis_async, "replies", 200, 30)
    engines.procs[0].kill()  # SIGKILL: connections drop mid-response, streams break mid-way
    await q.wait_many(jobs, timeout=60)
    await check_one_for_one(redis_async, jobs, bodies, "replies")


async def test_redis_restarted_mid_run_real_path(redis_server: RedisServer, redis_async: aioredis.Redis,
                                                 consumer: QueueIngress) -> None:
    bodies = jobs_spec(1500, stream_every=7)
    q = QueueClient(redis_async)
    jobs = await q.submit_many(bodies, reply_to="replies")
    await wait_progress(redis_async, "replies", 300, 30)
    await asyncio.to_thread(redis_server.restart)  # SIGTERM (AOF flushed), same port and dir
    await q.wait_many(jobs, timeout=60)
    await check_one_for_one(redis_async, jobs, bodies, "replies")
    for _ in range(300):  # the reader resumes on its own backoff schedule (≤ 2 s)
        if not consumer.paused:
            break
        await asyncio.sleep(0.02)
    assert not consumer.paused


def _toml(cfg: dict[str, Any]) -> str:
    enc = msgspec.json.encode  # TOML basic strings and arrays are JSON-compatible for these values
    lines = []
    for section in ("redis", "admission", "routing"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {enc(v).decode()}" for k, v in cfg[section].items()]
    for fleet in cfg["fleets"]:
        lines.append("[[fleets]]")
        lines += [f"{k} = {enc(v).decode()}" for k, v in fleet.items()]
    return "\n".join(lines) + "\n"


def _serve(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "routerd", "bench", "queue", "serve",
                                 "--config", str(config)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("engines", [(5.0, 2.0)], indirect=True)
async def test_sigkill_consumer_mid_run_then_restart(redis_server: RedisServer,
                                                     redis_async: aioredis.Redis, engines: Engines,
                                                     tmp_path: Path) -> None:
    config = tmp_path / "routerd.toml"
    config.write_text(_toml(e2e_config(redis_server.url, engines.urls)))
    bodies = jobs_spec(1500, stream_every=6)
    q = QueueClient(redis_async)
    jobs = await q.submit_many(bodies, reply_to="replies")
    proc = _serve(config, tmp_path / "consumer.log")
    try:
        await wait_progress(redis_async, "replies", 400, 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        stranded = (await redis_async.xpending("routerd:requests", "routerd"))["pending"]
        assert stranded > 0  # it really died holding jobs
        proc = _serve(config, tmp_path / "consumer.log")  # same consumer name: takes them back
        await q.wait_many(jobs, timeout=90)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    await check_one_for_one(redis_async, jobs, bodies, "replies")
    assert proc.returncode == 0  # the second life drained and exited cleanly on SIGTERM
    log = (tmp_path / "consumer.log").read_text()
    recovered = log.count("how=recovered") + log.count('"how":"recovered"')
    assert recovered == stranded  # took back exactly what the first life left pending
