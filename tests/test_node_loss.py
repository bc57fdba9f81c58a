"""Node loss on a real multi-node Ray cluster on this machine, and the placement rules behind it.

The cluster (routerd_bench/ray_nodes.py) is a head without GPUs plus worker nodes with declared GPUs,
each its own ``ray start``; a node is lost by SIGKILL of its raylet. The pure parts — what a placement
group must avoid (routerd/fleet/spread.py) and when a node counts as lost (routerd/fleet/nodes.py) —
are tested without Ray first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd import config
from routerd.client import QueueClient, Submitted
from routerd.config import Config
from routerd.fleet.nodes import NodeTracker
from routerd.fleet.ray_cluster import NodeInfo
from routerd.fleet.spread import Where, crowded, where
from routerd.registry import Instance, InstanceState, Registry
from routerd_bench.in_process import Running, running_routerd
from routerd_bench.load import Load
from routerd_bench.ray_nodes import LocalRayCluster
from tests.fixtures.helpers import eventually, starts
from tests.fixtures.redis_server import RedisServer
from tests.test_fleet import SIM_ARGS

A, B, C, D = "a" * 56, "b" * 56, "c" * 56, "d" * 56
GPU = {"GPU": 1.0, "CPU": 0.25}


# what a new placement group must avoid -----------------------------------------------------------
def test_any_avoids_only_lost_nodes() -> None:
    assert where("any", GPU, {A}, frozenset({B}), {}).avoid == {B}
    assert where("any", GPU, {A}, frozenset(), {}) == Where()


def test_strict_spread_always_avoids_the_other_replicas_nodes() -> None:
    w = where("strict_spread", GPU, {A, B}, frozenset({C}), {})
    assert w.avoid == {A, B, C}
    assert "strict_spread" in w.why  # what the pending instance shows


def test_spread_avoids_other_replicas_only_while_another_node_has_room() -> None:
    free = {A: {"GPU": 2.0, "CPU": 4.0}, B: {"GPU": 1.0, "CPU": 4.0}, C: {"GPU": 0.0, "CPU": 4.0}}
    assert where("spread", GPU, {A}, frozenset(), free).avoid == {A}  # B has room
    doubled = where("spread", GPU, {A, B}, frozenset({D}), free)  # only C is left, and it has no GPU
    assert doubled.avoid == {D}
    assert "doubling up" in doubled.why
    assert where("spread", GPU, set(), frozenset(), free) == Where()  # the first replica: anywhere


def test_spread_moves_doubled_up_replicas_only_when_a_node_without_one_has_room() -> None:
    claims = {0: A, 1: A, 2: B}
    assert crowded(claims, GPU, frozenset(), {A: {"GPU": 1.0}, B: {"GPU": 1.0}}) == []  # no empty node
    assert crowded(claims, GPU, frozenset(), {A: {"GPU": 1.0}, C: {"GPU": 0.0}}) == []  # C has no room
    assert crowded(claims, GPU, frozenset(), {C: {"GPU": 1.0, "CPU": 1.0}}) == [1]  # C has: move one
    assert crowded(claims, GPU, frozenset({C}), {C: {"GPU": 1.0, "CPU": 1.0}}) == []  # not onto a lost node
    assert crowded({0: A, 1: B}, GPU, frozenset(), {C: {"GPU": 1.0, "CPU": 1.0}}) == []  # spread already


# when a node counts as lost ------------------------------------------------------------------------
def _node(node_id: str, alive: bool = True) -> NodeInfo:
    return NodeInfo(node_id=node_id, host="127.0.0.1", port=1, alive=alive)


def test_a_node_is_lost_after_threshold_failed_probes_and_back_when_it_answers() -> None:
    t = NodeTracker(failure_threshold=3)
    assert t.observe_table([_node(A), _node(B)]) == []
    assert t.record(A, False, "ConnectionRefusedError") is None
    assert t.record(A, True) is None  # an answer in between resets the count
    assert t.record(A, False) is None
    assert t.record(A, False) is None
    lost = t.record(A, False, "timeout")
    assert lost is not None
    assert lost[0] == A
    assert t.gone(A)
    assert not t.gone(B)
    assert t.avoid() == {A}
    assert t.record(A, False) is None  # reported once
    assert t.record(A, True) is None  # a healed partition: Ray still counts it alive
    assert not t.gone(A)


def test_ray_declaring_a_node_dead_loses_it_at_once_but_old_deaths_are_history() -> None:
    t = NodeTracker(failure_threshold=3)
    assert t.observe_table([_node(A), _node(C, alive=False)]) == []  # C died before routerd looked
    assert t.gone(C)
    assert t.observe_table([_node(A, alive=False), _node(C, alive=False)]) == [
        (A, "Ray declared the node dead")]
    assert t.gone(A)
    assert t.avoid() == set()  # Ray never places on a node it declared dead: nothing to avoid
    assert t.record(A, True) is None
    assert t.gone(A)  # a dead node never comes back under its old id


# a real cluster ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
@starts("ray")
def nodes_cluster() -> Iterator[LocalRayCluster]:
    """A head (no GPUs) and two worker nodes with 3 declared GPUs each."""
    cluster = LocalRayCluster(head_cpus=4, head_gpus=0)
    try:
        cluster.start()
        cluster.add_node("w1", num_cpus=2, num_gpus=3)
        cluster.add_node("w2", num_cpus=2, num_gpus=3)
        yield cluster
    finally:
        cluster.close()


@dataclass
class Harness:
    r: Running

    @property
    def fm(self) -> Any:
        return self.r.fm

    @property
    def registry(self) -> Registry:
        registry: Registry = self.r.registry
        return registry

    @property
    def url(self) -> str:
        return self.r.url

    def inst(self, iid: str) -> Instance:
        inst = self.registry.get(iid)
        assert inst is not None, iid
        return inst

    def ready(self, iid: str, newer_than: int = -1) -> bool:
        """``iid`` is in the registry, ready, and a newer generation than ``newer_than``."""
        inst = self.registry.get(iid)
        return inst is not None and inst.state is InstanceState.READY and inst.generation > newer_than

    def reason(self, iid: str) -> str:
        inst = self.registry.get(iid)
        return inst.state_reason if inst is not None else ""

    async def wait(self, cond: Any, timeout: float, what: str) -> None:
        if not await eventually(cond, timeout, 0.05):
            raise AssertionError(f"timed out ({timeout}s) waiting for {what}: "
                                 f"{[(i.id, i.state.value, i.state_reason, i.node) for i in self.registry]}")

    async def node_id(self, name: str) -> str:
        return next(n.node_id for n in await self.r.cluster.nodes() if n.alive and name in n.resources)


@contextlib.asynccontextmanager
async def harness(cfg: Config, redis_url: str) -> AsyncIterator[Harness]:
    async with running_routerd(cfg, redis_url=redis_url) as r:
        yield Harness(r)


def _cfg(rc: LocalRayCluster, state: Path, redis_url: str) -> Config:
    fleet = {"engine": "sim", "replicas": 2, "num_cpus_per_instance": 0.25, "num_gpus_per_instance": 1,
             "engine_args": SIM_ARGS, "max_num_seqs": 8}
    return config.parse({
        "daemon": {"state_dir": str(state), "drain_timeout_s": 5},
        "redis": {"url": redis_url, "consumer": "nodes", "block_ms": 200, "reclaim_idle_ms": 2000,
                  "reclaim_interval_s": 0.5, "max_deliveries": 10},
        "ray": {"address": rc.address, "namespace": "routerd-nodes"},
        "routing": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
        "health": {"restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 2.0, "startup_timeout_s": 90},
        "fleets": [{"name": "sp", "model": "sim-sp", "placement": "spread", **fleet},
                   {"name": "ss", "model": "sim-ss", "placement": "strict_spread", **fleet}],
    }, environ={})


@pytest.mark.ray
@pytest.mark.timeout(420)
async def test_a_lost_node_moves_spread_replicas_and_strict_ones_wait_for_a_new_node(
        nodes_cluster: LocalRayCluster, redis_server: RedisServer, tmp_path: Path) -> None:
    """Two fleets of 2 one-GPU replicas — ``spread`` and ``strict_spread`` — over two 3-GPU nodes, under
    HTTP and queue traffic. SIGKILL of one node's raylet: both of its instances leave rotation within
    the heartbeat bounds; the spread one is relaunched at once on the other node (it has a free GPU),
    the strict one waits, pending, saying why. A new node joins: the strict one is placed there, and
    the spread fleet spreads again. No HTTP request fails before its first byte and every queue job
    gets its result."""
    cfg = _cfg(nodes_cluster, tmp_path, redis_server.url)
    h = cfg.health
    async with harness(cfg, redis_server.url) as r, aiohttp.ClientSession() as s, \
            QueueClient.from_url(redis_server.url) as q:
        await r.wait(lambda: r.registry.ready_count("sp") == 2 and r.registry.ready_count("ss") == 2, 120,
                     "4 ready")
        w1, w2 = await r.node_id("w1"), await r.node_id("w2")
        for fleet in ("sp", "ss"):  # one replica per node, none on the GPU-less head
            assert {r.inst(f"{fleet}:0").node, r.inst(f"{fleet}:1").node} == {w1[:12], w2[:12]}
        on_w2 = {fleet: next(i for i in (f"{fleet}:0", f"{fleet}:1") if r.inst(i).node == w2[:12])
                 for fleet in ("sp", "ss")}
        generations = {iid: r.inst(iid).generation for iid in on_w2.values()}

        stop = asyncio.Event()
        loads = [Load(r.url, "sim-sp", max_tokens=12), Load(r.url, "sim-ss", max_tokens=12)]
        clients = [asyncio.create_task(load.client(s, stop, stream=i % 2 == 1))
                   for load in loads for i in range(3)]
        jobs: list[Submitted] = []

        async def produce() -> None:
            n = 0
            while not stop.is_set():
                body = {"model": ("sim-sp", "sim-ss")[n % 2], "prompt": f"job {n}", "max_tokens": 8,
                        "stream": n % 3 == 0}
                with contextlib.suppress(TimeoutError):  # Redis slow on busy cores: not counted
                    jobs.append(await q.submit(body))
                n += 1
                await asyncio.sleep(0.05)

        producer = asyncio.create_task(produce())
        try:
            await asyncio.sleep(1.5)
            t0 = time.monotonic()
            nodes_cluster.kill_raylet("w2")
            out = set(on_w2.values())

            def routable() -> set[str]:
                return {i.id for fleet in ("sp", "ss") for i in r.registry.routable(fleet)}

            await r.wait(lambda: not out & routable(), 30, "the lost node's instances out of rotation")
            took = time.monotonic() - t0
            bound = h.heartbeat_timeout_s + h.heartbeat_interval_s * 1.2 + 1.0  # +1 s: 2 busy cores
            assert took <= bound, f"out of rotation {took:.2f}s after the node loss (bound {bound:.2f}s)"
            await r.wait(lambda: r.fm.nodes.gone(w2), bound, "the node watch calling the node lost")
            assert r.fm.nodes.tracker.lost[w2], r.fm.nodes.tracker.lost  # with why, for the log

            sp, ss = on_w2["sp"], on_w2["ss"]
            # spread: relaunched on the remaining node, which has a GPU free
            await r.wait(lambda: r.ready(sp, generations[sp]), 90, f"{sp} relaunched")
            relaunched_s = time.monotonic() - t0
            assert r.inst(sp).node == w1[:12]
            settled = r.inst(sp).generation
            # strict_spread: the remaining node holds its other replica, the head has no GPU: pending
            await r.wait(lambda: "strict_spread" in r.reason(ss), 30, f"{ss} pending, saying why")
            assert r.inst(ss).state is InstanceState.STARTING
            assert r.registry.ready_count("ss") == 1
            # no node without a replica has room (the lost one, Ray still lists, does not count): stays
            await asyncio.sleep(2.0)
            assert r.ready(sp)
            assert r.inst(sp).generation == settled

            nodes_cluster.add_node("w3", num_cpus=2, num_gpus=3)  # a node (re)joins
            w3 = await r.node_id("w3")
            await r.wait(lambda: r.ready(ss), 90, f"{ss} placed on the new node")
            assert r.inst(ss).node == w3[:12]
            # spread: the doubled-up replica moves to the new node too, one at a time, the other serving
            def sp_nodes() -> set[str]:
                return {i.node for i in r.registry.instances("sp") if i.state is InstanceState.READY}

            await r.wait(lambda: len(sp_nodes()) == 2, 120, "the spread fleet spread again")
            assert sp_nodes() == {w1[:12], w3[:12]}
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            await asyncio.gather(*clients)
            await producer
        results = await q.wait_many(jobs, timeout=120)
        print("node loss: out of rotation", round(took, 2), "s; spread replica back", round(relaunched_s, 2),
              "s;", r.fm.nodes.tracker.lost[w2],
              "; http", [(ld.ok, ld.failed_before_stream, ld.failed_mid_stream) for ld in loads],
              "; jobs", len(jobs))
        assert all(ld.failed_before_stream == 0 for ld in loads), [ld.errors for ld in loads]
        assert sum(ld.ok for ld in loads) > 50
        assert len(results) == len(jobs)
        failed = [(job_id, res.error) for job_id, res in results.items() if res.status != "ok"]
        assert not failed, failed
