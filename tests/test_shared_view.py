"""The shared view (routerd/peers/): two routerd processes on one Redis route, scrape and admit on the
fleet's whole load, and keep sessions — real Redis, simulated engines as processes, two data planes in
one test process (each with its own registry, Redis client and ``redis.consumer``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog

from routerd.assembly import Routerd, running
from routerd.config import Config, parse
from routerd.peers import SharedMeasures
from routerd.peers.load import LoadRecord
from routerd.peers.sealed import LOAD
from routerd.peers.sessions import digest
from routerd.redis_conn import redis_client
from routerd.redis_keys import RedisKeys
from routerd.registry import Instance, Registry
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcess, SimProcessFactory

pytestmark = [pytest.mark.redis]


def config(redis_url: str, consumer: str, urls: list[str], *, routing: dict[str, Any] | None = None,
           admission: dict[str, Any] | None = None, tenants: list[dict[str, Any]] | None = None,
           max_num_seqs: int = 16) -> Config:
    return parse({
        "http": {"host": "127.0.0.1", "port": 0},
        "redis": {"url": redis_url, "consumer": consumer, "block_ms": 100, "op_timeout_s": 2.0},
        "routing": {"scrape_interval_s": 0.05, "scrape_timeout_s": 0.5, "stale_after_s": 1.0,
                    "retry_backoff_ms": 1, **(routing or {})},
        "admission": admission or {},
        "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": urls,
                    "max_num_seqs": max_num_seqs}],
        "tenants": tenants or []}, environ={})


async def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def plane(cfg: Config) -> AsyncIterator[Routerd]:
    registry = Registry()
    # Each process keeps its own fleet (the tests give them different URLs) and probes it itself: what
    # is shared here is load, scrapes and sessions, not the fleet state (tests/test_fleet_view*.py).
    async with running(cfg, registry, consume=False, controls=lambda: True) as dp:
        await wait_until(lambda: registry.ready_count("f") == len(cfg.fleets[0].urls), what="ready")
        yield dp


def view(dp: Routerd) -> SharedMeasures:
    assert dp.peers is not None
    assert dp.peers.measures is not None
    return dp.peers.measures


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hello", "max_tokens": 4, **kw}


@contextlib.asynccontextmanager
async def held(s: aiohttp.ClientSession, url: str, n: int, **headers: str) -> AsyncIterator[list[str]]:
    """``n`` long streams through ``url``, each held open once its headers arrived; yields the instance
    each went to."""
    opened: list[aiohttp.ClientResponse] = []
    try:
        for _ in range(n):
            r = await s.post(url + "/v1/completions", json=body(max_tokens=2000, stream=True),
                             headers=headers)
            assert r.status == 200, await r.text()
            opened.append(r)
        yield [r.headers["X-Routerd-Instance"] for r in opened]
    finally:
        for r in opened:
            r.close()


class NoScrapes:
    """A ScrapeShare under which a process's scraper makes no scrape (as if each were shared)."""

    def covers(self, inst: Instance) -> bool:
        return True

    def scraped(self, inst: Instance) -> None:
        """A scrape begun before this share was put in place ends here."""


