"""Several routerd (real ``routerd run`` processes) on one Redis and one Ray cluster: exactly one controls
the fleets. Started at the same moment, both come up and nobody removes the other's placement groups;
an engine SIGKILLed is restarted once, not fought over; the controller SIGKILLed — together with an
engine — is replaced within the lease, which adopts the engines (none relaunched) and restarts the dead
one exactly once; a partitioned controller stops controlling before the other starts."""

from __future__ import annotations

import asyncio
import json
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
from tests.test_control_lease import PausableProxy

LEASE_S = 1.5


def events(rp: RouterdProcess, name: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``rp`` whose event is ``name``."""
    out = []
    for line in rp.log_path.read_text(errors="replace").splitlines():
        if f'"{name}"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == name:
            out.append(rec)
    return out


def launches(*rps: RouterdProcess) -> Counter[str]:
    """Engines started or restarted, per instance, by all of ``rps`` together."""
    return Counter(e["instance"] for rp in rps for name in ("engine_started", "engine_restarted")
                   for e in events(rp, name))


async def status(s: aiohttp.ClientSession, rp: RouterdProcess) -> dict[str, Any]:
    async with s.get(f"{rp.url}/admin/fleets", timeout=aiohttp.ClientTimeout(total=5)) as r:
        data: dict[str, Any] = await r.json()
        return data


async def poll(s: aiohttp.ClientSession, rp: RouterdProcess, cond: Any, what: str,
               timeout: float = 60.0) -> dict[str, Any]:
    """``/admin/fleets`` of ``rp`` once ``cond(it)`` holds."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            last = await status(s, rp)
            if cond(last):
                return last
        except (aiohttp.ClientError, TimeoutError, KeyError) as e:
            last = repr(e)
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {last}\n{rp.log()}")


async def metric(s: aiohttp.ClientSession, rp: RouterdProcess, name: str) -> float:
    """One unlabelled sample of ``rp``'s ``/metrics``."""
    async with s.get(f"{rp.url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def ready(fleet: str, n: int) -> Any:
    def ok(st: dict[str, Any]) -> bool:
        insts = st["fleets"][fleet]["instances"]
        return len(insts) == n and all(i["state"] == "ready" for i in insts)
    return ok


def pids(st: dict[str, Any], fleet: str) -> dict[str, int]:
    return {i["id"]: int(i["pid"]) for i in st["fleets"][fleet]["instances"]}


def replica_cfg(routerd_config: Any, tmp_path: Path, name: str, redis_url: str,
                stop_engines: bool = False, **extra: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = routerd_config(
        daemon={"state_dir": str(tmp_path / name), "stop_engines_on_exit": stop_engines},
        redis={"enabled": True, "url": redis_url, "consumer": name, "block_ms": 200},
        control={"lease_s": LEASE_S}, **extra)
    return cfg


@pytest.mark.ray
@pytest.mark.timeout(240)
async def test_two_replicas_one_controller_failover_adopts_and_restarts_once(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    fleet = {"name": "c", "model": "m", "engine": "sim", "replicas": 2, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 8, "ttft-ms": 5, "itl-ms": 3}}
    extra: dict[str, Any] = {
        "ray": {"address": ray_cluster.address, "namespace": f"ctl-{uuid.uuid4().hex[:8]}"},
        "health": {"restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 2.0}, "fleets": [fleet]}
    # stop_engines_on_exit: the engines go with the last routerd (a SIGKILLed one stops nothing).
    cfgs = [replica_cfg(routerd_config, tmp_path, name, redis_server.url, stop_engines=True, **extra)
            for name in ("ra", "rb")]

    # Started at the same moment: both come up, exactly one controls.
    procs = [routerd_process(cfg, wait_ready=False) for cfg in cfgs]
    await asyncio.gather(*(asyncio.to_thread(rp.wait_notify, "READY=1", 120) for rp in procs))
    async with aiohttp.ClientSession() as s:
        views = [await poll(s, rp, lambda st: st["control"]["controller"] is not None, "a controller")
                 for rp in procs]
        assert [v["control"]["controls"] for v in views].count(True) == 1, views
        ctl, fol = (procs[0], procs[1]) if views[0]["control"]["controls"] else (procs[1], procs[0])
        assert views[1]["control"]["controller"]["ident"] == views[0]["control"]["controller"]["ident"]
        st = await poll(s, ctl, ready("c", 2), "two ready engines")
        before = pids(st, "c")
        assert launches(ctl, fol) == {"c:0": 1, "c:1": 1}  # each engine launched once, by one of them
        for rp in procs:  # the loser removed none of the winner's new placement groups as strays
            assert events(rp, "stray_placement_group_removed") == []
            assert events(rp, "adopt_unwanted_stopping") == []
        # The follower follows the controller's fleet state, and its admin calls are the controller's.
        await poll(s, fol, lambda st: ready("c", 2)(st) and pids(st, "c") == before, "the follower following")
        async with s.post(f"{fol.url}/admin/instances/c:0/restart") as r:
            assert r.status == 200, await r.text()
        st = await poll(s, ctl, lambda st: ready("c", 2)(st) and pids(st, "c")["c:0"] != before["c:0"],
                        "c:0 restarted by the controller")
        assert launches(ctl, fol) == {"c:0": 2, "c:1": 1}
        assert Counter(e["instance"] for e in events(fol, "engine_restarted")) == Counter()
        before = pids(st, "c")

        # One engine SIGKILLed with both running: restarted exactly once (they used to fight over it).
        os.kill(before["c:0"], signal.SIGKILL)
        st = await poll(s, ctl, lambda st: ready("c", 2)(st) and pids(st, "c")["c:0"] != before["c:0"],
                        "c:0 restarted")
        await asyncio.sleep(LEASE_S)  # a fight would show as more restarts within this window
        assert launches(ctl, fol) == {"c:0": 3, "c:1": 1}
        before = pids(await poll(s, ctl, ready("c", 2), "still ready"), "c")

        # The controller SIGKILLed, and an engine with it, while nobody controls.
        killed_at = time.time()
        ctl.proc.send_signal(signal.SIGKILL)
        os.kill(before["c:1"], signal.SIGKILL)
        ctl.proc.wait(10)
        await poll(s, fol, lambda st: st["control"]["controls"], "the follower taking control")
        (took,) = events(fol, "control_acquired")[-1:]
        assert took["at"] - killed_at <= LEASE_S + 1.0, took
        st = await poll(s, fol, lambda st: ready("c", 2)(st) and pids(st, "c")["c:1"] != before["c:1"],
                        "the engines adopted, c:1 restarted")
        assert pids(st, "c")["c:0"] == before["c:0"]  # adopted, not relaunched
        started = Counter(e["instance"] for e in events(fol, "engine_started"))
        assert started == Counter()  # the new controller launched no engine
        await asyncio.sleep(LEASE_S)
        assert Counter(e["instance"] for e in events(fol, "engine_restarted")) == {"c:1": 1}
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        async with s.post(f"{fol.url}/v1/completions", json=body) as r:
            assert r.status == 200
        assert events(fol, "fleet_control_started")[-1]["adopted"] == 2

    fol.signal(signal.SIGTERM)
    assert await asyncio.to_thread(fol.wait_exit, 90) == 0, fol.log()
    for pid in pids(st, "c").values():  # stopped by the controller on its way out
        assert await eventually(lambda pid=pid: not group_members(pid), 15)


@pytest.mark.timeout(90)
async def test_a_partitioned_controller_stops_before_the_other_starts(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        tmp_path: Path) -> None:
    async with PausableProxy(redis_server.port) as proxy, aiohttp.ClientSession() as s:
        a = await asyncio.to_thread(routerd_process, replica_cfg(routerd_config, tmp_path, "pa", proxy.url))
        await poll(s, a, lambda st: st["control"]["controls"], "a controlling")
        b = await asyncio.to_thread(routerd_process,
                                    replica_cfg(routerd_config, tmp_path, "pb", redis_server.url))
        await poll(s, b, lambda st: st["control"]["controller"] is not None, "b seeing a")
        assert await metric(s, a, "routerd_control_is_controller") == 1
        assert await metric(s, b, "routerd_control_is_controller") == 0
        proxy.open.clear()  # a's connections to Redis blocked, b's not
        paused = time.time()
        await poll(s, b, lambda st: st["control"]["controls"], "b taking control", timeout=20)
        stopped = events(a, "control_stopped")[0]
        (took,) = events(b, "control_acquired")
        assert stopped["at"] < took["at"], (stopped, took)
        assert stopped["at"] - paused <= LEASE_S
        st = await status(s, a)
        assert st["control"]["controls"] is False
        assert await metric(s, a, "routerd_control_is_controller") == 0
        assert await metric(s, a, "routerd_control_losses_total") == 1
        assert await metric(s, b, "routerd_control_is_controller") == 1
        assert await metric(s, b, "routerd_control_acquisitions_total") == 1
        assert await metric(s, b, "routerd_control_token") > await metric(s, a, "routerd_control_token")
        proxy.open.set()
