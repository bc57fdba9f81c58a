"""When fleet control changes hands (issue 26): what a new controller stops leaves every view at once, a
fleet scaled to zero stays at zero, and replicas whose ``[[fleets]]`` differ do not fight — on a real
Redis, a real Ray cluster, simulated engines and real ``routerd run`` processes."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from routerd import assembly, config
from routerd.client import QueueClient
from routerd.config import ControlConfig, RedisConfig
from routerd.fleet.actor import group_members
from routerd.peers.fleet_state import config_fingerprint
from routerd.redis_keys import RedisKeys
from routerd.registry import InstanceState, Registry
from tests.fixtures.daemon import RouterdFactory
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.redis_server import RedisServer
from tests.test_control_replicas import LEASE_S, events, launches, metric, poll, replica_cfg
from tests.test_fleet import SIM_ARGS, make_cfg
from tests.test_workers_fleet import worker_views


@pytest.mark.ray
@pytest.mark.timeout(120)
async def test_an_engine_a_new_term_stops_leaves_the_published_state_at_once(
        ray_cluster: RayTestCluster, redis_server: RedisServer, tmp_path: Path) -> None:
    """The issue's repro: a count pinned by the admin call, then ``FLUSHALL`` — the lease and the pin
    gone, the next term of control stops the engine beyond the file's count as unwanted. It stayed
    published ``ready`` with its dead pid; it must leave the registry (what is published) as it stops."""
    fleet = {"name": "fh", "model": "sim-fh", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
             "engine_args": SIM_ARGS}
    cfg = make_cfg(ray_cluster, tmp_path, "fh", [fleet])
    cfg = msgspec.structs.replace(cfg, redis=RedisConfig(url=redis_server.url, consumer="fh"),
                                  control=ControlConfig(lease_s=LEASE_S))
    async with assembly.running(cfg, Registry(), stop_engines=True, consume=False) as r, \
            aiohttp.ClientSession() as s:
        async with s.post(f"{r.url}/admin/fleets/fh/replicas", json={"replicas": 2}) as resp:
            assert resp.status == 200, await resp.text()
        assert await eventually(lambda: r.registry.ready_count("fh") == 2, 60)
        gone = r.registry.get("fh:1")
        assert gone is not None
        assert gone.pid is not None
        dead_pid, terms = gone.pid, r.core.control.acquisitions
        redis_server.client().flushall()
        assert await eventually(lambda: r.core.control.acquisitions > terms and r.core.control.controls, 30)
        # The next term adopted fh:0 and stopped fh:1: gone from the registry, not left "ready".
        assert await eventually(lambda: [i.id for i in r.registry] == ["fh:0"], 30), \
            [(i.id, i.state, i.pid) for i in r.registry]
        assert await eventually(lambda: not group_members(dead_pid), 15)
        assert r.registry.ready_count("fh") == 1
        inst = r.registry.get("fh:0")
        assert inst is not None
        assert inst.state is InstanceState.READY


@pytest.mark.ray
@pytest.mark.timeout(180)
async def test_a_change_of_controller_leaves_a_fleet_at_zero_at_zero(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    """A ``min_replicas = 0`` fleet that scaled to zero: the next controller starts its autoscaler from
    the published count (0), not from the file's ``replicas`` — no engine is launched for nobody."""
    fleet = {"name": "zz", "model": "m", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
             "engine_args": SIM_ARGS,
             "autoscale": {"min_replicas": 0, "max_replicas": 1, "scale_down_delay_s": 0.5,
                           "drain_timeout_s": 5.0}}
    ns = f"zz-{uuid.uuid4().hex[:8]}"
    extra: dict[str, Any] = {"ray": {"address": ray_cluster.address, "namespace": ns}, "fleets": [fleet]}
    ctl = await asyncio.to_thread(routerd_process, replica_cfg(
        routerd_config, tmp_path, "za", redis_server.url, stop_engines=True, **extra))
    fol = await asyncio.to_thread(routerd_process, replica_cfg(
        routerd_config, tmp_path, "zb", redis_server.url, stop_engines=True, **extra))
    async with aiohttp.ClientSession() as s:
        await poll(s, ctl, lambda st: st["control"]["controls"], "za controlling")
        # Begun at the file's count, then scaled to zero while idle; the follower sees that.
        await poll(s, ctl, lambda st: not st["fleets"]["zz"]["instances"]
                   and st["fleets"]["zz"]["autoscale"]["desired"] == 0, "zz scaled to zero")
        await poll(s, fol, lambda st: st["fleets"]["zz"]["replicas"] == 0
                   and not st["fleets"]["zz"]["instances"], "the follower seeing zz at zero")
        ctl.proc.send_signal(signal.SIGKILL)
        ctl.proc.wait(10)
        st = await poll(s, fol, lambda st: st["control"]["controls"] and events(fol, "fleet_control_started"),
                        "zb taking control")
        st = await poll(s, fol, lambda st: st["fleets"]["zz"]["autoscale"] is not None, "zb's autoscaler")
        assert st["fleets"]["zz"]["autoscale"]["desired"] == 0, st["fleets"]["zz"]
        assert st["fleets"]["zz"]["instances"] == []
        assert launches(fol) == {}


