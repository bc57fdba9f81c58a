"""The one builder: a Config in, every component of one routerd out — built once, in dependency order,
each handed what it needs through its constructor.

The daemon (routerd/daemon.py: signals, drain, reload, sd_notify), the benchmarks and the test
fixtures all get their routerd here; parts are switched off by the config, never by a second builder:
no Redis queue without ``[redis] enabled``, no Ray, fleet manager or autoscaler without a launched
fleet. Two steps:

* :func:`build` — the components over an open client session (and the fleet manager, when there is
  one): nothing is opened, started or bound. A test that drives the parts by hand starts here.
* :func:`assemble` — the whole start-up, each step's undo on one ``AsyncExitStack``, so a start-up
  that fails half-way undoes what it did (README, "Start-up order"): Redis (embedded or reachable) →
  the one ``aiohttp.ClientSession`` → Ray and the fleet manager → :func:`build` → fleets adopted or
  launched → the HTTP listener bound. The long-running loops are the caller's to run
  (:meth:`Routerd.loops`, in the caller's TaskGroup); :func:`running` runs them too (benchmarks, tests)::

    async with running(cfg, Registry()) as routerd:
        ... routerd.url ...

Reload (SIGHUP) gives a new config to :meth:`Routerd.apply`, which hands each component its part
through that component's own ``update_config``, once, in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from . import config as config_mod
from . import log
from .config import Config
from .dataplane.admission import Admission
from .dataplane.dispatch import Dispatch
from .dataplane.upstream import Upstream, make_session
from .file_sd import FileSdWriter
from .fleet.static import StaticHealth
from .ingress.http import HttpIngress
from .ingress.listener import HttpListener
from .registry import Registry
from .routing import RequestViews, Router, Scraper
from .telemetry import Metrics, Telemetry, queue_collector, registry_collector
from .tenants.service import Tenancy
from .tracing import Tracing

_log = log.get("routerd.assembly")

if TYPE_CHECKING:  # imported where used: the queue pulls in its Redis scripts, the fleets Ray
    from aiohttp import web

    from .fleet import FleetManager, RayCluster
    from .ingress.queue import QueueIngress
    from .routing.engine_events import EngineEvents
    from .routing.keying_process import KeyingProcess


@dataclass(frozen=True, eq=False)
class Routerd:
    """Every component of one routerd, built by :func:`build`. ``queue`` is None without Redis,
    ``fleets`` and ``cluster`` without a launched fleet."""

    registry: Registry
    session: aiohttp.ClientSession
    tracing: Tracing  # off unless [tracing] or OTEL_* name a collector
    redis_url: str  # "" with [redis] disabled
    telemetry: Telemetry
    router: Router
    tenancy: Tenancy
    admission: Admission
    upstream: Upstream
    dispatch: Dispatch
    scraper: Scraper
    static_health: StaticHealth
    queue: QueueIngress | None
    metrics: Metrics
    http: HttpIngress
    listener: HttpListener
    file_sd: FileSdWriter
    cluster: RayCluster | None
    fleets: FleetManager | None
    # the engines' own KV-cache views, with fleets whose engines publish KV events (else None); long
    # prompts keyed in a process of their own
    engine_events: EngineEvents | None
    keying: KeyingProcess | None

    @property
    def url(self) -> str:
        """The HTTP listener's base URL once bound."""
        return self.listener.url

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The long-running loops, by task name, for the owner's TaskGroup (each runs until cancelled;
        the upstream's closes its engine connections then, the tenancy's its Redis client)."""
        loops = {"scraper": self.scraper.run(), "admission": self.admission.run(),
                 "tenancy": self.tenancy.run(), "static_health": self.static_health.run(),
                 "upstream": self.upstream.run(), "file_sd": self.file_sd.run()}
        if self.queue is not None:
            loops["queue"] = self.queue.run()
        if self.fleets is not None:
            loops["fleets"] = self.fleets.run()
        if self.engine_events is not None:
            loops["kv_events"] = self.engine_events.run()
        return loops

    async def apply(self, cfg: Config) -> None:
        """A reloaded config (its bound-at-start-up keys already kept by the caller): each component
        gets its part, once — tenants before admission, which takes their shares."""
        self.router.update_config(cfg.routing)
        self.tenancy.update_config(cfg)
        self.admission.update_config(cfg.admission, self.tenancy.shares())
        self.upstream.update_config(cfg.routing)
        self.scraper.update_config(cfg.routing)
        self.static_health.update_config(cfg)
        self.http.update_config(cfg)
        self.static_health.sync(cfg)
        for name in self.registry.fleets():
            if cfg.fleet(name) is None and not self.registry.instances(name):
                self.registry.drop_fleet(name)
        if self.queue is not None:
            self.queue.update_config(cfg)
        if self.fleets is not None:
            await self.fleets.apply(cfg)

    def status(self) -> dict[str, Any]:
        return self.http.fleets_status()


def launches(cfg: Config) -> bool:
    """Whether any fleet is launched by routerd (and so needs Ray), rather than static URLs."""
    return any(f.engine != "static" for f in cfg.fleets)


def build(cfg: Config, registry: Registry, session: aiohttp.ClientSession, *, tracing: Tracing,
          redis_url: str = "",
          fleets: FleetManager | None = None, cluster: RayCluster | None = None,
          rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> Routerd:
    """Every component for ``cfg`` over ``session``, in dependency order, with the static fleets'
    instances registered; nothing started. ``redis_url`` ("": none) shares tenants' limits and usage
    and feeds the queue consumer; ``fleets`` is the fleet manager of the launched fleets (its autoscaler
    wakes fleets at zero for admission; its replica counts show in ``/admin/fleets``)."""
    from .routing.engine_events import EngineEventsCollector, fleet_keyers, static_sources

    rng = rng if rng is not None else random.Random()
    telemetry = Telemetry()
    # Fleets whose engines publish KV events and whose tokens routerd can compute: routing scores their
    # instances by the engines' own cache views (routerd/routing/engine_events.py).
    keyers = fleet_keyers(cfg.fleets)
    engine_events = keying = None
    if keyers:
        from .routing.engine_events import EngineEvents
        from .routing.keying_process import KeyingProcess

        _log.info("kv_events_routing", fleets=sorted(keyers))
        engine_events = EngineEvents(registry, session, fleets=list(keyers),
                                     sources=static_sources(cfg.fleets))
        keying = KeyingProcess({fleet: k.spec for fleet, (k, _, _) in keyers.items()})
    views = RequestViews(cfg.routing, keyers=keyers, keying=keying,
                         learned_block_size=engine_events.fleet_block_size if engine_events else None)
    router = Router.from_config(registry, cfg.routing, rng=rng, clock=clock, views=views,
                                engine_cache=engine_events)
    tenancy = Tenancy(cfg, redis_url, clock=clock, rng=rng)
    elastic = fleets.autoscaler if fleets is not None else None
    admission = Admission(registry, cfg.admission, clock=clock, elastic=elastic, shares=tenancy.shares())
    upstream = Upstream(router, cfg.routing, telemetry, tracing=tracing, rng=rng, clock=clock)
    dispatch = Dispatch(views=router.views, admission=admission, engine=upstream, tenancy=tenancy,
                        telemetry=telemetry, tracing=tracing, clock=clock)
    scraper = Scraper(registry, session, cfg.routing, telemetry, clock=clock, rng=rng)
    static_health = StaticHealth(cfg, registry, session, clock=clock, rng=rng)
    queue = None
    if redis_url:
        from .ingress.queue import QueueIngress

        queue = QueueIngress.from_config(cfg, url=redis_url, dispatch=dispatch, admission=admission,
                                         tenancy=tenancy, tracing=tracing)
    collectors = [registry_collector(registry, admission.stats, clock),
                  tenancy.collector(admission.tenant_stats)]
    if queue is not None:
        collectors.append(queue_collector(queue))
    if fleets is not None:
        collectors.append(fleets.collector())
    if engine_events is not None:
        collectors.append(EngineEventsCollector(engine_events))
    if tracing.on:
        collectors.append(tracing.collector())
    metrics = Metrics(telemetry, collectors)
    http = HttpIngress(cfg, registry, dispatch=dispatch, admission=admission, router=router,
                       tenancy=tenancy, telemetry=telemetry, metrics=metrics, tracing=tracing, clock=clock,
                       desired_replicas=fleets.desired if fleets is not None else None, elastic=elastic)
    sd_path = (Path(cfg.daemon.file_sd_path) if cfg.daemon.file_sd_path
               else config_mod.state_dir(cfg) / "file_sd" / "engines.json")
    static_health.sync(cfg)
    return Routerd(registry=registry, session=session, tracing=tracing, redis_url=redis_url,
                   telemetry=telemetry,
                   router=router, tenancy=tenancy, admission=admission, upstream=upstream,
                   dispatch=dispatch, scraper=scraper, static_health=static_health, queue=queue,
                   metrics=metrics, http=http, listener=HttpListener(http),
                   file_sd=FileSdWriter(registry, sd_path), cluster=cluster, fleets=fleets,
                   engine_events=engine_events, keying=keying)


@contextlib.asynccontextmanager
async def assemble(cfg: Config, registry: Registry, *, sockets: Sequence[socket.socket] = (),
                   port: int | None = None, status: Callable[[str], None] = lambda step: None,
                   ray_connected: Callable[[], None] = lambda: None,
                   built: Callable[[Routerd], None] = lambda routerd: None, tracing: Tracing | None = None,
                   rng: random.Random | None = None,
                   clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Routerd]:
    """routerd for ``cfg`` started, in the start-up order of the module's docstring; on the way out
    (or when a step fails) everything done is undone, in reverse: the listener closed, the fleets'
    supervision ended (the engines keep running), Ray, the session and an embedded Redis closed.

    ``sockets``: systemd's (socket activation) to serve on, else ``http.host``/``port`` (``port``
    overrides the config's: 0 picks a free one); ``status(step)`` is told each step (sd_notify);
    ``ray_connected()`` runs right after Ray connected (the daemon takes its signals back then);
    ``built(routerd)`` as soon as every component exists, before the fleets and the listener start (so
    that a start-up failing after that can be looked at);
    ``tracing``: a caller's own exporter (tests), else the one ``cfg.tracing`` and ``OTEL_*`` ask for,
    started and closed here."""
    async with contextlib.AsyncExitStack() as stack:
        state = config_mod.state_dir(cfg)
        state.mkdir(parents=True, exist_ok=True)
        status("redis")
        redis_url = await _redis(cfg, stack, state)
        tracing = await _tracing(cfg, stack) if tracing is None else tracing
        session = make_session(cfg.routing)  # the one client session of the process
        stack.push_async_callback(session.close)
        cluster: RayCluster | None = None
        fleets: FleetManager | None = None
        if launches(cfg):
            from .fleet import FleetManager, RayCluster

            status("ray")
            cluster = await RayCluster.connect(cfg.ray, state)
            stack.push_async_callback(cluster.close)
            ray_connected()
            fleets = FleetManager(cfg, registry, cluster, session, clock=clock)
        routerd = build(cfg, registry, session, tracing=tracing, redis_url=redis_url, fleets=fleets,
                        cluster=cluster, rng=rng, clock=clock)
        if routerd.keying is not None:
            stack.callback(routerd.keying.close)
            routerd.keying.start()  # seconds to spawn: begun now, not by the first long request
        built(routerd)
        if routerd.queue is not None:
            await stack.enter_async_context(routerd.queue)
        if fleets is not None:
            # If a later step fails (say the HTTP port is taken), stop supervising; after a normal
            # drain this second shutdown finds nothing left to do.
            stack.push_async_callback(fleets.shutdown, False)
            await fleets.start()
        status("http")
        await stack.enter_async_context(routerd.listener)
        await routerd.listener.start(_admin_routes(routerd), port=port, sockets=sockets)
        yield routerd


@contextlib.asynccontextmanager
async def running(cfg: Config, registry: Registry, *, port: int | None = 0,
                  sockets: Sequence[socket.socket] = (), stop_engines: bool = True, consume: bool = True,
                  tracing: Tracing | None = None, rng: random.Random | None = None,
                  clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Routerd]:
    """:func:`assemble` with its loops running (benchmarks, tests): on the way out the queue stops
    reading, the loops end, the engines stop (``stop_engines``), then the rest is undone. Without
    ``consume`` the queue consumer is built but not run: the caller runs ``routerd.queue.run()``."""
    async with assemble(cfg, registry, sockets=sockets, port=port, tracing=tracing, rng=rng,
                        clock=clock) as routerd:
        loops = routerd.loops()
        if not consume and "queue" in loops:
            loops.pop("queue").close()  # never started
        tasks = [asyncio.create_task(coro, name=name) for name, coro in loops.items()]
        try:
            yield routerd
        finally:
            if routerd.queue is not None:
                routerd.queue.stop_intake()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if routerd.fleets is not None:
                await routerd.fleets.shutdown(stop_engines=stop_engines)


async def _tracing(cfg: Config, stack: contextlib.AsyncExitStack) -> Tracing:
    """``[tracing]`` (or ``OTEL_*``): the spans' exporter, closed last (what is queued gets
    ``tracing.shutdown_timeout_s`` to leave); a vLLM fleet whose engine cannot trace is named."""
    tracing = Tracing.from_config(cfg.tracing)
    stack.push_async_callback(tracing.aclose)
    if tracing.on:
        t = cfg.tracing
        _log.info("tracing_on", endpoint=tracing.endpoint, service_name=t.service_name,
                  sample_ratio=t.sample_ratio, max_queue_spans=t.max_queue_spans)
        await _check_engine_tracing(cfg)
    return tracing


async def _check_engine_tracing(cfg: Config) -> None:
    """Say at start-up which fleets' engines will not join routerd's traces: a launcher that can tell
    (vLLM's: ``tracing_missing``) is asked what its engine lacks."""
    from . import plugins

    for fleet in cfg.fleets:
        if fleet.engine == "static":
            continue
        try:
            launcher = plugins.load(plugins.LAUNCHER_GROUP, fleet.engine)
        except plugins.PluginNotFound:
            continue  # the fleet manager reports it
        check = getattr(launcher, "tracing_missing", None)
        missing = await check(dict(fleet.engine_args)) if check is not None else ""
        if missing:
            _log.warning("engine_tracing_unavailable", fleet=fleet.name, engine=fleet.engine,
                         missing=missing, effect="its engines are launched without "
                         "--otlp-traces-endpoint: traces end at routerd's attempt span")


async def _redis(cfg: Config, stack: contextlib.AsyncExitStack, state: Path) -> str:
    """Redis reachable, or embedded and started (stopped by ``stack``); "" with [redis] disabled."""
    if not cfg.redis.enabled:
        return ""
    url = cfg.redis.url
    if url == "embedded":
        from .redis_server import EmbeddedRedis

        url = await stack.enter_async_context(EmbeddedRedis(state / "redis"))
    return url


def _admin_routes(routerd: Routerd) -> Callable[[web.Application], None]:
    """The admin write routes — static-only too: a static instance is drained without Ray; what only
    launched engines have answers 400 without a fleet manager. The key is read per request, so a
    reload applies."""
    from .ingress.admin import add_admin_routes

    http = routerd.http
    return lambda app: add_admin_routes(app, routerd.fleets, routerd.static_health,
                                        lambda: http.cfg.http.admin_api_key)
