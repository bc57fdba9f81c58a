"""What the fleet manager does with an engine it finds running at start-up (its actor named like one of
routerd's): adopt it as it runs, or stop it.

Adopting is why a routerd restart reloads no weights: the engine a previous routerd launched serves on,
under a new supervisor. It is adopted even when its recorded launch spec differs from the config's —
marked stale, it keeps serving until the rolling update replaces it — and stopped when it cannot answer,
when its record is unreadable (another routerd version's), or when its fleet no longer wants it.

Its API key (routerd/trust.py) is compared by id: an engine launched before engines had keys serves on
(it ignores the key routerd sends) but is marked stale, so the rolling update replaces it with a keyed
one; an engine started with another key (the shared secret was rotated, or another secret's routerd
launched it) would refuse every request, so it is restarted at once, in place, with the current key.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .. import log
from ..plugins import LaunchSpec
from .engine import EngineOps, Placement
from .naming import bundle_for
from .ray_cluster import RayCluster
from .supervisor import Supervisor

_logger = log.get("routerd.fleet")


async def adopt(name: str, fleet: str, index: int, cluster: RayCluster, ops: EngineOps, *,
                desired: LaunchSpec | None,
                supervisor: Callable[[LaunchSpec], Supervisor]) -> Supervisor | None:
    """The supervisor of actor ``name`` (instance ``index`` of ``fleet``), adopted with its placement, or
    None when it is gone or was stopped. ``desired`` is what the config wants at that index (None: not
    wanted); ``supervisor`` makes the new supervisor for the spec the engine runs."""
    actor = await cluster.get_actor(name)
    if actor is None:
        return None
    pg_name = ops.pg_name(fleet, index)
    try:
        info = await ops.actor_info(actor, timeout=5.0)
    except Exception as e:  # noqa: BLE001  # an actor that cannot answer is replaced, not adopted
        _logger.warning("adopt_unresponsive", actor=name, error=repr(e))
        await ops.dispose(actor, pg_name, stop=False)
        return None
    try:
        recorded = msgspec.json.decode(info["spec"].encode(), type=LaunchSpec)
    except (KeyError, AttributeError, msgspec.DecodeError) as e:  # another routerd version's record
        _logger.warning("adopt_unreadable_record", actor=name, error=repr(e))
        await ops.dispose(actor, pg_name, stop=True)
        return None
    if desired is None:  # its fleet is gone, or it is beyond the replica count
        _logger.info("adopt_unwanted_stopping", actor=name, recorded=msgspec.to_builtins(recorded))
        await ops.dispose(actor, pg_name, stop=True)
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
