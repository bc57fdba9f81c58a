"""routerd assembled inside the benchmark's (or a test's) own process, by the one builder.

The failover, node-loss and autoscale measurements need routerd's objects at hand — the registry to
wait on, the fleet manager to fault and inspect — so they cannot use a separate ``plane`` process.
:func:`routerd.assembly.running` builds and starts it as the daemon does (Ray connected, the fleet
manager, the data plane over it, the HTTP listener on a free port with the admin routes, the queue
consumer with Redis), its loops running; on exit everything stops and the engines with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from routerd.assembly import Routerd
    from routerd.config import Config
    from routerd.fleet import FleetManager, RayCluster
    from routerd.registry import Registry


@dataclass
class Running:
    """A routerd assembled in this process."""

    fm: FleetManager
    dp: Routerd
    registry: Registry
    cluster: RayCluster
    url: str


@contextlib.asynccontextmanager
async def running_routerd(cfg: Config, *, redis_url: str | None = None) -> AsyncIterator[Running]:
    """routerd for ``cfg`` (launched fleets) with its loops running; ``redis_url`` adds the queue
    consumer. The admin routes are on, without a key: loopback only."""
    from routerd.assembly import running
    from routerd.registry import Registry

    redis = msgspec.structs.replace(cfg.redis, enabled=redis_url is not None, url=redis_url or cfg.redis.url)
    async with running(msgspec.structs.replace(cfg, redis=redis), Registry()) as routerd:
        fleets, cluster = routerd.fleets, routerd.cluster
        assert fleets is not None, "the in-process routerd launches fleets"
        assert cluster is not None
        yield Running(fleets, routerd, routerd.registry, cluster, routerd.url)
