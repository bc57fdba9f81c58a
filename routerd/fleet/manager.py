"""Fleets on Ray: desired vs actual instances — launch, adopt, roll, retire, scale, drain.

Each instance ``<fleet>:<n>`` is one detached ``EngineActor`` named ``routerd:<fleet>:<n>`` in the
configured namespace, inside its own detached placement group of one STRICT_PACK bundle holding the
TP×PP GPUs plus the engine's CPUs (one bundle, so the actor holds all of them and Ray sets
``CUDA_VISIBLE_DEVICES`` to exactly those GPUs; ``vllm serve`` runs with the ``mp`` backend beneath it).

Launch pattern for TP×PP larger than one node: a ``vllm serve`` subprocess can never reuse its actor's
placement group (vllm-and-ray-facts §4.1), so such a fleet sets ``distributed-executor-backend = "ray"``
in ``engine_args``. Its actor's bundle then holds CPUs only and the engine gets ``RAY_ADDRESS``; vLLM
creates and owns its own PACK placement group of ``{GPU: 1} × TP×PP`` across nodes (pattern B). The
fleet manager still supervises, probes and restarts it the same way; GPU accounting is vLLM's.

The manager decides which instances exist: it reconciles the config's replica counts, adopts engines a
previous routerd left running, rolls a changed spec out one instance at a time while the others serve,
and retires what is no longer wanted. Each instance's life is its ``Supervisor``'s
(routerd/fleet/supervisor.py), the only writer of that instance's state. The request path never awaits
Ray: it reads the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from .. import config as config_mod
from .. import log
from .._aio import wait_for
from ..config import Config, FleetConfig
from ..errors import RouterdError
from ..peers.lease import ControlLease
from ..peers.replicas import ReplicaStore
from ..plugins import LaunchSpec
from ..registry import Instance, InstanceState, Registry
from ..tracing import engine_env
from .adopt import Orphan, adopt, find_orphan
from .autoscaler import Autoscaler, FleetCollector
from .engine import EngineOps, ProbeAnswer
from .health import HealthMonitor, ProbeResult, in_rotation
from .naming import NAME_RE, actor_name, bundle_for, instance_id, spec_for
from .nodes import NodeWatch
from .ray_cluster import RayCluster
from .spread import Spreader
from .supervisor import Supervisor

_logger = log.get("routerd.fleet")
# The admin replica count's ceiling for a fleet without autoscale bounds: the ceiling the config puts
# on an autoscaled fleet's max_replicas.
MAX_REPLICAS = 1024


class FleetManager:
    """Keeps every launched fleet at its desired replicas on Ray; the daemon owns ``run()``.

    It acts only in a term of control (routerd/peers/lease.py): :meth:`start` begins one — adopting
    what runs, launching what is missing — and ``shutdown(stop_engines=False)`` ends it, supervising
    nothing more and stopping no engine, so the same manager can start again in a later term. Every
    Ray mutation is checked against ``control`` (its ``check()``, through the cluster's fence) and
    carries its token to the engine actors."""

    def __init__(self, cfg: Config, registry: Registry, cluster: RayCluster,
                 session: aiohttp.ClientSession, *, replica_store: ReplicaStore | None = None,
                 clock: Callable[[], float] = time.monotonic, control: ControlLease | None = None,
                 engine_api_key: str = "") -> None:
        """``session`` is the process's one client session (routerd/upstream.py), for ``/health``;
        ``replica_store`` (with Redis) keeps run-time replica counts for whoever controls next;
        ``control`` the lease this process controls the fleets under (None: sole control);
        ``engine_api_key`` what the engines it launches require (``Trust.engine_api_key``; "" none)."""
        self.control = control if control is not None else ControlLease("")
        # In a term of control: between start() and shutdown() — from the start under sole control.
        self._active = self.control.sole
        self._closed = False  # shut down by its owner: no term begins again
        self._start_failures = 0  # terms in a row whose start failed: the next waits 2**n s (≤ 30 s)
        self._next_start = 0.0
        self.cfg = cfg
        self.replica_store = replica_store
        self.registry = registry
        self.cluster = cluster
        self.clock = clock
        # Node loss and spread placement (routerd/fleet/nodes.py, spread.py): the node watch probes the
        # nodes the spreader knows engines on; a lost node fails its instances (_node_lost).
        self.nodes = NodeWatch(cluster, cfg.health, lambda: self.ops.spreader.nodes_in_use(), self._node_lost,
                               clock=clock)
        spreader = Spreader(cluster, self.nodes, self._placement_of)
        self.ops = EngineOps(cluster, str(config_mod.state_dir(cfg)), clock, session, spreader=spreader,
                             nodes=self.nodes, token=lambda: self.control.token,
                             raise_token=self.control.raise_above, api_key=engine_api_key)
        self.supervisors: dict[str, Supervisor] = {}
        # Engines of fleets this controller's config lacks, found running at the start of its term: left
        # running, unmanaged, until an operator removes them (remove_orphan) or a config with their fleet
        # controls again (README "Several routerd": the controller's fleets are the fleets).
        self.orphans: dict[str, Orphan] = {}
        # The launched fleets' desired counts in the last fleet state this process published or followed
        # (routerd/peers/fleet_state.py; set by the builder, which makes the view after this): where a
        # new term of control starts the autoscaled fleets from. None: no state seen.
        self.published: Callable[[], dict[str, int] | None] = lambda: None
        self._replicas_override: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._crowded: set[str] = set()  # replicas of spread fleets to move to a node of their own
        self.monitor = HealthMonitor(registry, cfg.health, self._probe, self._on_failed,
                                     clock=clock, watch=self._watched)
        # Autoscaled fleets' counts; an admin pin (_replicas_override) suspends a fleet's policy.
        self.autoscaler = Autoscaler(cfg, registry, cluster, on_change=self._wake.set,
                                     pin=self._replicas_override.get, clock=clock)

    # lifecycle -------------------------------------------------------------------------------
    def _placement_of(self, fleet: str) -> str:
        fcfg = self.cfg.fleet(fleet)
        return fcfg.placement if fcfg is not None else "any"

    def _node_lost(self, node_id: str, why: str) -> None:
        """Every instance on a lost node out of rotation now; each supervisor places its own again."""
        for fleet, index in self.ops.spreader.instances_on(node_id):
            sup = self.supervisors.get(instance_id(fleet, index))
            if sup is not None:
                sup.node_lost(node_id, why)

    def _watched(self, inst: Instance) -> bool:
        """The heartbeats of this manager's instances only (static ones have their own monitor)."""
        return inst.id in self.supervisors and in_rotation(inst)

    async def _probe(self, inst: Instance, deadline_s: float) -> ProbeAnswer:
        """The health monitor's probe: the instance's engine actor, asked within the deadline."""
        sup = self.supervisors.get(inst.id)
        if sup is None:
            return None, True, False
        return await sup.probe(deadline_s)

    def _fleets(self) -> list[FleetConfig]:
        return [f for f in self.cfg.fleets if f.engine != "static"]

    def desired(self, fleet: FleetConfig) -> int:
        """The count the fleet is kept at: an admin pin, else the autoscaler's, else the config's."""
        pinned = self._replicas_override.get(fleet.name)
        if pinned is not None:
            return pinned
        scaled = self.autoscaler.replicas(fleet.name)
        return fleet.replicas if scaled is None else scaled

    def _desired_spec(self, fleet_name: str, index: int, *, adopting: bool = False) -> LaunchSpec | None:
        fleet = self.cfg.fleet(fleet_name)
        if fleet is None or fleet.engine == "static":
            return None
        # An autoscaled fleet adopts whatever runs within its bounds: a restart keeps the count it had.
        limit = fleet.autoscale.max_replicas if adopting and fleet.autoscale is not None \
            else self.desired(fleet)
        if index >= limit:
            return None
        return spec_for(fleet, index, self.cluster.address, engine_env(self.cfg.tracing, fleet.name))

    async def start(self) -> None:
        """Begin a term of control: adopt matching engines, stop the rest (and stray placement groups),
        launch what is missing. Raises ``NotController`` outside a term of the lease."""
        self.control.check()
        self._active = True  # a previous term's supervisors were cancelled and forgotten by shutdown()
        await asyncio.to_thread(Path(self.ops.state_dir).mkdir, parents=True, exist_ok=True)
        for fleet in self._fleets():
            self.registry.ensure_fleet(fleet.name)
        if self.replica_store is not None:
            # The counts an admin set, here or on an earlier controller: Redis holds them (one that cannot
            # be read fails the start — a controller that cannot reach Redis holds no lease either).
            pins = await self.replica_store.load(self._fleets())
            self._replicas_override.clear()  # the autoscaler reads this very dict
            self._replicas_override.update(pins)
        keep_pgs: set[str] = set()
        counts: dict[str, int] = {}  # fleet → highest adopted index + 1
        self.orphans = {}
        for name in await self.cluster.named_actors():
            m = NAME_RE.match(name)
            if m is None:
                continue
            fleet_name, index = str(m["fleet"]), int(m["index"])
            if self.cfg.fleet(fleet_name) is None:
                if await self._orphan(name, fleet_name, index):
                    keep_pgs.add(self.ops.pg_name(fleet_name, index))
            elif await self._adopt(name, fleet_name, index):
                keep_pgs.add(self.ops.pg_name(fleet_name, index))
                counts[fleet_name] = max(counts.get(fleet_name, 0), index + 1)
        await self.ops.remove_stray_pgs(keep_pgs)
        self._forget_unsupervised()
        self.autoscaler.begin(counts, self.published())
        self._reconcile()
        adopted = [s for s in self.supervisors.values() if s.slot.info]
        if adopted:  # an unchanged restart serves again before start() returns
            await self._wait_states(adopted, timeout=10.0)

    async def _adopt(self, name: str, fleet: str, index: int) -> bool:
        """Adopt the engine running as actor ``name``, or stop it (routerd/fleet/adopt.py)."""
        fcfg = self.cfg.fleet(fleet)

        def supervisor(spec: LaunchSpec) -> Supervisor:
            assert fcfg is not None  # else nothing is desired at this index: adopt() stops the engine
            return self._new_supervisor(fcfg, spec, adopting=True)

        iid = instance_id(fleet, index)

        async def stop(actor: Any, graceful: bool, why: str) -> dict[str, Any]:
            return await self._stop_engine(iid, why, actor, self.ops.pg_name(fleet, index), graceful=graceful)

        sup = await adopt(name, fleet, index, self.cluster, self.ops,
                          desired=self._desired_spec(fleet, index, adopting=True), supervisor=supervisor,
                          stop=stop)
        if sup is not None:
            self._spawn_supervisor(sup)
        return sup is not None

    async def _orphan(self, name: str, fleet: str, index: int) -> bool:
        """An engine of a fleet this config lacks, left running and reported (adopt.py ``orphan``); out
        of the registry, so not routed to. False when its actor is gone."""
        orphan = await find_orphan(name, fleet, index, self.cluster, self.ops)
        if orphan is None:
            return False
        self.orphans[orphan.id] = orphan
        inst = self.registry.get(orphan.id)
        if inst is not None and not inst.static:  # followed from a controller that had the fleet
            if inst.state in (InstanceState.READY, InstanceState.DRAINING):
                inst.lose(f"instance {orphan.id}: its fleet is not in the controller's config")
            self.registry.remove(orphan.id)
        return True

    def orphan_list(self) -> list[dict[str, Any]]:
        """The orphaned engines, for ``/admin/fleets`` and the published fleet state."""
        return [o.status() for o in sorted(self.orphans.values(), key=lambda o: o.id)]

    async def remove_orphan(self, instance_id: str) -> dict[str, Any]:
        """Admin: stop an orphaned engine (its actor and placement group too). ``KeyError`` for an id
        that is not one."""
        self.control.check()
        orphan = self.orphans.pop(instance_id)
        try:
            report = await self._stop_engine(instance_id, "orphan removed by admin", orphan.actor,
                                             self.ops.pg_name(orphan.fleet, orphan.index))
        except BaseException:
            self.orphans.setdefault(instance_id, orphan)  # still there: it may be asked again
            raise
        _logger.info("orphan_removed", instance=instance_id, **report)
        return {"removed": instance_id, **report}

    async def _adopt_orphans(self) -> None:
        """A reload gave this controller the fleet of an orphaned engine: adopted as any running engine."""
        for iid, orphan in list(self.orphans.items()):
            fcfg = self.cfg.fleet(orphan.fleet)
            if fcfg is None or fcfg.engine == "static":
                continue
            del self.orphans[iid]
            await self._adopt(actor_name(orphan.fleet, orphan.index), orphan.fleet, orphan.index)

    def _forget_unsupervised(self) -> None:
        """After adoption: an instance this process's registry holds (followed from the previous
        controller) that no supervisor took has no engine behind it any more — out of every view now,
        not left published as it was last seen."""
        for inst in list(self.registry):
            if not inst.static and inst.id not in self.supervisors:
                _logger.info("instance_forgotten", instance=inst.id, state=inst.state.value,
                             why="no engine of it was found to adopt")
                if inst.state in (InstanceState.READY, InstanceState.DRAINING):
                    inst.lose(f"instance {inst.id}: its engine is gone")
                self.registry.remove(inst.id)

    async def _stop_engine(self, iid: str, reason: str, actor: Any, pg_name: str, *,
                           graceful: bool = True) -> dict[str, Any]:
        """The one way an engine this controller stops goes (scale-down, replacement, unwanted or
        unreadable at adoption, the owner's stop): out of rotation first (its requests here ended,
        ``stopped`` published), then stopped, then out of the registry — so out of the state every other
        process follows — in the same step, whether or not the stop went cleanly."""
        inst = self.registry.get(iid)
        if inst is not None and inst.static:
            inst = None
        if inst is not None:
            if inst.state in (InstanceState.READY, InstanceState.DRAINING):
                inst.lose(f"instance {iid}: {reason}")
            self.registry.set_state(inst, InstanceState.STOPPED, reason)
        try:
            return await self.ops.dispose(actor, pg_name, stop=graceful)
        finally:
            if inst is not None and self.registry.get(iid) is inst:
                self.registry.remove(iid)

    @property
    def active(self) -> bool:
        """In a term of control: started, and not shut down since."""
        return self._active

    async def run_controlled(self) -> None:
        """Fleet control that follows the lease, until cancelled: a term begins when this process takes
        control (:meth:`start` — the engines running are adopted, none relaunched — then :meth:`run`)
        and ends as soon as it stops controlling (``shutdown(stop_engines=False)``: supervision ends,
        every engine keeps running); the process then follows. The owner stops the last term itself
        (daemon drain, ``assembly.running``), with or without its engines."""
        control = self.control
        term: asyncio.Task[None] | None = None
        try:
            while True:
                if control.controls and not self._active and not self._closed \
                        and self.clock() >= self._next_start:
                    await self._begin_term()
                if self._active and term is None:
                    term = asyncio.create_task(self.run(), name="fleet-control")
                if term is not None and (term.done() or not control.controls):
                    crashed = term.exception() if term.done() and not term.cancelled() else None
                    if crashed is not None:
                        raise crashed  # run() ends only by a bug: as before the lease, the owner's
                    term.cancel()
                    await asyncio.gather(term, return_exceptions=True)
                    term = None
                    await self._end_term(stop_engines=False)
                    _logger.warning("fleet_control_ended", ident=control.ident, token=control.token,
                                    engines_stopped=0)
                await control.wait_changed(1.0)
        finally:
            if term is not None:
                term.cancel()
                await asyncio.gather(term, return_exceptions=True)

    async def _begin_term(self) -> None:
        """:meth:`start` under the lease; one that fails (Ray, or the lease lost meanwhile) is undone —
        no engine stopped — and tried again, after 1, 2, 4 … 30 s, while this process still controls."""
        try:
            await self.start()
        except Exception:  # a loop boundary: log, undo, and try again later
            retry_s = min(30.0, 2.0 ** self._start_failures)
            self._start_failures += 1
            self._next_start = self.clock() + retry_s
            _logger.exception("fleet_control_start_failed", ident=self.control.ident,
                              token=self.control.token, retry_in_s=retry_s)
            await self._end_term(stop_engines=False)
            return
        self._start_failures = 0
        _logger.info("fleet_control_started", ident=self.control.ident, token=self.control.token,
                     adopted=sum(1 for s in self.supervisors.values() if s.slot.info))

    async def run(self) -> None:
        """The control loop: health monitor, reconcile each second or when woken; failed steps are logged."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.monitor.run(), name="health-monitor")
            tg.create_task(self.nodes.run(), name="node-watch")
            tg.create_task(self.autoscaler.run(), name="autoscaler")
            while True:
                try:
                    self._reconcile()
                    for sup in list(self.supervisors.values()):
                        await sup.refresh_resources()
                except Exception:  # a loop boundary: log and go on
                    _logger.exception("fleet_step_failed")
                # For the next reconcile; never a stale answer (instance ids are reused by replacements).
                self._crowded = set()
                try:
                    self._crowded = await self._find_crowded()
                except Exception:  # a loop boundary: the next round asks Ray again
                    _logger.exception("respread_check_failed")
                with contextlib.suppress(TimeoutError):
                    await wait_for(self._wake.wait(), 1.0)
                self._wake.clear()

    async def apply(self, cfg: Config) -> None:
        """Reload: new/removed fleets, replica counts, changed specs (rolled out), health settings."""
        old = self.cfg
        self.cfg = cfg
        self.monitor.update_config(cfg.health)
        self.nodes.update_config(cfg.health)
        for name in list(self._replicas_override):
            o, n = old.fleet(name), cfg.fleet(name)
            if o is None or n is None or o.replicas != n.replicas or o.autoscale != n.autoscale:
                # The file changed its count or bounds: the file wins (an autoscaled fleet resumes
                # from the pinned count, so the pin's replicas are not all dropped at once).
                self.autoscaler.unpinned(name, self._replicas_override.pop(name))
                if self.replica_store is not None:
                    with contextlib.suppress(RouterdError):  # the next controller drops it too: file_of
                        await self.replica_store.unset(name)
        running: dict[str, int] = {}
        for sup in self.supervisors.values():
            if not sup.slot.retiring:
                running[sup.slot.spec.fleet] = running.get(sup.slot.spec.fleet, 0) + 1
        self.autoscaler.update_config(cfg, running)
        for sup in self.supervisors.values():
            spec = sup.slot.spec
            desired = self._desired_spec(spec.fleet, spec.index)
            sup.set_stale(desired is not None and desired != spec)  # None: _reconcile retires it
            fcfg = cfg.fleet(spec.fleet)
            # Not part of the spec (no relaunch), so applied in place, as for static fleets.
            capacity = fcfg.max_num_seqs if fcfg is not None else sup.slot.inst.capacity_hint
            sup.update_config(cfg.health, capacity)
        if self._active:
            await self._adopt_orphans()
        self._reconcile()

    async def shutdown(self, stop_engines: bool) -> None:
        """Stop supervising for good (the owner's drain); with ``stop_engines`` also stop every engine,
        actor and placement group. Without, the engines keep running for the next routerd to adopt."""
        self._closed = True
        await self._end_term(stop_engines)

    async def _end_term(self, stop_engines: bool) -> None:
        """End a term of control: stop supervising (and the engines, with ``stop_engines``). Without,
        the engines and their registry entries stay as they are (a follower's view of the fleet takes
        them over) and :meth:`start` may begin another term."""
        self._active = False
        self.orphans = {}  # the next controller finds them again, and judges them by its own config
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not stop_engines:
            for sup in self.supervisors.values():
                self.ops.release(sup.slot.spec)  # the next term claims the nodes it finds again
            self.supervisors = {}
        else:
            with contextlib.suppress(Exception):  # best effort: the cluster may be going away too
                await self.autoscaler.withdraw()
            # Slots still being placed have no Placement yet but may own a pending placement group.
            await asyncio.gather(*(self._dispose(sup, "routerd stopped its engines")
                                   for sup in self.supervisors.values()),
                                 return_exceptions=True)
            for sup in self.supervisors.values():
                sup.remove()

    async def _dispose(self, sup: Supervisor, reason: str) -> dict[str, Any]:
        """Stop the instance's engine and actor and remove its placement group (placed or pending)."""
        slot = sup.slot
        actor = slot.placement.actor if slot.placement is not None else None
        return await self._stop_engine(slot.inst.id, reason, actor,
                                       self.ops.pg_name(slot.spec.fleet, slot.spec.index))

    # reconcile -------------------------------------------------------------------------------
    def _new_supervisor(self, fleet: FleetConfig, spec: LaunchSpec, *, adopting: bool = False) -> Supervisor:
        """``adopting``: the engine runs, and an entry the registry has for it (a follower's view of the
        fleet, before this process took control) is kept — with the requests in flight on it."""
        sup = Supervisor(spec, fleet.max_num_seqs, self.registry, self.ops, self.cfg.health, self.clock,
                         keep_entry=adopting)
        self.supervisors[sup.slot.inst.id] = sup
        return sup

    def _reconcile(self) -> None:
        if not self._active:  # a follower's reload or admin call: the controller's reconcile acts
            return
        wanted: set[str] = set()
        for fleet in self._fleets():
            self.registry.ensure_fleet(fleet.name)
            for index in range(self.desired(fleet)):
                iid = instance_id(fleet.name, index)
                wanted.add(iid)
                if iid not in self.supervisors:
                    self._spawn_supervisor(self._new_supervisor(fleet, spec_for(
                        fleet, index, self.cluster.address, engine_env(self.cfg.tracing, fleet.name))))
        for iid, sup in list(self.supervisors.items()):
            if iid not in wanted and not sup.slot.retiring:
                self._retire(sup, "scaling down")
        for fleet in self._fleets():
            self._roll(fleet.name)
        configured = {f.name for f in self.cfg.fleets}
        for name in self.registry.fleets():
            if name not in configured and all(s.slot.spec.fleet != name for s in self.supervisors.values()):
                self.registry.drop_fleet(name)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_supervisor(self, sup: Supervisor) -> None:
        sup.task = self._spawn(sup.run(), f"supervise:{sup.slot.inst.id}")

    def _roll(self, fleet: str) -> None:
        """Rolling update: replace one stale instance at a time, and only while every other instance of
        the fleet is in rotation — a new spec that cannot start halts the rollout instead of emptying
        the fleet. The retired instance's index is relaunched with the new spec by the next reconcile."""
        sups = sorted((s for s in self.supervisors.values() if s.slot.spec.fleet == fleet),
                      key=lambda s: s.slot.spec.index)
        if any(s.slot.retiring for s in sups):
            return
        stale = [s for s in sups if s.slot.stale or s.slot.inst.id in self._crowded]
        others_ready = all(s.slot.inst.state is InstanceState.READY for s in sups if s not in stale)
        if stale and others_ready:
            _logger.info("rolling_replace", instance=stale[0].slot.inst.id, remaining=len(stale) - 1,
                         why="spec changed" if stale[0].slot.stale else "re-spreading over nodes")
            self._retire(stale[0], "replacing: spec changed" if stale[0].slot.stale
                         else "moving to a node of its own (placement = spread)")

    async def _find_crowded(self) -> set[str]:
        """Replicas of ``spread`` fleets doubled up on a node while another node has room for them
        (routerd/fleet/spread.py); ``_roll`` moves them one at a time."""
        out: set[str] = set()
        for fleet in self._fleets():
            if fleet.placement == "spread" and not any(s.slot.retiring for s in self.supervisors.values()
                                                        if s.slot.spec.fleet == fleet.name):
                bundle = bundle_for(spec_for(fleet, 0, self.cluster.address))
                indices = await self.ops.spreader.crowded(fleet.name, bundle)
                out |= {instance_id(fleet.name, i) for i in indices}
        return out

    def _retire(self, sup: Supervisor, reason: str) -> None:
        """Scale-down/removal/replacement: out of rotation, let in-flight requests finish, stop everything."""
        sup.retire(reason)
        self._spawn(self._retire_instance(sup), f"retire:{sup.slot.inst.id}")

    async def _retire_instance(self, sup: Supervisor) -> None:
        fleet = self.cfg.fleet(sup.slot.spec.fleet)
        # An autoscaled fleet's scale-down waits for its requests as long as they may reasonably run.
        timeout = fleet.autoscale.drain_timeout_s if fleet is not None and fleet.autoscale is not None \
            else self.cfg.daemon.drain_timeout_s
        await self.registry.wait_idle(sup.slot.inst, timeout)
        if sup.task is not None:
            sup.task.cancel()
            await asyncio.gather(sup.task, return_exceptions=True)
        # Never placed (or cancelled mid-placement): dispose still removes a pending placement group.
        report = await self._dispose(sup, sup.slot.inst.state_reason or "retired")
        _logger.info("instance_stopped", instance=sup.slot.inst.id, **report)
        sup.remove()
        if self.supervisors.get(sup.slot.inst.id) is sup:
            del self.supervisors[sup.slot.inst.id]
        self._wake.set()

    async def _wait_states(self, sups: list[Supervisor], timeout: float) -> None:
        deadline = self.clock() + timeout
        since = self.registry.version
        while any(s.slot.inst.state is InstanceState.STARTING for s in sups) and self.clock() < deadline:
            since = await self.registry.wait_changed(since, timeout=0.2)

    async def _on_failed(self, inst: Instance, result: ProbeResult) -> None:
        sup = self.supervisors.get(inst.id)
        if sup is not None:  # else gone
            sup.on_failed(inst, result)

    # admin -----------------------------------------------------------------------------------
    def _supervisor(self, instance_id: str) -> Supervisor:
        sup = self.supervisors.get(instance_id)
        if sup is None or sup.slot.retiring:
            raise KeyError(instance_id)
        return sup

    async def restart_instance(self, instance_id: str) -> dict[str, Any]:
        """Admin: take one instance out of rotation now and restart its engine (no backoff)."""
        self.control.check()
        sup = self._supervisor(instance_id)
        sup.request_restart()
        return sup.slot.inst.status(self.registry.clock())

    async def drain_instance(self, instance_id: str, timeout_s: float) -> dict[str, Any]:
        """Admin: no new requests; wait (≤ timeout_s) for in-flight ones. Stays drained until restarted."""
        self.control.check()
        sup = self._supervisor(instance_id)
        sup.drain()
        inst = sup.slot.inst
        await self.registry.wait_idle(inst, timeout_s)
        return {**inst.status(self.registry.clock()), "drained": inst.inflight == 0}

    def _launched(self, fleet: str) -> FleetConfig:
        """``fleet``'s config; ``KeyError`` unless it is a launched fleet (the admin calls' target)."""
        fcfg = self.cfg.fleet(fleet)
        if fcfg is None or fcfg.engine == "static":
            raise KeyError(fleet)
        return fcfg

    def max_replicas(self, fleet: str) -> tuple[int, str]:
        """The most replicas an admin may ask of a launched fleet, and why: an autoscaled fleet's
        ``max_replicas`` (the ceiling its operator set on its cost), else :data:`MAX_REPLICAS`.
        ``KeyError`` for a fleet that is not launched."""
        fcfg = self._launched(fleet)
        if fcfg.autoscale is not None:
            return fcfg.autoscale.max_replicas, "its autoscale.max_replicas"
        return MAX_REPLICAS, "the ceiling of a fleet without autoscale bounds"

    def wake(self, fleet: str) -> dict[str, Any]:
        """Another process's request found ``fleet`` scaled to zero (relayed to the controller): start
        an instance as for a request of this process's own. ``KeyError`` for a fleet not launched."""
        self._launched(fleet)
        self.control.check()
        eta = self.autoscaler.wake(fleet)
        return {"fleet": fleet, "woken": eta is not None, "ready_in_s": eta}

    async def set_replicas(self, fleet: str, replicas: int) -> dict[str, Any]:
        """Admin: change a fleet's replica count at run time (until the config file changes it, or
        :meth:`unset_replicas`). An autoscaled fleet is pinned there: its policy waits meanwhile."""
        fcfg = self._launched(fleet)
        self.control.check()
        if self.replica_store is not None:  # stored first: a count the next controller would not see is none
            await self.replica_store.set(fcfg, replicas)
        self._replicas_override[fleet] = replicas
        if fcfg.autoscale is not None:
            _logger.info("autoscale_pinned", fleet=fleet, replicas=replicas)
        self._reconcile()
        self._wake.set()
        return {"fleet": fleet, "replicas": replicas, "pinned": fcfg.autoscale is not None}

    async def unset_replicas(self, fleet: str) -> dict[str, Any]:
        """Admin: drop the run-time count: back to the autoscaler (from the pinned count) or the file."""
        fcfg = self._launched(fleet)
        self.control.check()
        if self.replica_store is not None:
            await self.replica_store.unset(fleet)
        pinned = self._replicas_override.pop(fleet, None)
        if pinned is not None:
            self.autoscaler.unpinned(fleet, pinned)
        self._reconcile()
        self._wake.set()
        return {"fleet": fleet, "replicas": self.desired(fcfg), "pinned": False}

    def replica_figures(self) -> list[tuple[str, int, int, int]]:
        """(fleet, desired, actual, ready) of every launched fleet: actual counts the replicas launched
        and not being retired (starting, ready or restarting)."""
        out = []
        for fleet in self._fleets():
            sups = [s for s in self.supervisors.values() if s.slot.spec.fleet == fleet.name]
            actual = sum(1 for s in sups if not s.slot.retiring)
            out.append((fleet.name, self.desired(fleet), actual, self.registry.ready_count(fleet.name)))
        return out

    def collector(self) -> FleetCollector:
        """The ``/metrics`` collector of desired vs actual replicas and autoscaling decisions."""
        return FleetCollector(self.replica_figures, self.autoscaler)
