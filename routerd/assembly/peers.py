"""The peers bundle: what several routerd processes on one Redis share (routerd/peers/).

Shared measures (load, scrapes, sessions), the fleet state (published while this process controls,
followed otherwise), the admin relay (admin calls made on a follower, carried out by the controller),
the wake relay (a request for a fleet at zero, on any process, wakes it) and the run-time replica
counts. Only with Redis: without it there are no peers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import Config
from ..elastic import Elastic
from .core import Core, Loops, Role, launches

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..fleet.static import StaticHealth
    from ..ingress.adapter_admin import AdapterAdmin
    from ..peers import SharedMeasures
    from ..peers.admin_relay import AdminRelay
    from ..peers.fleet_state import FleetStateSync
    from ..peers.replicas import ReplicaStore
    from ..peers.wake import RelayedElastic
    from .fleets import FleetControl


def shared_measures(core: Core) -> SharedMeasures | None:
    """Load, scrapes and sessions shared with the other processes on the same Redis (None without):
    built first, as the scraper and the router read them. This process scrapes for all while it controls."""
    if core.redis is None:
        return None
    from ..peers import SharedMeasures

    return SharedMeasures(core.cfg, core.registry, core.redis.ops(), seals=core.sealed,
                          is_scraper=core.controls, serves=core.role.serves, clock=core.clock)


def replica_store(core: Core) -> ReplicaStore | None:
    """The replica counts set at run time (``/admin/.../replicas``, the autoscaler), kept in Redis so a
    next controller starts from them; None without Redis."""
    if core.redis is None:
        return None
    from ..peers.replicas import ReplicaStore
    from ..redis_keys import RedisKeys

    return ReplicaStore(core.redis.ops(), RedisKeys.from_config(core.cfg.redis), seals=core.sealed,
                        op_timeout_s=core.cfg.redis.op_timeout_s)


class Peers:
    """The fleet state and the relays over the peers' Redis client, with the shared measures."""

    def __init__(self, core: Core, measures: SharedMeasures | None, fleet: FleetControl | None,
                 static_health: StaticHealth, *, adapters: AdapterAdmin | None = None) -> None:
        assert core.redis is not None, "peers share a Redis"
        from ..peers.admin_relay import READ_BLOCK_MS, AdminRelay
        from ..peers.fleet_state import FleetStateSync, config_fingerprint
        from ..redis_keys import RedisKeys

        cfg, self.core, self.measures = core.cfg, core, measures
        self.fleets = fleets = fleet.fleets if fleet is not None else None
        self.static_health = static_health
        self.adapters = adapters  # LoRA adapters' admin calls, carried out here while controlling
        self.wake_relay: RelayedElastic | None = None  # with a data plane: see :meth:`elastic`
        keys = RedisKeys.from_config(cfg.redis)
        # One client for both: the relay's reads block up to READ_BLOCK_MS (with the default [redis]
        # block_ms, the queue consumer's pool).
        client = core.redis.blocking(max(cfg.redis.block_ms, READ_BLOCK_MS))
        controls = core.controlling()
        control = core.control

        def replicas() -> dict[str, int]:
            return {name: n for name, n, _, _ in fleets.replica_figures()} if fleets is not None else {}

        def orphans() -> list[dict[str, Any]]:
            return fleets.orphan_list() if fleets is not None else []

        # A worker's parent is the daemon whose consumer name its own extends (workers.worker_consumer).
        ident = core.ident
        self.fleet_state: FleetStateSync = FleetStateSync(
            core.registry, client, keys, ident=ident, fingerprint=config_fingerprint(cfg),
            controls=controls, seals=core.sealed, token=lambda: control.token, replicas=replicas,
            op_timeout_s=cfg.redis.op_timeout_s, clock=core.clock,
            parent=ident.rpartition("-w")[0] if core.role is Role.WORKER else None, orphans=orphans)
        if fleets is not None:  # a term of control that begins here starts from the last state seen
            fleets.published = self.fleet_state.published_replicas
        self.admin_relay: AdminRelay = AdminRelay(client, keys, ident=ident, controls=controls,
                                                  seals=core.sealed, op_timeout_s=cfg.redis.op_timeout_s)

    def elastic(self, local: Elastic | None) -> Elastic | None:
        """What admission asks of fleets at zero: with launched fleets, the wake relay in front of the
        autoscaler (``local``, on the controller), so a request on any process wakes the fleet."""
        if not launches(self.core.cfg):
            return local
        from ..peers.wake import RelayedElastic

        relay = self.admin_relay
        self.wake_relay = RelayedElastic(self.core.cfg, self.core.registry, local, relay=relay.ask_wake,
                                         controls=relay.controls)
        return self.wake_relay

    def loops(self) -> Loops:
        from ..ingress.admin import AdminActions

        # carried out here while controlling
        actions = AdminActions(self.fleets, self.static_health, self.adapters)
        loops: Loops = {"fleet_view": self.fleet_state.run(),
                        "admin_relay": self.admin_relay.run(actions.execute)}
        if self.wake_relay is not None:
            loops["wake_relay"] = self.admin_relay.send_wakes()
        if self.measures is not None:
            loops["view"] = self.measures.run()
        return loops

    async def apply(self, cfg: Config) -> None:
        if self.measures is not None:
            self.measures.update_config(cfg)
        self.fleet_state.update_config(cfg)
        if self.wake_relay is not None:
            self.wake_relay.update_config(cfg)

    def collectors(self) -> list[Collector]:
        out: list[Collector] = [self.measures.collector()] if self.measures is not None else []
        return [*out, self.fleet_state.collector()]
