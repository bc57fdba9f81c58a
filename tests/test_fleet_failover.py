"""Failures under traffic on a real Ray cluster: SIGKILL, SIGSTOP and a killed actor, each replaced,
with no failed request: those that had not started streaming are retried elsewhere, the streams that
had are resumed there."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd import _aio
from routerd.fleet.actor import group_members
from routerd.registry import Instance, InstanceState
from routerd_bench.load import Load
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.test_fleet import SIM_ARGS, Running, make_cfg, running

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


def current(r: Running, iid: str) -> Instance:
    inst = r.registry.get(iid)
    assert inst is not None
    return inst


async def replaced(r: Running, iid: str, generation: int, timeout: float = 30.0) -> Instance:
    """Wait for a newer generation of ``iid`` in rotation (each generation is a new registry Instance)."""
    def ok() -> bool:
        inst = r.registry.get(iid)
        return inst is not None and inst.state is InstanceState.READY and inst.generation > generation

    await r.wait(ok, timeout, f"{iid} replaced")
    return current(r, iid)


async def left_rotation_within(r: Running, iid: str, limit_s: float) -> float:
    started = time.monotonic()
    await r.wait(lambda: not any(i.id == iid for i in r.registry.routable("fo")), limit_s + 5,
                 f"{iid} out of rotation")
    took = time.monotonic() - started
    assert took <= limit_s, f"{iid} left rotation after {took:.2f}s (limit {limit_s}s)"
    return took


class Timeline:
    """What each instance of the fleet went through (generation, state and why, last heartbeat result,
    circuit), and each failed request, by time: a failure of the test says where the fleet was."""

    def __init__(self, r: Running, fleet: str) -> None:
        self.r, self.fleet = r, fleet
        self.started = time.monotonic()
        self.lines: list[str] = []
        self._last: dict[str, tuple[object, ...]] = {}

    def note(self, what: str) -> None:
        self.lines.append(f"{time.monotonic() - self.started:7.3f} {what}")

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            for i in self.r.registry.instances(self.fleet):
                seen = (i.generation, i.state.value, i.state_reason, i.health, i.circuit(now).value)
                if self._last.get(i.id) != seen:
                    self._last[i.id] = seen
                    self.note(f"{i.id} g{seen[0]} {seen[1]} ({seen[2]}) health={seen[3]} circuit={seen[4]}")
            await asyncio.sleep(0.02)

    def report(self) -> str:
        return "\n".join(self.lines[-60:])


async def test_sigkill_sigstop_and_actor_kill_are_replaced_under_traffic(ray_cluster: RayTestCluster,
                                                                         tmp_path: Path) -> None:
    import ray

    cfg = make_cfg(ray_cluster, tmp_path, "fo", [
        {"name": "fo", "model": "sim-fo", "engine": "sim", "replicas": 2, "num_cpus_per_instance": 0.25,
         "engine_args": SIM_ARGS}])
    h = cfg.health
    async with running(cfg) as r, aiohttp.ClientSession() as s:
        await r.wait_ready("fo", 2)
        timeline = Timeline(r, "fo")
        traffic = Load(r.url, "sim-fo", max_tokens=12,
                       on_failure=lambda why: timeline.note(f"request failed: {why[:100]}"))
        watch = asyncio.create_task(timeline.run())
        stop = asyncio.Event()
        clients = [asyncio.create_task(traffic.client(s, stop, stream=i % 2 == 1)) for i in range(4)]
        try:
            await asyncio.sleep(1.0)
            timings: dict[str, float] = {}

            # 1. SIGKILL the engine: the death sentinel takes it out of rotation at once.
            a = current(r, "fo:0")
            gen, pid = a.generation, a.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            timeline.note("SIGKILL fo:0")
            timings["sigkill"] = await left_rotation_within(r, "fo:0", 2.0)
            a = await replaced(r, "fo:0", gen)
            assert a.pid != pid

            # 2. SIGSTOP: the port stays open, only the heartbeats notice.
            b = current(r, "fo:1")
            gen, pid = b.generation, b.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            timeline.note("SIGSTOP fo:1")
            timings["sigstop"] = await left_rotation_within(
                r, "fo:1", h.heartbeat_timeout_s + h.heartbeat_interval_s * 1.2 + 1.0)  # +1 s: 2 busy cores
            await replaced(r, "fo:1", gen)
            assert await eventually(lambda: not group_members(pid), 5), "the stopped engine was not killed"

            # 3. Kill the actor: its engine goes with it, a new actor takes the same placement group.
            gen, pid = a.generation, a.pid
            assert pid is not None
            actor = await r.cluster.get_actor("routerd:fo:0")
            await asyncio.to_thread(ray.kill, actor, no_restart=True)
            timeline.note("actor of fo:0 killed")
            timings["actor_kill"] = await left_rotation_within(r, "fo:0", 2.0)
            await replaced(r, "fo:0", gen)
            assert await eventually(lambda: not group_members(pid), 5), "the engine outlived its actor"
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            await asyncio.gather(*clients)
            await _aio.cancel_and_wait({watch}, 5.0)
        print("failover timings", {k: round(v, 3) for k, v in timings.items()}, "ok", traffic.ok,
              "mid-stream errors", traffic.failed_mid_stream)
        assert traffic.failed_before_stream == 0, timeline.report()
        # and what had started went on from the other instance, whole (routerd/resume.py)
        assert traffic.failed_mid_stream == 0, timeline.report()
        assert traffic.wrong_text == 0
        assert traffic.ok > 50
        assert current(r, "fo:0").restarts == 2
        assert current(r, "fo:1").restarts == 1
        assert r.registry.ready_count("fo") == 2


async def test_status_fields_for_operators(ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    """What `routerd status` shows comes from the registry the fleet manager fills."""
    cfg = make_cfg(ray_cluster, tmp_path, "st", [
        {"name": "st", "model": "sim-st", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
         "engine_args": SIM_ARGS}])
    async with running(cfg) as r:
        await r.wait_ready("st", 1)
        inst = r.registry.get("st:0")
        assert inst is not None
        await r.wait(lambda: inst.last_heartbeat > 0 and bool(inst.resources.get("rss_bytes")), 10,
                     "heartbeat and resource use")
        st: dict[str, Any] = inst.status(time.monotonic())
        assert st["url"].startswith("http://127.0.0.1:")
        assert st["pid"] == inst.pid
        assert st["node"]
        assert st["generation"] == 1
        assert st["health"] == "ok"
        assert abs(time.time() - st["last_heartbeat"]) < 5
        assert st["resources"]["processes"] == 1
