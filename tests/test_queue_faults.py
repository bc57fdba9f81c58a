"""The queue path when Redis goes away, and its backpressure: nothing lost, nothing doubled, and the
backlog stays in Redis rather than in routerd's memory."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from routerd.client import QueueClient
from routerd.redis_conn import RedisConn
from routerd.redis_server import EmbeddedRedis, embedded_url
from tests.fixtures.redis_server import (
    FakeUpstream,
    QueueBench,
    QueueBenchFactory,
    RedisServer,
    fake_engines,
    queue_config,
)

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


async def result_counts(r: aioredis.Redis, reply_to: str) -> Counter[str]:
    entries = await r.xrange(reply_to)
    return Counter(msgspec.json.decode(f[b"result"])["id"] for _, f in entries)


async def wait_done(r: aioredis.Redis, reply_to: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await r.xlen(reply_to) >= n:
                return
        except (aioredis.ConnectionError, OSError):
            pass  # the server is being restarted by the test
        assert time.monotonic() < deadline, "results did not arrive in time"
        await asyncio.sleep(0.05)


async def run_through_outage(redis_server: RedisServer, redis_async: aioredis.Redis, *,
                             queue_bench: QueueBenchFactory, kill: bool) -> QueueBench:
    n = 1000
    bench = queue_bench(FakeUpstream(delay_s=0.002))
    jobs = await QueueClient(redis_async).submit_many([BODY] * n, reply_to="replies")
    await bench.start()
    await wait_done(redis_async, "replies", n // 4, timeout=20)
    if kill:
        await asyncio.to_thread(redis_server.kill)
        async with asyncio.timeout(10):  # routerd must notice and pause, not die
            while not bench.ingress.paused:  # noqa: ASYNC110  # a flag, no event to wait on
                await asyncio.sleep(0.02)
        assert bench.task is not None
        assert not bench.task.done()
        await asyncio.to_thread(redis_server.start)
    else:
        await asyncio.to_thread(redis_server.restart)
    await wait_done(redis_async, "replies", n, timeout=30)
    for _ in range(300):  # the reader resumes on its own backoff schedule (≤ 2 s)
        if not bench.ingress.paused:
            break
        await asyncio.sleep(0.02)
    resumed = not bench.ingress.paused
    await bench.stop()
    assert resumed
    counts = await result_counts(redis_async, "replies")
    assert set(counts) == {j.id for j in jobs}  # every job has a result...
    assert max(counts.values()) == 1  # ...exactly one
    assert (await redis_async.xpending("routerd:requests", "routerd"))["pending"] == 0
    return bench


async def test_redis_restarted_mid_run(redis_server: RedisServer, redis_async: aioredis.Redis,
                                       queue_bench: QueueBenchFactory) -> None:
    await run_through_outage(redis_server, redis_async, queue_bench=queue_bench, kill=False)


async def test_redis_killed_mid_run_then_back(redis_server: RedisServer, redis_async: aioredis.Redis,
                                              queue_bench: QueueBenchFactory) -> None:
    await run_through_outage(redis_server, redis_async, queue_bench=queue_bench, kill=True)


async def test_backlog_stays_in_redis(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                      redis_async: aioredis.Redis) -> None:
    hold = asyncio.Event()
    up = FakeUpstream(hold=hold)
    cfg = queue_config(redis_server.url)
    bench = queue_bench(up, ready=2, cfg=cfg)  # 2 instances × 64 in flight each = 128 slots
    n = 3000
    await QueueClient(redis_async).submit_many([BODY] * n, reply_to="replies")
    await bench.start()
    try:
        limit = 2 * cfg.admission.max_inflight_per_instance
        async with asyncio.timeout(10):
            while bench.ingress.held < limit:  # noqa: ASYNC110  # a count, no event to wait on
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # two more reads (block_ms 200): none may take more
        assert bench.ingress.held == limit  # exactly what the fleet can run, not the backlog
        assert up.concurrent == limit
        info = await redis_async.xinfo_groups("routerd:requests")
        assert info[0]["pending"] == limit
        assert info[0]["lag"] == n - limit  # the rest was never read: it is durable in Redis
        hold.set()
        await wait_done(redis_async, "replies", n, timeout=60)
    finally:
        hold.set()
        await bench.stop()
    assert up.max_concurrent == limit


@pytest.mark.redis  # starts its own redis-server, outside the fixtures that declare it
async def test_embedded_redis_supervised_and_durable(tmp_path: Path) -> None:
    directory = tmp_path / "redis"
    async with EmbeddedRedis(directory, restart_backoff_s=0.05) as url:
        assert url.startswith("unix://")
        assert embedded_url(directory) == url  # where `routerd submit --config` finds it
        client = aioredis.Redis.from_url(url, socket_timeout=5)
        try:
            await client.xadd("s", {"job": b"1"})
            embedded_pid = (await client.info("server"))["process_id"]
            # redis-server dies: the supervisor brings it back and the AOF brings the data back
            await client.shutdown(nosave=False)
            deadline = time.monotonic() + 10
            while True:
                try:
                    if await client.ping():
                        break
                except (aioredis.ConnectionError, OSError):
                    pass
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert (await client.info("server"))["process_id"] != embedded_pid
            assert await client.xlen("s") == 1
        finally:
            await client.aclose()
    assert (directory / "appendonlydir").is_dir()
    async with EmbeddedRedis(directory) as url:  # a second life on the same state dir
        client = aioredis.Redis.from_url(url, socket_timeout=5)
        try:
            assert await client.xlen("s") == 1
        finally:
            await client.aclose()


@pytest.mark.redis  # starts its own redis-server, outside the fixtures that declare it
async def test_embedded_redis_stops_when_a_restart_loses_its_cancel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py writes under ``asyncio.wait_for``, which on Python 3.11 returns normally when the write
    completes as a cancel arrives: the cancel is lost. One lost while the supervisor restarted
    redis-server kept it waiting on the new server for good, and routerd's exit with it (seen: a hang
    until the test timeout). Here every restart loses the cancel; stopping must still end, and leave no
    redis-server behind."""
    restarting = asyncio.Event()
    real_start = EmbeddedRedis._start

    async def start_losing_the_cancel(self: EmbeddedRedis) -> None:
        if self._proc is None:  # the first start
            return await real_start(self)
        restarting.set()
        start = asyncio.ensure_future(real_start(self))
        try:
            await asyncio.shield(start)
        except asyncio.CancelledError:
            await start  # as wait_for does: the inner result wins, the cancel is gone

    monkeypatch.setattr(EmbeddedRedis, "_start", start_losing_the_cancel)
    embedded = EmbeddedRedis(tmp_path / "redis", restart_backoff_s=0.0)
    async with asyncio.timeout(30):
        async with embedded:
            first = embedded.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            await restarting.wait()
        assert embedded.pid is None
    assert embedded.restarts == 1  # counted before the supervisor saw it was stopping and returned
    leftover = embedded._proc
    assert leftover is not None
    assert leftover.returncode is not None  # the restarted one stopped too


