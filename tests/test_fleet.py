"""Fleets on a real local Ray cluster (4 declared GPUs): placement, scaling, admin, adoption, shutdown.

Each test gets its own Ray namespace, so one test's actors are never another's to adopt or stop.
Failure handling under traffic is in test_fleet_failover.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd import assembly, config
from routerd.config import Config
from routerd.fleet import FleetManager, RayCluster
from routerd.fleet.actor import group_members
from routerd.registry import InstanceState, Registry
from routerd.status import fetch, render
from routerd.status import main as status_main
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster, reclaim_leftovers

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

SIM_ARGS = {"max-num-seqs": 8, "ttft-ms": 5, "itl-ms": 3}


def make_cfg(rc: RayTestCluster, state: Path, ns: str, fleets: list[dict[str, Any]],
             health: dict[str, Any] | None = None) -> Config:
    raw = {
        "daemon": {"state_dir": str(state), "drain_timeout_s": 5},
        "redis": {"enabled": False},
        "ray": {"address": rc.address, "namespace": f"{rc.namespace}-{ns}"},
        "routing": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
        "health": {"restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 2.0, "startup_timeout_s": 60,
                   **(health or {})},
        "fleets": fleets,
    }
    return config.parse(raw, environ={})


@dataclass
class Running:
    fm: FleetManager
    registry: Registry
    cluster: RayCluster
    url: str = ""

    async def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        if not await eventually(cond, timeout):
            raise AssertionError(f"timed out ({timeout}s) waiting for {what}: "
                                 f"{[(i.id, i.state.value, i.state_reason) for i in self.registry]}")

    async def wait_ready(self, fleet: str, n: int, timeout: float = 60.0) -> None:
        await self.wait(lambda: self.registry.ready_count(fleet) == n, timeout, f"{n} ready in {fleet}")


@contextlib.asynccontextmanager
async def running(cfg: Config, *, stop_engines: bool = True) -> AsyncIterator[Running]:
    """routerd from the one builder, as the daemon has it: the fleet manager, the data plane and the
    admin routes on a free port."""
    async with assembly.running(cfg, Registry(), stop_engines=stop_engines) as routerd:
        assert routerd.fleets is not None
        assert routerd.cluster is not None
        await reclaim_leftovers(routerd.cluster)  # the head's 4 GPUs are this test's to count
        yield Running(routerd.fleets, routerd.registry, routerd.cluster, routerd.url)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None) -> Any:
    async with session.post(url, json=body or {}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def our_pgs(cluster: RayCluster) -> list[str]:
    prefix = f"routerd:{cluster.namespace}:"
    return [name for name, _, _ in await cluster.placement_groups() if name.startswith(prefix)]


async def test_tp2_fleet_fills_gpus_scales_and_is_operable(ray_cluster: RayTestCluster, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_cfg(ray_cluster, tmp_path, "tp", [
        {"name": "tp", "model": "sim-tp", "engine": "sim", "replicas": 2, "tensor_parallel_size": 2,
         "num_cpus_per_instance": 0.5, "engine_args": SIM_ARGS}])
    async with running(cfg) as r, aiohttp.ClientSession() as s:
        await r.wait_ready("tp", 2)
        _, avail = await r.cluster.resources()
        assert avail.get("GPU", 0.0) == 0.0  # 2 instances × TP 2 hold all 4 declared GPUs
        assert len(await our_pgs(r.cluster)) == 2

        # Scale 2 → 3: the third cannot be placed, and status says what is missing.
        await post(s, f"{r.url}/admin/fleets/tp/replicas", {"replicas": 3})
        await r.wait(lambda: "GPU" in getattr(r.registry.get("tp:2"), "state_reason", ""), 15,
                     "tp:2 reported as waiting for GPUs")
        third = r.registry.get("tp:2")
        assert third is not None
        async with s.get(f"{r.url}/admin/fleets") as resp:
            assert (await resp.json())["fleets"]["tp"]["replicas"] == 3  # the run-time count
        assert third.state is InstanceState.STARTING
        assert "waiting for resources" in third.state_reason

        # Scale 3 → 1: the pending one and one running one are stopped; their GPUs come back.
        pid1 = r.registry.get("tp:1").pid  # type: ignore[union-attr]  # present: 2 were ready
        await post(s, f"{r.url}/admin/fleets/tp/replicas", {"replicas": 1})
        await r.wait(lambda: [i.id for i in r.registry] == ["tp:0"], 20, "only tp:0 left")
        assert pid1 is not None
        assert await eventually(lambda: not group_members(pid1), 5)
        for _ in range(40):
            _, avail = await r.cluster.resources()
            if avail.get("GPU", 0.0) == 2.0:
                break
            await asyncio.sleep(0.25)
        assert avail.get("GPU", 0.0) == 2.0
        assert len(await our_pgs(r.cluster)) == 1

        # Drain, then restart one instance through the admin API.
        inst = r.registry.get("tp:0")
        assert inst is not None
        gen, pid0 = inst.generation, inst.pid
        drained = await post(s, f"{r.url}/admin/instances/tp:0/drain", {"timeout_s": 2})
        assert drained["draining"]["state"] == "draining"
        assert r.registry.routable("tp") == []
        await post(s, f"{r.url}/admin/instances/tp:0/restart")

        def restarted() -> bool:
            new = r.registry.get("tp:0")  # each engine generation is a fresh registry Instance
            return new is not None and new.state is InstanceState.READY and new.generation == gen + 1

        await r.wait(restarted, 30, "tp:0 restarted")
        inst = r.registry.get("tp:0")
        assert inst is not None
        assert inst.pid != pid0
        assert pid0 is not None
        assert not group_members(pid0)
        assert inst.restarts == 1

        # Operators' view: GET /admin/fleets and `routerd status`.
        await r.wait(lambda: bool(inst.resources.get("rss_bytes")), 10, "resource use reported")
        status = await fetch(r.url, "", 5.0)
        row = status["fleets"]["tp"]["instances"][0]
        assert row["pid"] == inst.pid
        assert row["generation"] == gen + 1
        table = render(status)
        assert "tp:0" in table
        assert "ready" in table
        assert await asyncio.to_thread(status_main, ["--url", r.url]) == 0
        printed = capsys.readouterr().out
        assert "tp:0" in printed
        assert "RESTARTS" in printed
        async with s.post(f"{r.url}/admin/instances/nope:0/restart") as resp:
            assert resp.status == 404
        pids = [i.pid for i in r.registry if i.pid]
    # Shutdown with stop_engines: no engine process, no placement group, no named actor is left.
    assert all(not group_members(p) for p in pids)
    cluster = await RayCluster.connect(cfg.ray, tmp_path)
    try:
        assert await our_pgs(cluster) == []
        assert [n for n in await cluster.named_actors() if n.startswith("routerd:")] == []
    finally:
        await cluster.close()


async def test_restart_adopts_same_pids_and_replaces_changed_specs(ray_cluster: RayTestCluster,
                                                                   tmp_path: Path) -> None:
    fleets = [{"name": "ad", "model": "sim-ad", "engine": "sim", "replicas": 2,
               "num_cpus_per_instance": 0.25, "tensor_parallel_size": 1, "engine_args": SIM_ARGS}]
    cfg = make_cfg(ray_cluster, tmp_path, "ad", fleets)
    async with running(cfg, stop_engines=False) as r:
        await r.wait_ready("ad", 2)
        before = {i.id: (i.pid, i.url, i.generation) for i in r.registry}
        # A placement group left by a routerd that died mid-launch: the next start removes it.
        await r.cluster.placement_group(f"routerd:{r.cluster.namespace}:ad:7", {"CPU": 0.1})

    started = time.monotonic()
    async with running(cfg, stop_engines=False) as r:
        assert r.registry.ready_count("ad") == 2  # start() returns with adopted engines in rotation
        adopt_s = time.monotonic() - started
        assert {i.id: (i.pid, i.url, i.generation) for i in r.registry} == before
        assert sorted(await our_pgs(r.cluster)) == [f"routerd:{r.cluster.namespace}:ad:0",
                                                    f"routerd:{r.cluster.namespace}:ad:1"]
    assert adopt_s < 10

    # Changed engine_args and fewer replicas: ad:1 is stopped at once; ad:0 is adopted as it runs,
    # keeps serving, and is then replaced by the rolling update with an engine of the new spec.
    changed = make_cfg(ray_cluster, tmp_path, "ad", [{**fleets[0], "replicas": 1,
                                                     "engine_args": {**SIM_ARGS, "itl-ms": 4}}])
    old_pids = {p for p, _, _ in before.values()}
    async with running(changed, stop_engines=True) as r:
        def renewed() -> bool:
            inst = r.registry.get("ad:0")
            return inst is not None and inst.state is InstanceState.READY and inst.pid not in old_pids

        await r.wait(renewed, 60, "ad:0 replaced with the new spec")
        assert r.fm.supervisors["ad:0"].slot.spec.engine_args["itl-ms"] == 4
        for pid, _, _ in before.values():
            assert pid is not None
            assert not group_members(pid)
        assert r.registry.get("ad:1") is None
        assert len(await our_pgs(r.cluster)) == 1


async def test_crash_loop_and_unplaceable_are_visible(ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    cfg = make_cfg(ray_cluster, tmp_path, "cl", [
        {"name": "cl", "model": "sim-cl", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
         "engine_args": {"no-such-flag": 1}},
        {"name": "huge", "model": "sim-huge", "engine": "sim", "replicas": 1, "tensor_parallel_size": 8,
         "num_cpus_per_instance": 0.25, "engine_args": SIM_ARGS}])
    async with running(cfg) as r:
        await r.wait(lambda: getattr(r.registry.get("huge:0"), "state_reason", "").startswith("unplaceable"),
                     15, "TP=8 on a 4-GPU cluster reported unplaceable")
        assert "'GPU': 8.0" in r.registry.get("huge:0").state_reason  # type: ignore[union-attr]  # waited
        await r.wait(lambda: "crash loop" in getattr(r.registry.get("cl:0"), "state_reason", ""), 30,
                     "a crash loop in the state reason")
        inst = r.registry.get("cl:0")
        assert inst is not None
        assert inst.state is InstanceState.UNHEALTHY
        assert inst.restarts >= 2
        assert "process exited" in inst.state_reason
        assert r.registry.routable("cl") == []
    logs = sorted((tmp_path / "engines" / "cl-0").glob("g*.log"))
    assert len(logs) >= 2  # one log per engine generation, kept for the operator
    assert "no-such-flag" in logs[0].read_text()


async def test_reload_rolls_changed_specs_one_at_a_time(ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    fleet = {"name": "ro", "model": "sim-ro", "engine": "sim", "replicas": 2, "num_cpus_per_instance": 0.25,
             "engine_args": SIM_ARGS}
    cfg = make_cfg(ray_cluster, tmp_path, "ro", [fleet])
    async with running(cfg) as r:
        await r.wait_ready("ro", 2)
        old = {i.pid for i in r.registry}
        min_ready = 2

        async def watch() -> None:
            nonlocal min_ready
            while True:
                min_ready = min(min_ready, r.registry.ready_count("ro"))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            await r.fm.apply(make_cfg(ray_cluster, tmp_path, "ro",
                                      [{**fleet, "engine_args": {**SIM_ARGS, "itl-ms": 4}}]))
            await r.wait(lambda: r.registry.ready_count("ro") == 2 and not old & {i.pid for i in r.registry},
                         60, "both instances replaced")
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        assert min_ready == 1  # never both out of rotation at once
        assert all(s.slot.spec.engine_args["itl-ms"] == 4 for s in r.fm.supervisors.values())


async def test_daemon_start_up_failing_after_fleets_stops_supervising(ray_cluster: RayTestCluster,
                                                                      tmp_path: Path) -> None:
    import socket

    import msgspec

    from routerd.daemon import Daemon

    cfg = make_cfg(ray_cluster, tmp_path, "su", [
        {"name": "su", "model": "sim-su", "engine": "sim", "replicas": 0, "engine_args": SIM_ARGS}])
    with socket.socket() as busy:  # the HTTP port is taken: start-up fails after the fleets started
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = msgspec.structs.replace(cfg, http=msgspec.structs.replace(cfg.http, port=busy.getsockname()[1]))
        daemon = Daemon(tmp_path / "routerd.toml", cfg)
        with pytest.raises(ExceptionGroup) as info:  # the TaskGroup's
            await daemon.run()
        assert info.group_contains(OSError)
    assert daemon.routerd is not None
    assert daemon.routerd.fleets is not None
    assert daemon.routerd.core.session.closed  # no leaked aiohttp session
    assert not daemon.routerd.fleets._tasks  # no supervisor left running


async def test_an_actor_record_this_version_cannot_read_is_replaced(ray_cluster: RayTestCluster,
                                                                    tmp_path: Path) -> None:
    class OlderEngineActor:  # local, so Ray pickles it by value; stands in for another routerd version's
        def info(self) -> dict[str, Any]:
            return {"spec": '{"fleet": "ur", "index": "zero"}', "pid": None}

        def ping(self) -> bool:
            return True

    cfg = make_cfg(ray_cluster, tmp_path, "ur", [
        {"name": "ur", "model": "sim-ur", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
         "engine_args": SIM_ARGS}])
    cluster = await RayCluster.connect(cfg.ray, config.state_dir(cfg))
    try:
        pg = await cluster.placement_group(f"routerd:{cluster.namespace}:ur:0", {"CPU": 0.25})
        older = await cluster.create_actor(OlderEngineActor, "routerd:ur:0", {"CPU": 0.25}, pg)
        assert await older.ping.remote() is True
    finally:
        await cluster.close()
    async with running(cfg) as r:  # start() used to raise here, so routerd could never start again
        await r.wait_ready("ur", 1)
        assert r.fm.supervisors["ur:0"].slot.spec.model == "sim-ur"
