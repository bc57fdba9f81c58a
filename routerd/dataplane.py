"""The data plane of one routerd: everything on the request path, built for one Config.

``DataPlane`` owns the pooled client session, scraper, router (with its policy plugin and circuit
breaker), upstream, admission and the HTTP app. It does not care who put an instance in the registry:
static fleets are registered (and heartbeaten, routerd/static_health.py) here, launched ones by the
fleet manager; both are scraped and routed the same way. Lifecycle (the daemon's, or a test's)::

    async with DataPlane(cfg, registry) as dp:      # session, components, static instances
        url = await dp.start_http(extra_routes=...)  # bind the listener
        task = asyncio.create_task(dp.run())        # scraper, admission, static health (until cancelled)
        ...
        await dp.stop_intake(); await dp.wait_idle(t); await dp.close_streams("…")
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web

from . import log
from .admission import Admission
from .config import Config, FleetConfig
from .ingress.http import ExtraRoutes, HttpIngress
from .registry import Instance, Registry
from .router import Router
from .scraper import Scraper
from .static_health import STATIC, StaticHealth
from .telemetry import Telemetry
from .upstream import Upstream, make_session

_log = log.get("routerd.dataplane")


def static_instances(fleet: FleetConfig) -> list[Instance]:
    """A static fleet's registry entries, ``<fleet>:static<i>`` per URL, starting out of rotation."""
    return [Instance(id=f"{fleet.name}:static{i}", fleet=fleet.name, url=url.rstrip("/"),
                     capacity_hint=fleet.max_num_seqs)
            for i, url in enumerate(fleet.urls)]


class DataPlane:
    """Ingress → admission → router → upstream, plus the scraper that keeps load figures fresh."""

    def __init__(self, cfg: Config, registry: Registry, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.registry = registry
        self.rng = rng or random.Random()
        self.clock = clock
        self.telemetry = Telemetry()
        self.router = Router.from_config(registry, cfg.routing, rng=self.rng, clock=clock)
        self.admission = Admission(registry, cfg.admission, clock=clock)
        self.session: aiohttp.ClientSession | None = None
        self._upstream: Upstream | None = None
        self._scraper: Scraper | None = None
        self._static_health: StaticHealth | None = None
        self.http: HttpIngress | None = None
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._sites: list[web.BaseSite] = []
        self.url = ""
        self.telemetry.attach(registry, self.router.breaker.state, self.admission.stats, clock)

    # components that need the session exist only inside ``async with`` ---------------------------
    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            raise RuntimeError("DataPlane is not started (use `async with DataPlane(...)`)")
        return self._upstream

    @property
    def scraper(self) -> Scraper:
        if self._scraper is None:
            raise RuntimeError("DataPlane is not started (use `async with DataPlane(...)`)")
        return self._scraper

    @property
    def static_health(self) -> StaticHealth:
        if self._static_health is None:
            raise RuntimeError("DataPlane is not started (use `async with DataPlane(...)`)")
        return self._static_health

    async def __aenter__(self) -> DataPlane:
        self.session = make_session(self.cfg.routing)
        self._upstream = Upstream(self.session, self.router, self.cfg.routing, self.telemetry,
                                  rng=self.rng, clock=self.clock)
        self._scraper = Scraper(self.registry, self.session, self.cfg.routing, self.telemetry,
                                clock=self.clock, rng=self.rng)
        self._static_health = StaticHealth(self.cfg, self.registry, self.session, clock=self.clock,
                                           rng=self.rng)
        self.http = HttpIngress(self.cfg, self.registry, self.admission, self._upstream, self.telemetry,
                                self.router.breaker, clock=self.clock)
        self._sync_static(self.cfg)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
        finally:
            if self.session is not None:
                await self.session.close()
                self.session = None

    # HTTP ------------------------------------------------------------------------------------
    async def start_http(self, extra_routes: ExtraRoutes | None = None, *, host: str | None = None,
                         port: int | None = None) -> str:
        """Bind the HTTP listener (``port=0`` picks a free one); returns its base URL."""
        assert self.http is not None, "start_http() needs `async with DataPlane(...)` first"
        self.app = self.http.build_app(extra_routes)
        http_cfg = self.cfg.http
        # Connections are ClientConnection (bounded count, client timeouts): see ingress/_connections.py.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        self._runner = runner
        assert runner.server is not None
        self.http.connections.install(runner.server)
        site = self.http.connections.site(runner, host or http_cfg.host,
                                          http_cfg.port if port is None else port, backlog=1024)
        await site.start()
        self._sites.append(site)
        bound = runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        _log.info("http_listening", url=self.url)
        return self.url

    async def stop_intake(self) -> None:
        """Stop taking new requests: close the listener; requests on open connections get 503, and so
        do those still receiving their bodies (a slowloris does not hold the drain)."""
        if self.http is not None:
            self.http.draining = True
            self.http.connections.end_pending_bodies("routerd is shutting down")
        for site in self._sites:
            await site.stop()
        self._sites.clear()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) until no HTTP request is in progress; True when idle."""
        if self.http is None:
            return True
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self.http.idle.wait()
        except TimeoutError:
            return False
        return True

    async def close_streams(self, reason: str) -> None:
        """End what is still in flight: streams get a terminal error event saying ``reason``."""
        if self.http is None or not self.http.handlers:
            return
        self.http.close_reason = reason
        handlers = list(self.http.handlers)
        for task in handlers:
            task.cancel()
        await asyncio.wait(handlers, timeout=3.0)

    # the loops -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Scraping, admission dispatch and static-fleet health, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.scraper.run(), name="scraper")
            tg.create_task(self.admission.run(), name="admission")
            tg.create_task(self.static_health.run(), name="static_health")

    def _sync_static(self, cfg: Config) -> None:
        """Make the registry's static instances match ``cfg`` (start-up and reload)."""
        wanted: dict[str, Instance] = {}
        for fleet in cfg.fleets:
            self.registry.ensure_fleet(fleet.name)
            if fleet.engine == STATIC:
                wanted.update((i.id, i) for i in static_instances(fleet))
        for inst in list(self.registry):
            if ":static" not in inst.id:
                continue
            new = wanted.get(inst.id)
            if new is None or new.url != inst.url:
                self.registry.remove(inst.id)
            else:
                inst.capacity_hint = new.capacity_hint
                wanted.pop(inst.id)
        for inst in wanted.values():
            self.registry.add(inst)

    # reload ----------------------------------------------------------------------------------
    async def apply(self, cfg: Config) -> None:
        """Swap in a new config: policy, timeouts, admission bounds, keys, static fleets."""
        self.cfg = cfg
        self.router.update_config(cfg.routing)
        self.admission.update_config(cfg.admission)
        if self._upstream is not None:
            self._upstream.update_config(cfg.routing)
        if self._scraper is not None:
            self._scraper.update_config(cfg.routing)
        if self._static_health is not None:
            self._static_health.update_config(cfg)
        if self.http is not None:
            self.http.update_config(cfg)
        self._sync_static(cfg)
        for name in self.registry.fleets():
            if cfg.fleet(name) is None and not self.registry.instances(name):
                self.registry.drop_fleet(name)

    def status(self) -> dict[str, Any]:
        assert self.http is not None
        return self.http.fleets_status()
