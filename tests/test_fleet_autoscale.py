"""Elastic fleets on a real local Ray cluster (4 declared GPUs) with simulated engines.

Zero → the first request served (and a waiting room that runs out answers 503 with Retry-After, never
404); a burst raises replicas to the max in one decision; idle returns them to min, one at a time,
draining each (a stream on the replica going away finishes); steady load at a threshold does not flap;
a scale-up Ray cannot place is pending with what is missing and asked of Ray's autoscaler, and the
request is withdrawn as the fleet scales down; an admin pin holds the fleet until lifted.
The daemon with the Redis queue and SIGHUP is in test_daemon_autoscale.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from routerd.assembly import Routerd
from routerd.config import Config
from routerd.fleet import FleetManager, RayCluster
from routerd.fleet.actor import group_members
from routerd.registry import InstanceState, Registry
from routerd_bench.in_process import running_routerd
from routerd_bench.load import Load
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster, reclaim_leftovers
from tests.test_fleet import make_cfg

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@dataclass
class Elastic:
    fm: FleetManager
    dp: Routerd
    registry: Registry
    cluster: RayCluster
    url: str

    async def wait(self, cond: Any, timeout: float, what: str) -> None:
        if not await eventually(cond, timeout):
            raise AssertionError(f"timed out ({timeout}s) waiting for {what}: "
                                 f"{[(i.id, i.state.value, i.state_reason) for i in self.registry]}; "
                                 f"{self.fm.autoscaler.status(self.dp.http.cfg.fleets[0].name)}")

    def decisions(self, fleet: str) -> list[tuple[int, int, str, float]]:
        status = self.fm.autoscaler.status(fleet)
        assert status is not None
        return [(d["from"], d["to"], d["reason"], d["at"]) for d in status["recent"]]

    def launched(self, fleet: str) -> list[str]:
        return sorted(i.id for i in self.registry.instances(fleet))


@contextlib.asynccontextmanager
async def elastic(cfg: Config) -> AsyncIterator[Elastic]:
    """Fleet manager, data plane and admin routes, wired as the daemon wires them."""
    async with running_routerd(cfg) as r:
        await reclaim_leftovers(r.cluster)  # the head's 4 GPUs are this test's to count
        yield Elastic(r.fm, r.dp, r.registry, r.cluster, r.url)


def autoscaled(name: str, *, replicas: int, engine_args: dict[str, Any], **autoscale: Any) -> dict[str, Any]:
    return {"name": name, "model": f"sim-{name}", "engine": "sim", "replicas": replicas,
            "num_cpus_per_instance": 0.25, "engine_args": engine_args, "autoscale": autoscale}


def with_admission(cfg: Config, **admission: Any) -> Config:
    return msgspec.structs.replace(cfg, admission=msgspec.structs.replace(cfg.admission, **admission))


async def metric(s: aiohttp.ClientSession, url: str, prefix: str) -> float | None:
    async with s.get(f"{url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(prefix + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


async def test_zero_to_first_request_and_back_to_zero(ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    cfg = with_admission(make_cfg(ray_cluster, tmp_path, "zero", [
        autoscaled("z", replicas=0, engine_args={"max-num-seqs": 4, "ttft-ms": 5, "itl-ms": 3},
                   min_replicas=0, max_replicas=2, scale_down_delay_s=2.0, scale_up_delay_s=0.5)]),
        waiting_room_s=60.0)
    async with elastic(cfg) as e, aiohttp.ClientSession() as s:
        assert e.launched("z") == []
        async with s.get(f"{e.url}/readyz") as r:  # at zero, the fleet still counts as ready
            assert r.status == 200, await r.text()
            assert (await r.json())["standby"] == ["z"]
        async with s.get(f"{e.url}/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["sim-z"]

        # The first request starts an engine and is served by it.
        body = {"model": "sim-z", "prompt": "hello", "max_tokens": 4}
        async with s.post(f"{e.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Routerd-Instance"] == "z:0"
            assert (await r.json())["choices"][0]["text"]
        assert [d[:3] for d in e.decisions("z")] == [(0, 1, "cold_start")]
        assert e.fm.autoscaler.startup_s["z"] > 0  # learned from this launch: the next Retry-After's base
        pid = e.registry.get("z:0").pid  # type: ignore[union-attr]  # it just answered
        assert pid is not None
        assert await metric(s, e.url, 'routerd_autoscale_decisions_total{direction="up",fleet="z",'
                                      'reason="cold_start"}') == 1.0

        # Idle for scale_down_delay_s: the last engine is stopped; the fleet is at zero and still ready.
        await e.wait(lambda: e.launched("z") == [], 30, "z back to zero")
        assert [d[:3] for d in e.decisions("z")][-1] == (1, 0, "idle")
        assert await eventually(lambda: not group_members(pid), 5), "the engine outlived scale-to-zero"
        assert await metric(s, e.url, 'routerd_fleet_desired_replicas{fleet="z"}') == 0.0
        async with s.get(f"{e.url}/readyz") as r:
            assert r.status == 200

        # A waiting room shorter than the start-up: 503 with Retry-After (never 404), and the engine
        # it woke serves the next request.
        e.dp.admission.update_config(msgspec.structs.replace(cfg.admission, waiting_room_s=0.2))
        async with s.post(f"{e.url}/v1/completions", json=body) as r:
            assert r.status == 503, await r.text()
            assert int(r.headers["Retry-After"]) >= 1
            err = (await r.json())["error"]
            assert err["type"] == "ServiceUnavailableError"
            assert "starting" in err["message"]
        e.dp.admission.update_config(cfg.admission)
        async with s.post(f"{e.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()

        # An admin pin holds the fleet where it is, idle or not, until it is lifted; never past the
        # fleet's max_replicas.
        async with s.post(f"{e.url}/admin/fleets/z/replicas", json={"replicas": 3}) as r:
            assert r.status == 400
            assert "0..2" in (await r.json())["error"]["message"]
        async with s.post(f"{e.url}/admin/fleets/z/replicas", json={"replicas": 1}) as r:
            assert (await r.json())["pinned"] is True
        await asyncio.sleep(cfg.fleets[0].autoscale.scale_down_delay_s * 2)  # type: ignore[union-attr]
        assert e.launched("z") == ["z:0"]
        async with s.get(f"{e.url}/admin/fleets") as r:
            assert (await r.json())["fleets"]["z"]["autoscale"]["pinned"] is True
        async with s.delete(f"{e.url}/admin/fleets/z/replicas") as r:
            assert r.status == 200
        await e.wait(lambda: e.launched("z") == [], 30, "z back to zero once unpinned")


async def test_burst_to_max_then_down_one_at_a_time_without_a_failed_request(
        ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    delay = 2.0
    cfg = make_cfg(ray_cluster, tmp_path, "burst", [
        autoscaled("b", replicas=1, engine_args={"max-num-seqs": 4, "ttft-ms": 5, "itl-ms": 30},
                   min_replicas=1, max_replicas=4, scale_down_delay_s=delay, scale_up_delay_s=0.5,
                   target_utilization=0.5)])
    async with elastic(cfg) as e, aiohttp.ClientSession() as s:
        await e.wait(lambda: e.registry.ready_count("b") == 1, 60, "b:0 ready")
        load = Load(e.url, "sim-b", max_tokens=12)
        stop = asyncio.Event()
        clients = [asyncio.create_task(load.client(s, stop, stream=i % 2 == 0)) for i in range(16)]
        try:
            # 16 requests in flight against 2 per replica at the target: the max, several at a time.
            await e.wait(lambda: e.registry.ready_count("b") == 4, 60, "4 ready")
        finally:
            stop.set()
            await asyncio.gather(*clients)
        ups = [d for d in e.decisions("b") if d[1] > d[0]]
        assert ups[-1][1] == 4
        assert max(to - frm for frm, to, _, _ in ups) >= 2, ups  # in proportion, not one by one

        # Long streams keep every replica busy while the fleet scales down around them.
        streams = [asyncio.create_task(_stream(s, e.url, "sim-b", 150)) for _ in range(4)]
        await e.wait(lambda: e.registry.ready_count("b") == 1 and e.launched("b") == ["b:0"], 60,
                     "back to min")
        for events in await asyncio.gather(*streams):
            assert events[-1] == b"data: [DONE]"
            assert not any(b'"error"' in ev for ev in events)
        downs = [d for d in e.decisions("b") if d[1] < d[0]]
        assert [d[:2] for d in downs] == [(4, 3), (3, 2), (2, 1)]  # one at a time
        assert all(b[3] - a[3] >= delay for a, b in itertools.pairwise(downs))  # each after a whole delay
        assert load.failed_before_stream == 0, load.errors
        assert load.failed_mid_stream == 0
        assert load.ok > 20


async def _stream(s: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> list[bytes]:
    body = {"model": model, "prompt": "a long one", "max_tokens": max_tokens, "stream": True}
    events: list[bytes] = []
    async with s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line.strip())
    return events


async def test_steady_load_at_a_threshold_does_not_flap(ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    delay = 3.0
    cfg = make_cfg(ray_cluster, tmp_path, "steady", [
        autoscaled("st", replicas=1, engine_args={"max-num-seqs": 4, "ttft-ms": 5, "itl-ms": 10},
                   min_replicas=1, max_replicas=3, scale_down_delay_s=delay, scale_up_delay_s=1.0,
                   target_utilization=0.5)])
    async with elastic(cfg) as e, aiohttp.ClientSession() as s:
        await e.wait(lambda: e.registry.ready_count("st") == 1, 60, "st:0 ready")
        load = Load(e.url, "sim-st", max_tokens=8)
        stop = asyncio.Event()
        # Two requests always in flight: exactly one replica's worth at the target (2 of 4 slots).
        clients = [asyncio.create_task(load.client(s, stop, stream=False)) for _ in range(2)]
        try:
            await asyncio.sleep(delay * 5)
        finally:
            stop.set()
            await asyncio.gather(*clients)
        decisions = e.decisions("st")
        assert len(decisions) <= 1, decisions  # at most one decision per scale_down_delay_s, and no cycle
        assert load.failed_before_stream == 0, load.errors
        assert load.ok > 50
        status = e.fm.autoscaler.status("st")
        assert status is not None
        assert status["signals"]["ready"] >= 1


async def test_unplaceable_scale_up_is_pending_and_asked_of_rays_autoscaler(
        ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    def requested() -> list[dict[str, float]]:
        raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
        return json.loads(raw) if raw else []

    cfg = make_cfg(ray_cluster, tmp_path, "gpu", [
        {**autoscaled("g", replicas=0, engine_args={"max-num-seqs": 2, "ttft-ms": 5, "itl-ms": 50},
                      min_replicas=0, max_replicas=3, scale_down_delay_s=1.5, scale_up_delay_s=0.5,
                      target_utilization=0.5),
         "tensor_parallel_size": 2}])
    cfg = with_admission(cfg, waiting_room_s=60.0)
    async with elastic(cfg) as e, aiohttp.ClientSession() as s:
        # Six long requests from zero ask for 3 replicas of 2 GPUs on a 4-GPU cluster.
        body = {"model": "sim-g", "prompt": "x", "max_tokens": 60}
        started = time.monotonic()
        requests = [asyncio.create_task(s.post(f"{e.url}/v1/completions", json=body)) for _ in range(6)]
        def pending() -> list[str]:
            return [i.state_reason for i in e.registry.instances("g")
                    if i.state is InstanceState.STARTING and "missing" in i.state_reason]

        await e.wait(lambda: bool(pending()), 30, "a replica pending with what is missing")
        assert len(e.launched("g")) == 3
        assert "'GPU': 2.0" in pending()[0]
        await e.wait(lambda: requested() == [{"CPU": 0.25, "GPU": 2.0}] * 3, 10, "3 bundles asked of Ray")
        async with s.get(f"{e.url}/admin/fleets") as r:
            assert (await r.json())["fleets"]["g"]["autoscale"]["ray_requested_bundles"] == 3
        for resp in await asyncio.gather(*requests):  # served by the two placed replicas
            assert resp.status == 200, await resp.text()
            resp.release()
        assert time.monotonic() - started < 60
        # Idle: the pending replica goes first, and the request shrinks with the fleet, to nothing.
        await e.wait(lambda: e.launched("g") == [], 40, "g back to zero")
        await e.wait(lambda: requested() == [], 10, "the request to Ray withdrawn")
        assert [d[:2] for d in e.decisions("g") if d[1] < d[0]] == [(3, 2), (2, 1), (1, 0)]
