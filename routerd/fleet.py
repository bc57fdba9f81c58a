"""Fleets on Ray: desired vs actual instances — launch, adopt, restart with backoff, scale, drain.

Each instance ``<fleet>:<n>`` is one detached ``EngineActor`` named ``routerd:<fleet>:<n>`` in the
configured namespace, inside its own detached placement group of one STRICT_PACK bundle holding the
TP×PP GPUs plus the engine's CPUs (one bundle, so the actor holds all of them and Ray sets
``CUDA_VISIBLE_DEVICES`` to exactly those GPUs; ``vllm serve`` runs with the ``mp`` backend beneath it).

Launch pattern for TP×PP larger than one node: a ``vllm serve`` subprocess can never reuse its actor's
placement group (vllm-and-ray-facts §4.1), so such a fleet sets ``distributed-executor-backend = "ray"``
in ``engine_args``. Its actor's bundle then holds CPUs only and the engine gets ``RAY_ADDRESS``; vLLM
creates and owns its own PACK placement group of ``{GPU: 1} × TP×PP`` across nodes (pattern B). The
fleet manager still supervises, probes and restarts it the same way; GPU accounting is vLLM's.

Every instance has one supervising task (``_supervise``): place → start → ready (``/health`` 200 and
one warm-up generation) → READY → watch (death sentinel, heartbeat failures, admin restarts) → out of
rotation at once → capped exponential backoff → restart (same actor if it lives, else a new actor in the
same placement group) → generation + 1 (a new registry Instance per generation, so nothing of the old
engine's scrape or circuit state is held against the new one). A changed spec (reload, or an engine
adopted from an earlier config) is rolled out one instance at a time while the others serve. The request
path never awaits Ray: it reads the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from . import config as config_mod
from ._aio import wait_for
from ._fleet_ops import EngineOps, Placement
from .config import Config, FleetConfig
from .health import HealthMonitor, ProbeResult, in_rotation
from .plugins import LaunchSpec
from .raycluster import RayCluster
from .registry import Instance, InstanceState, Registry

_logger = structlog.get_logger("routerd.fleet")

NAME_RE = re.compile(r"^routerd:(?P<fleet>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<index>\d+)$")
HEALTHY_RESET_S = 30.0  # this long in rotation forgives earlier crashes (backoff starts over)


def actor_name(fleet: str, index: int) -> str:
    return f"routerd:{fleet}:{index}"


def spec_for(fleet: FleetConfig, index: int, ray_address: str = "") -> LaunchSpec:
    """The LaunchSpec of instance ``index``: what adoption compares against the actor's record."""
    env = dict(fleet.env)
    if _ray_backend(fleet):
        env.setdefault("RAY_ADDRESS", ray_address)
    return LaunchSpec(fleet=fleet.name, index=index, model=fleet.model, engine=fleet.engine,
                      tensor_parallel_size=fleet.tensor_parallel_size,
                      pipeline_parallel_size=fleet.pipeline_parallel_size,
                      num_cpus=fleet.num_cpus_per_instance, num_gpus=_gpus(fleet),
                      engine_args=dict(fleet.engine_args), env=env)


def _ray_backend(fleet: FleetConfig) -> bool:
    args = fleet.engine_args
    backend = args.get("distributed-executor-backend", args.get("distributed_executor_backend", ""))
    return str(backend) == "ray"


def _gpus(fleet: FleetConfig) -> float:
    if fleet.num_gpus_per_instance is not None:
        return float(fleet.num_gpus_per_instance)
    return 0.0 if _ray_backend(fleet) else float(fleet.tensor_parallel_size * fleet.pipeline_parallel_size)


def bundle_for(spec: LaunchSpec) -> dict[str, float]:
    bundle = {"CPU": spec.num_cpus, "GPU": spec.num_gpus}
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}


@dataclass
class Slot:
    """The fleet manager's side of one instance (the registry holds what others may read)."""

    inst: Instance
    spec: LaunchSpec
    placement: Placement | None = None
    info: dict[str, Any] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    fail_reason: str = ""
    restart_requested: bool = False
    retiring: bool = False
    stale: bool = False  # runs an older spec than the config's: replaced by the rolling update
    drained: bool = False
    streak: int = 0  # failures since it was last healthy for HEALTHY_RESET_S
    ready_since: float | None = None


