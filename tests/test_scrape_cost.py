"""Watching many instances cheaply: the /metrics fast path, the lean fetch, idle-rate scrapes and
heartbeats (routerd/routing/metrics_text.py, routing/scraper.py, fleet/health.py, dataplane/engine_http.py).

Rates are compared, never timed: an idle instance's scrapes and heartbeats against a busy one's over
the same window, counted at the simulated engines (``SimEngine.watched``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd.dataplane.engine_http import EnginePool, ProtocolError
from routerd.sim.config import SimConfig
from routerd.sim.metrics import SimMetrics
from routerd.sim.server import SimEngine
from routerd.vllm_wire import metrics_text
from tests.fixtures.dataplane import PlaneFactory, RunningPlane, SimFactory
from tests.test_promtext import vllm_page

REAL_PAGE = (Path(__file__).parent / "data" / "vllm" / "metrics.txt").read_bytes()


# the fast path reads the same snapshot as the full parser ---------------------------------------
@pytest.mark.parametrize("page", [
    REAL_PAGE,
    SimMetrics(SimConfig(model="m")).exposition(),
    vllm_page(running=3, waiting=2, kv=0.25).encode(),
    vllm_page(running=1, waiting=0, kv=0.5, old_names=True).encode(),
    vllm_page(running=2, waiting=1, kv=0.4, engines=2, max_num_seqs=48).encode(),
    # not prometheus_client's layout: no leading # HELP, so the whole page is read
    b'vllm:generation_tokens 7 1700000000000\nvllm:num_requests_running{model_name="a b}c"} 2\n',
    # a # HELP that is not the samples' own family: the blocks hold no wanted sample, so read whole
    b"# HELP x\nvllm:generation_tokens 7\nvllm:num_requests_running 2\n",
], ids=["real_vllm", "sim_idle", "current", "pre_012", "two_engines", "no_help", "foreign_help"])
def test_fast_path_reads_what_the_full_parser_reads(page: bytes) -> None:
    full = metrics_text.parse(page.decode(), 4.0)
    assert metrics_text.parse_page(page, 4.0) == full
    assert metrics_text.parse_page(page, 4.0) == full  # again: its family blocks as read the first time


async def test_fast_path_on_a_busy_sim_page(sims: SimFactory) -> None:
    """Requests running and finished: gauges, counters and the finished-request histograms' sums."""
    eng = await sims(itl_ms=20, max_num_seqs=2)
    async with aiohttp.ClientSession() as s:
        async def one(tokens: int) -> None:
            async with s.post(eng.url + "/v1/completions", json={"model": "m", "prompt": "hello there",
                                                                  "max_tokens": tokens}) as r:
                await r.read()

        await one(3)
        long = [asyncio.create_task(one(200)) for _ in range(3)]  # 2 running, 1 waiting
        try:
            while eng.stats.running < 2 or eng.stats.waiting < 1:  # noqa: ASYNC110  # the engine's counts
                await asyncio.sleep(0.01)
            page = eng.metrics.exposition()
        finally:
            for t in long:
                t.cancel()
            await asyncio.gather(*long, return_exceptions=True)
    fast = metrics_text.parse_page(page, 1.0)
    assert fast == metrics_text.parse(page.decode(), 1.0)
    assert (fast.running, fast.waiting) == (2, 1)
    assert fast.running_seconds_count == 1
    assert fast.generation_tokens >= 3


def test_fast_path_skips_the_families_routing_does_not_read() -> None:
    """A malformed line in a family routing never reads does not fail the scrape any more: the fast
    path does not look at it (the full parser, which reads every vllm: line, still refuses it)."""
    page = REAL_PAGE.replace(b'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny"}',
                             b'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny"', 1)
    assert page != REAL_PAGE
    with pytest.raises(metrics_text.ParseError):
        metrics_text.parse(page.decode(), 0.0)
    assert metrics_text.parse_page(page, 0.0) == metrics_text.parse(REAL_PAGE.decode(), 0.0)


# the watchers' lean fetch ---------------------------------------------------------------------------
async def test_fetch_reads_whole_pages_on_one_kept_alive_connection(sims: SimFactory) -> None:
    eng = await sims()
    pool = EnginePool(connect_timeout_s=2.0, read_timeout_s=2.0)
    try:
        for _ in range(3):
            status, page = await pool.fetch(eng.url + "/metrics", 8 * 1024 * 1024)
            assert status == 200
            text = eng.metrics.exposition().decode()
            assert metrics_text.parse_page(page, 0.0) == metrics_text.parse(text, 0.0)
        assert (await pool.fetch(eng.url + "/health", 1024))[0] == 200
        assert (await pool.fetch(eng.url + "/nope", 1024))[0] == 404
        assert pool.connects == 1
        with pytest.raises(ProtocolError, match="larger than 1000 bytes"):
            await pool.fetch(eng.url + "/metrics", 1000)
        assert (await pool.fetch(eng.url + "/health", 1024))[0] == 200
        assert pool.connects == 2  # the over-long answer's connection was closed, not reused
    finally:
        pool.close()
    assert eng.watched["/metrics"] == 4


