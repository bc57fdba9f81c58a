"""The fleet manager's supervision policy (restart, retire, shutdown, reload) without Ray.

``FakeOps`` stands in for ``routerd.fleet.engine.EngineOps`` (the Ray-facing mechanism) so each race is
driven step by step; the Ray-backed behaviour is in test_fleet.py and test_fleet_failover.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd import config
from routerd.assembly import build
from routerd.config import Config, HealthConfig
from routerd.fleet import EngineOps, FleetManager, Placement, ProbeResult, RayCluster
from routerd.plugins import LaunchSpec
from routerd.registry import Instance, InstanceState, Registry
from routerd.tracing import Tracing
from tests.fixtures.sim import SimEngineFactory

pytestmark = pytest.mark.timeout(30)


class FakeOps:
    """EngineOps' interface as the supervisors use it; every engine step is a controllable event."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()  # wait_ready blocks until set (engine "starting")
        self.placed = asyncio.Event()  # launch blocks placement until set
        self.placed.set()
        self.dead = asyncio.Event()  # the death sentinel resolves when set
        self.restarts: list[float] = []
        self.ready_calls = 0
        self.disposed: list[tuple[Any, str]] = []
        self.url = "http://127.0.0.1:9"  # where the "engine" answers (a test may put a real one there)

    def pg_name(self, fleet: str, index: int) -> str:
        return f"pg:{fleet}:{index}"

    def claim(self, spec: LaunchSpec, node_id: str) -> None:
        pass  # one node here: nothing to spread

    def release(self, spec: LaunchSpec) -> None:
        pass

    def node_gone(self, placement: Placement | None) -> bool:
        return False

    def _info(self) -> dict[str, Any]:
        return {"url": self.url, "pid": None, "generation": 0, "alive": True}

    async def launch(self, spec: LaunchSpec, generation: int,
                     report: Callable[[str], None]) -> tuple[Placement, dict[str, Any]]:
        report("placing")
        await self.placed.wait()
        return Placement(actor=f"actor:{spec.fleet}:{spec.index}", pg=None, bundle={"CPU": 1.0}), self._info()

    async def wait_ready(self, placement: Placement, spec: LaunchSpec, url: str, generation: int,
                         health: HealthConfig) -> str | None:
        self.ready_calls += 1
        await self.ready.wait()
        return None

    async def death_sentinel(self, placement: Placement, generation: int) -> tuple[str, bool]:
        await self.dead.wait()
        return "process exited (rc=1)", False

    async def restart(self, placement: Placement, spec: LaunchSpec, *, generation: int, pid: int | None,
                      report: Callable[[str], None], grace_s: float = 1.0) -> dict[str, Any]:
        self.restarts.append(grace_s)
        self.dead = asyncio.Event()
        report("restarting")
        return self._info()

    async def dispose(self, actor: Any, pg_name: str, *, stop: bool) -> dict[str, Any]:
        self.disposed.append((actor, pg_name))
        return {}


def make_cfg(tmp_path: Path, replicas: int = 0, max_num_seqs: int = 8, backoff_s: float = 0.01) -> Config:
    return config.parse({
        "daemon": {"state_dir": str(tmp_path), "drain_timeout_s": 30},
        "redis": {"enabled": False},
        "health": {"restart_backoff_initial_s": backoff_s, "restart_backoff_max_s": 1.0},
        "fleets": [{"name": "f", "model": "m", "engine": "sim", "replicas": replicas,
                    "max_num_seqs": max_num_seqs}],
    }, environ={})


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """The process's one client session, as the daemon hands it to the fleet manager."""
    async with aiohttp.ClientSession() as s:
        yield s


