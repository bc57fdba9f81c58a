"""``[daemon] workers = 2`` over a fleet launched on Ray (routerd/workers.py, routerd/view/): the parent
controls the engines, the workers follow the fleet state it publishes in Redis and relay their admin
calls to it. Real ``routerd run``, real redis-server, a real Ray head, simulated engines as processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd.fleet.actor import group_members
from tests.fixtures.daemon import RouterdFactory, RouterdProcess
from tests.fixtures.ray_cluster import RayTestCluster, eventually
from tests.fixtures.redis_server import RedisServer
from tests.test_control_replicas import events
from tests.test_workers import _who_answers

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


async def worker_views(url: str, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """``/admin/fleets`` as each worker answers it (new connections until both answered)."""
    seen: dict[str, dict[str, Any]] = {}
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        while len(seen) < 2:
            assert time.monotonic() < end, f"only workers {sorted(seen)} answered"
            async with s.get(f"{url}/admin/fleets", timeout=aiohttp.ClientTimeout(total=5)) as r:
                assert r.status == 200, await r.text()
                seen.setdefault(r.headers["X-Routerd-Worker"], await r.json())
    return seen


def engine(view: dict[str, Any]) -> tuple[str, int] | None:
    """The fleet's one instance as (state, pid), None while it has none (or no process yet)."""
    insts = view["fleets"]["w"]["instances"]
    if len(insts) != 1 or insts[0]["pid"] is None:
        return None
    return insts[0]["state"], int(insts[0]["pid"])


async def both_see(rp: RouterdProcess, cond: Any, what: str, timeout: float = 60.0) -> dict[str, Any]:
    """Poll until both workers' views satisfy ``cond``; one of them."""
    end = time.monotonic() + timeout
    views: dict[str, dict[str, Any]] = {}
    while time.monotonic() < end:
        views = await worker_views(rp.url)
        if all(cond(v) for v in views.values()):
            return views["0"]
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {views}\n{rp.log()}")


def parent_restarts(rp: RouterdProcess) -> Counter[str]:
    """``engine_restarted`` per instance, and that only the parent (no ``worker``) restarted any."""
    restarted = events(rp, "engine_restarted")
    assert all("worker" not in e for e in restarted), restarted
    return Counter(e["instance"] for e in restarted)


async def test_workers_follow_a_launched_fleet_and_relay_admin_calls_to_the_parent(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    """Both workers route to the engine the parent launched; ``/admin/fleets`` on either names the parent
    as controller; a restart sent to a worker is carried out by the parent; the engine SIGKILLed is
    restarted once, by the parent, and both workers route to its replacement."""
    fleet = {"name": "w", "model": "m", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 8, "ttft-ms": 5, "itl-ms": 3}}
    cfg = routerd_config(
        daemon={"workers": 2, "stop_engines_on_exit": True},
        redis={"enabled": True, "url": redis_server.url, "consumer": "wk", "block_ms": 200},
        control={"lease_s": 1.5},
        ray={"address": ray_cluster.address, "namespace": f"wk-{uuid.uuid4().hex[:8]}"},
        health={"restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 2.0}, fleets=[fleet])
    rp = await asyncio.to_thread(routerd_process, cfg)

    def up(pid: int | None = None) -> Any:
        def ok(v: dict[str, Any]) -> bool:
            e = engine(v)
            return e is not None and e[0] == "ready" and (pid is None or e[1] != pid)
        return ok

    view = await both_see(rp, up(), "the launched engine on both workers")
    assert view["control"]["controller"]["ident"] == "wk", view["control"]  # the parent
    assert view["control"]["controls"] is False
    first = engine(view)
    assert first is not None
    assert set(await _who_answers(rp.url, 24)) == {"200:w0", "200:w1"}

    # An admin restart sent to a worker: the parent carries it out (relay), once.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.post(f"{rp.url}/admin/instances/w:0/restart") as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Routerd-Worker"] in ("0", "1")
    second = engine(await both_see(rp, up(first[1]), "the engine restarted on the admin call"))
    assert second is not None
    assert parent_restarts(rp) == {"w:0": 1}

    # The engine SIGKILLed: the parent restarts it exactly once; both workers route to the new one.
    os.kill(second[1], signal.SIGKILL)
    third = engine(await both_see(rp, up(second[1]), "the killed engine replaced"))
    assert third is not None
    assert set(await _who_answers(rp.url, 24)) == {"200:w0", "200:w1"}
    await asyncio.sleep(1.5)  # a second restart (a fight, a stale view) would show within this
    assert parent_restarts(rp) == {"w:0": 2}
    assert engine((await worker_views(rp.url))["1"]) == third

    rp.signal(signal.SIGTERM)
    assert await asyncio.to_thread(rp.wait_exit, 90) == 0, rp.log()
    assert await eventually(lambda: not group_members(third[1]), 15)  # stopped by the parent
