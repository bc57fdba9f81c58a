"""Redis behind Sentinel (issue 32): routerd follows the master through a failover.

Real processes throughout: a master, a replica and three ``redis-server --sentinel`` on loopback
(tests/fixtures/sentinel.py), a real ``routerd run`` over a sim engine, the producers' client. The
master is SIGKILLed; the sentinels promote the replica; nothing is told to reconnect.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis
import structlog

from routerd._net import free_port
from routerd.client import NotDurable, QueueClient, Submitted
from routerd.config import parse
from routerd.redis_conn import RedisConn
from routerd.redis_keys import RedisKeys
from routerd.redis_server import REDIS_DOWN
from routerd.submit import submit_main
from routerd.tenants.directory import Directory
from routerd.tenants.ratelimit import RateLimiter
from routerd.tenants.report import main as usage_main
from routerd.tenants.usage import UsageLedger, day_of
from routerd_bench._common import to_toml
from routerd_bench.scale_replicas import log_events
from tests.fixtures.daemon import RouterdFactory
from tests.fixtures.helpers import until
from tests.fixtures.sentinel import SentinelRedis
from tests.fixtures.sim import SimProcessFactory

JOBS = 2000


async def _no_master_s(conn: RedisConn, stop: asyncio.Event) -> float:
    """The longest time writes through the sentinels failed (``INCR`` every 20 ms) until ``stop``."""
    r = conn.ops()
    last_ok, longest = time.monotonic(), 0.0
    while not stop.is_set():
        try:
            await r.incr("probe")
            now = time.monotonic()
            longest, last_ok = max(longest, now - last_ok), now
        except REDIS_DOWN:
            pass
        await asyncio.sleep(0.02)
    return longest


async def _submit_all(q: QueueClient, bodies: list[dict[str, Any]], unconfirmed: list[str],
                      ) -> list[Submitted]:
    """Every job submitted durably, 100 a batch. A batch that failed (no master) is sent again with the
    same job ids — routerd keeps one result per job id; one the master queued but no replica confirmed
    (the promoted master has none until the old one rejoins) is kept, its ids noted in ``unconfirmed``."""
    ids = [f"job-{i}" for i in range(len(bodies))]
    out: list[Submitted] = []
    for i in range(0, len(bodies), 100):
        while True:
            try:
                out += await q.submit_many(bodies[i:i + 100], job_ids=ids[i:i + 100], durable=True)
                break
            except NotDurable as e:
                out += e.jobs
                unconfirmed += [j.id for j in e.jobs]
                break
            except REDIS_DOWN:
                await asyncio.sleep(0.05)
    return out


async def _http_traffic(url: str, stop: asyncio.Event) -> Counter[int]:
    """Completions over HTTP, four at a time, until ``stop``: the statuses they got."""
    statuses: Counter[int] = Counter()

    async def one_at_a_time(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with session.post(f"{url}/v1/completions",
                                    json={"model": "m", "prompt": "hi", "max_tokens": 2}) as resp:
                await resp.read()
                statuses[resp.status] += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(one_at_a_time(session) for _ in range(4)))
    return statuses


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_failover_mid_queue_loses_no_job_and_answers_each_once(
        sentinel_redis: SentinelRedis, routerd_process: RouterdFactory, routerd_config: Any,
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    """2,000 jobs in flight, the master SIGKILLed at a random moment: every job submitted durably is
    answered, once as the producer sees it (a result stored twice carries the same job id), HTTP
    requests are served throughout, and the time without a master is measured."""
    sim = await sim_process(model="m", max_num_seqs=256, ttft_ms=1, itl_ms=1)
    redis = sentinel_redis.redis(consumer="a", block_ms=200, reclaim_idle_ms=3000, reclaim_interval_s=0.5,
                                 op_timeout_s=1.0)
    rp = await asyncio.to_thread(routerd_process, routerd_config(
        redis={"enabled": True, **redis}, admission={"max_inflight_per_instance": 256},
        fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}]))
    cfg = parse({"redis": redis}, environ={})
    probe = RedisConn(cfg.redis.url, cfg.redis)
    stop_probe, stop_http = asyncio.Event(), asyncio.Event()
    probing = asyncio.create_task(_no_master_s(probe, stop_probe))
    http = asyncio.create_task(_http_traffic(rp.url, stop_http))
    bodies = [{"model": "m", "prompt": f"job {i}", "max_tokens": 2} for i in range(JOBS)]
    async with QueueClient.from_config(cfg.redis) as q:
        unconfirmed: list[str] = []
        submitting = asyncio.create_task(_submit_all(q, bodies, unconfirmed))
        await asyncio.sleep(random.uniform(0.2, 2.0))  # somewhere in the submissions and the runs
        old = await asyncio.to_thread(sentinel_redis.kill_master)
        killed = time.monotonic()
        new = await asyncio.to_thread(sentinel_redis.wait_promoted, old)
        promoted_s = time.monotonic() - killed
        await asyncio.to_thread(sentinel_redis.rejoin, old, new)  # a replica again for WAIT
        jobs = await submitting
        results = await q.wait_many(jobs, timeout=100)
        stop_probe.set()
        stop_http.set()
        no_master_s = await probing
        statuses = await http
        await probe.aclose()
        assert {j.id for j in jobs} == {f"job-{i}" for i in range(JOBS)}
        assert set(results) == {j.id for j in jobs}
        assert {r.status for r in results.values()} == {"ok"}, Counter(r.status for r in results.values())
        assert all(r.id == job_id for job_id, r in results.items())
        again = await q.wait_many(jobs, timeout=30)  # asked again: the same (first) result each
        assert all(again[j] is results[j] for j in results)
        # Each reply stream: results of its own job only; two when a stored result was lost with the
        # old master and the job ran again — the client kept the first.
        new_r = aioredis.Redis(port=new.port, socket_timeout=10)
        twice = 0
        try:
            for j in jobs:
                ids = [msgspec.json.decode(f[b"result"])["id"] for _, f in await new_r.xrange(j.reply_to)
                       if b"result" in f]
                assert set(ids) <= {j.id}, ids
                twice += len(ids) > 1
        finally:
            await new_r.aclose()
    assert set(statuses) == {200}, statuses
    masters = [e.get("master") for e in log_events(rp.log_path, "redis_master")]
    assert masters[-1] == f"127.0.0.1:{new.port}", masters  # the routerd saw the failover
    print(f"\nfailover: master SIGKILLed, replica promoted by the sentinels in {promoted_s:.1f} s; "
          f"writes through the sentinels failed for {no_master_s:.1f} s; {JOBS} jobs answered once each "
          f"({twice} stored twice, the first kept); {sum(statuses.values())} HTTP requests, all 200")


@pytest.mark.timeout(120)
async def test_rate_limits_usage_and_the_tools_use_the_promoted_master(
        sentinel_redis: SentinelRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With the master gone the rate limiter decides locally (logged once) and usage keeps its
    increments; both reach the promoted replica by themselves, nothing reconnected by hand. ``routerd
    submit`` and ``routerd usage`` with the same config find it through the sentinels too."""
    raw = {"redis": sentinel_redis.redis(op_timeout_s=1.0),
           "tenants": [{"name": "t", "api_keys": ["k-t"], "requests_per_minute": 100_000}],
           "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": ["http://127.0.0.1:1"]}]}
    cfg = parse(raw, environ={})
    conn = RedisConn(cfg.redis.url, cfg.redis)
    keys = RedisKeys(stream=cfg.redis.stream)
    tenant = Directory(cfg).get("t")
    assert tenant is not None
    limiter = RateLimiter(conn.ops, keys)
    usage = UsageLedger(conn.ops, keys, retention_days=1, flush_interval_s=0.1, op_timeout_s=1.0)
    running = [asyncio.create_task(limiter.run()), asyncio.create_task(usage.run())]
    try:
        await until(lambda: _shared_grant(limiter, tenant), 10, "a check answered by Redis")
        with structlog.testing.capture_logs() as logs:
            old = await asyncio.to_thread(sentinel_redis.kill_master)
            await until(lambda: _down(limiter, tenant), 30, "the checks find the master gone")
            usage.add("t", "f", requests=1, prompt_tokens=5, completion_tokens=7)
            assert (await limiter.acquire(tenant, 10)).allowed  # decided here meanwhile
            new = await asyncio.to_thread(sentinel_redis.wait_promoted, old)
            await until(lambda: _shared_grant(limiter, tenant), 30, "checks answered by the new master")
        events = [e["event"] for e in logs if e["event"].startswith("rate_limits_")]
        assert events == ["rate_limits_local", "rate_limits_shared"], events  # one line each way
        r = aioredis.Redis(port=new.port, socket_timeout=5)
        try:
            assert await r.exists(keys.ratelimit("t"))
            await until(lambda: _usage_on(r, keys, "t|f|prompt_tokens", 5), 30, "usage on the new master")
            path = tmp_path / "routerd.toml"
            path.write_text(to_toml(raw))
            capsys.readouterr()
            assert await asyncio.to_thread(submit_main, ["--config", str(path), "hi"]) == 0
            job_id = capsys.readouterr().out.strip()
            queued = [msgspec.json.decode(f[b"job"])["id"] for _, f in await r.xrange(keys.stream)]
            assert queued == [job_id]
            assert await asyncio.to_thread(usage_main, ["--config", str(path), "--json"]) == 0
            assert msgspec.json.decode(capsys.readouterr().out)["totals"]["prompt_tokens"] == 5
        finally:
            await r.aclose()
    finally:
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await conn.aclose()


