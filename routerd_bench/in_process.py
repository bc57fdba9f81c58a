"""routerd assembled inside the benchmark's (or a test's) own process, as the daemon assembles it.

The failover, node-loss and autoscale measurements need routerd's objects at hand — the registry to
wait on, the fleet manager to fault and inspect — so they cannot use a separate ``plane`` process.
One assembly serves them all: Ray connected, the fleet manager, the data plane built over it with the
autoscaler attached (the daemon's order: the data plane before the fleet manager starts), the HTTP
listener on a free port, optionally the admin routes and the queue consumer, their loops running; on
exit everything stops and the engines with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from routerd.config import Config
    from routerd.dataplane import DataPlane
    from routerd.fleet import FleetManager, RayCluster
    from routerd.registry import Registry


@dataclass
class Running:
    """A routerd assembled in this process."""

    fm: FleetManager
    dp: DataPlane
    registry: Registry
    cluster: RayCluster
    url: str


@contextlib.asynccontextmanager
async def running_routerd(cfg: Config, *, redis_url: str | None = None,
                          admin: bool = False) -> AsyncIterator[Running]:
    """routerd for ``cfg`` with its loops running; ``redis_url`` adds the queue consumer, ``admin`` the
    admin routes (without a key: loopback only)."""
    from routerd import config as config_mod
    from routerd.dataplane import build_dataplane
    from routerd.fleet import FleetManager, RayCluster
    from routerd.ingress.admin import add_admin_routes
    from routerd.ingress.listener import HttpListener
    from routerd.ingress.queue import QueueIngress
    from routerd.registry import Registry
    from routerd.upstream import make_session

    cluster = await RayCluster.connect(cfg.ray, config_mod.state_dir(cfg))
    registry = Registry()
    try:
        async with make_session(cfg.routing) as session:  # one per process, as the daemon's
            fm = FleetManager(cfg, registry, cluster, session)
            try:
                dp = build_dataplane(cfg, registry, session, desired_replicas=fm.desired,
                                     elastic=fm.autoscaler)
                fm.autoscaler.attach_admission(dp.admission.stats)
                dp.telemetry.attach_fleets(fm.collector())
                await fm.start()
                routes = (lambda app: add_admin_routes(app, fm, dp.static_health, "")) if admin else None
                async with contextlib.AsyncExitStack() as stack:
                    listener = await stack.enter_async_context(HttpListener(dp.http))
                    queue = None
                    if redis_url is not None:
                        queue = await stack.enter_async_context(QueueIngress.from_config(
                            cfg, url=redis_url, registry=registry, upstream=dp.upstream,
                            admission=dp.admission, tenancy=dp.tenancy))
                    url = await listener.start(routes, port=0)
                    tasks = [asyncio.create_task(fm.run()), asyncio.create_task(dp.run())]
                    if queue is not None:
                        tasks.append(asyncio.create_task(queue.run()))
                    try:
                        yield Running(fm, dp, registry, cluster, url)
                    finally:
                        if queue is not None:
                            queue.stop_intake()
                        for t in tasks:
                            t.cancel()
                        await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                await fm.shutdown(stop_engines=True)
    finally:
        await cluster.close()
