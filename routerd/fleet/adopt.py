"""What the fleet manager does with an engine it finds running at start-up (its actor named like one of
routerd's): adopt it as it runs, or stop it.

Adopting is why a routerd restart reloads no weights: the engine a previous routerd launched serves on,
under a new supervisor. It is adopted even when its recorded launch spec differs from the config's —
marked stale, it keeps serving until the rolling update replaces it — and stopped when it cannot answer,
when its record is unreadable (another routerd version's), or when it is beyond its fleet's count.

Its API key (routerd/trust.py) is compared by id: an engine launched before engines had keys serves on
(it ignores the key routerd sends) but is marked stale, so the rolling update replaces it with a keyed
one; an engine started with another key (the shared secret was rotated, or another secret's routerd
launched it) would refuse every request, so it is restarted at once, in place, with the current key.

An engine of a fleet the config does not have at all is not this controller's to judge (a replica with
another ``[[fleets]]`` launched it): the fleet manager leaves it running as an :class:`Orphan` until an
operator removes it (``DELETE /admin/orphans/{instance}``) or a controller with that fleet adopts it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from .. import log
from ..plugins import LaunchSpec
from .engine import EngineOps, Placement
from .naming import bundle_for, instance_id
from .ray_cluster import RayCluster
from .supervisor import Supervisor

_logger = log.get("routerd.fleet")


@dataclass(frozen=True)
class Orphan:
    """A running engine of a fleet the controller's config lacks: left alone, reported, not routed to."""

    id: str
    fleet: str
    index: int
    actor: Any
    url: str
    pid: int | None
    node: str
    since: float  # wall clock: when this controller found it

    @classmethod
    def of(cls, iid: str, fleet: str, index: int, actor: Any, info: dict[str, Any]) -> Orphan:
        pid = info.get("pid")
        return cls(id=iid, fleet=fleet, index=index, actor=actor, url=str(info.get("url") or ""),
                   pid=int(pid) if pid is not None else None,
                   node=str(info.get("node_id", ""))[:12] or str(info.get("host", "")), since=time.time())

    def status(self) -> dict[str, Any]:
        return {"id": self.id, "fleet": self.fleet, "url": self.url, "pid": self.pid, "node": self.node,
                "since": self.since, "state": "orphaned",
                "reason": "its fleet is not in the controller's config: running, unmanaged, not routed to"}


async def adopt(name: str, fleet: str, index: int, cluster: RayCluster, ops: EngineOps, *,
                desired: LaunchSpec | None,
                supervisor: Callable[[LaunchSpec], Supervisor],
                stop: Callable[[Any, bool, str], Awaitable[Any]]) -> Supervisor | None:
    """The supervisor of actor ``name`` (instance ``index`` of ``fleet``), adopted with its placement, or
    None when it is gone or was stopped. ``desired`` is what the config wants at that index (None: not
    wanted); ``supervisor`` makes the new supervisor for the spec the engine runs; ``stop(actor,
    graceful, why)`` is the fleet manager's one way to stop an engine (it leaves every view with it)."""
    actor = await cluster.get_actor(name)
    if actor is None:
        return None
    try:
        info = await ops.actor_info(actor, timeout=5.0)
    except Exception as e:  # noqa: BLE001  # an actor that cannot answer is replaced, not adopted
        _logger.warning("adopt_unresponsive", actor=name, error=repr(e))
        await stop(actor, False, "unresponsive when adopted")
        return None
    held = int(info.get("token") or 0)
    if held > ops.token() and ops.raise_token is not None:
        # A token from a term Redis lost in a failover (routerd/peers/lease.py): this term goes above it
        # before it sends the engine anything, else the engine would refuse every command of it.
        await ops.raise_token(held)
    try:
        recorded = msgspec.json.decode(info["spec"].encode(), type=LaunchSpec)
    except (KeyError, AttributeError, msgspec.DecodeError) as e:  # another routerd version's record
        _logger.warning("adopt_unreadable_record", actor=name, error=repr(e))
        await stop(actor, True, "unreadable launch record")
        return None
    if desired is None:  # beyond its fleet's replica count (a fleet the config lacks is orphaned instead)
        _logger.info("adopt_unwanted_stopping", actor=name, recorded=msgspec.to_builtins(recorded))
        await stop(actor, True, "not wanted by the controller's config")
        return None
    # A changed spec is adopted as it runs and marked stale: it keeps serving until the rolling
    # replacement (FleetManager._roll) swaps it, one instance at a time, for one with the new spec.
    sup = supervisor(recorded)
    pg = await ops.find_pg(fleet, index)
    key_id = str(info.get("api_key_id", ""))
    unkeyed = bool(ops.api_key_id) and not key_id
    sup.adopt(Placement(actor=actor, pg=pg, bundle=bundle_for(recorded)), info, stale=desired != recorded,
              unkeyed=unkeyed, rekey=bool(key_id) and key_id != ops.api_key_id)
    _logger.info("adopted", instance=sup.slot.inst.id, pid=info["pid"], url=info["url"],
                 alive=info["alive"], stale=sup.slot.stale)
    if unkeyed:
        _logger.warning("engine_without_api_key", instance=sup.slot.inst.id, url=info["url"],
                        effect="launched before engines had API keys: anyone who reaches its port is "
                               "served; it is replaced by the rolling update")
    elif sup.slot.rekey:
        _logger.warning("engine_api_key_changed", instance=sup.slot.inst.id, running=key_id,
                        expected=ops.api_key_id, effect="it would refuse routerd's requests (the shared "
                        "secret changed): restarted now with the current key")
    return sup


async def find_orphan(name: str, fleet: str, index: int, cluster: RayCluster,
                      ops: EngineOps) -> Orphan | None:
    """Actor ``name`` runs an engine of ``fleet``, which the config does not have: not this controller's
    to destroy (a replica with another ``[[fleets]]`` launched it). Left running and reported; None when
    the actor is gone."""
    actor = await cluster.get_actor(name)
    if actor is None:
        return None
    try:
        info = await ops.actor_info(actor, timeout=5.0)
    except Exception as e:  # noqa: BLE001  # reported as it is: the operator decides what to do with it
        info = {"error": repr(e)[:200]}
    orphan = Orphan.of(instance_id(fleet, index), fleet, index, actor, info)
    _logger.warning("engine_orphaned", instance=orphan.id, actor=name, pid=orphan.pid, url=orphan.url,
                    why="its fleet is not in this controller's config; it keeps running, unmanaged",
                    remove_with=f"DELETE /admin/orphans/{orphan.id}")
    return orphan