# -- load ---------------------------------------------------------------------------------------------
async def test_least_load_counts_what_the_other_process_has_in_flight(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """A burst through A lands on instance 0 (A's fleet lists only that URL); B, between two scrapes,
    sends its own requests to instance 1 — and once it scrapes, counts A's requests once, not twice."""
    sims = [await sim_process(model="m", max_num_seqs=32, ttft_ms=1, itl_ms=20) for _ in range(2)]
    routing = {"stale_after_s": 300.0}  # B's last scrape stays in use while B scrapes no more
    async with plane(config(redis_server.url, "a", [sims[0].url], routing=routing)) as a, \
            plane(config(redis_server.url, "b", [s.url for s in sims], routing=routing)) as b, \
            aiohttp.ClientSession() as s:
        await wait_until(lambda: a.registry.processes == b.registry.processes == 2, what="both counted")
        b.watch.scraper.shared = NoScrapes()  # between two scrapes from now on: in-flight counts alone move
        first = b.registry.get("f:static0")
        assert first is not None
        async with held(s, a.url, 6) as on_a:
            assert set(on_a) == {"f:static0"}
            await wait_until(lambda: first.inflight_elsewhere == 6, what="B sees A's six")
            async with held(s, b.url, 4) as on_b:
                assert on_b == ["f:static1"] * 4, on_b  # on its own counts: two and two
                # B scrapes now: the engine's gauges hold A's six, which are not counted again on top
                assert await b.watch.scraper.scrape(first)
                assert first.snapshot is not None
                assert first.snapshot.running == 6
                assert first.inflight_at_scrape == 6
                assert first.estimated_queue() == 6.0
                async with s.get(b.url + "/admin/fleets") as r:
                    shown = {i["id"]: i for i in (await r.json())["fleets"]["f"]["instances"]}
                assert shown["f:static0"]["inflight_elsewhere"] == 6
        await wait_until(lambda: first.inflight_elsewhere == 0, what="A's requests ended")


async def test_a_dead_processs_figures_expire_and_a_stopped_one_withdraws(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m", max_num_seqs=32, ttft_ms=1, itl_ms=20)
    cfg = config(redis_server.url, "b", [sim.url])
    keys = RedisKeys.from_config(cfg.redis)
    async with plane(cfg) as b:
        inst = b.registry.get("f:static0")
        assert inst is not None
        async with plane(config(redis_server.url, "a", [sim.url])) as a, aiohttp.ClientSession() as s:
            await wait_until(lambda: b.registry.processes == 2, what="A counted")
            async with held(s, a.url, 3):
                await wait_until(lambda: inst.inflight_elsewhere == 3, what="A's three")
        await wait_until(lambda: b.registry.processes == 1 and inst.inflight_elsewhere == 0,
                         what="A withdrawn as it stopped")
        # A process that died without a word: its last figures, then nothing renews them
        client = redis_client(redis_server.url, cfg.redis)
        try:
            # its secret (the state dir's) seals a record as a routerd's would
            payload = msgspec.msgpack.encode(LoadRecord({"f:static0": 5}))
            record = view(b).load.seals.seal(LOAD, payload, "dead")
            await client.set(keys.load("dead"), record, px=600)
            await client.sadd(keys.processes, "dead")
            await wait_until(lambda: inst.inflight_elsewhere == 5, what="the dead one's figures")
            await wait_until(lambda: inst.inflight_elsewhere == 0 and b.registry.processes == 1,
                             what="its figures expired")
            await wait_until(lambda: not redis_server.client().sismember(keys.processes, "dead"),
                             what="its membership dropped")
        finally:
            await client.aclose()


# -- scrapes ------------------------------------------------------------------------------------------
async def scrapes_of(sims: list[SimProcess]) -> int:
    return sum([(await sim.stats())["metrics_requests"] for sim in sims])


async def test_the_engines_are_scraped_once_per_interval_in_total_and_a_stale_follower_scrapes_itself(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    sims = [await sim_process(model="m", max_num_seqs=8, ttft_ms=1, itl_ms=2) for _ in range(2)]
    urls = [s.url for s in sims]
    interval = 0.1
    routing = {"scrape_interval_s": interval}
    scraper = {"a": True}
    async with plane(config(redis_server.url, "a", urls, routing=routing)) as a, \
            plane(config(redis_server.url, "b", urls, routing=routing)) as b:
        view(a).scrapes.is_scraper = lambda: scraper["a"]
        view(b).scrapes.is_scraper = lambda: False
        b_insts = [i for i in b.registry]
        await wait_until(lambda: all(i.shared_scrape for i in b_insts) and not view(b).scrapes.own,
                         what="B on A's scrapes")
        own_before = view(b).scrapes.own_scrapes_total
        before, started = await scrapes_of(sims), time.monotonic()
        await asyncio.sleep(2.0)
        after, elapsed = await scrapes_of(sims), time.monotonic() - started
        per_interval = elapsed / interval * len(sims)  # what one process scraping on time makes
        assert after - before <= 1.25 * per_interval + 2, (after - before, per_interval)  # not twice
        assert view(b).scrapes.own_scrapes_total == own_before
        now = time.monotonic()
        assert all(i.snapshot is not None and now - i.snapshot.scraped_at < 3 * interval + 0.5
                   for i in b_insts), "B's figures follow A's scrapes"
        assert all(i.inflight_at_scrape == 0 for i in b_insts)

        # Nobody publishes now: B's shared figures go stale and it scrapes for itself, and says so
        scraper["a"] = False
        await wait_until(lambda: view(b).scrapes.own == {i.id for i in b_insts}, what="B scrapes itself")
        mark = time.monotonic()
        await wait_until(lambda: all(not i.shared_scrape and i.snapshot is not None
                                     and i.snapshot.scraped_at > mark for i in b_insts),
                         what="B's own fresh scrapes")
        async with aiohttp.ClientSession() as s, s.get(b.url + "/metrics") as r:
            text = await r.text()
        assert 'routerd_view_scraping_own{instance="f:static0"} 1.0' in text
        assert "routerd_view_processes 2.0" in text

        # A scrapes again: B goes back to its figures
        scraper["a"] = True
        await wait_until(lambda: not view(b).scrapes.own and all(i.shared_scrape for i in b_insts),
                         what="B back on shared scrapes")


# -- sessions -----------------------------------------------------------------------------------------
async def test_a_sessions_next_turn_through_the_other_process_keeps_its_instance(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    sims = [await sim_process(model="m", max_num_seqs=8, ttft_ms=1, itl_ms=1) for _ in range(2)]
    urls = [s.url for s in sims]
    cfg_a = config(redis_server.url, "a", urls)
    keys = RedisKeys.from_config(cfg_a.redis)
    r = redis_server.client()
    async with plane(cfg_a) as a, plane(config(redis_server.url, "b", urls)) as b, \
            aiohttp.ClientSession() as s:
        await wait_until(lambda: a.registry.processes == b.registry.processes == 2, what="both counted")
        for dp in (a, b):  # the test is of the lookup, not of this loaded machine's Redis round trip
            view(dp).sessions.lookup_timeout_s = 2.0
        for n in range(8):
            session = f"conversation-{n}"
            first, second = (a, b) if n % 2 else (b, a)
            async with s.post(first.url + "/v1/completions", json=body(),
                              headers={"X-Session-Id": session}) as resp:
                assert resp.status == 200
                went = resp.headers["X-Routerd-Instance"]
            key = keys.session(digest(session))
            await wait_until(lambda key=key: bool(r.exists(key)), what="written")  # type: ignore[misc]
            async with s.post(second.url + "/v1/completions", json=body(user=session)) as resp:
                assert resp.status == 200
                assert resp.headers["X-Routerd-Instance"] == went, (session, view(second).sessions.lookups)
        assert view(a).sessions.lookups["found"] + view(b).sessions.lookups["found"] == 8


async def test_one_process_alone_never_looks_sessions_up(redis_server: RedisServer,
                                                         sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m", max_num_seqs=8, ttft_ms=1, itl_ms=1)
    async with plane(config(redis_server.url, "a", [sim.url])) as a, aiohttp.ClientSession() as s:
        await wait_until(lambda: view(a).load.exchanges_total >= 2, what="a few exchanges")
        for n in range(3):
            async with s.post(a.url + "/v1/completions", json=body(),
                              headers={"X-Session-Id": f"s{n}"}) as resp:
                assert resp.status == 200
        assert a.registry.processes == 1
        assert sum(view(a).sessions.lookups.values()) == 0


# -- admission ----------------------------------------------------------------------------------------
async def test_a_fleets_admission_bounds_hold_per_fleet_not_per_process(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """A fleet of 4 slots and 2 waiters: A alone takes all 4; B then has its part, 2 slots and 1 waiter
    — not 4 and 2 of its own."""
    sim = await sim_process(model="m", max_num_seqs=32, ttft_ms=1, itl_ms=20)
    admission = {"max_inflight_per_instance": 4, "max_queued": 2}
    async with plane(config(redis_server.url, "a", [sim.url], admission=admission)) as a, \
            plane(config(redis_server.url, "b", [sim.url], admission=admission)) as b, \
            aiohttp.ClientSession() as s:
        await wait_until(lambda: a.registry.processes == b.registry.processes == 2, what="both counted")
        inst = b.registry.get("f:static0")
        assert inst is not None
        async with held(s, a.url, 4):  # the others idle: A may use the whole fleet
            await wait_until(lambda: inst.inflight_elsewhere == 4, what="B sees A's four")
            await wait_until(lambda: b.admission.limit("f") == 2, what="B's part")
            opened: list[aiohttp.ClientResponse] = []
            tasks = [asyncio.create_task(s.post(b.url + "/v1/completions",
                                                json=body(max_tokens=2000, stream=True)))
                     for _ in range(4)]
            try:
                await wait_until(lambda: sum(t.done() for t in tasks) == 3, what="2 in, 1 refused")
                done = [t.result() for t in tasks if t.done()]
                opened += done
                assert sorted(r.status for r in done) == [200, 200, 429]
                assert b.admission.stats("f")["queued_http"] == 1
                assert b.admission.stats("f")["active"] == 2
            finally:
                for t in tasks:
                    t.cancel()
                for t in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        resp = await t
                        resp.close()
                for resp in opened:
                    resp.close()


async def test_weighted_fair_share_holds_across_two_processes(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Two tenants, weights 3:1, each spread over two processes (a load balancer in front), saturating
    one engine of 4 slots: the slot-time each gets, summed over both processes, is within 20 % of 3:1,
    and the engine queues (almost) nothing — the two processes admit the fleet's 4, not 4 each."""
    sim = await sim_process(model="m", max_num_seqs=4, ttft_ms=5, itl_ms=3)
    tenants = [{"name": "small", "api_keys": ["sk-small"], "weight": 1},
               {"name": "large", "api_keys": ["sk-large"], "weight": 3}]
    planes = [plane(config(redis_server.url, name, [sim.url], tenants=tenants, max_num_seqs=4))
              for name in ("a", "b")]
    async with planes[0] as a, planes[1] as b, aiohttp.ClientSession() as s:
        await wait_until(lambda: a.registry.processes == b.registry.processes == 2, what="both counted")
        stop = asyncio.Event()

        async def client(url: str, key: str) -> None:  # a closed loop: always a request waiting
            while not stop.is_set():
                async with s.post(url + "/v1/completions", json=body(max_tokens=12),
                                  headers={"Authorization": f"Bearer {key}"}) as resp:
                    assert resp.status == 200, await resp.text()

        def slot_seconds() -> dict[str, float]:
            out = {"small": 0.0, "large": 0.0}
            for dp in (a, b):
                for tenant, _, figures in dp.admission.tenant_stats():
                    out[tenant] += figures["slot_seconds"]
            return out

        tasks = [asyncio.create_task(client(dp.url, key)) for dp in (a, b) for key in ("sk-small", "sk-large")
                 for _ in range(6)]
        await asyncio.sleep(1.0)
        before = slot_seconds()
        waiting = []
        for _ in range(16):
            await asyncio.sleep(0.25)
            waiting.append((await sim.stats())["waiting"])
        after = slot_seconds()
        stop.set()
        await asyncio.gather(*tasks)
    used = {t: after[t] - before[t] for t in ("small", "large")}
    share = used["large"] / (used["large"] + used["small"])
    assert abs(share - 0.75) / 0.75 < 0.20, used  # one process: 15 % (test_tenants_e2e)
    # Each process admitting 4 of its own would keep 4 waiting throughout; the shared count lags the
    # exchange by a round trip, so on a loaded machine one more is sometimes let in (a mean of 17/16 was
    # seen in a fresh-clone run): the bound is halfway.
    assert sum(waiting) / len(waiting) < 2.0, waiting


async def test_a_session_lookup_redis_does_not_answer_is_routed_without_it(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Redis stopped (SIGSTOP): a turn of a session B does not know waits for the lookup's bound only,
    then is routed as a new session."""
    sim = await sim_process(model="m", max_num_seqs=8, ttft_ms=1, itl_ms=1)
    async with plane(config(redis_server.url, "a", [sim.url])) as a, \
            plane(config(redis_server.url, "b", [sim.url])) as b, aiohttp.ClientSession() as s:
        await wait_until(lambda: a.registry.processes == b.registry.processes == 2, what="both counted")
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)  # the fixture's own redis-server
        try:
            async with s.post(b.url + "/v1/completions", json=body(user="never-seen")) as resp:
                assert resp.status == 200
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        # the lookup's own bound ended it, not the Redis client's (op_timeout_s, 2 s: an "error")
        assert view(b).sessions.lookups == {"found": 0, "unknown": 0, "timeout": 1, "error": 0}


async def test_redis_away_is_logged_once_and_its_return_once(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """Redis stopped for two of the load exchange's 2 s bounds: each exchange fails, one warning says
    so (with what it means for routing), one line says it answers again — not one per round trip."""
    sim = await sim_process(model="m", max_num_seqs=8, ttft_ms=1, itl_ms=1)
    async with plane(config(redis_server.url, "a", [sim.url])) as a:
        await wait_until(lambda: view(a).load.exchanges_total > 0, what="a first exchange")
        assert redis_server.proc is not None
        with structlog.testing.capture_logs() as logs:
            redis_server.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(4.5)
            finally:
                redis_server.proc.send_signal(signal.SIGCONT)
            await wait_until(lambda: any(e["event"] == "shared_load_recovered" for e in logs),
                             what="the recovery logged")
    lines = [e for e in logs if e["event"].startswith("shared_load_")]
    assert [e["event"] for e in lines] == ["shared_load_unavailable", "shared_load_recovered"], lines
    assert "own in-flight counts" in lines[0]["effect"]
    assert "Timeout" in lines[0]["error"]
