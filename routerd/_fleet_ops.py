"""The fleet manager's Ray-facing steps: place, create, start, probe, watch, restart and dispose one engine.

Kept apart from routerd.fleet so that module reads as policy (what should run, when to restart) and this
one as mechanism (how a step talks to Ray and the engine). Every call here is bounded by a timeout; the
blocking Ray APIs go through RayCluster (a thread), actor calls are awaited ObjectRefs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import structlog

from ._aio import wait_for
from .config import HealthConfig
from .engine_actor import EngineActor, group_members
from .health import ActorProbe, ProbeFn
from .raycluster import RayCluster
from .registry import Instance, InstanceState, Registry

if TYPE_CHECKING:
    from .fleet import Slot

_logger = structlog.get_logger("routerd.fleet")

_PLACEMENT_LOG_EVERY_S = 30.0


@dataclass
class Placement:
    actor: Any
    pg: Any
    bundle: dict[str, float]
    actor_dead: bool = False


async def _resolve(ref: Any) -> Any:
    return await ref


def _is_actor_died(e: BaseException) -> bool:
    from ray.exceptions import ActorDiedError

    return isinstance(e, ActorDiedError)


class EngineOps:
    def __init__(self, cluster: RayCluster, state_dir: str, clock: Callable[[], float]) -> None:
        self.cluster = cluster
        self.state_dir = state_dir
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None

    def pg_name(self, fleet: str, index: int) -> str:
        return f"routerd:{self.cluster.namespace}:{fleet}:{index}"

    async def actor_info(self, actor: Any, timeout: float) -> dict[str, Any]:
        info: dict[str, Any] = await wait_for(_resolve(actor.info.remote()), timeout)
        return info

    @staticmethod
    def renew(slot: Slot, registry: Registry, info: dict[str, Any]) -> Instance:
        """A new engine generation gets a new registry Instance, so nothing of the old engine's —
        its scrape snapshot and token counters, its circuit-breaker failures, its in-flight count —
        is held against the fresh one. Requests still holding the old object finish against it."""
        old = slot.inst
        inst = old
        if old.generation and int(info["generation"]) != old.generation:
            inst = Instance(id=old.id, fleet=old.fleet, url=info["url"], capacity_hint=old.capacity_hint,
                            restarts=old.restarts, state=InstanceState.STARTING,
                            state_reason=old.state_reason)
            registry.add(inst)
            slot.inst = inst
        EngineOps.apply_info(inst, info)
        return inst

    @staticmethod
    def apply_info(inst: Instance, info: dict[str, Any]) -> None:
        inst.url = info["url"]
        inst.pid = info["pid"]
        inst.node = info.get("node_id", "")[:12] or info.get("host", "")
        inst.generation = int(info["generation"])
        inst.resources = info.get("resources", {})
        inst.started_at = info.get("started_at") or inst.started_at

    # placement -------------------------------------------------------------------------------
    async def find_pg(self, fleet: str, index: int) -> Any | None:
        name = self.pg_name(fleet, index)
        for pg_name, _, handle in await self.cluster.placement_groups():
            if pg_name == name:
                return handle
        return None

    async def remove_stray_pgs(self, keep: set[str]) -> None:
        """Placement groups of ours with no adopted actor (an earlier routerd died mid-launch)."""
        prefix = f"routerd:{self.cluster.namespace}:"
        for name, state, handle in await self.cluster.placement_groups():
            if name.startswith(prefix) and name not in keep:
                _logger.info("stray_placement_group_removed", placement_group=name, state=state)
                await self.cluster.remove_placement_group(handle)

    async def place(self, slot: Slot, registry: Registry, bundle: dict[str, float]) -> Any:
        """Create (or find) the instance's PG and wait until placed, saying in status what is missing."""
        inst = slot.inst
        pg = await self.cluster.placement_group(self.pg_name(slot.spec.fleet, slot.spec.index), bundle)
        ready = asyncio.ensure_future(_resolve(pg.ready()))
        last_log = -_PLACEMENT_LOG_EVERY_S
        try:
            while True:
                done, _ = await asyncio.wait({ready}, timeout=2.0)
                if done:
                    ready.result()
                    return pg
                total, avail = await self.cluster.resources()
                infeasible = {k: v for k, v in bundle.items() if total.get(k, 0.0) < v}
                missing = {k: round(v - avail.get(k, 0.0), 3) for k, v in bundle.items()
                           if avail.get(k, 0.0) < v}
                if infeasible:
                    reason = (f"unplaceable: needs {bundle} on one node; cluster total "
                              f"{ {k: total.get(k, 0.0) for k in bundle} }")
                else:
                    reason = f"waiting for resources: missing {missing or bundle}"
                registry.set_state(inst, InstanceState.STARTING, reason)
                if self.clock() - last_log >= _PLACEMENT_LOG_EVERY_S:
                    last_log = self.clock()
                    _logger.warning("placement_pending", instance=inst.id, bundle=bundle, missing=missing,
                                    infeasible=bool(infeasible))
        finally:
            ready.cancel()

    # launch ----------------------------------------------------------------------------------
    async def ensure_running(self, slot: Slot, registry: Registry) -> None:
        """A placed actor with a started engine (launching, or restarting an adopted dead engine)."""
        from .fleet import actor_name, bundle_for

        inst = slot.inst
        if slot.placement is None:
            bundle = bundle_for(slot.spec)
            registry.set_state(inst, InstanceState.STARTING, "placing")
            pg = await self.place(slot, registry, bundle)
            slot.placement = Placement(actor=None, pg=pg, bundle=bundle)
            await self._new_actor(slot, registry, actor_name(slot.spec.fleet, slot.spec.index))
        elif not slot.info.get("alive", False):
            await self.restart(slot, registry)

    async def _new_actor(self, slot: Slot, registry: Registry, name: str) -> None:
        assert slot.placement is not None
        inst = slot.inst
        if slot.placement.pg is None:  # adopted without a PG record: place a fresh one
            slot.placement.pg = await self.place(slot, registry, slot.placement.bundle)
        registry.set_state(inst, InstanceState.STARTING, "starting engine")
        spec_json = msgspec.json.encode(slot.spec)
        actor = await self.cluster.create_actor(EngineActor, name, slot.placement.bundle, slot.placement.pg,
                                                spec_json, inst.generation + 1, self.state_dir,
                                                "127.0.0.1" if self.cluster.is_local() else "")
        slot.placement.actor = actor
        slot.placement.actor_dead = False
        info: dict[str, Any] = await wait_for(_resolve(actor.start.remote()), 120.0)
        slot.info = info
        inst = self.renew(slot, registry, info)
        _logger.info("engine_started", instance=inst.id, pid=info["pid"], url=info["url"],
                     generation=info["generation"], log=info["log_path"])

    async def restart(self, slot: Slot, registry: Registry, grace_s: float = 1.0) -> None:
        """New engine for the same instance: in the same actor if it answers, else a new actor, same PG."""
        from .fleet import actor_name

        if slot.placement is None:
            return  # never placed: ensure_running launches it
        inst = slot.inst
        registry.set_state(inst, InstanceState.STARTING, "restarting")
        old_pid = inst.pid
        if not slot.placement.actor_dead and slot.placement.actor is not None:
            try:
                info: dict[str, Any] = await wait_for(
                    _resolve(slot.placement.actor.restart_engine.remote(grace_s)), 60.0)
                slot.info = info
                inst = self.renew(slot, registry, info)
                _logger.info("engine_restarted", instance=inst.id, pid=info["pid"], url=info["url"],
                             generation=info["generation"])
                return
            except Exception as e:  # noqa: BLE001  # any failure here means: replace the actor
                _logger.warning("actor_restart_failed", instance=inst.id, error=repr(e))
        if slot.placement.actor is not None:
            await self.cluster.kill(slot.placement.actor)
        if old_pid is not None and self.cluster.is_local():
            await asyncio.to_thread(reap_local_group, old_pid)
        await self._wait_name_free(actor_name(slot.spec.fleet, slot.spec.index))
        await self._new_actor(slot, registry, actor_name(slot.spec.fleet, slot.spec.index))

    async def _wait_name_free(self, name: str) -> None:
        deadline = self.clock() + 10.0
        while await self.cluster.get_actor(name) is not None and self.clock() < deadline:  # noqa: ASYNC110  # polling Ray's name table: no event to wait on
            await asyncio.sleep(0.1)

    async def wait_ready(self, slot: Slot, registry: Registry, health: HealthConfig) -> bool:
        """``/health`` 200, then one small warm-up generation; False if the engine dies or times out."""
        inst = slot.inst
        sentinel = asyncio.ensure_future(self.death_sentinel(slot))
        ready = asyncio.ensure_future(self._http_ready(inst, slot.spec.model, health))
        try:
            done, _ = await asyncio.wait({sentinel, ready}, timeout=health.startup_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if ready in done:
                return bool(ready.result())
            if sentinel in done:
                reason, actor_dead = sentinel.result()
                if actor_dead and slot.placement is not None:
                    slot.placement.actor_dead = True
                slot.fail_reason = f"died while starting: {reason}"
            else:
                slot.fail_reason = f"not ready after {health.startup_timeout_s}s"
            return False
        finally:
            sentinel.cancel()
            ready.cancel()

    async def _http_ready(self, inst: Instance, model: str, health: HealthConfig) -> bool:
        assert self.session is not None
        while True:  # bounded by the caller's startup timeout
            try:
                async with self.session.get(f"{inst.url}/health",
                                            timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                    if resp.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
        if not health.warmup:
            return True
        body = {"model": model, "prompt": "warm up", "max_tokens": 1, "temperature": 0}
        while True:  # bounded by the caller's startup timeout
            try:
                async with self.session.post(f"{inst.url}/v1/completions", json=body,
                                             timeout=aiohttp.ClientTimeout(total=60.0)) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return True
                    _logger.warning("warmup_failed", instance=inst.id, status=resp.status)
            except (aiohttp.ClientError, TimeoutError) as e:
                _logger.warning("warmup_failed", instance=inst.id, error=repr(e))
            await asyncio.sleep(1.0)

    async def death_sentinel(self, slot: Slot) -> tuple[str, bool]:
        """Resolves when the engine process exits ("process exited …", False) or the actor dies (…, True)."""
        assert slot.placement is not None
        actor = slot.placement.actor
        while True:
            try:
                rc = await _resolve(actor.wait_exit.remote(slot.inst.generation))
                return f"process exited (rc={rc})", False
            except Exception as e:  # noqa: BLE001  # Ray's error tree: classified just below
                if _is_actor_died(e):
                    return "actor died", True
                # ActorUnavailableError or a broken connection: dead only if it stays unreachable.
                try:
                    await wait_for(_resolve(actor.ping.remote()), 2.0)
                except Exception:  # noqa: BLE001  # unreachable twice in a row: treat as gone
                    return f"actor unreachable: {type(e).__name__}", True

    def probe_for(self, slots: dict[str, Slot]) -> ProbeFn:
        """The health monitor's probe: one ``EngineActor.probe`` call, bounded by the probe deadline."""

        async def probe(inst: Instance, deadline_s: float) -> tuple[ActorProbe | None, bool, bool]:
            from ray.exceptions import ActorUnavailableError, RayActorError

            slot = slots.get(inst.id)
            if slot is None or slot.placement is None or slot.placement.actor is None:
                return None, True, False
            try:
                res = await wait_for(_resolve(slot.placement.actor.probe.remote(deadline_s * 0.9)),
                                             deadline_s)
            except TimeoutError:
                return None, False, False
            except ActorUnavailableError:
                return None, False, True
            except RayActorError:
                return None, True, False
            return ActorProbe(process_alive=res["process_alive"], http_status=res["http_status"],
                              error=res.get("error", ""), returncode=res.get("returncode")), False, False

        return probe

    # stop ------------------------------------------------------------------------------------
    async def dispose(self, actor: Any, pg_name: str, *, stop: bool) -> dict[str, Any]:
        """Stop the engine (graceful, then forced), kill the actor, remove the placement group."""
        report: dict[str, Any] = {}
        pid = None
        if actor is not None and stop:
            try:
                info = await wait_for(_resolve(actor.info.remote()), 5.0)
                pid = info.get("pid")
                report = await wait_for(_resolve(actor.stop.remote(10.0)), 30.0)
            except Exception as e:  # noqa: BLE001  # a dead/hung actor: the kill below and the reap do it
                report = {"stop_error": repr(e)}
        if actor is not None:
            await self.cluster.kill(actor)
        if pid is not None and self.cluster.is_local():
            report["reaped"] = await asyncio.to_thread(reap_local_group, pid)
        for name, _, handle in await self.cluster.placement_groups():
            if name == pg_name:
                await self.cluster.remove_placement_group(handle)
        return report


def reap_local_group(pgid: int, wait_s: float = 3.0) -> list[int]:
    """After-the-fact check on this node: kill anything still in the dead engine's process group.

    PDEATHSIG covers the engine itself; this covers grandchildren (vLLM's EngineCore/workers) that a
    killed actor could leave behind. Returns the pids that had to be killed. Callers use it only on a
    local cluster: an engine's pid on another node may be an unrelated process group here.
    """
    deadline = time.monotonic() + wait_s
    members = group_members(pgid)
    while members and time.monotonic() < deadline:  # give PDEATHSIG and vLLM's own clean-up a moment
        time.sleep(0.1)
        members = group_members(pgid)
    for pid in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if members:
        _logger.warning("orphans_killed", pgid=pgid, pids=members)
    return members
