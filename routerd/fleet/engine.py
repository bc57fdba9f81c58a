"""One launched engine's Ray-facing steps: place, start, restart, probe, watch and dispose.

An engine is one detached ``EngineActor`` (routerd/fleet/actor.py) inside its own placement group; a
``Placement`` is the handle to both. ``EngineOps`` does each step on a handle and returns what it learnt
(the actor's info, a failure reason): it knows nothing of the fleet manager's slots or the registry, and
says how a long step is going through the ``report`` callback its caller passes. Every call is bounded
by a timeout; the blocking Ray APIs go through RayCluster (a thread), actor calls are awaited ObjectRefs.

Nodes: a new placement group avoids what the ``Spreader`` says (lost nodes; other replicas' nodes for a
spread fleet, routerd/fleet/spread.py) and its node is claimed there once placed. An engine whose node
is gone (routerd/fleet/nodes.py) is not restarted in its old group — the group is removed and a new one
placed — and no step keeps waiting on a node for more than a second after it is known lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from .. import log
from .._aio import wait_for
from ..config import HealthConfig
from ..plugins import LaunchSpec
from . import naming
from .actor import EngineActor, FencedOut, api_key_id, group_members
from .health import ActorProbe
from .nodes import NodeWatch
from .ray_cluster import RayCluster
from .spread import Spreader

_logger = log.get("routerd.fleet")

_PLACEMENT_LOG_EVERY_S = 30.0

Report = Callable[[str], None]
"""How a step says what it is waiting for (the caller shows it as the instance's STARTING reason)."""

ProbeAnswer = tuple[ActorProbe | None, bool, bool]
"""(the actor's probe, actor dead, actor unavailable), as the health monitor's probe returns it."""


@dataclass
class Placement:
    """The handle to one engine: its actor, its placement group and the bundle it holds."""

    actor: Any
    pg: Any
    bundle: dict[str, float]
    actor_dead: bool = False
    node_id: str = ""  # the node its placement group is on ("" until placed or known)


class NodeGone(RuntimeError):
    """The node an engine was being started on was lost; the step is given up (and placed anew)."""


async def _resolve(ref: Any) -> Any:
    return await ref


def _is_actor_died(e: BaseException) -> bool:
    from ray.exceptions import ActorDiedError

    return isinstance(e, ActorDiedError)


def _instance(spec: LaunchSpec) -> str:
    return naming.instance_id(spec.fleet, spec.index)


class EngineOps:
    """The steps on engine handles, over the Ray connection and the process's one client session."""

    def __init__(self, cluster: RayCluster, state_dir: str, clock: Callable[[], float],
                 session: aiohttp.ClientSession, *, spreader: Spreader | None = None,
                 nodes: NodeWatch | None = None, token: Callable[[], int] = lambda: 0,
                 raise_token: Callable[[int], Awaitable[bool]] | None = None,
                 api_key: str = "") -> None:
        """``token()``: this process's control token, sent with every mutating actor call (the actor
        refuses one older than it has seen: routerd/fleet/actor.py); ``raise_token(t)`` makes it higher
        than ``t``, one an adopted engine holds (``ControlLease.raise_above``). ``api_key``: what every
        engine started here requires on its /v1 routes (routerd/trust.py derives it; "" none)."""
        self.cluster = cluster
        self.token = token
        self.raise_token = raise_token
        self.api_key = api_key
        self.api_key_id = api_key_id(api_key)
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.state_dir = state_dir
        self.clock = clock
        self.session = session  # the process's one client session, for /health and warm-up
        self.nodes = nodes
        self.spreader = spreader if spreader is not None else Spreader(cluster, nodes, lambda _: "any")

    def claim(self, spec: LaunchSpec, node_id: str) -> None:
        """The instance's placement group is on ``node_id`` (adopted, or found after a restart)."""
        self.spreader.claim(spec.fleet, spec.index, node_id)

    def release(self, spec: LaunchSpec) -> None:
        """The instance's placement group is gone (the instance was disposed)."""
        self.spreader.release(spec.fleet, spec.index)

    def node_gone(self, placement: Placement | None) -> bool:
        """The engine's node is lost (or dead to Ray): its placement group must be replaced."""
        return (placement is not None and self.nodes is not None and bool(placement.node_id)
                and self.nodes.gone(placement.node_id))

    def pg_name(self, fleet: str, index: int) -> str:
        return naming.pg_name(self.cluster.namespace, fleet, index)

    async def actor_info(self, actor: Any, timeout: float) -> dict[str, Any]:
        info: dict[str, Any] = await wait_for(_resolve(actor.info.remote()), timeout)
        return info

    # placement -------------------------------------------------------------------------------
    async def find_pg(self, fleet: str, index: int) -> Any | None:
        name = self.pg_name(fleet, index)
        for pg_name, _, handle in await self.cluster.placement_groups():
            if pg_name == name:
                return handle
        return None

    async def remove_stray_pgs(self, keep: set[str]) -> None:
        """Placement groups of ours with no adopted actor (an earlier routerd died mid-launch)."""
        prefix = naming.pg_prefix(self.cluster.namespace)
        for name, state, handle in await self.cluster.placement_groups():
            if name.startswith(prefix) and name not in keep:
                _logger.info("stray_placement_group_removed", placement_group=name, state=state)
                await self.cluster.remove_placement_group(handle)

    async def place(self, spec: LaunchSpec, bundle: dict[str, float], report: Report) -> tuple[Any, str]:
        """Create (or find) the instance's PG where the spreader allows and wait until placed,
        reporting what is missing; the group and its node. Called under ``spreader.placing``."""
        name = self.pg_name(spec.fleet, spec.index)
        where = await self.spreader.where(spec.fleet, spec.index, bundle)
        pg = await self.cluster.placement_group(name, bundle, where.avoid)
        last_log = -_PLACEMENT_LOG_EVERY_S
        while True:
            ready = asyncio.ensure_future(self.cluster.placement_group_ready(pg))
            try:
                done, _ = await asyncio.wait({ready}, timeout=2.0)
            finally:
                ready.cancel()
            if done:
                ready.result()
                return pg, await self.cluster.placement_group_node(pg)
            now = await self.spreader.where(spec.fleet, spec.index, bundle)
            if now != where:  # a node was lost or a replica went away: wait under the new constraint
                _logger.info("placement_constraint_changed", instance=_instance(spec),
                             avoid=sorted(n[:12] for n in now.avoid), why=now.why)
                await self.cluster.remove_placement_group(pg)
                where = now
                pg = await self.cluster.placement_group(name, bundle, where.avoid)
                continue
            total, avail = await self.cluster.resources()
            infeasible = {k: v for k, v in bundle.items() if total.get(k, 0.0) < v}
            missing = {k: round(v - avail.get(k, 0.0), 3) for k, v in bundle.items()
                       if avail.get(k, 0.0) < v}
            if infeasible:
                reason = (f"unplaceable: needs {bundle} on one node; cluster total "
                          f"{ {k: total.get(k, 0.0) for k in bundle} }")
            else:
                reason = f"waiting for resources: missing {missing or bundle}"
            if where.why:
                reason += f"; {where.why}"
            report(reason)
            if self.clock() - last_log >= _PLACEMENT_LOG_EVERY_S:
                last_log = self.clock()
                _logger.warning("placement_pending", instance=_instance(spec), bundle=bundle,
                                missing=missing, infeasible=bool(infeasible), constraint=where.why)

    async def _place_claimed(self, placement: Placement, spec: LaunchSpec, report: Report) -> None:
        """A new group for ``placement`` (one at a time per spread fleet), its node claimed."""
        async with self.spreader.placing(spec.fleet):
            placement.pg, placement.node_id = await self.place(spec, placement.bundle, report)
            self.spreader.claim(spec.fleet, spec.index, placement.node_id)

    # launch ----------------------------------------------------------------------------------
    async def launch(self, spec: LaunchSpec, generation: int,
                     report: Report) -> tuple[Placement, dict[str, Any]]:
        """Place a new instance and start its engine: the handle and the actor's info."""
        report("placing")
        placement = Placement(actor=None, pg=None, bundle=naming.bundle_for(spec))
        await self._place_claimed(placement, spec, report)
        return placement, await self._new_actor(placement, spec, generation, report)

    async def _new_actor(self, placement: Placement, spec: LaunchSpec, generation: int,
                         report: Report) -> dict[str, Any]:
        """A new actor in the handle's placement group, its engine started as ``generation + 1``."""
        if placement.pg is not None and self.node_gone(placement):
            _logger.warning("placement_group_replaced", instance=_instance(spec), node=placement.node_id[:12],
                            why="its node is lost")
            await self.cluster.remove_placement_group(placement.pg)
            self.spreader.release(spec.fleet, spec.index)
            placement.pg, placement.node_id = None, ""
        if placement.pg is None:  # adopted without a PG record, or its node lost: place a fresh one
            await self._place_claimed(placement, spec, report)
        report("starting engine")
        actor = await self.cluster.create_actor(EngineActor, naming.actor_name(spec.fleet, spec.index),
                                                placement.bundle, placement.pg, msgspec.json.encode(spec),
                                                generation + 1, self.state_dir,
                                                "127.0.0.1" if self.cluster.is_local() else "", self.token())
        placement.actor = actor
        placement.actor_dead = False
        started = _resolve(actor.start.remote(self.token(), self.api_key))
        info: dict[str, Any] = await self._unless_node_gone(placement, started, 120.0)
        _logger.info("engine_started", instance=_instance(spec), pid=info["pid"], url=info["url"],
                     generation=info["generation"], log=info["log_path"])
        return info

    async def _unless_node_gone(self, placement: Placement, aw: Any, timeout: float) -> Any:
        """Await ``aw`` (bounded by ``timeout``), giving up with :class:`NodeGone` as soon as the
        placement's node is lost: a call to an actor on a vanished node would wait out the timeout."""
        task = asyncio.ensure_future(aw)
        deadline = self.clock() + timeout
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(1.0, max(0.0, deadline - self.clock())))
                if done:
                    return task.result()
                if self.node_gone(placement):
                    raise NodeGone(f"node {placement.node_id[:12]} lost")
                if self.clock() >= deadline:
                    raise TimeoutError(f"no answer in {timeout}s")
        finally:
            task.cancel()

    async def restart(self, placement: Placement, spec: LaunchSpec, *, generation: int, pid: int | None,
                      report: Report, grace_s: float = 1.0) -> dict[str, Any]:
        """New engine for the same instance: in the same actor if it answers, else a new actor in the
        same PG — or, when its node is lost, a new actor in a new PG elsewhere."""
        self.cluster.fence()
        report("restarting")
        if self.node_gone(placement):
            placement.actor_dead = True
        if not placement.actor_dead and placement.actor is not None:
            try:
                info: dict[str, Any] = await wait_for(
                    _resolve(placement.actor.restart_engine.remote(grace_s, self.token(), generation,
                                                                   self.api_key)), 60.0)
                _logger.info("engine_restarted", instance=_instance(spec), pid=info["pid"], url=info["url"],
                             generation=info["generation"], token=info.get("token"))
                return info
            except FencedOut:
                raise  # a newer controller owns this engine: nothing of ours may replace it
            except Exception as e:  # noqa: BLE001  # any failure here means: replace the actor
                _logger.warning("actor_restart_failed", instance=_instance(spec), error=repr(e))
        if placement.actor is not None:
            await self.cluster.kill(placement.actor)
        if pid is not None and self.cluster.is_local():
            await asyncio.to_thread(reap_local_group, pid)
        await self._wait_name_free(naming.actor_name(spec.fleet, spec.index))
        return await self._new_actor(placement, spec, generation, report)

    async def _wait_name_free(self, name: str) -> None:
        deadline = self.clock() + 10.0
        while (holder := await self.cluster.get_actor(name)) is not None and self.clock() < deadline:
            # An actor an interrupted start left behind (its handle never reached us) holds the name.
            await self.cluster.kill(holder)
            await asyncio.sleep(0.1)

    async def wait_ready(self, placement: Placement, spec: LaunchSpec, url: str, generation: int,
                         health: HealthConfig) -> str | None:
        """``/health`` 200, then one small warm-up generation: None when ready, else why it is not
        (the engine died, or timed out)."""
        sentinel = asyncio.ensure_future(self.death_sentinel(placement, generation))
        ready = asyncio.ensure_future(self._http_ready(_instance(spec), url, spec.model, health))
        try:
            done, _ = await asyncio.wait({sentinel, ready}, timeout=health.startup_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if ready in done:
                ready.result()
                return None
            if sentinel in done:
                reason, actor_dead = sentinel.result()
                if actor_dead:
                    placement.actor_dead = True
                return f"died while starting: {reason}"
            return f"not ready after {health.startup_timeout_s}s"
        finally:
            sentinel.cancel()
            ready.cancel()

    async def _http_ready(self, instance: str, url: str, model: str, health: HealthConfig) -> None:
        while True:  # bounded by the caller's startup timeout
            try:
                async with self.session.get(f"{url}/health",
                                            timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                    if resp.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
        if not health.warmup:
            return
        body = {"model": model, "prompt": "warm up", "max_tokens": 1, "temperature": 0}
        while True:  # bounded by the caller's startup timeout
            try:
                async with self.session.post(f"{url}/v1/completions", json=body, headers=self._auth,
                                             timeout=aiohttp.ClientTimeout(total=60.0)) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return
                    _logger.warning("warmup_failed", instance=instance, status=resp.status)
            except (aiohttp.ClientError, TimeoutError) as e:
                _logger.warning("warmup_failed", instance=instance, error=repr(e))
            await asyncio.sleep(1.0)

    async def death_sentinel(self, placement: Placement, generation: int) -> tuple[str, bool]:
        """Resolves when the engine process exits ("process exited …", False) or the actor dies (…, True)."""
        actor = placement.actor
        while True:
            try:
                rc = await _resolve(actor.wait_exit.remote(generation))
                return f"process exited (rc={rc})", False
            except Exception as e:  # noqa: BLE001  # Ray's error tree: classified just below
                if _is_actor_died(e):
                    return "actor died", True
                # ActorUnavailableError or a broken connection: dead only if it stays unreachable.
                try:
                    await wait_for(_resolve(actor.ping.remote()), 2.0)
                except Exception:  # noqa: BLE001  # unreachable twice in a row: treat as gone
                    return f"actor unreachable: {type(e).__name__}", True

    async def probe(self, placement: Placement | None, deadline_s: float) -> ProbeAnswer:
        """One ``EngineActor.probe`` call, bounded by the probe deadline (the health monitor's probe)."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        if placement is None or placement.actor is None:
            return None, True, False
        try:
            res = await wait_for(_resolve(placement.actor.probe.remote(deadline_s * 0.9)), deadline_s)
        except TimeoutError:
            return None, False, False
        except ActorUnavailableError:
            return None, False, True
        except RayActorError:
            return None, True, False
        return ActorProbe(process_alive=res["process_alive"], http_status=res["http_status"],
                          error=res.get("error", ""), returncode=res.get("returncode")), False, False

    # stop ------------------------------------------------------------------------------------
    async def dispose(self, actor: Any, pg_name: str, *, stop: bool) -> dict[str, Any]:
        """Stop the engine (graceful, then forced), kill the actor, remove the placement group."""
        self.cluster.fence()
        report: dict[str, Any] = {}
        pid = None
        if actor is not None and stop:
            try:
                info = await wait_for(_resolve(actor.info.remote()), 5.0)
                pid = info.get("pid")
                report = await wait_for(_resolve(actor.stop.remote(10.0, self.token())), 30.0)
            except FencedOut:
                raise
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