# idle-rate scrapes and heartbeats ------------------------------------------------------------------
def _watched(sim: SimEngine) -> dict[str, int]:
    return {"/metrics": sim.watched["/metrics"], "/health": sim.watched["/health"]}


async def _busy(url: str, tokens: int) -> None:
    """A long request straight to the engine (not through routerd): its figures show work."""
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": tokens}) as r:
        await r.read()


async def test_idle_instances_are_watched_at_the_idle_periods(sims: SimFactory,
                                                              dataplane: PlaneFactory) -> None:
    idle, busy = await sims(itl_ms=10), await sims(itl_ms=10)
    plane = await dataplane([idle.url, busy.url],
                            routing={"scrape_interval_s": 0.05, "idle_scrape_interval_s": 0.5,
                                     "stale_after_s": 2.0},
                            health={"heartbeat_interval_s": 0.05, "idle_heartbeat_interval_s": 0.5})
    by_url = {i.url: i for i in plane.registry}
    work = asyncio.create_task(_busy(busy.url, 3000))
    try:
        await plane.wait_for(lambda: (s := by_url[busy.url].snapshot) is not None and s.running >= 1,
                             what="the busy engine's scrape showing its request")
        await plane.wait_for(lambda: by_url[idle.url].idle(), what="the idle instance idle")
        idle0, busy0 = _watched(idle), _watched(busy)
        # a window of at least three idle scrapes and two idle heartbeats
        end = time.monotonic() + 30
        while True:
            idle1 = _watched(idle)
            if idle1["/metrics"] - idle0["/metrics"] >= 3 and idle1["/health"] - idle0["/health"] >= 2:
                break
            assert time.monotonic() < end, f"idle instance watched {idle1} since {idle0}"
            await asyncio.sleep(0.1)
        busy1 = _watched(busy)
    finally:
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
    # 10× the rate at these periods; 3× leaves room for a loaded machine's late fast loops
    for path in ("/metrics", "/health"):
        idle_n, busy_n = idle1[path] - idle0[path], busy1[path] - busy0[path]
        assert busy_n >= 3 * idle_n, (path, idle_n, busy_n)
    assert all(i.state.value == "ready" for i in plane.registry)  # never stale, never out of rotation


async def _napping(plane: RunningPlane) -> bool:
    return len(plane.dp.watch.scraper._naps) == 1 and len(plane.dp.watch.static_health.monitor._naps) == 1


async def test_a_request_to_an_idle_instance_ends_its_idle_periods(sims: SimFactory,
                                                                   dataplane: PlaneFactory) -> None:
    """Idle periods of 30 s: a scrape and a heartbeat within the 10 s this test waits can only come
    from the request ending them."""
    sim = await sims(itl_ms=10)
    plane = await dataplane([sim.url], routing={"scrape_interval_s": 0.05, "idle_scrape_interval_s": 30,
                                                "stale_after_s": 60},
                            health={"heartbeat_interval_s": 0.05, "idle_heartbeat_interval_s": 30})
    end = time.monotonic() + 10
    while not await _napping(plane):
        assert time.monotonic() < end, "the instance's scrapes and heartbeats never went idle"
        await asyncio.sleep(0.02)
    before = _watched(sim)
    body: dict[str, Any] = {"model": "m", "prompt": "x", "max_tokens": 150, "stream": True}
    inst = next(iter(plane.registry))
    async with aiohttp.ClientSession() as s, s.post(plane.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        after = before
        while after["/metrics"] == before["/metrics"] or after["/health"] == before["/health"]:
            assert time.monotonic() < end + 10, f"not watched since the request: {after}"
            await asyncio.sleep(0.05)
            after = _watched(sim)
        # the scrape saw the request run (1.5 s of tokens: it is still running)
        await plane.wait_for(lambda: (snap := inst.snapshot) is not None and snap.running >= 1)
        await r.read()


async def test_a_missed_idle_heartbeat_is_followed_up_at_the_fast_period(sims: SimFactory,
                                                                           dataplane: PlaneFactory) -> None:
    """An idle engine whose ``/health`` says 503 (vLLM: the engine core is dead) while its ``/metrics``
    still answers: its scrapes stay good, so only the heartbeats see it. After the first miss the next
    probes come at the fast period — failed at once, not two idle periods (≥ 4.8 s here) later."""
    eng = await sims()
    plane = await dataplane([eng.url], routing={"scrape_interval_s": 0.05, "stale_after_s": 2.0},
                            health={"heartbeat_interval_s": 0.05, "idle_heartbeat_interval_s": 3.0})
    inst = next(iter(plane.registry))
    monitor = plane.dp.watch.static_health.monitor
    await plane.wait_for(lambda: len(monitor._naps) == 1, what="the idle instance's heartbeats napping")
    eng.faults.set(unhealthy=True)
    await plane.wait_for(lambda: (t := monitor.tracker(inst.id)) is not None and t.misses >= 1,
                         timeout=10.0, what="the first missed heartbeat")
    await plane.wait_for(lambda: inst.state.value == "unhealthy", timeout=2.0,
                         what="the instance failed by fast follow-up probes")
    assert inst.health == "unhealthy_http"
    assert not inst.scrape_error  # its scrapes never failed: the heartbeats alone found it