@pytest.mark.timeout(120)
async def test_a_reload_still_reaching_the_workers_is_no_config_mismatch(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any) -> None:
    """SIGHUP on a daemon with workers: the parent applies the new file and publishes its fingerprint
    before each worker has read the file again. The workers compared it with their old one and warned
    ``fleet_config_mismatch`` on every reload; a reload still reaching them is no mismatch. (The workers
    are held stopped until the parent published, so the order the issue saw is the order here.)"""
    cfg = routerd_config(daemon={"workers": 2, "worker_watchdog_s": 60.0},
                         redis={"enabled": True, "url": redis_server.url, "consumer": "rl", "block_ms": 200},
                         control={"lease_s": LEASE_S})
    rp = await asyncio.to_thread(routerd_process, cfg)
    for _ in range(300):  # until both workers follow the parent's state
        views = await worker_views(rp.url)
        if {v["view"]["controller"] for v in views.values()} == {"rl"}:
            break
        await asyncio.sleep(0.1)
    assert {v["view"]["controller"] for v in views.values()} == {"rl"}, views
    assert not any(v["view"]["config_mismatch"] for v in views.values())
    new = copy.deepcopy(cfg)
    new.setdefault("health", {})["failure_threshold"] = 5
    fingerprint = config_fingerprint(config.parse(new, environ={}))
    state_key = RedisKeys.from_config(config.parse(cfg, environ={}).redis).fleet_state()
    redis = redis_server.client()
    workers = [int(e["pid"]) for e in events(rp, "worker_started")]
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        rp.rewrite_config(new)
        rp.signal(signal.SIGHUP)
        assert await eventually(lambda: fingerprint.encode() in (redis.hget(state_key, "state") or b""), 30)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)

    def reloaded() -> bool:
        return len([e for e in events(rp, "reloaded") if "worker" in e]) == 2
    assert await eventually(reloaded, 30), rp.log()
    views = await worker_views(rp.url)
    assert {v["view"]["fingerprint"] for v in views.values()} == {fingerprint}
    assert not any(v["view"]["config_mismatch"] for v in views.values())
    assert events(rp, "fleet_config_mismatch") == []


