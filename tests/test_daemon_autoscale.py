"""``routerd run`` with a fleet that scales to zero: ready at zero, a queue job starts it and is served,
idle returns it to zero and a batch of jobs brings it back, SIGHUP moves the bounds, and
``routerd status`` / ``/metrics`` show what the autoscaler did. Real Redis, Ray and engines."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from typing import Any

import aiohttp
import pytest

from routerd.client import QueueClient
from routerd.status import main as status_main
from tests.fixtures.daemon import RouterdFactory
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.redis_server import RedisServer

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


async def _fleet(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/admin/fleets") as r:
        fleet: dict[str, Any] = (await r.json())["fleets"]["q"]
    return fleet


async def _until(s: aiohttp.ClientSession, url: str, what: str, cond: Any, timeout: float) -> dict[str, Any]:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        fleet = await _fleet(s, url)
        if cond(fleet):
            return fleet
        assert asyncio.get_running_loop().time() < end, f"never {what}: {json.dumps(fleet)[:2000]}"
        await asyncio.sleep(0.2)


async def test_queue_job_wakes_a_fleet_at_zero_and_sighup_moves_the_bounds(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = {"name": "q", "model": "sim-q", "engine": "sim", "replicas": 0, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 4, "ttft-ms": 5, "itl-ms": 3},
             "autoscale": {"min_replicas": 0, "max_replicas": 2, "scale_down_delay_s": 2.0}}
    cfg = routerd_config(ray={"address": ray_cluster.address, "namespace": f"a-{uuid.uuid4().hex[:8]}"},
                         redis={"enabled": True, "url": redis_server.url}, admission={"waiting_room_s": 60.0},
                         fleets=[fleet],
                         # its engines (one GPU each, declared) must not outlive it on the shared test cluster
                         daemon={"stop_engines_on_exit": True})
    rp = await asyncio.to_thread(routerd_process, cfg)  # READY=1 with the fleet at zero
    async with aiohttp.ClientSession() as s, QueueClient.from_url(redis_server.url) as q:
        async with s.get(f"{rp.url}/readyz") as r:
            assert r.status == 200, await r.text()
        assert (await _fleet(s, rp.url))["instances"] == []

        # A queue job is read although the fleet has no instance, wakes it, and is served by it.
        job = await q.submit({"model": "sim-q", "prompt": "hi", "max_tokens": 3}, endpoint="/v1/completions")
        result = await q.wait(job, timeout=90)
        assert result.status == "ok", result.error
        assert result.instance == "q:0"

        # Idle: back to zero; then a batch of jobs wakes it again and every one is served.
        await _until(s, rp.url, "back to zero", lambda f: not f["instances"], 30)
        bodies = [{"model": "sim-q", "prompt": f"hi {i}", "max_tokens": 3} for i in range(8)]
        batch = await q.submit_many(bodies, endpoint="/v1/completions")
        results = await q.wait_many(batch, timeout=90)
        assert sorted(r.status for r in results.values()) == ["ok"] * 8
        await _until(s, rp.url, "back to zero again", lambda f: not f["instances"], 60)

        # SIGHUP raising min_replicas to 2: the bounds apply at once (reason "bounds").
        new = json.loads(json.dumps(cfg))
        new["fleets"][0]["autoscale"]["min_replicas"] = 2
        rp.rewrite_config(new)
        # Read the notify socket empty first: its queue holds a few datagrams and the watchdog pings
        # every 0.2 s, so RELOADING=1 would be dropped behind them.
        await asyncio.to_thread(rp.read_notify, 0.3)
        rp.signal(signal.SIGHUP)
        await asyncio.to_thread(rp.wait_notify, "RELOADING=1", 10)
        fleet_now = await _until(s, rp.url, "2 ready after the reload", lambda f: f["ready"] == 2, 60)
        auto = fleet_now["autoscale"]
        assert auto["min_replicas"] == 2
        assert auto["desired"] == 2
        assert auto["recent"][-1]["reason"] == "bounds"
        assert auto["decisions_total"]["up:cold_start"] == 2

        async with s.get(f"{rp.url}/metrics") as r:
            text = await r.text()
        assert 'routerd_fleet_desired_replicas{fleet="q"} 2.0' in text
        assert 'routerd_fleet_ready_replicas{fleet="q"} 2.0' in text
        assert 'routerd_autoscale_decisions_total{direction="down",fleet="q",reason="idle"}' in text
        assert 'routerd_autoscale_decisions_total{direction="up",fleet="q",reason="bounds"} 1.0' in text
        assert await asyncio.to_thread(status_main, ["--url", rp.url]) == 0
        assert "autoscale=2..2" in capsys.readouterr().out
