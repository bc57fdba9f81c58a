"""A replica count set at run time lives in Redis, so the next controller starts from it, not from the
file (routerd/peers/replicas.py) — on a real Ray cluster with simulated engines.

The issue's failure: a count set on one routerd was invisible to the next, whose start stopped the
extra engine as unwanted.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import msgspec
import pytest

from routerd import assembly
from routerd.config import RedisConfig
from routerd.redis_keys import RedisKeys
from routerd.registry import Registry
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.redis_server import RedisServer
from tests.test_fleet import SIM_ARGS, make_cfg

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


async def test_a_replica_count_set_at_run_time_outlives_its_controller(
        ray_cluster: RayTestCluster, redis_server: RedisServer, tmp_path: Path) -> None:
    fleet = {"name": "rp", "model": "sim-rp", "engine": "sim", "replicas": 0, "num_cpus_per_instance": 0.25,
             "tensor_parallel_size": 1, "engine_args": SIM_ARGS}
    cfg = make_cfg(ray_cluster, tmp_path, "rp", [fleet])
    cfg = msgspec.structs.replace(cfg, redis=RedisConfig(url=redis_server.url, consumer="a"))
    pinned = RedisKeys.from_config(cfg.redis).replicas()
    async with assembly.running(cfg, Registry(), stop_engines=False, consume=False) as r, \
            aiohttp.ClientSession() as s:
        async with s.post(f"{r.url}/admin/fleets/rp/replicas", json={"replicas": 1}) as resp:
            assert resp.status == 200, await resp.text()
        assert await eventually(lambda: r.registry.ready_count("rp") == 1, 60)
        pids = {i.id: i.pid for i in r.registry}
    assert redis_server.client().hexists(pinned, "rp")

    # The next controller (same file: replicas = 0) adopts the engine and keeps it.
    async with assembly.running(cfg, Registry(), stop_engines=True, consume=False) as r, \
            aiohttp.ClientSession() as s:
        assert r.fleets is not None
        assert r.registry.ready_count("rp") == 1  # start() returns with the adopted engine in rotation
        assert {i.id: i.pid for i in r.registry} == pids
        assert r.fleets.desired(cfg.fleets[0]) == 1
        async with s.delete(f"{r.url}/admin/fleets/rp/replicas") as resp:
            assert resp.status == 200, await resp.text()
        assert await eventually(lambda: not list(r.registry), 30)
    assert not redis_server.client().hexists(pinned, "rp")