async def _shared_grant(limiter: RateLimiter, tenant: Any) -> bool:
    grant = await limiter.acquire(tenant, 10)
    return grant.allowed and limiter.shared


async def _down(limiter: RateLimiter, tenant: Any) -> bool:
    await limiter.acquire(tenant, 10)
    return not limiter.shared


async def _usage_on(r: aioredis.Redis, keys: RedisKeys, field: str, at_least: int) -> bool:
    value = await r.hget(keys.usage(day_of(time.time())), field)
    return value is not None and int(value) >= at_least


@pytest.mark.timeout(120)
async def test_a_service_name_no_sentinel_knows_and_wrong_addresses_are_said_once_and_in_readyz(
        sentinel_redis: SentinelRedis, routerd_process: RouterdFactory, routerd_config: Any,
        sim_process: SimProcessFactory) -> None:
    """A routerd whose sentinels know no master by its ``service_name`` starts, stays up, says so in
    one log line and in ``/readyz`` (503: it never had Redis); wrong sentinel addresses likewise."""
    sim = await sim_process(model="m")
    rp = await asyncio.to_thread(routerd_process, routerd_config(
        redis={"enabled": True, **sentinel_redis.redis(service_name="nope", op_timeout_s=1.0)},
        fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}]))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{rp.url}/readyz") as resp:
            body = await resp.json()
            assert resp.status == 503
        assert body["redis"] == "no sentinel knows a master named 'nope' (they know: routerd-test)"
        await asyncio.sleep(3)  # several checks of the sentinels later
        assert rp.proc.poll() is None  # no crash, so no crash loop
        said = log_events(rp.log_path, "redis_sentinel_unknown_service")
        assert len(said) == 1, said
        assert len(log_events(rp.log_path, "batches_redis_unavailable")) <= 1  # polled each second

    nowhere = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    problem, unready = await _first_check({"url": "redis:///0", "service_name": "routerd-test",
                                           "op_timeout_s": 1.0, "sentinels": nowhere})
    assert unready
    assert problem.startswith(f"no sentinel answers ({', '.join(nowhere)}): ConnectionError")
    # Sentinels with ACL users: SENTINEL MASTERS is the one right routerd's needs; a wrong password is
    # said as the sentinels' refusal.
    for s in sentinel_redis.sentinels:
        with s.client() as c:
            c.execute_command("ACL", "SETUSER", "rt", "on", ">pw", "-@all", "+sentinel|masters")
    user = sentinel_redis.redis(sentinel_username="rt", sentinel_password="pw")
    assert await _first_check(user) == ("", False)
    problem, unready = await _first_check({**user, "sentinel_password": "no"})
    assert unready
    assert "AuthenticationError" in problem


