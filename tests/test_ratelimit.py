"""Rate limits and usage under bad input and Redis errors (issue 18): one request, one tenant's key or
one error reply stays with itself — the batching loop every tenant's checks go through goes on, the
other tenants stay on the shared buckets, and an error is logged as the error it is."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog

from routerd.config import Config
from routerd.redis_conn import RedisConn
from routerd.tenants.directory import Tenant
from routerd.tenants.ratelimit import LocalBuckets
from routerd.tenants.service import Tenancy
from routerd.tenants.usage import day_of
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory
from tests.test_tenants_e2e import config, post, routerd, wait_until

pytestmark = [pytest.mark.redis]

_NO_ENGINE = ["http://127.0.0.1:1"]


@contextlib.asynccontextmanager
async def running(cfg: Config, url: str) -> AsyncIterator[Tenancy]:
    tenancy = Tenancy(cfg, RedisConn(url, cfg.redis, pooled=False))
    task = asyncio.create_task(tenancy.run())
    try:
        yield tenancy
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _tenant(tenancy: Tenancy, name: str) -> Tenant:
    t = tenancy.tenant(name)
    assert t is not None
    return t


def _events(logs: list[dict[str, Any]]) -> set[str]:
    return {e["event"] for e in logs}


@pytest.mark.slow
async def test_a_rate_limit_check_that_cannot_be_sent_fails_its_request_alone(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """A limit msgpack cannot carry (what a config could hold before the loader bounded it) ended the
    batching task, the data plane's TaskGroup with it, and routerd exited 1. Now that request gets an
    OpenAI-style 500 and every other request goes on being checked against Redis."""
    sim = await sim_process(model="m", ttft_ms=0, itl_ms=0)
    tenants = [{"name": "good", "api_keys": ["sk-good"], "requests_per_minute": 100},
               {"name": "bad", "api_keys": ["sk-bad"], "requests_per_minute": 100}]
    cfg = config(redis_server.url, [sim.url], tenants)
    # The value itself no longer passes the loader: put it in the loaded tree the way a reload would.
    bad = msgspec.structs.replace(cfg.tenants[1], requests_per_minute=10**20)
    async with routerd(cfg) as rd, aiohttp.ClientSession() as s:
        await rd.dp.apply(msgspec.structs.replace(cfg, tenants=[cfg.tenants[0], bad]))
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        with structlog.testing.capture_logs() as logs:
            status, _, answer = await post(s, rd.url, body, "sk-bad")
        assert status == 500
        error = msgspec.json.decode(answer)["error"]
        assert "rate limit" in error["message"]
        assert "OverflowError" in error["message"]
        failed = [e for e in logs if e["event"] == "rate_limit_batch_failed"]
        assert failed
        assert failed[0]["tenants"] == ["bad"]
        assert failed[0].get("exc_info")
        for _ in range(3):
            status, headers, _ = await post(s, rd.url, body, "sk-good")
            assert status == 200
        assert headers["x-ratelimit-remaining-requests"] == "97"  # from the shared bucket
        r = redis_server.client()
        assert float(r.hget("routerd:ratelimit:good", "r") or 0) < 98  # the checks went to Redis
        assert rd.dp.serving.tenancy.limiter.shared
        assert rd.dp.serving.tenancy.limiter.redis_errors == 0
        alive = {t.get_name() for t in asyncio.all_tasks() if not t.done()}
        assert {"tenancy", "tenant-limits", "tenant-usage"} <= alive  # the loop that would have ended


async def test_a_bucket_key_of_another_type_is_its_tenant_s_alone_and_logged_as_that_error(
        redis_server: RedisServer) -> None:
    """A stream at one tenant's bucket key (a producer's ``reply_to`` named it) made every script call
    fail WRONGTYPE, logged as "Redis did not answer", and this routerd enforced every tenant's limits
    alone for good. Now that tenant alone is decided here, and the log says WRONGTYPE."""
    cfg = config(redis_server.url, _NO_ENGINE, [{"name": "broken", "requests_per_minute": 3},
                                                 {"name": "fine", "requests_per_minute": 5}])
    r = redis_server.client()
    r.xadd("routerd:ratelimit:broken", {"result": "{}"})
    async with running(cfg, redis_server.url) as tenancy:
        broken, fine = _tenant(tenancy, "broken"), _tenant(tenancy, "fine")
        with structlog.testing.capture_logs() as logs:
            answers = [(await tenancy.limiter.acquire(broken, 1)).allowed for _ in range(4)]
            grants = [await tenancy.limiter.acquire(fine, 1) for _ in range(2)]
        assert answers == [True, True, True, False]  # its limit still holds, in this process
        assert [g.requests_left for g in grants] == [4, 3]
        assert float(r.hget("routerd:ratelimit:fine", "r") or 0) < 4  # shared, in Redis
        assert tenancy.limiter.shared
        assert r.type("routerd:ratelimit:broken") == b"stream"  # routerd does not destroy what is there
        errors = [e for e in logs if e["event"] == "rate_limit_bucket_error"]
        assert len(errors) == 1  # not once per request
        assert errors[0]["tenant"] == "broken"
        assert "WRONGTYPE" in errors[0]["error"]
        assert "rate_limits_local" not in _events(logs)


async def test_an_error_reply_is_logged_as_an_error_not_as_redis_away(redis_server: RedisServer) -> None:
    """Redis refusing the script (here: out of memory) is not a time-out: the log names the error."""
    cfg = config(redis_server.url, _NO_ENGINE, [{"name": "a", "requests_per_minute": 3}])
    r = redis_server.client()
    async with running(cfg, redis_server.url) as tenancy:
        a = _tenant(tenancy, "a")
        assert (await tenancy.limiter.acquire(a, 1)).requests_left == 2
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", "1")
        try:
            with structlog.testing.capture_logs() as logs:
                assert (await tenancy.limiter.acquire(a, 1)).allowed  # decided here meanwhile
        finally:
            r.config_set("maxmemory", "0")
        refused = [e for e in logs if e["event"] == "rate_limits_redis_error"]
        assert refused
        assert "OutOfMemoryError" in refused[0]["error"]
        assert "maxmemory" in refused[0]["error"]
        assert "rate_limits_local" not in _events(logs)


async def test_a_dimension_without_a_limit_keeps_no_debt_for_a_limit_added_later(
        redis_server: RedisServer) -> None:
    """49 requests while only tokens were limited left the request bucket at -48; a reload adding
    requests_per_minute = 100 then answered 429 at once."""
    cfg = config(redis_server.url, _NO_ENGINE, [{"name": "t", "tokens_per_minute": 100_000}])
    r = redis_server.client()
    async with running(cfg, redis_server.url) as tenancy:
        t = _tenant(tenancy, "t")
        for _ in range(49):
            assert (await tenancy.limiter.acquire(t, 1)).allowed
        assert r.hget("routerd:ratelimit:t", "r") is None
        limited = dataclasses.replace(t, requests_per_minute=100)
        grant = await tenancy.limiter.acquire(limited, 1)
        assert grant.allowed
        assert grant.requests_left == 99
        # and the other way round: a request limit only, then tokens limited too
        only_requests = dataclasses.replace(t, tokens_per_minute=0, requests_per_minute=100)
        for _ in range(5):
            tenancy.limiter.settle(only_requests, 0, 1000)
        await wait_until(lambda: r.hget("routerd:ratelimit:t", "t") is None, timeout=10)
        grant = await tenancy.limiter.acquire(dataclasses.replace(t, requests_per_minute=100), 10)
        assert grant.allowed
        assert grant.tokens_left == 100_000 - 10


async def test_an_absurd_usage_report_caps_the_debt_and_stays_in_its_batch(redis_server: RedisServer) -> None:
    """An engine reporting 10**30 tokens: the correction is clamped (msgpack carries it, the batch it
    travels in is not lost) and the debt is capped at an hour of the limit, not forever."""
    cfg = config(redis_server.url, _NO_ENGINE, [{"name": "a", "tokens_per_minute": 1000},
                                                 {"name": "b", "requests_per_minute": 10}])
    async with running(cfg, redis_server.url) as tenancy:
        a, b = _tenant(tenancy, "a"), _tenant(tenancy, "b")
        assert (await tenancy.limiter.acquire(a, 10)).allowed
        tenancy.limiter.settle(a, 0, 10**30)
        refused = await tenancy.limiter.acquire(a, 10)
        assert not refused.allowed
        assert 59 * 60_000 < refused.tokens_reset_ms <= 61 * 60_000
        assert (await tenancy.limiter.acquire(b, 1)).requests_left == 9
        assert tenancy.limiter.shared
        assert tenancy.limiter.redis_errors == 0


def test_local_buckets_keep_no_debt_for_a_dimension_without_a_limit() -> None:
    now = [0.0]
    local = LocalBuckets(clock=lambda: now[0])
    t = Tenant("t", tokens_per_minute=100_000)
    for _ in range(49):
        assert local.apply(t, 1, 1, check=True).allowed
    grant = local.apply(dataclasses.replace(t, requests_per_minute=100), 1, 1, check=True)
    assert grant.allowed
    assert grant.requests_left == 99
    local.apply(t, 0, 10**30, check=False)
    refused = local.apply(t, 1, 1, check=True)
    assert not refused.allowed
    assert refused.retry_after_ms <= 61 * 60_000


async def test_a_usage_increment_redis_refuses_is_dropped_not_retried_with_the_others(
        redis_server: RedisServer) -> None:
    """One field Redis refuses (here: not an integer) failed the whole pipeline, whose other increments
    Redis had applied; the batch was kept and written again every second, adding them again each time."""
    cfg = config(redis_server.url, _NO_ENGINE, [{"name": "a"}, {"name": "b"}])
    r = redis_server.client()
    day = day_of(time.time())
    r.hset(f"routerd:usage:{day}", "a|f|requests", "not a number")
    async with running(cfg, redis_server.url) as tenancy:
        ledger = tenancy.ledger
        ledger.add("a", "f", requests=1)
        ledger.add("b", "f", requests=1, prompt_tokens=7)
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                await ledger.flush()
    written = r.hgetall(f"routerd:usage:{day}")
    assert (written[b"b|f|requests"], written[b"b|f|prompt_tokens"]) == (b"1", b"7")  # once, not 3 times
    refused = [e for e in logs if e["event"] == "usage_write_refused"]
    assert len(refused) == 1
    assert refused[0]["field"] == "a|f|requests"
    assert "not an integer" in refused[0]["error"]