@pytest.mark.redis  # starts its own redis-server, outside the fixtures that declare it
async def test_daemon_wiring_embedded_redis(tmp_path: Path) -> None:
    """The way the daemon builds the queue path: embedded Redis, then the queue over the data plane's
    upstream and admission."""
    from routerd.ingress.queue import QueueIngress
    from routerd.tracing import Tracing

    async with EmbeddedRedis(tmp_path / "redis") as url:
        cfg = queue_config("embedded")
        parts = fake_engines(cfg, FakeUpstream())
        queue = QueueIngress.from_config(cfg, redis=RedisConn(url, cfg.redis, pooled=False),
                                         dispatch=parts.dispatch, admission=parts.admission,
                                         tenancy=parts.tenancy, tracing=Tracing.off())
        async with queue:
            task = asyncio.create_task(queue.run())
            client = aioredis.Redis.from_url(url, socket_timeout=5)
            try:
                q = QueueClient(client)
                result = await q.wait(await q.submit(BODY), timeout=10)
            finally:
                await client.aclose()
            queue.stop_intake()
            assert await queue.wait_idle(5)
            await asyncio.wait_for(task, 5)
    assert result.status == "ok"


@pytest.mark.redis  # starts its own redis-server, outside the fixtures that declare it
async def test_redis_password_from_the_environment(tmp_path: Path) -> None:
    from tests.fixtures.redis_server import RedisServer as Server

    server = Server(tmp_path, extra_args=("--requirepass", "s3cret"))
    server.start()
    try:
        raw = queue_config(server.url)
        cfg = parse_with_env(server.url, {"ROUTERD_REDIS_PASSWORD": "s3cret"})
        assert cfg.redis.password == "s3cret"
        assert raw.redis.password == ""
        bench = QueueBench(cfg, FakeUpstream())  # its own Redis, with a password: not queue_bench's
        client = aioredis.Redis.from_url(server.url, password="s3cret", socket_timeout=5)
        try:
            q = QueueClient(client)
            job = await q.submit(BODY)
            await bench.start()
            result = await q.wait(job, timeout=10)
            await bench.stop()
        finally:
            await client.aclose()
        assert result.status == "ok"
    finally:
        server.kill()


def parse_with_env(url: str, environ: dict[str, str]) -> Any:
    from routerd.config import parse

    return parse({"redis": {"url": url, "consumer": "c1", "block_ms": 200},
                  "fleets": [{"name": "f", "model": "m", "engine": "sim"}]}, environ=environ)


@pytest.mark.redis  # starts its own redis-server, outside the fixtures that declare it
async def test_embedded_redis_exit_keeps_the_callers_cancellation(tmp_path: Path) -> None:
    """Cancelling the task that is stopping embedded Redis must cancel it (never swallowed), and the
    redis-server must still be stopped."""
    er = EmbeddedRedis(tmp_path / "redis")
    await er.__aenter__()
    pid = er.pid
    assert pid is not None
    stopping = asyncio.create_task(er.__aexit__(None, None, None))
    await asyncio.sleep(0)  # it has cancelled the supervisor and waits for it
    stopping.cancel()
    await asyncio.wait([stopping])
    assert stopping.cancelled()
    assert er.pid is None  # redis-server was terminated all the same
