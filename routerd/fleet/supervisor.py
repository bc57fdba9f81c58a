"""One launched instance's life, and the only writer of its state.

A ``Supervisor`` runs one loop per instance: place → start → ready (``/health`` 200 and one warm-up
generation) → READY → watch (death sentinel, heartbeat failures, admin restarts) → out of rotation at
once → capped exponential backoff → restart (same actor if it lives, else a new actor in the same
placement group) → generation + 1 (a new registry Instance per generation, so nothing of the old
engine's scrape or circuit state is held against the new one). The engine steps themselves are
``EngineOps``' (routerd/fleet/engine.py), which return data; the supervisor writes the ``Slot`` and the
registry entry. The fleet manager decides *which* instances should exist and asks the supervisor to
drain, retire, restart or mark one stale; it never writes an instance's state itself.

A lost node (routerd/fleet/nodes.py) fails its instances at once (``node_lost``), as failed heartbeats
do; their restart skips the backoff — the engine is not to blame — and happens in a new placement group
on another node (``EngineOps``), or waits for one, pending.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import log
from ..config import HealthConfig
from ..peers.lease import NotController
from ..plugins import LaunchSpec
from ..registry import Instance, InstanceState, Registry
from ..speed import spec_capacity
from . import naming
from .actor import FencedOut
from .engine import EngineOps, Placement, ProbeAnswer
from .health import ProbeResult

_logger = log.get("routerd.fleet")

HEALTHY_RESET_S = 30.0  # this long in rotation forgives earlier crashes (backoff starts over)


@dataclass
class Slot:
    """The fleet manager's side of one instance (the registry holds what others may read)."""

    inst: Instance
    spec: LaunchSpec
    placement: Placement | None = None
    info: dict[str, Any] = field(default_factory=dict)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    fail_reason: str = ""
    restart_requested: bool = False
    retiring: bool = False
    stale: bool = False  # runs an older spec than the config's: replaced by the rolling update
    unkeyed: bool = False  # adopted without an API key (launched before keys): stale whatever the spec
    rekey: bool = False  # adopted with another API key: its engine is restarted (with ours) before use
    drained: bool = False
    streak: int = 0  # failures since it was last healthy for HEALTHY_RESET_S
    ready_since: float | None = None


def apply_info(inst: Instance, info: dict[str, Any]) -> None:
    """What the engine actor says about its engine, into the instance's registry entry."""
    inst.url = info["url"]
    inst.pid = info["pid"]
    inst.node = info.get("node_id", "")[:12] or info.get("host", "")
    inst.generation = int(info["generation"])
    inst.resources = info.get("resources", {})
    inst.started_at = info.get("started_at") or inst.started_at