@pytest.mark.ray
@pytest.mark.timeout(180)
async def test_the_controllers_fleets_are_the_fleets(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    """Replicas whose ``[[fleets]]`` differ: ``ea`` has the fleet ``extra``, ``eb`` does not. ``eb``
    taking control leaves ``extra``'s engine running as orphaned (it used to stop it, and the next
    controller with the fleet launched it again: a fight at every change); ``ea`` following ``eb`` is
    ready, lists only ``eb``'s models and answers ``extra``'s model 404 at once (it was 503 on /readyz,
    and a 20 s wait then 503); the orphan goes when an operator removes it."""
    base = {"name": "c", "model": "m", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
            "engine_args": SIM_ARGS}
    extra_fleet = {**base, "name": "extra", "model": "mx"}
    ray = {"address": ray_cluster.address, "namespace": f"ex-{uuid.uuid4().hex[:8]}"}
    # stop_engines_on_exit: the last controller stops what it manages (c:0) when the test ends.
    with_extra = replica_cfg(routerd_config, tmp_path, "ea", redis_server.url, stop_engines=True, ray=ray,
                             fleets=[base, extra_fleet], admission={"waiting_room_s": 20.0})
    without = replica_cfg(routerd_config, tmp_path, "eb", redis_server.url, stop_engines=True, ray=ray,
                          fleets=[base])
    ea = first = await asyncio.to_thread(routerd_process, with_extra)
    async with aiohttp.ClientSession() as s:
        st = await poll(s, ea, lambda st: st["control"]["controls"] and st["fleets"]["extra"]["ready"] == 1
                        and st["fleets"]["c"]["ready"] == 1, "ea launching both fleets")
        orphan_pid = int(st["fleets"]["extra"]["instances"][0]["pid"])
        eb = await asyncio.to_thread(routerd_process, without)
        await poll(s, eb, lambda st: st["fleets"]["c"]["ready"] == 1, "eb following")
        ea.proc.send_signal(signal.SIGKILL)
        ea.proc.wait(10)
        st = await poll(s, eb, lambda st: st["control"]["controls"] and st.get("orphaned"),
                        "eb orphaning extra")
        assert [(o["id"], o["pid"]) for o in st["orphaned"]] == [("extra:0", orphan_pid)]
        assert events(eb, "adopt_unwanted_stopping") == []
        assert group_members(orphan_pid), "the orphaned engine was stopped"

        ea = await asyncio.to_thread(routerd_process, with_extra)  # back, following eb
        st = await poll(s, ea, lambda st: st["view"]["controller"] == "eb"
                        and st["fleets"]["c"]["ready"] == 1, "ea following eb")
        assert [o["id"] for o in st["orphaned"]] == ["extra:0"]
        assert await metric(s, ea, "routerd_view_orphaned_engines") == 1
        async with s.get(f"{ea.url}/readyz") as r:
            assert r.status == 200, await r.text()
            assert "extra" not in (await r.json())["ready_instances"]
        async with s.get(f"{ea.url}/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["m"]
        async with s.post(f"{ea.url}/v1/completions", json={"model": "mx", "prompt": "hi", "max_tokens": 2},
                          timeout=aiohttp.ClientTimeout(total=10)) as r:
            assert r.status == 404, await r.text()
        # Both ways in: a queue job for it is answered at once too (either replica may read it; ea's
        # file has the fleet, and used to hold such a job the whole waiting room, then 503).
        async with QueueClient.from_url(redis_server.url) as q:
            jobs = [await q.submit({"model": "mx", "prompt": "hi", "max_tokens": 2}) for _ in range(6)]
            answers = await q.wait_many(jobs, timeout=10)
        assert {a.status for a in answers.values()} == {"error"}
        assert all("no fleet serves model" in str(a.error) for a in answers.values()), answers

        async with s.delete(f"{ea.url}/admin/orphans/extra:0") as r:  # relayed to the controller
            assert r.status == 200, await r.text()
        assert await eventually(lambda: not group_members(orphan_pid), 15)
        await poll(s, eb, lambda st: st["orphaned"] == [], "the orphan gone")
        async with s.delete(f"{eb.url}/admin/orphans/extra:0") as r:
            assert r.status == 404, await r.text()
    assert launches(first, ea, eb) == {"c:0": 1, "extra:0": 1}  # nothing launched twice, nothing fought over
