"""Fleet control across a Redis failover (real Sentinels, real Ray, two real ``routerd run`` processes, a
simulated engine): the master is SIGKILLed while the controller is restarting an engine. Afterwards
exactly one routerd controls — their terms never overlapped — the engine was restarted once, not twice,
and it takes the new controller's commands (its token is higher)."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures.daemon import RouterdFactory, RouterdProcess
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.sentinel import SentinelRedis
from tests.test_control_replicas import events, launches, pids, poll, ready

LEASE_S = 2.0


def terms(rp: RouterdProcess) -> list[tuple[float, float]]:
    """The (start, end) wall-clock times of ``rp``'s terms of control, from its log (end: inf while it
    still controls)."""
    out: list[tuple[float, float]] = []
    start: float | None = None
    for e in sorted(events(rp, "control_acquired") + events(rp, "control_stopped"), key=lambda e: e["at"]):
        if e["event"] == "control_acquired":
            start = e["at"]
        elif start is not None:
            out.append((start, e["at"]))
            start = None
    if start is not None:
        out.append((start, math.inf))
    return out


@pytest.mark.ray
@pytest.mark.timeout(240)
async def test_a_master_killed_mid_restart_leaves_one_controller_and_one_restart(
        ray_cluster: RayTestCluster, sentinel_redis: SentinelRedis, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    fleet = {"name": "c", "model": "m", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 8, "ttft-ms": 5, "itl-ms": 3}}
    ns = f"ctl-{uuid.uuid4().hex[:8]}"
    procs = [routerd_process(routerd_config(
        daemon={"state_dir": str(tmp_path / name), "stop_engines_on_exit": True},
        redis={"enabled": True, **sentinel_redis.redis(consumer=name, block_ms=200)},
        control={"lease_s": LEASE_S, "secret": "s" * 32},
        ray={"address": ray_cluster.address, "namespace": ns, "connect_timeout_s": 90},  # a loaded machine
        health={"restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 2.0}, fleets=[fleet]),
        wait_ready=False) for name in ("fa", "fb")]
    await asyncio.gather(*(asyncio.to_thread(rp.wait_notify, "READY=1", 120) for rp in procs))
    async with aiohttp.ClientSession() as s:
        views = [await poll(s, rp, lambda st: st["control"]["controller"] is not None, "a controller")
                 for rp in procs]
        ctl = procs[0] if views[0]["control"]["controls"] else procs[1]
        st = await poll(s, ctl, ready("c", 1), "the engine ready")
        before, first_token = pids(st, "c"), st["control"]["controller"]["token"]

        # The engine dies — the controller restarts it — and the Redis master with it.
        os.kill(before["c:0"], signal.SIGKILL)
        killed_at = time.time()
        old = await asyncio.to_thread(sentinel_redis.kill_master)
        await asyncio.to_thread(sentinel_redis.wait_promoted, old)

        def settled(st: dict[str, Any]) -> bool:
            return st["control"]["controls"] and ready("c", 1)(st) and pids(st, "c")["c:0"] != before["c:0"]

        now = await asyncio.gather(*(poll(s, rp, lambda st: st["control"]["controller"] is not None
                                          and st["control"]["controller"]["token"] != first_token,
                                          "a new term") for rp in procs))
        ctl = procs[0] if now[0]["control"]["controls"] else procs[1]
        st = await poll(s, ctl, settled, "the engine restarted under the new term")
        restarted = pids(st, "c")["c:0"]
        await asyncio.sleep(LEASE_S)  # a second restart (or a fight) would show within this window
        views = [await poll(s, rp, lambda st: True, "a view") for rp in procs]
        assert [v["control"]["controls"] for v in views].count(True) == 1, views
        assert views[0]["control"]["controller"] == views[1]["control"]["controller"]
        new_token = views[0]["control"]["controller"]["token"]
        assert new_token > first_token
        assert launches(*procs) == {"c:0": 2}, (launches(*procs), [rp.log() for rp in procs])

        # Their terms of control never overlapped, across the failover included.
        spans = sorted((start, end, rp.config_path.name) for rp in procs for start, end in terms(rp))
        for (_, end, who), (start, _, nxt) in itertools.pairwise(spans):
            assert end <= start, f"{who} and {nxt} controlled at once: {spans}"
        ended = max((end for _, end, _ in spans if end != math.inf), default=killed_at)
        began = spans[-1][0]
        print(f"no controller for {began - ended:.2f}s across the failover; master killed "
              f"{ended - killed_at:.2f}s before the old term ended (lease_s={LEASE_S})")

        # The engine takes the new controller's commands.
        async with s.post(f"{ctl.url}/admin/instances/c:0/restart") as r:
            assert r.status == 200, await r.text()
        await poll(s, ctl, lambda st: ready("c", 1)(st) and pids(st, "c")["c:0"] != restarted,
                   "c:0 restarted on command")
        assert launches(*procs) == {"c:0": 3}
        for rp in procs:
            assert events(rp, "supervision_fenced") == []

    for rp in procs:
        rp.signal(signal.SIGTERM)
    for rp in procs:
        assert await asyncio.to_thread(rp.wait_exit, 90) == 0, rp.log()