class Supervisor:
    """Launches (or adopts), readies, watches and restarts one instance until cancelled."""

    def __init__(self, spec: LaunchSpec, capacity_hint: int, registry: Registry, ops: EngineOps,
                 health: HealthConfig, clock: Callable[[], float], *, keep_entry: bool = False) -> None:
        """Puts the instance in the registry at once (STARTING); ``run()`` does the rest. With
        ``keep_entry`` (adopting a running engine) a launched instance's entry already in the registry
        is kept as it is — its state, its requests in flight — if :meth:`adopt` finds the same engine
        generation in it."""
        iid = naming.instance_id(spec.fleet, spec.index)
        found = registry.get(iid) if keep_entry else None
        if found is not None and found.fleet == spec.fleet and not found.static:
            inst = found
            inst.capacity_hint = capacity_hint
            inst.launch_capacity = spec_capacity(spec.engine_args)
        else:
            inst = Instance(id=iid, fleet=spec.fleet, url="", capacity_hint=capacity_hint,
                            launch_capacity=spec_capacity(spec.engine_args))
        self.slot = Slot(inst=inst, spec=spec)
        self.registry = registry
        self.ops = ops
        self.health = health
        self.clock = clock
        self.task: asyncio.Task[None] | None = None  # set by the fleet manager, which owns the task
        registry.add(inst)

    # what the fleet manager asks ------------------------------------------------------------------
    def update_config(self, health: HealthConfig, capacity_hint: int) -> None:
        """Reload: health settings and the capacity hint are applied in place (no relaunch)."""
        self.health = health
        self.slot.inst.capacity_hint = capacity_hint

    def set_stale(self, stale: bool) -> None:
        self.slot.stale = stale or self.slot.unkeyed

    def adopt(self, placement: Placement, info: dict[str, Any], *, stale: bool, unkeyed: bool = False,
              rekey: bool = False) -> None:
        """An engine found running (launched by an earlier routerd): supervised from where it is.
        ``unkeyed``: it runs without an API key (replaced by the rolling update); ``rekey``: with
        another one (restarted before it is used: it would refuse routerd's requests)."""
        slot = self.slot
        slot.unkeyed = unkeyed
        slot.rekey = rekey
        slot.stale = stale or unkeyed
        slot.placement = placement
        self._renew(info)  # a kept entry of another generation is replaced by a fresh one

    def _claim_node(self, info: dict[str, Any]) -> None:
        """The node the actor reports is where its placement group is (the group holds the actor)."""
        placement = self.slot.placement
        node = str(info.get("node_id", ""))
        if placement is not None and node and not placement.node_id:
            placement.node_id = node
            self.ops.claim(self.slot.spec, node)

    def retire(self, reason: str) -> None:
        """Out of rotation for good: in-flight requests finish, the manager then disposes the engine."""
        self.slot.retiring = True
        self.registry.set_state(self.slot.inst, InstanceState.DRAINING, reason)

    def drain(self) -> None:
        """Admin: no new requests until restarted."""
        self.slot.drained = True
        self.registry.set_state(self.slot.inst, InstanceState.DRAINING, "drained by admin")

    def request_restart(self) -> None:
        """Admin: out of rotation now, restarted without backoff and with the full grace."""
        self.slot.restart_requested = True
        self.fail("restart requested")

    def remove(self) -> None:
        self.registry.remove(self.slot.inst.id)
        self.ops.release(self.slot.spec)

    def node_lost(self, node_id: str, why: str) -> None:
        """The node this instance's engine runs on is lost: out of rotation and its requests ended now
        (streams resume elsewhere); ``run()`` places it again on another node."""
        slot = self.slot
        inst = slot.inst
        if slot.placement is not None:
            slot.placement.actor_dead = True
        reason = f"node {node_id[:12]} lost: {why}"
        # One still starting fails its start step on its own (EngineOps gives up on a gone node).
        if inst.state in (InstanceState.READY, InstanceState.DRAINING):
            self.fail(reason)
        ended = inst.lose(f"instance {inst.id}: {reason}")
        _logger.warning("instance_node_lost", instance=inst.id, node=node_id[:12], why=why,
                        generation=inst.generation, requests_ended=ended)

    async def probe(self, deadline_s: float) -> ProbeAnswer:
        return await self.ops.probe(self.slot.placement, deadline_s)

    def fail(self, reason: str) -> None:
        """Out of rotation at once; ``run()`` restarts it."""
        slot = self.slot
        if not slot.fail_reason:
            slot.fail_reason = reason
        self.registry.set_state(slot.inst, InstanceState.UNHEALTHY, slot.fail_reason)
        slot.failed.set()

    def on_failed(self, inst: Instance, result: ProbeResult) -> None:
        """The heartbeats concluded ``inst`` failed."""
        slot = self.slot
        if slot.inst is not inst or inst.state not in (InstanceState.READY, InstanceState.DRAINING):
            return  # a past generation, or already failed (the death sentinel was first)
        if result is ProbeResult.ACTOR_DEAD and slot.placement is not None:
            slot.placement.actor_dead = True
        self.fail(f"heartbeat: {result.value}")
        # A hung engine keeps its sockets open until the restart kills it, after the backoff: end
        # what runs on it now (streams get the terminal error event, the rest are retried elsewhere).
        ended = inst.lose(f"instance {inst.id} failed its heartbeats ({result.value})")
        _logger.warning("instance_failed", instance=inst.id, result=result.value, generation=inst.generation,
                        requests_ended=ended)

    async def refresh_resources(self) -> None:
        """Resource use for status (CPU, RSS, GPU memory), at most every few seconds."""
        slot = self.slot
        if slot.placement is None or slot.inst.state not in (InstanceState.READY, InstanceState.DRAINING):
            return
        if self.clock() - slot.info.get("_refreshed", 0.0) < 5.0:
            return
        with contextlib.suppress(Exception):  # status detail only; health decides liveness
            info = await self.ops.actor_info(slot.placement.actor, timeout=2.0)
            info["_refreshed"] = self.clock()
            slot.info = info
            slot.inst.resources = info.get("resources", {})

    # the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        """One instance's life: launch or adopt, ready, watch, restart with backoff — until cancelled."""
        slot = self.slot
        failed_before = False
        while True:
            try:
                if failed_before:
                    await self._after_failure()
                await self._ensure_running()
                if await self._wait_ready():
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
                    await self._watch()
            except asyncio.CancelledError:
                raise
            except (NotController, FencedOut) as e:
                # The term of control ended under this step: nothing more is ours to do to the engine.
                _logger.warning("supervision_fenced", instance=slot.inst.id, reason=str(e))
                await asyncio.Event().wait()  # the fleet manager's shutdown cancels this task
            except Exception as e:  # a loop boundary: this instance's step failed; back off and retry
                _logger.exception("instance_step_failed", instance=slot.inst.id)
                slot.fail_reason = slot.fail_reason or f"error: {e!r}"[:200]
            failed_before = True

    def _starting(self, reason: str) -> None:
        self.registry.set_state(self.slot.inst, InstanceState.STARTING, reason)

    async def _ensure_running(self) -> None:
        """A placed actor with a started engine (launching, or restarting an adopted dead engine)."""
        slot = self.slot
        if slot.placement is None:
            placement, info = await self.ops.launch(slot.spec, slot.inst.generation, self._starting)
            slot.placement = placement
            self._renew(info)
        elif not slot.info.get("alive", False) or slot.rekey:
            slot.rekey = False  # any restart gives the engine the current key, the failure path's too
            await self._restart(grace_s=1.0)

    async def _restart(self, grace_s: float) -> None:
        slot = self.slot
        if slot.placement is None:
            return  # never placed: _ensure_running launches it
        info = await self.ops.restart(slot.placement, slot.spec, generation=slot.inst.generation,
                                      pid=slot.inst.pid, report=self._starting, grace_s=grace_s)
        self._renew(info)

    def _renew(self, info: dict[str, Any]) -> None:
        """A new engine generation gets a new registry Instance, so nothing of the old engine's —
        its scrape snapshot and token counters, its circuit-breaker failures, its in-flight count —
        is held against the fresh one. Requests still holding the old object finish against it. What
        ``/metrics`` exposes as the instance's counters (restarts, failed scrapes) goes on: a counter
        under the same labels never goes back."""
        slot = self.slot
        slot.info = info
        old = slot.inst
        self._claim_node(info)
        if old.generation and int(info["generation"]) != old.generation:
            inst = Instance(id=old.id, fleet=old.fleet, url=info["url"], capacity_hint=old.capacity_hint,
                            launch_capacity=old.launch_capacity,
                            restarts=old.restarts, scrape_errors_total=old.scrape_errors_total,
                            state=InstanceState.STARTING, state_reason=old.state_reason)
            self.registry.add(inst)
            slot.inst = inst
        apply_info(slot.inst, info)

    async def _wait_ready(self) -> bool:
        slot = self.slot
        assert slot.placement is not None
        why_not = await self.ops.wait_ready(slot.placement, slot.spec, slot.inst.url, slot.inst.generation,
                                            self.health)
        if why_not is not None:
            slot.fail_reason = why_not
        return why_not is None

    async def _watch(self) -> None:
        """Wait for a death (sentinel), a heartbeat failure or an admin restart."""
        slot = self.slot
        assert slot.placement is not None
        sentinel = asyncio.ensure_future(self.ops.death_sentinel(slot.placement, slot.inst.generation))
        failed = asyncio.ensure_future(slot.failed.wait())
        try:
            done, _ = await asyncio.wait({sentinel, failed}, return_when=asyncio.FIRST_COMPLETED)
            if sentinel in done:
                reason, actor_dead = sentinel.result()
                if actor_dead:
                    slot.placement.actor_dead = True
                self.fail(reason)
        finally:
            sentinel.cancel()
            failed.cancel()

    async def _after_failure(self) -> None:
        slot = self.slot
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
        # A lost node is not the engine's fault: no backoff, and no step towards "crash loop".
        if not requested and not self.ops.node_gone(slot.placement):
            slot.streak += 1
            h = self.health
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
        await self._restart(grace_s=10.0 if requested else 1.0)