async def _first_check(redis: dict[str, Any]) -> tuple[str, bool]:
    """What a routerd with these ``[redis]`` settings would say of its Redis after the first check."""
    cfg = parse({"redis": redis}, environ={})
    conn = RedisConn(cfg.redis.url, cfg.redis)
    watch = conn.watch
    assert watch is not None
    watching = asyncio.create_task(watch.run())
    try:
        await until(watch.checked.is_set, 10, "a first check")
        return conn.health()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await conn.aclose()


@pytest.mark.timeout(60)
async def test_a_planned_failover_moves_every_connection_off_the_old_master(
        sentinel_redis: SentinelRedis) -> None:
    """``SENTINEL FAILOVER`` leaves the old master running — and taking writes, which its demotion (some
    10 s later) throws away. Once routerd's watch sees the new master, every connection has left it; a
    producer's client, which has no watch, asks the sentinels itself and leaves it within seconds."""
    cfg = parse({"redis": sentinel_redis.redis(op_timeout_s=1.0)}, environ={})
    conn = RedisConn(cfg.redis.url, cfg.redis)
    watch = conn.watch
    assert watch is not None
    watching = asyncio.create_task(watch.run())
    r = conn.ops()
    q = QueueClient.from_config(cfg.redis)
    try:
        await until(lambda: bool(watch.master), 10, "the master named")
        assert await r.incr("n") == 1  # a connection to the master now
        await q.submit({"model": "m", "prompt": "x"})  # and the producer's
        old = await asyncio.to_thread(sentinel_redis.failover)
        new = await asyncio.to_thread(sentinel_redis.wait_promoted, old)
        await until(lambda: watch.master == f"127.0.0.1:{new.port}", 10, "the watch sees the new master")
        written = await r.incr("n")
        with new.client() as on_new, old.client() as on_old:
            assert on_old.execute_command("ROLE")[0] == b"master"  # not demoted yet: writes would stay
            assert int(on_new.get("n") or 0) == written

        async def lands_on_new() -> bool:
            job = await q.submit({"model": "m", "prompt": "y"})
            with new.client() as on_new:
                return bool(on_new.xrange(q.keys.stream, job.entry, job.entry))

        await until(lands_on_new, 5, "a submit reaching the new master before the old one is demoted")
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await q.aclose()
        await conn.aclose()
