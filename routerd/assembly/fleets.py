"""The fleet-control bundle: Ray, the fleet manager (with its autoscaler) and the term of control the
lease gives it. Only with a launched fleet, and never in a worker.

The lease itself is every process's (:class:`~routerd.peers.lease.ControlLease`, in the core: a worker
reads who holds it); this bundle is what acts while this process holds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import config as config_mod
from ..config import Config
from .core import Core, Loops

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..fleet import FleetManager, RayCluster
    from ..peers.replicas import ReplicaStore


class FleetControl:
    """Ray connected and the fleet manager over it; the manager's loop runs while this process controls."""

    def __init__(self, cluster: RayCluster, fleets: FleetManager) -> None:
        self.cluster = cluster
        self.fleets = fleets

    @classmethod
    async def connect(cls, core: Core, stack: contextlib.AsyncExitStack, *,
                      replica_store: ReplicaStore | None, ray_connected: Callable[[], None]) -> FleetControl:
        """Ray connected (closed by ``stack``; ``ray_connected()`` told at once) and the fleet manager
        built; nothing adopted or launched yet (:meth:`start`)."""
        from ..fleet import FleetManager, RayCluster

        cfg = core.cfg
        cluster = await RayCluster.connect(cfg.ray, config_mod.state_dir(cfg), fence=core.control.check)
        stack.push_async_callback(cluster.close)
        ray_connected()
        trust = core.trust
        fleets = FleetManager(cfg, core.registry, cluster, core.session, replica_store=replica_store,
                              clock=core.clock, control=core.control,
                              engine_api_key=trust.engine_api_key if trust is not None else "")
        return cls(cluster, fleets)

    async def start(self, core: Core, stack: contextlib.AsyncExitStack) -> None:
        """Fleets adopted or launched now if this process controls (else when it takes the lease). If a
        later step of the start-up fails, supervision ends; after a normal stop this finds nothing to do."""
        stack.push_async_callback(self.fleets.shutdown, False)
        if core.control.controls:
            await self.fleets.start()

    def loops(self) -> Loops:
        return {"fleets": self.fleets.run_controlled()}

    async def apply(self, cfg: Config) -> None:
        await self.fleets.apply(cfg)

    def collectors(self) -> list[Collector]:
        return [self.fleets.collector()]