class FleetManager:
    """Keeps every launched fleet at its desired replicas on Ray; the daemon owns ``run()``."""

    def __init__(self, cfg: Config, registry: Registry, cluster: RayCluster, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.registry = registry
        self.cluster = cluster
        self.clock = clock
        self.ops = EngineOps(cluster, str(config_mod.state_dir(cfg)), clock)
        self.slots: dict[str, Slot] = {}
        self._replicas_override: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self.monitor = HealthMonitor(registry, cfg.health, self.ops.probe_for(self.slots), self._on_failed,
                                     clock=clock, watch=self._watched)

    # lifecycle -------------------------------------------------------------------------------
    def _watched(self, inst: Instance) -> bool:
        """The heartbeats of this manager's instances only (static ones have their own monitor)."""
        return inst.id in self.slots and in_rotation(inst)

    def _fleets(self) -> list[FleetConfig]:
        return [f for f in self.cfg.fleets if f.engine != "static"]

    def desired(self, fleet: FleetConfig) -> int:
        return self._replicas_override.get(fleet.name, fleet.replicas)

    def _desired_spec(self, fleet_name: str, index: int) -> LaunchSpec | None:
        fleet = self.cfg.fleet(fleet_name)
        if fleet is None or fleet.engine == "static" or index >= self.desired(fleet):
            return None
        return spec_for(fleet, index, self.cluster.address)

    async def start(self) -> None:
        """Adopt matching engines, stop the rest (and stray placement groups), launch what is missing."""
        await asyncio.to_thread(Path(self.ops.state_dir).mkdir, parents=True, exist_ok=True)
        self._session = aiohttp.ClientSession()
        self.ops.session = self._session
        for fleet in self._fleets():
            self.registry.ensure_fleet(fleet.name)
        keep_pgs: set[str] = set()
        for name in await self.cluster.named_actors():
            m = NAME_RE.match(name)
            if m is None:
                continue
            fleet_name, index = str(m["fleet"]), int(m["index"])
            if await self._adopt(name, fleet_name, index):
                keep_pgs.add(self.ops.pg_name(fleet_name, index))
        await self.ops.remove_stray_pgs(keep_pgs)
        self._reconcile()
        adopted_slots = [s for s in self.slots.values() if s.info]
        if adopted_slots:  # an unchanged restart serves again before start() returns
            await self._wait_states(adopted_slots, timeout=10.0)

    async def _adopt(self, name: str, fleet: str, index: int) -> bool:
        actor = await self.cluster.get_actor(name)
        if actor is None:
            return False
        try:
            info = await self.ops.actor_info(actor, timeout=5.0)
        except Exception as e:  # noqa: BLE001  # an actor that cannot answer is replaced, not adopted
            _logger.warning("adopt_unresponsive", actor=name, error=repr(e))
            await self.ops.dispose(actor, self.ops.pg_name(fleet, index), stop=False)
            return False
        try:
            recorded = msgspec.json.decode(info["spec"].encode(), type=LaunchSpec)
        except (KeyError, AttributeError, msgspec.DecodeError) as e:  # another routerd version's record
            _logger.warning("adopt_unreadable_record", actor=name, error=repr(e))
            await self.ops.dispose(actor, self.ops.pg_name(fleet, index), stop=True)
            return False
        desired = self._desired_spec(fleet, index)
        if desired is None:  # its fleet is gone, or it is beyond the replica count
            _logger.info("adopt_unwanted_stopping", actor=name, recorded=msgspec.to_builtins(recorded))
            await self.ops.dispose(actor, self.ops.pg_name(fleet, index), stop=True)
            return False
        fcfg = self.cfg.fleet(fleet)
        assert fcfg is not None
        # A changed spec is adopted as it runs and marked stale: it keeps serving until the rolling
        # replacement in _reconcile swaps it, one instance at a time, for one with the new spec.
        slot = self._new_slot(fcfg, index, recorded)
        slot.stale = desired != recorded
        slot.placement = Placement(actor=actor, pg=await self.ops.find_pg(fleet, index),
                                   bundle=bundle_for(recorded))
        slot.info = info
        self.ops.apply_info(slot.inst, info)
        _logger.info("adopted", instance=slot.inst.id, pid=info["pid"], url=info["url"], alive=info["alive"],
                     stale=slot.stale)
        self._spawn_supervisor(slot)
        return True

    async def run(self) -> None:
        """The control loop: health monitor, reconcile each second or when woken; failed steps are logged."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.monitor.run(), name="health-monitor")
            while True:
                try:
                    self._reconcile()
                    await self._refresh_resources()
                except Exception:  # a loop boundary: log and go on
                    _logger.exception("fleet_step_failed")
                with contextlib.suppress(TimeoutError):
                    await wait_for(self._wake.wait(), 1.0)
                self._wake.clear()

    async def apply(self, cfg: Config) -> None:
        """Reload: new/removed fleets, replica counts, changed specs (rolled out), health settings."""
        old = self.cfg
        self.cfg = cfg
        self.monitor.update_config(cfg.health)
        for name in list(self._replicas_override):
            o, n = old.fleet(name), cfg.fleet(name)
            if o is None or n is None or o.replicas != n.replicas:
                del self._replicas_override[name]  # the file changed its count: the file wins
        for slot in self.slots.values():
            desired = self._desired_spec(slot.spec.fleet, slot.spec.index)
            slot.stale = desired is not None and desired != slot.spec  # None: _reconcile retires it
            fcfg = cfg.fleet(slot.spec.fleet)
            if fcfg is not None:  # not part of the spec (no relaunch), so applied in place, as for static
                slot.inst.capacity_hint = fcfg.max_num_seqs
        self._reconcile()

    async def shutdown(self, stop_engines: bool) -> None:
        """Stop supervising; with ``stop_engines`` also stop every engine, actor and placement group."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if stop_engines:
            # Slots still being placed have no Placement yet but may own a pending placement group.
            await asyncio.gather(*(self.ops.dispose(s.placement.actor if s.placement is not None else None,
                                                    self.ops.pg_name(s.spec.fleet, s.spec.index), stop=True)
                                   for s in self.slots.values()),
                                 return_exceptions=True)
            for s in self.slots.values():
                self.registry.remove(s.inst.id)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # reconcile -------------------------------------------------------------------------------
    def _new_slot(self, fleet: FleetConfig, index: int, spec: LaunchSpec) -> Slot:
        inst = Instance(id=f"{fleet.name}:{index}", fleet=fleet.name, url="",
                        capacity_hint=fleet.max_num_seqs)
        slot = Slot(inst=inst, spec=spec)
        self.slots[inst.id] = slot
        self.registry.add(inst)
        return slot

    def _reconcile(self) -> None:
        wanted: set[str] = set()
        for fleet in self._fleets():
            self.registry.ensure_fleet(fleet.name)
            for index in range(self.desired(fleet)):
                iid = f"{fleet.name}:{index}"
                wanted.add(iid)
                if iid not in self.slots:
                    self._spawn_supervisor(self._new_slot(fleet, index, spec_for(fleet, index,
                                                                                 self.cluster.address)))
        for iid, slot in list(self.slots.items()):
            if iid not in wanted and not slot.retiring:
                self._retire(slot, "scaling down")
        for fleet in self._fleets():
            self._roll(fleet.name)
        configured = {f.name for f in self.cfg.fleets}
        for name in self.registry.fleets():
            if name not in configured and not any(s.spec.fleet == name for s in self.slots.values()):
                self.registry.drop_fleet(name)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_supervisor(self, slot: Slot) -> None:
        slot.task = self._spawn(self._supervise(slot), f"supervise:{slot.inst.id}")

    def _roll(self, fleet: str) -> None:
        """Rolling update: replace one stale instance at a time, and only while every other instance of
        the fleet is in rotation — a new spec that cannot start halts the rollout instead of emptying
        the fleet. The retired slot's index is relaunched with the new spec by the next reconcile."""
        slots = sorted((s for s in self.slots.values() if s.spec.fleet == fleet), key=lambda s: s.spec.index)
        if any(s.retiring for s in slots):
            return
        stale = [s for s in slots if s.stale]
        others_ready = all(s.inst.state is InstanceState.READY for s in slots if not s.stale)
        if stale and others_ready:
            _logger.info("rolling_replace", instance=stale[0].inst.id, remaining=len(stale) - 1)
            self._retire(stale[0], "replacing: spec changed")

    def _retire(self, slot: Slot, reason: str) -> None:
        """Scale-down/removal/replacement: out of rotation, let in-flight requests finish, stop everything."""
        slot.retiring = True
        self._spawn(self._retire_slot(slot, reason), f"retire:{slot.inst.id}")

    async def _retire_slot(self, slot: Slot, reason: str) -> None:
        self.registry.set_state(slot.inst, InstanceState.DRAINING, reason)
        await self._wait_idle(slot.inst, self.cfg.daemon.drain_timeout_s)
        if slot.task is not None:
            slot.task.cancel()
            await asyncio.gather(slot.task, return_exceptions=True)
        # Never placed (or cancelled mid-placement): dispose still removes a pending placement group.
        actor = slot.placement.actor if slot.placement is not None else None
        report = await self.ops.dispose(actor, self.ops.pg_name(slot.spec.fleet, slot.spec.index), stop=True)
        _logger.info("instance_stopped", instance=slot.inst.id, **report)
        self.registry.remove(slot.inst.id)
        if self.slots.get(slot.inst.id) is slot:
            del self.slots[slot.inst.id]
        self._wake.set()

    async def _wait_idle(self, inst: Instance, timeout: float) -> None:
        deadline = self.clock() + timeout
        since = self.registry.version
        while inst.inflight > 0 and self.clock() < deadline:
            since = await self.registry.wait_changed(since, timeout=0.1)

    async def _wait_states(self, slots: list[Slot], timeout: float) -> None:
        deadline = self.clock() + timeout
        since = self.registry.version
        while any(s.inst.state is InstanceState.STARTING for s in slots) and self.clock() < deadline:
            since = await self.registry.wait_changed(since, timeout=0.2)

    async def _refresh_resources(self) -> None:
        """Resource use for status (CPU, RSS, GPU memory), at most every few seconds per instance."""
        for slot in list(self.slots.values()):
            if slot.placement is None or slot.inst.state not in (InstanceState.READY, InstanceState.DRAINING):
                continue
            if self.clock() - slot.info.get("_refreshed", 0.0) < 5.0:
                continue
            with contextlib.suppress(Exception):  # status detail only; health decides liveness
                info = await self.ops.actor_info(slot.placement.actor, timeout=2.0)
                info["_refreshed"] = self.clock()
                slot.info = info
                slot.inst.resources = info.get("resources", {})

    # supervision ------------------------------------------------------------------------------
    async def _supervise(self, slot: Slot) -> None:
        """One instance's life: launch or adopt, ready, watch, restart with backoff — until cancelled."""
        failed_before = False
        while True:
            try:
                if failed_before:
                    await self._after_failure(slot)
                await self.ops.ensure_running(slot, self.registry)
                if await self.ops.wait_ready(slot, self.registry, self.cfg.health):
                    inst = slot.inst  # a restart may have put a new Instance in the registry
                    if slot.retiring:  # restarted while being retired: never back into rotation
                        self.registry.set_state(inst, InstanceState.DRAINING, "retiring")
                    elif slot.drained:
                        self.registry.set_state(inst, InstanceState.DRAINING, "drained by admin")
                    else:
                        self.registry.set_state(inst, InstanceState.READY)
                    slot.ready_since = self.clock()
                    _logger.info("instance_ready", instance=inst.id, url=inst.url, pid=inst.pid,
                                 generation=inst.generation)
                    await self._watch(slot)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a loop boundary: this instance's step failed; back off and retry
                _logger.exception("instance_step_failed", instance=slot.inst.id)
                slot.fail_reason = slot.fail_reason or f"error: {e!r}"[:200]
            failed_before = True

    async def _watch(self, slot: Slot) -> None:
        """Wait for a death (sentinel), a heartbeat failure or an admin restart."""
        assert slot.placement is not None
        sentinel = asyncio.ensure_future(self.ops.death_sentinel(slot))
        failed = asyncio.ensure_future(slot.failed.wait())
        try:
            done, _ = await asyncio.wait({sentinel, failed}, return_when=asyncio.FIRST_COMPLETED)
            if sentinel in done:
                reason, actor_dead = sentinel.result()
                if actor_dead:
                    slot.placement.actor_dead = True
                self._fail(slot, reason)
        finally:
            sentinel.cancel()
            failed.cancel()

    def _fail(self, slot: Slot, reason: str) -> None:
        """Out of rotation at once; the supervisor restarts it."""
        if not slot.fail_reason:
            slot.fail_reason = reason
        self.registry.set_state(slot.inst, InstanceState.UNHEALTHY, slot.fail_reason)
        slot.failed.set()

    async def _on_failed(self, inst: Instance, result: ProbeResult) -> None:
        slot = self.slots.get(inst.id)
        if slot is None or slot.inst is not inst or inst.state not in (InstanceState.READY,
                                                                       InstanceState.DRAINING):
            return  # gone, a past generation, or already failed (the death sentinel was first)
        if result is ProbeResult.ACTOR_DEAD and slot.placement is not None:
            slot.placement.actor_dead = True
        self._fail(slot, f"heartbeat: {result.value}")
        # A hung engine keeps its sockets open until the restart kills it, after the backoff: end
        # what runs on it now (streams get the terminal error event, the rest are retried elsewhere).
        ended = inst.lose(f"instance {inst.id} failed its heartbeats ({result.value})")
        _logger.warning("instance_failed", instance=inst.id, result=result.value, generation=inst.generation,
                        requests_ended=ended)

    async def _after_failure(self, slot: Slot) -> None:
        # Cleared here, not when watching starts: an admin restart that arrives while the engine is
        # still starting must survive until _watch sees it.
        slot.failed.clear()
        inst = slot.inst
        if slot.ready_since is not None and self.clock() - slot.ready_since >= HEALTHY_RESET_S:
            slot.streak = 0
        slot.ready_since = None
        reason = slot.fail_reason or "not ready"
        requested = slot.restart_requested
        slot.restart_requested = False
        self.registry.set_state(inst, InstanceState.UNHEALTHY, reason)
        delay = 0.0
        if not requested:
            slot.streak += 1
            h = self.cfg.health
            delay = min(h.restart_backoff_initial_s * 2 ** (slot.streak - 1), h.restart_backoff_max_s)
            crash_loop = " (crash loop)" if slot.streak >= 3 else ""
            self.registry.set_state(inst, InstanceState.UNHEALTHY,
                                    f"{reason}; restart {slot.streak} in {delay:.1f}s{crash_loop}")
        _logger.warning("instance_restarting", instance=inst.id, reason=reason, delay_s=round(delay, 2),
                        streak=slot.streak, requested=requested)
        await asyncio.sleep(delay)
        slot.fail_reason = ""
        slot.drained = False
        inst.restarts += 1
        # A failed engine gets a short grace (a hung one cannot act on SIGTERM); a requested restart of
        # a healthy engine gets the full one so it can finish cleanly.
        await self.ops.restart(slot, self.registry, grace_s=10.0 if requested else 1.0)

    # admin -----------------------------------------------------------------------------------
    def _slot(self, instance_id: str) -> Slot:
        slot = self.slots.get(instance_id)
        if slot is None or slot.retiring:
            raise KeyError(instance_id)
        return slot

    async def restart_instance(self, instance_id: str) -> dict[str, Any]:
        """Admin: take one instance out of rotation now and restart its engine (no backoff)."""
        slot = self._slot(instance_id)
        slot.restart_requested = True
        self._fail(slot, "restart requested")
        return slot.inst.status(self.registry.clock())

    async def drain_instance(self, instance_id: str, timeout_s: float) -> dict[str, Any]:
        """Admin: no new requests; wait (≤ timeout_s) for in-flight ones. Stays drained until restarted."""
        slot = self._slot(instance_id)
        slot.drained = True
        self.registry.set_state(slot.inst, InstanceState.DRAINING, "drained by admin")
        await self._wait_idle(slot.inst, timeout_s)
        return {**slot.inst.status(self.registry.clock()), "drained": slot.inst.inflight == 0}

    async def set_replicas(self, fleet: str, replicas: int) -> dict[str, Any]:
        """Admin: change a fleet's replica count at run time (until the config file changes it)."""
        fcfg = self.cfg.fleet(fleet)
        if fcfg is None or fcfg.engine == "static":
            raise KeyError(fleet)
        self._replicas_override[fleet] = replicas
        self._reconcile()
        self._wake.set()
        return {"fleet": fleet, "replicas": replicas}
