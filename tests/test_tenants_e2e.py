"""Tenants end to end: real Redis, simulated engines as processes, HTTP and the queue at once, and two
routerd processes sharing one Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from routerd.assembly import Routerd as Assembled
from routerd.assembly import running
from routerd.client import QueueClient
from routerd.config import Config, RedisConfig, parse
from routerd.ingress.queue import QueueIngress
from routerd.redis_conn import RedisConn, redis_client
from routerd.redis_keys import RedisKeys
from routerd.registry import Registry
from routerd.tenants.service import Tenancy
from routerd.tenants.usage import UsageLedger, day_of, read_days
from routerd.vllm_wire.metrics_text import parse as parse_metrics
from tests.fixtures.daemon import RouterdFactory, to_toml
from tests.fixtures.helpers import eventually
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory, sim_processes

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def config(redis_url: str, urls: list[str], tenants: list[dict[str, Any]], **admission: Any) -> Config:
    return parse({
        "http": {"host": "127.0.0.1", "port": 0},
        "redis": {"url": redis_url, "consumer": "t1", "block_ms": 100, "reclaim_interval_s": 0.5,
                  "op_timeout_s": 2.0},
        "routing": {"scrape_interval_s": 0.05, "scrape_timeout_s": 0.5, "stale_after_s": 1.0,
                    "retry_backoff_ms": 1},
        "admission": admission,
        "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": urls, "max_num_seqs": 4}],
        "tenants": tenants}, environ={})


@dataclass
class Routerd:
    url: str
    dp: Assembled
    queue: QueueIngress

    def served(self, tenant: str) -> int:
        return self.dp.serving.tenancy.ledger.totals.get((tenant, "f"), [0])[0]

    def admitted(self, tenant: str) -> int:
        """Slots given to ``tenant``'s requests: counted by routerd, so a stall of this process (while the
        engines go on) does not move it."""
        return int(sum(st["admitted_total"] for name, _, st in self.dp.admission.tenant_stats()
                       if name == tenant))


@contextlib.asynccontextmanager
async def routerd(cfg: Config) -> AsyncIterator[Routerd]:
    """One routerd in this process: the data plane, its HTTP listener and its queue consumer."""
    registry = Registry()
    async with running(cfg, registry) as dp:
        assert dp.queue is not None
        deadline = time.monotonic() + 20
        while any(registry.ready_count(f.name) < len(f.urls) for f in cfg.fleets):
            assert time.monotonic() < deadline, dp.status()
            await asyncio.sleep(0.05)
        yield Routerd(dp.url, dp, dp.queue)


async def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str | None = None,
               endpoint: str = "/v1/completions") -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with s.post(url + endpoint, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def engine_tokens(s: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """(prompt, generation) tokens the engines counted, from their own ``/metrics``."""
    prompt = generation = 0.0
    for url in urls:
        async with s.get(url + "/metrics") as r:
            snap = parse_metrics(await r.text(), 0.0)
        prompt += snap.prompt_tokens
        generation += snap.generation_tokens
    return prompt, generation


# -- rate limits ----------------------------------------------------------------------------------------
async def test_rate_limits_hold_across_two_routerds_sharing_one_redis(
        redis_server: RedisServer, sim_process: SimProcessFactory, routerd_process: RouterdFactory,
        routerd_config: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    sim = await sim_process(model="m", max_num_seqs=8, ttft_ms=1, itl_ms=1)

    def cfg(consumer: str) -> dict[str, Any]:
        return routerd_config(  # two replicas: each its own state dir (one routerd per dir)
            daemon={"state_dir": str(tmp_path / consumer)},
            redis={"enabled": True, "url": redis_server.url, "consumer": consumer},
            fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url], "max_num_seqs": 8}],
            tenants=[{"name": "team", "api_keys": ["sk-team"], "requests_per_minute": 6}])

    first, second = routerd_process(cfg("r1")), routerd_process(cfg("r2"))
    answers = []
    async with aiohttp.ClientSession() as s:
        for i in range(10):
            answers.append(await post(s, (first, second)[i % 2].url,
                                      {"model": "m", "prompt": "hi", "max_tokens": 2}, "sk-team"))
    ok = [h for status, h, _ in answers if status == 200]
    refused = [(h, body) for status, h, body in answers if status == 429]
    assert [len(ok), len(refused)] == [6, 4], [a[0] for a in answers]  # one bucket for both processes
    assert sorted(int(h["x-ratelimit-remaining-requests"]) for h in ok) == [0, 1, 2, 3, 4, 5]
    assert all(h["x-ratelimit-limit-requests"] == "6" for h in ok)
    for h, body in refused:
        assert int(h["Retry-After"]) >= 1
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert json.loads(body)["error"]["type"] == "RateLimitError"


async def test_queue_jobs_over_the_limit_wait_for_quota_until_their_deadline(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """60 requests a minute: the bucket holds 60, then one more each second. Jobs beyond it wait for
    their turn and succeed; a job whose deadline comes first gets an error result saying why."""
    sim = await sim_process(model="m", max_num_seqs=8, ttft_ms=0, itl_ms=0)
    cfg = config(redis_server.url, [sim.url], [{"name": "batch", "requests_per_minute": 60}])
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q:
        jobs = await q.submit_many([{"model": "m", "prompt": f"p{i}", "max_tokens": 1} for i in range(62)],
                                   tenant="batch")
        # its deadline comes before the bucket's first refill (one request a second), whatever the
        # order in which the waiting jobs are granted
        late = await q.submit({"model": "m", "prompt": "late", "max_tokens": 1}, tenant="batch",
                              deadline_ms=700)
        started = time.monotonic()
        results = await asyncio.gather(*(q.wait(j, timeout=30) for j in jobs))
        took = time.monotonic() - started
        expired = await q.wait(late, timeout=30)
        requests, _, rate_limited = rd.dp.serving.tenancy.ledger.totals[("batch", "f")][:3]
    assert [r.status for r in results] == ["ok"] * 62
    # the jobs that waited were served, not refused: only the one whose deadline came first counts as
    # rate limited, once, however often it looked at the bucket
    assert (requests, rate_limited) == (62, 1)
    assert took >= 1.5  # the last two waited for the bucket to refill, one second each
    assert expired.status == "error"
    assert expired.error is not None
    assert "over its rate limit" in expired.error["message"]


def queue_config(redis_url: str, urls: list[str], tenants: list[dict[str, Any]]) -> Config:
    """:func:`config` with a small read batch (so a limited tenant's room holds 8 jobs), a read-ahead of
    32 and a short keep-alive period (so set-aside jobs are kept fresh several times during a test)."""
    cfg = config(redis_url, urls, tenants)
    raw = msgspec.to_builtins(cfg)
    raw["redis"].update(read_batch=8, read_ahead_jobs=32, reclaim_idle_ms=1500, reclaim_interval_s=0.3)
    return parse(raw, environ={})


async def test_a_rate_limited_tenants_backlog_does_not_stop_the_queue_for_others(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """400 jobs of a tenant allowed 3 a minute, then 10 of another: the consumer used to stop reading
    once 8 × slots of the first waited for quota, and the second's jobs got no result for hours. Now
    the first's wait in a room of ``read_batch`` and the rest are set aside, pending in Redis: the
    second's are read and served, memory stays bounded, and set-aside jobs still get their deadline's
    error and their producer's cancel, once, with no delivery counted."""
    sim = await sim_process(model="m", max_num_seqs=4, ttft_ms=0, itl_ms=1)
    cfg = queue_config(redis_server.url, [sim.url], [{"name": "slow", "requests_per_minute": 3},
                                                     {"name": "fast"}])
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q:
        slow = await q.submit_many([body] * 200, tenant="slow")
        expiring = [await q.submit(body, tenant="slow", deadline_ms=2500) for _ in range(3)]
        cancelled = await q.submit(body, tenant="slow")
        slow += await q.submit_many([body] * 200, tenant="slow")
        fast = await q.submit_many([body] * 10, tenant="fast")
        most_held = 0

        async def watch() -> None:
            nonlocal most_held
            while True:
                most_held = max(most_held, rd.queue.held)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            await wait_until(lambda: rd.queue.stats["set_aside"] >= 300)
            await q.cancel(cancelled)
            results = await q.wait_many(fast, timeout=20)
            late = [await q.wait(j, timeout=20) for j in expiring]
            gone = await q.wait(cancelled, timeout=20)
            await asyncio.sleep(2 * 1.5)  # two keep-alive periods: nobody reclaims what is set aside
            pending = await q.redis.xpending_range("routerd:requests", "routerd", min="-", max="+",
                                                   count=1000)
        finally:
            watcher.cancel()
        held, parked = rd.queue.held, dict(rd.queue._held.parked_by)
        aside, served = rd.queue._held.set_aside, rd.served("slow")
        stats = dict(rd.queue.stats)
        went_local = rd.dp.serving.tenancy.limiter.redis_errors > 0
    assert [r.status for r in results.values()] == ["ok"] * 10
    # the bucket's minute: the rest wait. A Redis answer slower than the limiter waits (a loaded CI
    # machine: "rate_limits_local") has this routerd decide alone for a while, from its own full bucket
    # (README: limits are per routerd while Redis is away): one more minute's quota at the most
    assert served == 3 if not went_local else 3 <= served <= 6
    for r in late:
        assert r.error is not None
        assert "over its rate limit" in r.error["message"]
    assert gone.error is not None
    assert gone.error["code"] == 499
    assert parked == {"slow": 8}  # its room
    left = 404 - 3 - 3 - 1  # served, past their deadline, cancelled
    assert (held, aside) == (8, left - 8)  # the room here; the rest set aside, pending in Redis
    # what the fleet runs (4) read twice over, or a read batch, + the read-ahead + the room + the 4 jobs
    # brought back for their result (deadline passed, cancelled): not the backlog
    assert most_held <= max(2 * 4, 8) + 32 + 8 + 4
    # Kept fresh, never claimed by a reclaim; a set-aside job's delivery is given back in Redis (a
    # restart's recovery counts it once, so a backlog that waits across restarts is not dead-lettered)
    assert len(pending) == left
    assert sorted(p["times_delivered"] for p in pending) == [0] * (left - 8) + [1] * 8
    assert (stats["reclaimed"], stats["redelivered"], stats["dead"]) == (0, 0, 0)


async def test_a_tenant_at_its_max_concurrent_does_not_stop_the_queue_for_others(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """The same stall through another door: 200 jobs of a tenant allowed one at a time filled the read
    bound waiting for its one slot while the fleet's other three stood idle, and the other tenant's
    jobs behind them were not read until those 200 had run (~20 s here). Beyond a room of
    ``read_batch`` waiting, its jobs are set aside too."""
    sim = await sim_process(model="m", max_num_seqs=4, ttft_ms=0, itl_ms=10)
    cfg = queue_config(redis_server.url, [sim.url], [{"name": "one", "max_concurrent": 1}, {"name": "other"}])
    body = {"model": "m", "prompt": "x", "max_tokens": 10}
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q:
        await q.submit_many([body] * 200, tenant="one")
        other = await q.submit_many([body] * 10, tenant="other")
        results = await q.wait_many(other, timeout=8)
        most_waiting = 0
        for _ in range(50):  # a moment's samples: as one gets its slot the next comes back
            most_waiting = max(most_waiting, rd.queue._held.slot_by["one"])
            await asyncio.sleep(0.01)
        aside, served = rd.queue._held.set_aside, rd.served("one")
    assert [r.status for r in results.values()] == ["ok"] * 10
    assert most_waiting == 8  # its room, never more
    assert aside >= 200 - served - 8 - 1 - 8  # the rest set aside (but the one running, some on their way)


async def test_a_backlog_waiting_for_quota_outlives_restarts_beyond_max_deliveries(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """A set-aside job — and one waiting in its tenant's room, set aside by the drain — gives its
    delivery back: three drains and starts with ``max_deliveries = 2`` dead-letter none of them, the
    drain does not wait for quota, and each stop lets the queue consumer's name go for the next start."""
    sim = await sim_process(model="m", max_num_seqs=4, ttft_ms=0, itl_ms=1)
    limited = msgspec.to_builtins(queue_config(redis_server.url, [sim.url],
                                               [{"name": "slow", "requests_per_minute": 1}]))
    limited["redis"]["max_deliveries"] = 2
    async with QueueClient.from_url(redis_server.url) as q:
        jobs = await q.submit_many([{"model": "m", "prompt": "x", "max_tokens": 2}] * 30, tenant="slow")
        served = 0
        for _ in range(3):
            async with routerd(parse(limited, environ={})) as rd:
                await wait_until(lambda: rd.queue._held.parked == 8)
                rd.queue.stop_intake()
                assert await rd.queue.wait_idle(3.0)  # the waiters were set aside, not waited for
                aside = rd.queue._held.set_aside
                served += rd.served("slow")
            # All but those served, room included: the first start's one (a minute's quota), and one
            # more by a later start whose rate-limit check Redis did not answer in time on a loaded
            # machine (that routerd then decides alone, from a full bucket of its own: rate_limits_local).
            assert served >= 1
            assert aside == 30 - served
            # Its stop let the consumer name go (it lapsed 10 s later before): the next start reads at once.
            assert await q.redis.exists("routerd:consumer:t1") == 0
        lifted = dict(limited, tenants=[{"name": "slow"}])
        async with routerd(parse(lifted, environ={})):
            results = await q.wait_many(jobs, timeout=20)
        assert await q.redis.xlen("routerd:dead") == 0
    assert sorted(r.status for r in results.values()) == ["ok"] * 30


async def test_a_reload_lifting_a_limit_reaches_the_jobs_waiting_for_it(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Each waiting job held the ``Tenant`` it was read under: after a reload lifted the limit they
    still drained at one per 5 s. Waiters and set-aside jobs now see the current config at once."""
    sim = await sim_process(model="m", max_num_seqs=4, ttft_ms=0, itl_ms=1)
    tenants: list[dict[str, Any]] = [{"name": "slow", "requests_per_minute": 2}]
    cfg = queue_config(redis_server.url, [sim.url], tenants)
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q:
        jobs = await q.submit_many([{"model": "m", "prompt": "x", "max_tokens": 2}] * 40, tenant="slow")
        await wait_until(lambda: rd.served("slow") == 2 and rd.queue._held.parked == 8
                         and rd.queue._held.set_aside == 30)
        lifted = msgspec.to_builtins(cfg)
        lifted["tenants"][0]["requests_per_minute"] = 0
        new = parse(lifted, environ={})
        await rd.dp.apply(new)
        rd.queue.update_config(new)
        results = await q.wait_many(jobs, timeout=4)  # well within one 5 s look at the bucket
    assert [r.status for r in results.values()] == ["ok"] * 40


async def test_a_reload_taking_a_fleet_from_a_tenant_reaches_its_waiting_jobs(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """The fleet check was made once, when the job was read: a job waiting for quota ran on a fleet a
    reload had taken from its tenant. It is checked again with the quota, under the current config."""
    m, n = await asyncio.gather(sim_process(model="m", max_num_seqs=4, ttft_ms=0, itl_ms=1),
                                sim_process(model="n", max_num_seqs=4, ttft_ms=0, itl_ms=1))
    raw = msgspec.to_builtins(queue_config(redis_server.url, [m.url],
                                           [{"name": "slow", "requests_per_minute": 1}]))
    raw["fleets"].append({"name": "g", "model": "n", "engine": "static", "urls": [n.url], "max_num_seqs": 4})
    async with routerd(parse(raw, environ={})) as rd, QueueClient.from_url(redis_server.url) as q:
        jobs = await q.submit_many([{"model": "m", "prompt": "x", "max_tokens": 2}] * 3, tenant="slow")
        await wait_until(lambda: rd.served("slow") == 1 and rd.queue._held.parked == 2)
        raw["tenants"][0] |= {"requests_per_minute": 0, "fleets": ["g"]}
        new = parse(raw, environ={})
        await rd.dp.apply(new)
        rd.queue.update_config(new)
        results = await q.wait_many(jobs, timeout=10)
    codes = sorted(200 if r.status == "ok" else r.error["code"] for r in results.values())  # type: ignore[index]
    assert codes == [200, 403, 403]


# -- fair share -----------------------------------------------------------------------------------------
async def test_a_queue_flood_does_not_hold_up_an_interactive_tenant(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """A batch tenant floods the queue with ten times what the fleet runs; each streaming chat of the
    interactive tenant gets its first token after about one batch job ends, not after the backlog."""
    sims = await sim_processes(sim_process, 2, model="m", max_num_seqs=4, ttft_ms=10, itl_ms=5)
    cfg = config(redis_server.url, [s.url for s in sims],
                 [{"name": "batch", "weight": 1}, {"name": "chat", "api_keys": ["sk-chat"], "weight": 1}])
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q, aiohttp.ClientSession() as s:
        jobs = await q.submit_many([{"model": "m", "prompt": f"batch {i}", "max_tokens": 40}
                                    for i in range(80)], tenant="batch")
        await wait_until(lambda: rd.served("batch") >= 8)  # the flood holds every slot
        admitted_meanwhile = []
        for _ in range(5):
            before = rd.admitted("batch")
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "stream": True}
            async with s.post(rd.url + "/v1/chat/completions", json=body,
                              headers={"Authorization": "Bearer sk-chat"}) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"content"' in line:
                        break
                admitted_meanwhile.append(rd.admitted("batch") - before)
                await r.read()
            await asyncio.sleep(0.1)
        backlog = 80 - rd.served("batch")
        results = await asyncio.gather(*(q.wait(j, timeout=60) for j in jobs))
        preempted = rd.queue.stats["preempted"]
    assert backlog >= 30  # the flood was still far from done
    # Slots were taken back from batch jobs for the chats; each such job ran again, whole.
    assert preempted >= 1
    assert all(r.status == "ok" and r.response["usage"]["completion_tokens"] == 40 for r in results)
    # Eight slots: in FIFO order a chat would wait for ~70 batch jobs to be given a slot first; here at
    # most for the next one to end.
    assert max(admitted_meanwhile) <= 4, admitted_meanwhile


async def test_backlogged_http_tenants_get_slots_by_weight(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    sims = await sim_processes(sim_process, 2, model="m", max_num_seqs=4, ttft_ms=5, itl_ms=3)
    cfg = config(redis_server.url, [s.url for s in sims],
                 [{"name": "small", "api_keys": ["sk-small"], "weight": 1},
                  {"name": "large", "api_keys": ["sk-large"], "weight": 3}])
    async with routerd(cfg) as rd, aiohttp.ClientSession() as s:
        stop = asyncio.Event()

        async def client(key: str) -> None:  # a closed loop: always a request waiting
            while not stop.is_set():
                status, _, _ = await post(s, rd.url, {"model": "m", "prompt": "x", "max_tokens": 12}, key)
                assert status == 200

        tasks = [asyncio.create_task(client(k)) for k in ("sk-small", "sk-large") for _ in range(12)]

        def backlogged() -> bool:  # both tenants have requests waiting: the share is then by weight
            lines = {t: v for t, _, v in rd.dp.admission.tenant_stats()}
            return all(t in lines and lines[t]["queued"] > 0 for t in ("small", "large"))

        # A loaded machine may take seconds before the first requests arrive; measure from the backlog.
        assert await eventually(backlogged, 30.0), list(rd.dp.admission.tenant_stats())
        await asyncio.sleep(0.5)
        before = {t: v["slot_seconds"] for t, _, v in rd.dp.admission.tenant_stats()}
        await asyncio.sleep(4.0)
        after = {t: v["slot_seconds"] for t, _, v in rd.dp.admission.tenant_stats()}
        stop.set()
        await asyncio.gather(*tasks)
    used = {t: after[t] - before[t] for t in ("small", "large")}
    share = used["large"] / (used["large"] + used["small"])
    # 3:1 is 0.75 and no weights 0.5; over 4 s on a loaded machine the share wanders (0.842 was seen
    # beside three busy loops), so the bound is 15 %, which 0.5 still misses by far.
    assert abs(share - 0.75) / 0.75 < 0.15, used


# -- usage ----------------------------------------------------------------------------------------------
async def test_usage_totals_equal_what_the_engines_reported(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Both ways in, streamed or not, usage asked for or not: per tenant, the tokens in /metrics, in
    Redis and from ``routerd usage`` are the engines' own counts; a client that did not ask for usage
    does not get routerd's usage event."""
    sims = await sim_processes(sim_process, 2, model="m", max_num_seqs=4, ttft_ms=1, itl_ms=1)
    urls = [s.url for s in sims]
    cfg = config(redis_server.url, urls, [{"name": "web", "api_keys": ["sk-web"]}, {"name": "jobs"}])
    engine: dict[str, tuple[float, float]] = {}
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q, aiohttp.ClientSession() as s:
        start = await engine_tokens(s, urls)
        streams: list[bytes] = []
        for i in range(4):
            _, _, body = await post(s, rd.url, {"model": "m", "prompt": f"plain {i} " * (i + 1),
                                                "max_tokens": 3 + i}, "sk-web")
            assert b'"usage"' in body
            _, _, body = await post(s, rd.url, {"model": "m", "prompt": f"stream {i}", "max_tokens": 5,
                                                "stream": True}, "sk-web")
            streams.append(body)
            chat = {"model": "m", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 4,
                    "stream": True, "stream_options": {"include_usage": True}}
            _, _, body = await post(s, rd.url, chat, "sk-web", "/v1/chat/completions")
            assert b'"choices":[],"usage":{' in body  # asked for: passed on
        mid = await engine_tokens(s, urls)
        jobs = await q.submit_many([{"model": "m", "prompt": f"job {i}", "max_tokens": 6,
                                     "stream": i % 2 == 0} for i in range(6)], tenant="jobs")
        assert all(r.status == "ok" for r in await asyncio.gather(*(q.wait(j, timeout=30) for j in jobs)))
        end = await engine_tokens(s, urls)
        engine = {"web": (mid[0] - start[0], mid[1] - start[1]), "jobs": (end[0] - mid[0], end[1] - mid[1])}
        assert await rd.dp.serving.tenancy.ledger.flush()
        metrics = (await (await s.get(rd.url + "/metrics")).read()).decode()
    for body in streams:  # not asked for: the client's stream is as if routerd had not asked either
        assert b'"usage"' not in body
        assert body.endswith(b"data: [DONE]\n\n")
    for tenant, (prompt, completion) in engine.items():
        assert prompt > 0
        assert completion > 0
        assert rd.dp.serving.tenancy.ledger.totals[(tenant, "f")][3:] == [prompt, completion]
        assert f'routerd_tenant_tokens_total{{fleet="f",kind="completion",tenant="{tenant}"}} {completion}' \
            in metrics
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routerd", "usage", "--redis", redis_server.url, "--json",
        stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(cli.communicate(), 30)
    assert cli.returncode == 0
    rows = {r["tenant"]: r for r in json.loads(out)["rows"]}
    for tenant, (prompt, completion) in engine.items():
        assert (rows[tenant]["prompt_tokens"], rows[tenant]["completion_tokens"]) == (prompt, completion)
    assert rows["web"]["requests"] == 12
    assert rows["jobs"]["requests"] == 6


async def test_usage_and_submit_log_in_with_the_configs_password_whatever_its_keys(tmp_path: Path) -> None:
    """``routerd usage --config`` (and ``routerd submit --config``) reach a password-protected Redis with
    the file's ``redis.password``, or ``$ROUTERD_REDIS_PASSWORD`` without a file, and a tenant's ``env:``
    key whose variable is not set where the tool runs does not matter: keys are not what it reads."""
    password = "usage-pw-J3k9"
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", extra_args=("--requirepass", password))
    server.start()
    try:
        cfg = {"redis": {"url": server.url, "password": password},
               "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": ["http://127.0.0.1:9"]}],
               "tenants": [{"name": "web", "api_keys": ["env:ROUTERD_TEST_KEY_NOT_SET_HERE"]}]}
        path = tmp_path / "routerd.toml"
        path.write_text(to_toml(cfg))
        writer = redis_client(server.url, RedisConfig(password=password))
        ledger = UsageLedger(lambda: writer, RedisKeys(), retention_days=1)  # what a routerd on it counted
        ledger.add("web", "f", requests=3, prompt_tokens=5, completion_tokens=7)
        assert await ledger.flush()
        await writer.aclose()
        env = {k: v for k, v in os.environ.items()
               if k not in {"ROUTERD_REDIS_PASSWORD", "ROUTERD_REDIS_URL", "ROUTERD_TEST_KEY_NOT_SET_HERE"}}

        async def run(*argv: str, **extra: str) -> str:
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "routerd", *argv, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**env, **extra})
            out, err = await asyncio.wait_for(cli.communicate(), 60)
            assert cli.returncode == 0, err.decode()
            return out.decode()

        for argv, extra in [(["--config", str(path)], {}),
                            (["--redis", server.url], {"ROUTERD_REDIS_PASSWORD": password})]:
            rows = json.loads(await run("usage", *argv, "--json", **extra))["rows"]
            assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] \
                == [("web", 3, 5, 7)], argv
        cli = await asyncio.create_subprocess_exec(  # --days past the bound is refused (a huge one hung)
            sys.executable, "-m", "routerd", "usage", "--config", str(path), "--days", "5000",
            stderr=asyncio.subprocess.PIPE, env=env)
        _, err = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 2
        assert b"--days must be 1..3660" in err
        job = (await run("submit", "--config", str(path), "hello")).strip()
        async with QueueClient.from_url(server.url, password=password) as q:
            entries = await q.redis.xrange("routerd:requests")
        assert len(entries) == 1
        assert job.encode() in entries[0][1][b"job"]  # the job it said it wrote
    finally:
        server.kill()