def manager(cfg: Config, session: aiohttp.ClientSession) -> tuple[FleetManager, FakeOps, Registry]:
    registry = Registry()
    cluster = RayCluster("127.0.0.1:1", "ns", owns_connection=False, local_head=True)  # never called
    fm = FleetManager(cfg, registry, cluster, session)
    ops = FakeOps()
    fm.ops = ops  # type: ignore[assignment]  # a fake of EngineOps' interface
    return fm, ops, registry


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not cond():  # noqa: ASYNC110  # polls state the fleet manager sets; no event to await
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_admin_restart_while_starting_is_carried_out_once_ready(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    fm, ops, registry = manager(make_cfg(tmp_path), session)
    try:
        await fm.set_replicas("f", 1)
        await until(lambda: ops.ready_calls == 1, "the engine starting")
        await fm.restart_instance("f:0")  # the operator restarts an engine that is still warming up
        ops.ready.set()
        await until(lambda: len(ops.restarts) == 1, "the requested restart")
        assert ops.restarts == [10.0]  # a requested restart: full grace, no backoff
        await until(lambda: registry.ready_count("f") == 1, "ready again")
    finally:
        await fm.shutdown(stop_engines=False)


async def test_a_late_heartbeat_failure_does_not_restart_twice(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    fm, ops, registry = manager(make_cfg(tmp_path, backoff_s=0.3), session)
    try:
        ops.ready.set()
        await fm.set_replicas("f", 1)
        await until(lambda: registry.ready_count("f") == 1, "ready")
        inst = fm.supervisors["f:0"].slot.inst
        ops.dead.set()  # the sentinel sees the death first ...
        await until(lambda: "restart 1 in" in inst.state_reason, "the restart backoff")
        await fm._on_failed(inst, ProbeResult.PROCESS_DEAD)  # ... then a probe that was in flight
        await until(lambda: len(ops.restarts) == 1 and registry.ready_count("f") == 1, "restarted")
        await asyncio.sleep(0.1)
        assert len(ops.restarts) == 1
        assert registry.ready_count("f") == 1
    finally:
        await fm.shutdown(stop_engines=False)


class NewGenerations(FakeOps):
    """Each restart starts the engine as the next generation, as the engine actor does."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 1

    def _info(self) -> dict[str, Any]:
        return {**super()._info(), "generation": self.generation}

    async def restart(self, placement: Placement, spec: LaunchSpec, *, generation: int, pid: int | None,
                      report: Callable[[str], None], grace_s: float = 1.0) -> dict[str, Any]:
        self.generation += 1
        return await super().restart(placement, spec, generation=generation, pid=pid, report=report,
                                     grace_s=grace_s)


async def test_a_new_generation_keeps_the_instances_counters(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """A restarted engine gets a new registry Instance; the counters ``/metrics`` shows for the
    instance (restarts, failed scrapes) go on under the same labels, never back to 0."""
    fm, _, registry = manager(make_cfg(tmp_path), session)
    ops = fm.ops = NewGenerations()  # type: ignore[assignment]  # a fake of EngineOps' interface
    try:
        ops.ready.set()
        await fm.set_replicas("f", 1)
        await until(lambda: registry.ready_count("f") == 1, "ready")
        old = registry.get("f:0")
        assert old is not None
        old.scrape_errors_total = 3
        ops.dead.set()
        await until(lambda: (new := registry.get("f:0")) is not None and new is not old
                    and new.state is InstanceState.READY, "the next generation ready")
        new = registry.get("f:0")
        assert new is not None
        assert (new.generation, new.restarts, new.scrape_errors_total) == (2, 1, 3)
    finally:
        await fm.shutdown(stop_engines=False)


async def test_an_instance_restarted_while_retiring_stays_out_of_rotation(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    fm, ops, registry = manager(make_cfg(tmp_path), session)
    try:
        ops.ready.set()
        await fm.set_replicas("f", 1)
        await until(lambda: registry.ready_count("f") == 1, "ready")
        inst = fm.supervisors["f:0"].slot.inst
        inst.inflight = 1  # a long stream keeps the retirement draining
        await fm.set_replicas("f", 0)
        await until(lambda: inst.state is InstanceState.DRAINING, "draining")
        ops.dead.set()  # the engine dies during the drain: the supervisor restarts it
        await until(lambda: len(ops.restarts) == 1 and ops.ready_calls == 2, "the restart")
        await asyncio.sleep(0.05)
        assert registry.routable("f") == []  # about to be stopped: must take no new requests
        assert inst.state is InstanceState.DRAINING
        inst.inflight = 0
        await until(lambda: "f:0" not in fm.supervisors, "retired")
        assert ops.disposed == [("actor:f:0", "pg:f:0")]
        assert registry.get("f:0") is None
    finally:
        await fm.shutdown(stop_engines=False)


async def test_shutdown_stopping_engines_removes_a_placement_still_pending(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    fm, ops, _ = manager(make_cfg(tmp_path), session)
    ops.placed.clear()  # waiting for resources
    await fm.set_replicas("f", 1)
    await asyncio.sleep(0.02)
    assert fm.supervisors["f:0"].slot.placement is None
    await fm.shutdown(stop_engines=True)
    assert ops.disposed == [(None, "pg:f:0")]


async def test_reload_applies_max_num_seqs_to_running_instances(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    fm, ops, registry = manager(make_cfg(tmp_path, replicas=1, max_num_seqs=8), session)
    try:
        ops.ready.set()
        await fm.set_replicas("f", 1)
        await until(lambda: registry.ready_count("f") == 1, "ready")
        assert registry.instances("f")[0].capacity == 8
        await fm.apply(make_cfg(tmp_path, replicas=1, max_num_seqs=32))
        assert registry.instances("f")[0].capacity == 32  # as for static fleets; no relaunch needed
        assert not fm.supervisors["f:0"].slot.stale
    finally:
        await fm.shutdown(stop_engines=False)


async def test_a_heartbeat_failure_ends_the_streams_on_the_hung_engine(
        tmp_path: Path, sim_engine: SimEngineFactory, session: aiohttp.ClientSession) -> None:
    """The restart comes only after the backoff; a stream on the hung engine must not wait for it
    (or for read_timeout_s): it ends at once with the terminal error event."""
    eng = await sim_engine(model="m", itl_ms=20)
    cfg = make_cfg(tmp_path, backoff_s=1.0)  # the fake restart never touches the engine anyway
    fm, ops, registry = manager(cfg, session)
    ops.url = eng.url
    try:
        ops.ready.set()
        await fm.set_replicas("f", 1)
        await until(lambda: registry.ready_count("f") == 1, "ready")
        inst = fm.supervisors["f:0"].slot.inst
        dp = build(cfg, registry, session, tracing=Tracing.off())
        async with dp.serving.listener as listener, aiohttp.ClientSession() as client:
            url = await listener.start(port=0)
            body = {"model": "m", "prompt": "hi", "max_tokens": 2000, "stream": True}
            async with client.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()  # the first event: streaming
                eng.faults.set(hang=True)  # the engine hangs with its socket open
                await fm._on_failed(inst, ProbeResult.TIMEOUT)  # what the heartbeats conclude
                rest = await asyncio.wait_for(r.content.read(), 5.0)
            events = [line for line in rest.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]"
            assert events[-2].startswith(b'data: {"error"')
            assert b"failed its heartbeats (timeout)" in events[-2]
            assert inst.inflight == 0
            assert inst.state is InstanceState.UNHEALTHY
    finally:
        eng.faults.set(hang=False)
        await fm.shutdown(stop_engines=False)


async def test_the_launched_fleets_heartbeats_leave_static_instances_alone(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """With launched and static fleets side by side, the fleet manager's monitor (actor probes) must not
    probe a static instance: it has no actor, and would be reported ``actor_dead`` in status."""
    cfg = config.parse({
        "daemon": {"state_dir": str(tmp_path)}, "redis": {"enabled": False},
        "health": {"heartbeat_interval_s": 0.05},
        "fleets": [{"name": "f", "model": "m", "engine": "sim", "replicas": 0},
                   {"name": "s", "model": "m2", "engine": "static", "urls": ["http://127.0.0.1:9"]}],
    }, environ={})
    fm, _, registry = manager(cfg, session)
    static = registry.add(Instance(id="s:static0", fleet="s", url="http://127.0.0.1:9",
                                   state=InstanceState.READY))
    task = asyncio.create_task(fm.run())
    try:
        await asyncio.sleep(0.5)
        assert static.health == "unknown"
        assert fm.monitor.tracker("s:static0") is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fm.shutdown(stop_engines=False)


class _Method:
    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result

    def remote(self, *_: Any) -> Coroutine[Any, Any, dict[str, Any]]:
        async def ref() -> dict[str, Any]:
            return self.result
        return ref()


class FakeActor:
    """An engine actor that reports ``pid`` as its engine's and stops it at once."""

    def __init__(self, pid: int) -> None:
        self.info = _Method({"pid": pid})
        self.stop = _Method({"stopped": True})


class OfflineCluster(RayCluster):
    """RayCluster with the Ray calls dispose makes answered locally."""

    async def kill(self, actor: Any) -> None:
        return None

    async def placement_groups(self) -> list[tuple[str, str, Any]]:
        return []


@pytest.mark.parametrize(("address", "local", "reaped"), [("10.255.0.1:6379", False, False),
                                                          ("127.0.0.1:6379", True, True)])
async def test_dispose_reaps_a_process_group_only_on_a_local_cluster(
        tmp_path: Path, address: str, local: bool, reaped: bool, session: aiohttp.ClientSession) -> None:
    # An engine's pid on another node says nothing about this one: here it may be anybody's group.
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)  # noqa: ASYNC220  # fork+exec returns at once
    try:
        ops = EngineOps(OfflineCluster(address, "ns", owns_connection=False, local_head=local),
                        str(tmp_path), time.monotonic, session)
        report = await ops.dispose(FakeActor(bystander.pid), "pg:f:0", stop=True)
        await asyncio.sleep(0.1)
        assert (bystander.poll() is not None) is reaped
        assert ("reaped" in report) is reaped
    finally:
        bystander.kill()
        bystander.wait()
