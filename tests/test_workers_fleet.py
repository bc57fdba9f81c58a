"""``[daemon] workers = 2`` over a fleet launched on Ray (routerd/workers.py, routerd/peers/): the parent
controls the engines, the workers follow the fleet state it publishes in Redis and relay their admin
calls to it. Real ``routerd run``, real redis-server, a real Ray head, simulated engines as processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd.client import QueueClient
from routerd.config import RayConfig
from routerd.fleet.actor import group_members
from routerd.fleet.engine import EngineOps
from routerd.fleet.ray_cluster import RayCluster
from routerd.plugins import LaunchSpec
from tests.fixtures.daemon import RouterdFactory, RouterdProcess
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.redis_server import RedisServer
from tests.test_control_replicas import events
from tests.test_workers import _alive, _who_answers

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


async def both_serve(url: str, rounds: int = 20) -> None:
    """Every request answered 200, until each worker has answered some (the kernel picks the worker per
    connection: a worker slowed by a loaded machine may miss one round)."""
    seen: set[str] = set()
    for _ in range(rounds):
        answers = await _who_answers(url, 12)
        assert all(k.startswith("200:") for k in answers), answers
        seen |= set(answers)
        if seen == {"200:w0", "200:w1"}:
            return
    raise AssertionError(f"only {sorted(seen)} answered")


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
    await both_serve(rp.url)
    # The parent kept the lease it launched under (spawning the workers and the first placement group's
    # wait held its loop past a short lease once) and removed nothing as a stray.
    assert len(events(rp, "control_acquired")) == 1, rp.log()
    assert events(rp, "stray_placement_group_removed") == []

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
    await both_serve(rp.url)
    await asyncio.sleep(1.5)  # a second restart (a fight, a stale view) would show within this
    assert parent_restarts(rp) == {"w:0": 2}
    assert engine((await worker_views(rp.url))["1"]) == third

    # SIGHUP: the parent and both workers reload; the workers keep the launched instance (it is not in
    # their file, only in the parent's published state) and route to it.
    rp.signal(signal.SIGHUP)
    rp.wait_notify("READY=1", timeout=60)
    await both_serve(rp.url)
    assert engine((await worker_views(rp.url))["0"]) == third

    # A replica count sent to a worker: the parent launches the second engine, both workers see it.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.post(f"{rp.url}/admin/fleets/w/replicas", json={"replicas": 2}) as r:
        assert r.status == 200, await r.text()
    await both_see(rp, lambda v: v["fleets"]["w"]["ready"] == 2 and v["fleets"]["w"]["replicas"] == 2,
                   "two ready engines on both workers")

    # Queue jobs, read by both workers, run on the launched engines: one result each.
    client = QueueClient.from_url(redis_server.url)
    try:
        jobs = await client.submit_many([{"model": "m", "prompt": f"job {i}", "max_tokens": 4}
                                         for i in range(20)])
        results = await client.wait_many(jobs, timeout=60)
        assert {r.status for r in results.values()} == {"ok"}, [r.error for r in results.values()][:3]
        assert {r.instance for r in results.values()} <= {"w:0", "w:1"}
    finally:
        await client.aclose()
    last = await worker_views(rp.url)
    engines = {i["id"]: int(i["pid"]) for i in last["0"]["fleets"]["w"]["instances"]}
    workers = {int(e["worker"]): int(e["pid"]) for e in events(rp, "worker_started")}

    # The daemon SIGKILLed: its workers drain and exit, the engines run on; the same config started
    # again takes the lease at once (the same ident) and adopts them — none relaunched.
    rp.proc.kill()
    await asyncio.to_thread(rp.proc.wait, 10)
    assert await eventually(lambda: not any(_alive(pid) for pid in workers.values()), 30), rp.log()
    again = await asyncio.to_thread(routerd_process, cfg)
    view = await both_see(again, lambda v: v["fleets"]["w"]["ready"] == 2, "the engines adopted")
    assert {i["id"]: int(i["pid"]) for i in view["fleets"]["w"]["instances"]} == engines
    assert events(again, "engine_started") == []
    assert len(events(again, "adopted")) == 2
    await both_serve(again.url)

    again.signal(signal.SIGTERM)
    assert await asyncio.to_thread(again.wait_exit, 90) == 0, again.log()
    for pid in engines.values():  # stopped by the parent on its way out
        assert await eventually(lambda pid=pid: not group_members(pid), 15)



async def test_a_request_on_a_worker_wakes_a_fleet_scaled_to_zero(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any) -> None:
    """The parent controls the fleets and takes no requests: a request on a worker that found the fleet
    at zero used to wait out the waiting room and get 503 while the fleet stayed at zero. The worker
    now has the parent start an engine (the wake relay), and the request is served by it."""
    fleet = {"name": "z", "model": "m", "engine": "sim", "replicas": 0, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 4, "ttft-ms": 5, "itl-ms": 3},
             "autoscale": {"min_replicas": 0, "max_replicas": 1, "scale_down_delay_s": 600.0}}
    cfg = routerd_config(
        daemon={"workers": 2, "stop_engines_on_exit": True},
        redis={"enabled": True, "url": redis_server.url, "consumer": "wz", "block_ms": 200},
        control={"lease_s": 1.5}, admission={"waiting_room_s": 60.0},
        ray={"address": ray_cluster.address, "namespace": f"wz-{uuid.uuid4().hex[:8]}"}, fleets=[fleet])
    rp = await asyncio.to_thread(routerd_process, cfg)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for _ in range(4):  # either worker: ready at zero (the fleet starts on demand)
            async with s.get(f"{rp.url}/readyz") as r:
                assert r.status == 200, await r.text()
        assert [v["fleets"]["z"]["instances"] for v in (await worker_views(rp.url)).values()] == [[], []]
        body = {"model": "m", "prompt": "wake up", "max_tokens": 3}
        async with s.post(f"{rp.url}/v1/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=90)) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Routerd-Instance"] == "z:0"
            assert r.headers["X-Routerd-Worker"] in ("0", "1")
    woken = [e for e in events(rp, "autoscale_decision") if e.get("fleet") == "z" and e["replicas"] == 1]
    assert woken, rp.log()
    assert all("worker" not in e for e in woken), woken  # the parent started it
    rp.signal(signal.SIGTERM)
    assert await asyncio.to_thread(rp.wait_exit, 90) == 0, rp.log()

async def test_placing_an_engine_waits_for_its_group_off_the_event_loop(
        ray_cluster: RayTestCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's first ``pg.ready()`` held the event loop 0.2 s here, 1.2 s under load — past the
    renew margin of a short control lease, so a parent of workers lost control in the middle of its
    first launch and removed its own new placement group as a stray. It is made in a thread now."""
    loop_thread = threading.current_thread()
    cluster = await RayCluster.connect(RayConfig(address=ray_cluster.address,
                                                 namespace=f"pl-{uuid.uuid4().hex[:8]}"), tmp_path / "state")
    made_on: list[threading.Thread] = []
    from ray.util.placement_group import PlacementGroup

    ready = PlacementGroup.ready

    def noting(pg: PlacementGroup) -> Any:  # Ray's own ready(), where it is called noted
        made_on.append(threading.current_thread())
        return ready(pg)

    monkeypatch.setattr(PlacementGroup, "ready", noting)
    try:
        async with aiohttp.ClientSession() as session:
            ops = EngineOps(cluster, str(tmp_path / "state"), time.monotonic, session)
            spec = LaunchSpec(fleet="pl", index=0, model="m", engine="sim")
            pg, node = await ops.place(spec, {"CPU": 0.1}, lambda _: None)
        assert node  # placed
        assert made_on
        assert loop_thread not in made_on
        await cluster.remove_placement_group(pg)
    finally:
        await cluster.close()
