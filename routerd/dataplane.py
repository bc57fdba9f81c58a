"""The data plane of one routerd: everything on the request path, as one plain bundle.

:func:`build_dataplane` builds it from a Config, the registry and the process's one client session
(scrapes and health checks); the daemon, the benchmarks and the test fixtures all build it with that
one function. It opens nothing and starts nothing: the daemon opens the session before, binds the
listener (:class:`~routerd.ingress.listener.HttpListener`) after, runs :meth:`DataPlane.loops` in its
TaskGroup (the upstream's loop closes its engine connections when cancelled) and closes the session at
the end; :func:`running_dataplane` does the same for a data plane on its own (benchmarks, tests). It
does not care who put an instance in the registry: static fleets are registered (and heartbeaten,
routerd/fleet/static.py) here, launched ones by the fleet manager; both are scraped and routed the
same way::

    async with running_dataplane(cfg, registry) as plane, HttpListener(plane.http) as listener:
        url = await listener.start(port=0)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from .admission import Admission
from .config import Config, FleetConfig
from .elastic import Elastic
from .fleet.static import StaticHealth
from .ingress.http import HttpIngress
from .registry import Registry
from .routing import Router, Scraper
from .telemetry import Telemetry
from .tenants.service import Tenancy
from .tracing import Tracing
from .upstream import Upstream, make_session


@dataclass(frozen=True, eq=False)
class DataPlane:
    """Ingress → admission → router → upstream, plus the scraper that keeps load figures fresh."""

    session: aiohttp.ClientSession
    registry: Registry
    telemetry: Telemetry
    router: Router
    admission: Admission
    upstream: Upstream
    scraper: Scraper
    static_health: StaticHealth
    http: HttpIngress
    tenancy: Tenancy

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The long-running loops, by task name, for the owner's TaskGroup (each runs until cancelled)."""
        return {"scraper": self.scraper.run(), "admission": self.admission.run(),
                "tenancy": self.tenancy.run(),
                "static_health": self.static_health.run(), "upstream": self.upstream.run()}

    async def run(self) -> None:
        """Every loop of :meth:`loops` in one TaskGroup, until cancelled (benchmarks, tests)."""
        async with asyncio.TaskGroup() as tg:
            for name, coro in self.loops().items():
                tg.create_task(coro, name=name)

    def apply(self, cfg: Config) -> None:
        """Swap in a new config: policy, timeouts, admission bounds, keys, static fleets."""
        self.router.update_config(cfg.routing)
        self.admission.update_config(cfg.admission)
        self.tenancy.update_config(cfg)
        self.admission.set_tenants(self.tenancy.shares(), configured=self.tenancy.directory.configured)
        self.upstream.update_config(cfg.routing)
        self.scraper.update_config(cfg.routing)
        self.static_health.update_config(cfg)
        self.http.update_config(cfg)
        self.static_health.sync(cfg)
        for name in self.registry.fleets():
            if cfg.fleet(name) is None and not self.registry.instances(name):
                self.registry.drop_fleet(name)

    def status(self) -> dict[str, Any]:
        return self.http.fleets_status()

def build_dataplane(cfg: Config, registry: Registry, session: aiohttp.ClientSession, *,
                    desired_replicas: Callable[[FleetConfig], int] | None = None,
                    elastic: Elastic | None = None, redis_url: str = "",
                    rng: random.Random | None = None,
                    clock: Callable[[], float] = time.monotonic,
                    tracing: Tracing | None = None) -> DataPlane:
    """The data plane for ``cfg`` over ``session``, with the static fleets' instances registered.

    ``desired_replicas`` is the fleet manager's run-time replica count (admin scaling overrides the
    file until the next reload changes it), shown by ``/admin/fleets``; None when nothing is launched.
    ``elastic`` is the fleet manager's autoscaler: admission wakes fleets scaled to zero through it.
    ``redis_url``: where tenants' rate limits and usage are shared ("": in this process only).
    ``tracing``: its owner's (:class:`~routerd.tracing.Tracing`, closed by that owner); None: off.
    """
    rng = rng or random.Random()
    telemetry = Telemetry()
    router = Router.from_config(registry, cfg.routing, rng=rng, clock=clock)
    admission = Admission(registry, cfg.admission, clock=clock, elastic=elastic)
    tenancy = Tenancy(cfg, redis_url, clock=clock, rng=rng)
    admission.set_tenants(tenancy.shares(), configured=tenancy.directory.configured)
    telemetry.attach(registry, admission.stats, clock)
    telemetry.prom.register(tenancy.collector(admission.tenant_stats))
    tracing = tracing or Tracing.off()
    if tracing.on:
        telemetry.prom.register(tracing.collector())
    upstream = Upstream(router, cfg.routing, telemetry, rng=rng, clock=clock, tracing=tracing)
    scraper = Scraper(registry, session, cfg.routing, telemetry, clock=clock, rng=rng)
    static_health = StaticHealth(cfg, registry, session, clock=clock, rng=rng)
    http = HttpIngress(cfg, registry, admission, upstream, telemetry, clock=clock,
                       desired_replicas=desired_replicas, elastic=elastic, tenancy=tenancy)
    static_health.sync(cfg)
    return DataPlane(session=session, registry=registry, telemetry=telemetry, router=router,
                     admission=admission, upstream=upstream, scraper=scraper, static_health=static_health,
                     tenancy=tenancy,
                     http=http)


@contextlib.asynccontextmanager
async def running_dataplane(cfg: Config, registry: Registry, *,
                            desired_replicas: Callable[[FleetConfig], int] | None = None,
                            rng: random.Random | None = None, redis_url: str = "",
                            clock: Callable[[], float] = time.monotonic,
                            tracing: Tracing | None = None) -> AsyncIterator[DataPlane]:
    """A data plane on its own (benchmarks, tests): its session opened, its loops running; on the way
    out the loops end and the session closes. The daemon composes the same steps with the rest.
    Without ``tracing`` it traces as ``cfg.tracing`` and the ``OTEL_*`` variables say, and closes that."""
    owned = tracing is None
    tracing = Tracing.from_config(cfg.tracing) if tracing is None else tracing
    try:
        async with make_session(cfg.routing) as session:
            plane = build_dataplane(cfg, registry, session, desired_replicas=desired_replicas, rng=rng,
                                    clock=clock, redis_url=redis_url, tracing=tracing)
            task = asyncio.create_task(plane.run(), name="dataplane")
            try:
                yield plane
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    finally:
        if owned:
            await tracing.aclose()