async def read_events(r: aiohttp.ClientResponse, k: int) -> int:
    """Read ``k`` events carrying text of a stream (fewer if it ends first); the number read."""
    n = 0
    async for line in r.content:
        if line.startswith(b"data: {") and b'"text"' in line:
            n += 1
            if n == k:
                break
    return n


async def test_streams_ended_early_are_billed_what_the_engine_generated(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Issue 18.2: a stream its client closes after k of n events, and a queue job's stream cut by its
    deadline, are billed the tokens the engine generated (its own ``vllm:generation_tokens``) — in
    /metrics, in Redis' usage and in the tenant's token bucket — not 0."""
    sims = await sim_processes(sim_process, 2, model="m", max_num_seqs=8, ttft_ms=1, itl_ms=20)
    urls = [s.url for s in sims]
    # 600 tokens a minute, 10 a second refilled: 8 streams of 40 tokens read leave it far from full.
    cfg = config(redis_server.url, urls, [{"name": "web", "api_keys": ["sk-web"], "tokens_per_minute": 600},
                                         {"name": "jobs"}])
    keys = RedisKeys.from_config(cfg.redis)
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q, aiohttp.ClientSession() as s:
        start = await engine_tokens(s, urls)
        began = time.monotonic()

        async def closed_early(i: int) -> int:
            body = {"model": "m", "prompt": f"cut {i}", "max_tokens": 100, "stream": True}
            async with s.post(rd.url + "/v1/completions", json=body,
                              headers={"Authorization": "Bearer sk-web"}) as r:
                assert r.status == 200
                n = await read_events(r, 40)
                r.close()  # the client goes away before the end: the engine aborts the request
            return n

        assert await asyncio.gather(*(closed_early(i) for i in range(8))) == [40] * 8
        await wait_until(lambda: rd.dp.serving.upstream.active == 0)
        mid = await _settled_engine_tokens(s, urls)
        web = rd.dp.serving.tenancy.directory.get("web")
        assert web is not None
        level = await rd.dp.serving.tenancy.limiter.acquire(web, 0)
        refilled = 10 * (time.monotonic() - began)
        job = await q.submit({"model": "m", "prompt": "long job", "max_tokens": 500, "stream": True},
                             tenant="jobs", deadline_ms=1500)
        result = await q.wait(job, timeout=30)
        assert result.status == "error"  # its deadline cut the stream
        end = await _settled_engine_tokens(s, urls)
        assert await rd.dp.serving.tenancy.ledger.flush()
        metrics = (await (await s.get(rd.url + "/metrics")).read()).decode()
        async with redis_client(redis_server.url, cfg.redis) as client:
            rows = {r["tenant"]: r for r in await read_days(client, keys, [day_of(time.time())])}
    engine = {"web": (mid[0] - start[0], mid[1] - start[1]), "jobs": (end[0] - mid[0], end[1] - mid[1])}
    assert engine["web"][1] >= 8 * 40
    assert engine["jobs"][1] >= 20
    for tenant, (prompt, completion) in engine.items():
        _, _, _, billed_prompt, billed = rd.dp.serving.tenancy.ledger.totals[(tenant, "f")]
        assert billed_prompt == prompt
        # The count read last: the engine may have made a token or two more before it saw the abort.
        assert 0.9 * completion <= billed <= completion, (tenant, billed, completion)
        assert (rows[tenant]["prompt_tokens"], rows[tenant]["completion_tokens"]) == (billed_prompt, billed)
        assert f'routerd_tenant_tokens_total{{fleet="f",kind="completion",tenant="{tenant}"}} ' \
            f'{float(billed)}' in metrics
    # The bucket was charged what was generated (not only the prompts' estimates), less its refill.
    left = int(level.headers()["x-ratelimit-remaining-tokens"])
    charged = sum(rd.dp.serving.tenancy.ledger.totals[("web", "f")][3:])
    assert left <= 600 - charged + refilled + 1, (left, refilled)


async def test_a_non_streamed_request_its_client_left_is_billed_an_estimate_of_the_engines_work(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Issue 18.2, a non-streamed request: its client goes away while the engine generates; nobody reads
    the answer, so routerd bills its best figure — the prompt estimate and the instance's learned
    decode speed over the time it had the request — which lands near the engine's own count."""
    sims = [await sim_process(model="m", max_num_seqs=8, ttft_ms=1, itl_ms=20)]
    urls = [s.url for s in sims]
    cfg = config(redis_server.url, urls, [{"name": "web", "api_keys": ["sk-web"]}])
    async with routerd(cfg) as rd, aiohttp.ClientSession() as s:
        # The instance shows its decode speed at the batch the test runs (four at once): a sequence
        # decodes slower beside three others, and slower again on a busy machine, so speed learned from
        # one request at a time bills a batch up to 1.6x what the engine made (fresh-clone CI).
        for r in range(2):
            warm = [post(s, rd.url, {"model": "m", "prompt": f"warm {r} {i}", "max_tokens": 20}, "sk-web")
                    for i in range(4)]
            assert [status for status, _, _ in await asyncio.gather(*warm)] == [200] * 4
        await wait_until(lambda: all(i.learned.decode_tokens_per_s for i in rd.dp.registry.instances("f")))
        rd.dp.serving.tenancy.ledger.totals.clear()
        start = await _settled_engine_tokens(s, urls)

        async def left(i: int) -> None:
            body = {"model": "m", "prompt": f"left {i}", "max_tokens": 400}
            try:
                async with s.post(rd.url + "/v1/completions", json=body,
                                  headers={"Authorization": "Bearer sk-web"},
                                  timeout=aiohttp.ClientTimeout(total=1.5)) as r:
                    await r.read()
            except TimeoutError:
                return
            raise AssertionError("the answer came before the client left")

        results = await asyncio.gather(*(left(i) for i in range(4)), return_exceptions=True)
        assert not any(isinstance(r, AssertionError) for r in results), results
        await wait_until(lambda: rd.dp.serving.upstream.active == 0)
        end = await _settled_engine_tokens(s, urls)
    generated = end[1] - start[1]
    requests, errors, _, prompt, completion = rd.dp.serving.tenancy.ledger.totals[("web", "f")]
    assert (requests, errors) == (0, 4)
    assert prompt > 0
    # 1.5 s of 20 ms tokens is 75 each on a quiet machine; a loaded one makes fewer — what counts is
    # that the engine did real work and the bill follows it.
    assert generated >= 4 * 10
    assert 0.6 * generated <= completion <= 1.4 * generated, (completion, generated)


async def test_a_stream_its_client_left_during_the_prefill_is_billed_its_prompt(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Issue 18.2: a stream whose client leaves before any token (the engine still prefilling) has no
    count to read; the engine did take its prompt, so the prompt estimate is billed, not refunded."""
    sims = [await sim_process(model="m", max_num_seqs=4, ttft_ms=2500, itl_ms=1)]
    urls = [s.url for s in sims]
    cfg = config(redis_server.url, urls, [{"name": "web", "api_keys": ["sk-web"]}])
    async with routerd(cfg) as rd, aiohttp.ClientSession() as s:
        start = await _settled_engine_tokens(s, urls)
        body = {"model": "m", "prompt": "a prompt the engine takes", "max_tokens": 50, "stream": True}
        with contextlib.suppress(TimeoutError):
            async with s.post(rd.url + "/v1/completions", json=body,
                              headers={"Authorization": "Bearer sk-web"},
                              timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                await r.read()
        await wait_until(lambda: rd.dp.serving.upstream.active == 0)
        end = await _settled_engine_tokens(s, urls)
    assert end[0] - start[0] > 0  # the engine took the prompt ...
    assert end[1] == start[1]  # ... and made no token
    requests, errors, _, prompt, completion = rd.dp.serving.tenancy.ledger.totals[("web", "f")]
    assert (requests, errors, completion) == (0, 1, 0)
    assert prompt > 0


async def _settled_engine_tokens(s: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """The engines' token counts once no request runs on them (the aborted ones stopped counting)."""
    deadline = time.monotonic() + 10
    while True:
        counts = await engine_tokens(s, urls)
        running = 0.0
        for url in urls:
            async with s.get(url + "/metrics") as r:
                running += parse_metrics(await r.text(), 0.0).running
        if running == 0:
            return counts
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


# -- who may send what ------------------------------------------------------------------------------------
async def listed_models(s: aiohttp.ClientSession, url: str, key: str) -> list[str]:
    async with s.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200
        return sorted(m["id"] for m in (await r.json())["data"])


async def test_tenants_keys_fleets_and_unknown_queue_tenants(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    m, n = await asyncio.gather(sim_process(model="m", ttft_ms=0, itl_ms=0),
                                sim_process(model="n", ttft_ms=0, itl_ms=0))
    cfg = parse({
        "http": {"host": "127.0.0.1", "port": 0, "api_keys": ["sk-shared"]},
        "redis": {"url": redis_server.url, "consumer": "t1", "block_ms": 100},
        "routing": {"scrape_interval_s": 0.05},
        "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": [m.url]},
                   {"name": "g", "model": "n", "engine": "static", "urls": [n.url]}],
        "tenants": [{"name": "only-f", "api_keys": ["sk-only-f"], "fleets": ["f"]}]}, environ={})
    async with routerd(cfg) as rd, QueueClient.from_url(redis_server.url) as q, aiohttp.ClientSession() as s:
        assert (await post(s, rd.url, {"model": "m", "prompt": "x", "max_tokens": 1}, "sk-only-f"))[0] == 200
        status, _, body = await post(s, rd.url, {"model": "n", "prompt": "x", "max_tokens": 1}, "sk-only-f")
        assert status == 403
        assert json.loads(body)["error"]["type"] == "PermissionDeniedError"
        assert (await post(s, rd.url, {"model": "n", "prompt": "x", "max_tokens": 1}, "sk-shared"))[0] == 200
        assert (await post(s, rd.url, {"model": "m", "prompt": "x", "max_tokens": 1}, "sk-nobody"))[0] == 401
        assert (await post(s, rd.url, {"model": "m", "prompt": "x", "max_tokens": 1}))[0] == 401
        assert await listed_models(s, rd.url, "sk-only-f") == ["m"]  # n is a model it may not use
        assert await listed_models(s, rd.url, "sk-shared") == ["m", "n"]
        unknown = await q.submit({"model": "m", "prompt": "x"}, tenant="nobody")
        barred = await q.submit({"model": "n", "prompt": "x"}, tenant="only-f")
        r1, r2 = await q.wait(unknown, timeout=10), await q.wait(barred, timeout=10)
        dead = await q.redis.xrange("routerd:dead")
    assert r1.status == "error"
    assert r1.error is not None
    assert r1.error["code"] == 400
    assert "no tenant named 'nobody'" in r1.error["message"]
    assert r2.status == "error"
    assert r2.error is not None
    assert r2.error["code"] == 403
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert any("no tenant named 'nobody'" in r for r in reasons)
    assert any("may not use fleet 'g'" in r for r in reasons)
    assert rd.served("default") == 0  # the shared key's request was served on g, the other fleet
    assert rd.dp.serving.tenancy.ledger.totals[("default", "g")][0] == 1


async def test_a_reload_applies_tenants_keys_and_weights(redis_server: RedisServer,
                                                         sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m", ttft_ms=0, itl_ms=0)
    tenants = [{"name": "a", "api_keys": ["sk-a"]}]
    async with routerd(config(redis_server.url, [sim.url], tenants)) as rd, aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        assert (await post(s, rd.url, body, "sk-b"))[0] == 401
        await rd.dp.apply(config(redis_server.url, [sim.url],
                           [*tenants, {"name": "b", "api_keys": ["sk-b"], "requests_per_minute": 1}]))
        assert (await post(s, rd.url, body, "sk-b"))[0] == 200
        status, headers, _ = await post(s, rd.url, body, "sk-b")
        assert status == 429
        assert headers["x-ratelimit-limit-requests"] == "1"


async def test_rate_limits_are_enforced_locally_while_redis_is_away(redis_server: RedisServer) -> None:
    """A Redis outage never stops requests: each routerd then keeps the buckets itself."""
    cfg = config(redis_server.url, ["http://127.0.0.1:1"], [{"name": "a", "requests_per_minute": 3}])
    tenancy = Tenancy(cfg, RedisConn(redis_server.url, cfg.redis, pooled=False))
    run = asyncio.create_task(tenancy.run())
    try:
        a = tenancy.tenant("a")
        assert a is not None
        shared = await tenancy.limiter.acquire(a, 1)
        assert shared.allowed
        assert shared.requests_left == 2  # from the shared bucket in Redis
        redis_server.kill()
        answers = [(await tenancy.limiter.acquire(a, 1)).allowed for _ in range(4)]
        assert answers == [True, True, True, False]  # this process's own bucket, full to start
        assert tenancy.limiter.redis_errors >= 1
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
