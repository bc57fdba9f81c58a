"""Fleet control follows the lease (real Redis, real Ray, a simulated engine as a process): a routerd
that loses control stops supervising and stops no engine; when it takes control again, the same fleet
manager adopts the engine into the registry entry it already has — requests in flight on it and all."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from routerd import assembly, config
from routerd.fleet.actor import group_members
from routerd.peers.lease import ControlLease
from routerd.redis_conn import RedisConn
from routerd.registry import InstanceState, Registry
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.redis_server import RedisServer
from tests.test_fleet import SIM_ARGS

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


async def test_losing_control_keeps_the_engines_and_a_new_term_adopts_them_in_place(
        ray_cluster: RayTestCluster, redis_server: RedisServer, tmp_path: Path) -> None:
    cfg = config.parse({
        "daemon": {"state_dir": str(tmp_path), "drain_timeout_s": 5},
        "redis": {"url": redis_server.url, "consumer": "host-a", "block_ms": 200},
        "control": {"lease_s": 1.5},
        "ray": {"address": ray_cluster.address, "namespace": f"{ray_cluster.namespace}-term",
                "connect_timeout_s": 90},  # ray.init alone took 20-30 s on a loaded 2-core machine
        "health": {"restart_backoff_initial_s": 0.2, "startup_timeout_s": 60},
        "fleets": [{"name": "t", "model": "m", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
                    "engine_args": SIM_ARGS}],
    }, environ={})
    registry = Registry()
    async with assembly.running(cfg, registry) as routerd:
        fm, control = routerd.fleets, routerd.core.control
        assert fm is not None
        assert control.controls
        assert await eventually(lambda: registry.ready_count("t") == 1, 60)
        inst = registry.get("t:0")
        assert inst is not None
        pid, generation, first = inst.pid, inst.generation, control.token
        assert pid is not None
        inst.inflight += 2  # requests this process has in flight on it
        # The engine holds a token above any this Redis hands out — from a term a failover lost (a
        # replica promoted without it): the next term must go above it, or the engine refuses it.
        held = first + 10**9
        placement = fm.supervisors["t:0"].slot.placement
        assert placement is not None
        await placement.actor.start.remote(held)  # it runs: a start only raises the actor's token

        # The same replica restarted elsewhere (a newer incarnation of "host-a") takes the lease.
        usurper = ControlLease("host-a", redis=RedisConn(redis_server.url, cfg.redis, pooled=False),
                               cfg=cfg.control)
        assert await usurper.try_acquire()
        # The term ends in steps (inactive first, then its tasks cancelled, then its supervisors let go).
        assert await eventually(lambda: not control.controls and not fm.active and not fm.supervisors, 10)
        assert group_members(pid)  # losing control stopped no engine
        assert registry.get("t:0") is inst  # and left what routing knows of it alone
        assert inst.state is InstanceState.READY

        # The usurper goes away cleanly: this process takes control again, in a new term.
        await usurper.release()
        assert await eventually(lambda: control.controls and fm.active and "t:0" in fm.supervisors, 10)
        assert control.token > held > usurper.token > first  # raised above the engine's at adoption
        assert await eventually(lambda: fm.supervisors["t:0"].slot.ready_since is not None, 30)
        assert registry.get("t:0") is inst  # adopted into the same entry ...
        assert inst.inflight == 2  # ... with the requests in flight on it
        assert (inst.pid, inst.generation) == (pid, generation)  # not relaunched
        assert inst.state is InstanceState.READY
        inst.inflight -= 2
        await asyncio.sleep(0)
        await fm.restart_instance("t:0")  # the engine takes this term's commands
        assert await eventually(lambda: registry.ready_count("t") == 1 and (now := registry.get("t:0"))
                                is not None and now.generation == generation + 1 and now.pid != pid, 30)
        restarted = registry.get("t:0")
        assert restarted is not None
        assert restarted.pid is not None
        pid = restarted.pid
    assert await eventually(lambda: not group_members(pid), 15)  # stopped by the controller at the end
