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
  the one ``aiohttp.ClientSession`` → Ray and the fleet manager → the control lease (with Redis: one
  process at a time controls the fleets, routerd/peers/lease.py) → :func:`build` → fleets adopted or
  launched (by the controller; a follower's fleet control starts when it takes the lease) → the HTTP
  listener bound. The long-running loops are the caller's to run
  (:meth:`Routerd.loops`, in the caller's TaskGroup); :func:`running` runs them too (benchmarks, tests)::

    async with running(cfg, Registry()) as routerd:
        ... routerd.url ...

Reload (SIGHUP) gives a new config to :meth:`Routerd.apply`, which hands each component its part
through that component's own ``update_config``, once, in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
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
from ._aio import cancel_and_wait
from .config import Config, FleetConfig
from .dataplane.admission import Admission
from .dataplane.dispatch import Dispatch
from .dataplane.engine_http import EnginePool
from .dataplane.upstream import Upstream, make_session
from .elastic import Elastic
from .file_sd import FileSdWriter
from .fleet.adapters import AdapterPlacer  # LoRA
from .fleet.static import StaticHealth
from .ingress.adapter_admin import AdapterAdmin  # LoRA
from .ingress.http import HttpIngress
from .ingress.listener import HttpListener
from .peers.adapters import AdapterStore  # LoRA
from .peers.lease import ControlLease
from .peers.sealed import Seals
from .registry import Registry
from .routing import RequestViews, Router, Scraper
from .routing.adapters import AdapterCatalog, AdaptersCollector, AdapterSlots  # LoRA
from .telemetry import Metrics, Telemetry, queue_collector, registry_collector
from .tenants.service import Tenancy
from .tracing import Tracing
from .trust import Trust

_log = log.get("routerd.assembly")

if TYPE_CHECKING:  # imported where used: the queue pulls in its Redis scripts, the fleets Ray
    import redis.asyncio as aioredis
    from aiohttp import web
    from prometheus_client.registry import Collector

    from .fleet import FleetManager, RayCluster
    from .ingress.queue import QueueIngress
    from .peers import SharedMeasures
    from .peers.admin_relay import AdminRelay
    from .peers.fleet_state import FleetStateSync
    from .peers.wake import RelayedElastic
    from .routing.engine_cache.keying_process import KeyingProcess
    from .routing.engine_cache.subscriptions import EngineEvents


class Role(enum.Enum):
    """What one process of a routerd does (``[daemon] workers``, routerd/workers.py)."""

    ONE = "one"  # workers = 1: everything, in this one process (routerd as it always was)
    PARENT = "parent"  # workers > 1, the daemon: Redis, Ray and the fleets; it serves neither way in
    WORKER = "worker"  # workers > 1, one of them: HTTP and the queue; no Ray, no fleet manager


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
    watch_pool: EnginePool  # the scraper's and static heartbeats' keep-alive connections
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
    # the lease that lets one process at a time control the fleets (sole without Redis)
    control: ControlLease
    # with Redis: the fleet state published while this process controls, followed otherwise; admin
    # calls made on a follower, carried out by the controller (routerd/peers/)
    fleet_view: FleetStateSync | None = None
    admin_relay: AdminRelay | None = None
    # whether this process controls the fleets now (the control lease's, unless a test says); None: always
    controls: Callable[[], bool] | None = None
    role: Role = Role.ONE
    # load, scrapes and sessions shared with the other routerd processes on the same Redis (None
    # without Redis)
    view: SharedMeasures | None = None
    # with Redis and launched fleets: admission's view of fleets at zero, whose wakes go to the controller
    wake_relay: RelayedElastic | None = None
    # LoRA adapters (routerd/routing/adapters.py), with a fleet that serves them: who holds which, the
    # run-time ones kept in Redis, the admin routes' side
    lora: LoraBundle | None = None

    @property
    def url(self) -> str:
        """The HTTP listener's base URL once bound."""
        return self.listener.url

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The long-running loops, by task name, for the owner's TaskGroup (each runs until cancelled;
        the upstream's closes its engine connections then, the tenancy's its Redis client)."""
        # A follower does not probe static engines: their rotation is the controller's, followed.
        static_health = self.static_health.run() if self.controls is None \
            else while_controlling(self.controls, self.static_health.run)
        loops = {"scraper": self.scraper.run(), "admission": self.admission.run(),
                 "tenancy": self.tenancy.run(), "static_health": static_health,
                 "upstream": self.upstream.run(), "watch_pool": self.watch_pool.run()}
        if self.role is not Role.WORKER:  # one file for Prometheus, written by the daemon
            loops["file_sd"] = self.file_sd.run()
        if self.queue is not None:
            loops["queue"] = self.queue.run()
        if self.fleets is not None:
            loops["fleets"] = self.fleets.run_controlled()
        if self.engine_events is not None:
            loops["kv_events"] = self.engine_events.run()
        if self.fleet_view is not None:
            loops["fleet_view"] = self.fleet_view.run()
        if self.admin_relay is not None:
            from .ingress.admin import AdminActions

            loops["admin_relay"] = self.admin_relay.run(AdminActions(
                self.fleets, self.static_health, self.lora.admin if self.lora is not None else None).execute)
            if self.wake_relay is not None:
                loops["wake_relay"] = self.admin_relay.send_wakes()
        if self.view is not None:
            loops["view"] = self.view.run()
        if self.lora is not None:  # LoRA
            loops["adapters"] = self.lora.slots.run()
            loops["adapter_store"] = self.lora.store.run()
            loops["adapter_placement"] = self.lora.placer.run()
        return loops

    async def apply(self, cfg: Config) -> None:
        """A reloaded config (its bound-at-start-up keys already kept by the caller): each component
        gets its part, once — tenants before admission, which takes their shares."""
        self.router.update_config(cfg.routing)
        self.tenancy.update_config(cfg)
        self.admission.update_config(cfg.admission, self.tenancy.shares())
        self.upstream.update_config(cfg.routing)
        self.upstream.update_fleets(cfg.fleets)
        self.scraper.update_config(cfg.routing)
        if self.view is not None:
            self.view.update_config(cfg)
        self.static_health.update_config(cfg)
        self.watch_pool.configure(connect_timeout_s=cfg.routing.connect_timeout_s,
                                  read_timeout_s=cfg.routing.scrape_timeout_s)
        self.http.update_config(cfg)
        self.listener.reload_tls()
        self.static_health.sync(cfg)
        for name in self.registry.fleets():
            if cfg.fleet(name) is None and not self.registry.instances(name):
                self.registry.drop_fleet(name)
        if self.queue is not None:
            self.queue.update_config(cfg)
        if self.fleet_view is not None:
            self.fleet_view.update_config(cfg)
        if self.wake_relay is not None:
            self.wake_relay.update_config(cfg)
        self.control.update_config(cfg.control)
        if self.lora is not None:  # LoRA
            self.lora.catalog.update_config(cfg)
            self.lora.admin.cfg = cfg
        if self.fleets is not None:
            await self.fleets.apply(cfg)

    def status(self) -> dict[str, Any]:
        return self.http.fleets_status()


def launches(cfg: Config) -> bool:
    """Whether any fleet is launched by routerd (and so needs Ray), rather than static URLs."""
    return any(f.engine != "static" for f in cfg.fleets)


def build(cfg: Config, registry: Registry, session: aiohttp.ClientSession, *, tracing: Tracing,
          redis_url: str = "", view_redis: aioredis.Redis | None = None,
          controls: Callable[[], bool] | None = None,
          fleets: FleetManager | None = None, cluster: RayCluster | None = None,
          control: ControlLease | None = None,
          rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
          role: Role = Role.ONE, collectors: Sequence[Collector] = (),
          ident: str | None = None, scrapes_here: Callable[[], bool] | None = None,
          trust: Trust | None = None, seals: Seals | None = None) -> Routerd:
    """Every component for ``cfg`` over ``session``, in dependency order, with the static fleets'
    instances registered; nothing started. ``redis_url`` ("": none) shares tenants' limits and usage
    and feeds the queue consumer (not in the daemon of workers: ``role``); ``fleets`` is the fleet manager
    of the launched fleets (its autoscaler wakes fleets at zero for admission; its replica counts show in
    ``/admin/fleets``); ``control`` the lease fleet control follows (the fleet manager's own; None: sole
    control). ``view_redis`` (the caller's client, with Redis) shares the fleet state and relays admin
    calls between processes; ``controls()`` says whether this process controls the fleets now (None: the
    lease says; a worker never does); ``collectors`` add to ``/metrics`` (a worker's own figures).
    With Redis, load, scrapes and sessions are shared with the other processes on it (``ident``: this
    process's name there, default ``redis.consumer``; ``scrapes_here()``: whether this process scrapes
    the engines for all — default: while it controls). ``trust``: the shared secret's keys (the launched
    engines' API key among them; None: engines are sent no key, as a test's own engines want).
    ``seals`` (routerd/peers/sealed.py) seal and open every record shared through Redis: required with
    Redis (their refusals in ``/metrics`` are the caller's to add to ``collectors``)."""
    from .routing.engine_cache.subscriptions import EngineEventsCollector, fleet_keyers, static_sources

    rng = rng if rng is not None else random.Random()
    if control is None:
        control = fleets.control if fleets is not None else ControlLease(_ident(cfg))
    if role is Role.WORKER:
        controls = _never
    elif controls is None and not control.sole:
        lease = control
        controls = lambda: lease.controls  # noqa: E731  # the lease's verdict, read each time
    view = None
    if redis_url:
        from .peers import SharedMeasures

        view = SharedMeasures(cfg, registry, redis_url, seals=_required(seals), ident=ident,
                          is_scraper=scrapes_here or controls,
                          serves=role is not Role.PARENT, clock=clock)

    telemetry = Telemetry()
    # Fleets whose engines publish KV events and whose tokens routerd can compute: routing scores their
    # instances by the engines' own cache views (routerd/routing/engine_cache/subscriptions.py).
    keyers = fleet_keyers(cfg.fleets)
    engine_events = keying = None
    if keyers:
        from .routing.engine_cache.keying_process import KeyingProcess
        from .routing.engine_cache.subscriptions import EngineEvents

        _log.info("kv_events_routing", fleets=sorted(keyers))
        engine_events = EngineEvents(registry, session, fleets=list(keyers),
                                     sources=static_sources(cfg.fleets))
        keying = KeyingProcess({fleet: k.spec for fleet, (k, _, _) in keyers.items()})
    lora = _lora(cfg, registry, session, view_redis, seals, clock,  # LoRA: None without a LoRA fleet
                 controls=controls if role is not Role.PARENT else _never)
    views = RequestViews(cfg.routing, keyers=keyers, keying=keying,
                         learned_block_size=engine_events.fleet_block_size if engine_events else None,
                         adapter_of=lora.adapter_of if lora is not None else None)
    router = Router.from_config(registry, cfg.routing, rng=rng, clock=clock, views=views,
                                engine_cache=engine_events,
                                shared_sessions=view.sessions if view is not None else None,
                                adapters=lora.slots if lora is not None else None)
    tenancy = Tenancy(cfg, redis_url, clock=clock, rng=rng)
    fleet_view, admin_relay = _view(cfg, registry, view_redis, controls, fleets, clock,
                                    token=lambda: control.token, seals=seals, worker=role is Role.WORKER)
    elastic, wake_relay = _elastic(cfg, registry, fleets, admin_relay)
    admission = Admission(registry, cfg.admission, clock=clock, elastic=elastic, shares=tenancy.shares())
    upstream = Upstream(router, cfg.routing, telemetry, tracing=tracing, rng=rng, clock=clock,
                        engine_api_key=trust.engine_api_key if trust is not None else "")
    upstream.update_fleets(cfg.fleets)
    dispatch = Dispatch(views=router.views, admission=admission, engine=upstream, tenancy=tenancy,
                        telemetry=telemetry, tracing=tracing, clock=clock)
    # Watching engines (scrapes, static heartbeats) on lean keep-alive connections of its own, apart
    # from the engine calls': with hundreds of instances aiohttp's per-request cost was most of it.
    watch_pool = EnginePool(connect_timeout_s=cfg.routing.connect_timeout_s,
                            read_timeout_s=cfg.routing.scrape_timeout_s)
    scraper = Scraper(registry, session, cfg.routing, telemetry, clock=clock, rng=rng,
                      shared=view.scrapes if view is not None else None, fetch=watch_pool.fetch)
    static_health = StaticHealth(cfg, registry, session, clock=clock, rng=rng, fetch=watch_pool.fetch)
    queue = None
    if redis_url and role is not Role.PARENT:
        from .ingress.queue import QueueIngress

        queue = QueueIngress.from_config(cfg, url=redis_url, dispatch=dispatch, admission=admission,
                                         tenancy=tenancy, tracing=tracing,
                                         serves=fleet_view.serves if fleet_view is not None else None)
    extra, collectors = collectors, [registry_collector(registry, admission.stats, clock),
                  tenancy.collector(admission.tenant_stats)]
    if queue is not None:
        collectors.append(queue_collector(queue))
    if fleets is not None:
        collectors.append(fleets.collector())
    if engine_events is not None:
        collectors.append(EngineEventsCollector(engine_events))
    if tracing.on:
        collectors.append(tracing.collector())
    collectors.append(control.collector())
    if view is not None:
        collectors.append(view.collector())
    if fleet_view is not None:
        collectors.append(fleet_view.collector())
    collectors += _lora_collectors(lora)  # LoRA
    metrics = Metrics(telemetry, [*collectors, *extra])
    http = HttpIngress(cfg, registry, dispatch=dispatch, admission=admission, router=router,
                       tenancy=tenancy, telemetry=telemetry, metrics=metrics, tracing=tracing, clock=clock,
                       elastic=elastic, control=control.status, **_http_view(fleet_view, fleets))
    _attach_lora(lora, upstream, http)
    sd_path = (Path(cfg.daemon.file_sd_path) if cfg.daemon.file_sd_path
               else config_mod.state_dir(cfg) / "file_sd" / "engines.json")
    static_health.sync(cfg)
    return Routerd(registry=registry, session=session, tracing=tracing, redis_url=redis_url,
                   telemetry=telemetry,
                   router=router, tenancy=tenancy, admission=admission, upstream=upstream,
                   dispatch=dispatch, scraper=scraper, static_health=static_health,
                   watch_pool=watch_pool, queue=queue,
                   metrics=metrics, http=http, listener=HttpListener(http),
                   file_sd=FileSdWriter(registry, sd_path), cluster=cluster, fleets=fleets,
                   engine_events=engine_events, keying=keying, control=control, fleet_view=fleet_view,
                   admin_relay=admin_relay, controls=controls, role=role, view=view, wake_relay=wake_relay,
                   lora=lora)


@dataclass(frozen=True, eq=False)
class LoraBundle:
    """LoRA adapters as models: the catalog, who holds which, the run-time store, the admin side."""

    catalog: AdapterCatalog
    slots: AdapterSlots
    store: AdapterStore
    admin: AdapterAdmin
    placer: AdapterPlacer  # placement by demand (routerd/fleet/adapters.py), while this process controls

    def adapter_of(self, fleet: str, model: str) -> tuple[str, str] | None:
        a = self.catalog.get(model)
        return (a.name, a.path) if a is not None and a.fleet == fleet else None


def _lora_collectors(lora: LoraBundle | None) -> list[Collector]:
    return [AdaptersCollector(lora.slots)] if lora is not None else []


def _attach_lora(lora: LoraBundle | None, upstream: Upstream, http: HttpIngress) -> None:
    """LoRA: loads carry the engines' key; the ingress knows the adapters."""
    if lora is not None:
        lora.slots.bearer = upstream.bearer
        http.adapters, http.adapter_slots = lora.catalog, lora.slots


def _lora(cfg: Config, registry: Registry, session: aiohttp.ClientSession, client: aioredis.Redis | None,
          seals: Seals | None, clock: Callable[[], float], *,
          controls: Callable[[], bool] | None) -> LoraBundle | None:
    """The LoRA bundle when a fleet serves adapters (engine_args enable-lora), else None."""
    if not any(f.lora_slots() for f in cfg.fleets):
        return None
    from .peers.adapters import StoredAdapter
    from .redis_keys import RedisKeys
    from .routing.adapters import Adapter

    catalog = AdapterCatalog(cfg)
    slots = AdapterSlots(registry, catalog, session, clock=clock)
    store = AdapterStore(client, RedisKeys.from_config(cfg.redis) if client is not None else None,
                         seals=seals if client is not None else None, op_timeout_s=cfg.redis.op_timeout_s)

    def changed(entries: dict[str, StoredAdapter]) -> None:
        catalog.set_runtime(Adapter(name=n, fleet=e.fleet, path=e.path, source="admin")
                            for n, e in entries.items())

    store.on_change = changed
    # Placement measures demand where requests are routed: not in a daemon of workers (it serves none)
    placer = AdapterPlacer(slots, controls or (lambda: True), clock=clock)
    return LoraBundle(catalog=catalog, slots=slots, store=store,
                      admin=AdapterAdmin(cfg, registry, slots, store), placer=placer)


def _required(seals: Seals | None) -> Seals:
    if seals is None:
        raise ValueError("a routerd sharing Redis needs its seals: build(..., seals=Seals(trust))")
    return seals


def _never() -> bool:
    """A worker's answer to "do I control the fleets?"."""
    return False


async def while_controlling(controls: Callable[[], bool], run: Callable[[], Coroutine[Any, Any, None]],
                            poll_s: float = 0.1) -> None:
    """``run()`` while ``controls()``: cancelled within ``poll_s`` of control being lost, started again
    when it is back; until cancelled. What ``run()`` raises is raised here."""
    while True:
        if not controls():
            await asyncio.sleep(poll_s)  # the seam is a callable: nothing to wait on
            continue
        task = asyncio.create_task(run())
        try:
            while controls() and not task.done():
                await asyncio.wait({task}, timeout=poll_s)
        finally:
            task.cancel()
            results = await asyncio.gather(task, return_exceptions=True)
        if isinstance(results[0], Exception):
            raise results[0]


def _elastic(cfg: Config, registry: Registry, fleets: FleetManager | None,
             relay: AdminRelay | None) -> tuple[Elastic | None, RelayedElastic | None]:
    """What admission asks of fleets at zero: the autoscaler, alone; with Redis and launched fleets,
    behind the wake relay, so a request on any process wakes the fleet (the controller starts it)."""
    local = fleets.autoscaler if fleets is not None else None
    if relay is None or not launches(cfg):
        return local, None
    from .peers.wake import RelayedElastic

    wake = RelayedElastic(cfg, registry, local, relay=relay.ask_wake, controls=relay.controls)
    return wake, wake


def _view(cfg: Config, registry: Registry, client: aioredis.Redis | None,
          controls: Callable[[], bool] | None, fleets: FleetManager | None,
          clock: Callable[[], float], *, token: Callable[[], int], seals: Seals | None,
          worker: bool = False) -> tuple[FleetStateSync | None, AdminRelay | None]:
    """With Redis: the fleet state this process publishes or follows, and the admin calls' relay. A
    ``worker``'s parent is the daemon whose consumer name its own extends (workers.worker_consumer)."""
    if client is None:
        return None, None
    seals = _required(seals)
    from .peers.admin_relay import AdminRelay
    from .peers.fleet_state import FleetStateSync, config_fingerprint
    from .redis_keys import RedisKeys

    keys = RedisKeys.from_config(cfg.redis)
    ident = _ident(cfg)
    controls = controls if controls is not None else (lambda: True)

    def replicas() -> dict[str, int]:
        return {name: n for name, n, _, _ in fleets.replica_figures()} if fleets is not None else {}

    def orphans() -> list[dict[str, Any]]:
        return fleets.orphan_list() if fleets is not None else []

    view = FleetStateSync(registry, client, keys, ident=ident, fingerprint=config_fingerprint(cfg),
                     controls=controls, seals=seals, token=token, replicas=replicas,
                     op_timeout_s=cfg.redis.op_timeout_s, clock=clock,
                     parent=ident.rpartition("-w")[0] if worker else None, orphans=orphans)
    if fleets is not None:  # a term of control that begins here starts from the last state seen
        fleets.published = view.published_replicas
    return view, AdminRelay(client, keys, ident=ident, controls=controls, seals=seals,
                            op_timeout_s=cfg.redis.op_timeout_s)


def _http_view(view: FleetStateSync | None, fleets: FleetManager | None) -> dict[str, Any]:
    """What the HTTP ingress reads of the fleets beyond its registry: the replica counts, the fleets
    there are (the controller's, while following), the orphaned engines and the view's status."""
    out: dict[str, Any] = {"desired_replicas": _desired(view, fleets)}
    if view is not None:
        out["view_status"] = view.status
        out["view_untrusted"] = view.untrusted
        out["serves"] = view.serves
    if view is not None or fleets is not None:
        def orphaned() -> list[dict[str, Any]]:
            followed = view.followed_orphans() if view is not None else None
            if followed is not None:
                return followed
            return fleets.orphan_list() if fleets is not None else []
        out["orphaned"] = orphaned
    return out


def _desired(view: FleetStateSync | None, fleets: FleetManager | None) -> Callable[[FleetConfig], int] | None:
    """A launched fleet's replica count in ``/admin/fleets``: the controller's (followed), else this
    process's fleet manager's, else the file's."""
    if view is None and fleets is None:
        return None

    def desired(fleet: FleetConfig) -> int:
        followed = view.replicas(fleet.name) if view is not None else None
        if followed is not None:
            return followed
        return fleets.desired(fleet) if fleets is not None else fleet.replicas
    return desired


@contextlib.asynccontextmanager
async def assemble(cfg: Config, registry: Registry, *, sockets: Sequence[socket.socket] = (),
                   port: int | None = None, status: Callable[[str], None] = lambda step: None,
                   ray_connected: Callable[[], None] = lambda: None,
                   built: Callable[[Routerd], None] = lambda routerd: None, tracing: Tracing | None = None,
                   controls: Callable[[], bool] | None = None,
                   rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                   role: Role = Role.ONE, collectors: Sequence[Collector] = (),
                   worker: int | None = None) -> AsyncIterator[Routerd]:
    """routerd for ``cfg`` started, in the start-up order of the module's docstring; on the way out
    (or when a step fails) everything done is undone, in reverse: the listener closed, the fleets'
    supervision ended (the engines keep running), Ray, the session and an embedded Redis closed.

    ``sockets``: systemd's (socket activation) to serve on, else ``http.host``/``port`` (``port``
    overrides the config's: 0 picks a free one); ``status(step)`` is told each step (sd_notify);
    ``ray_connected()`` runs right after Ray connected (the daemon takes its signals back then);
    ``built(routerd)`` as soon as every component exists, before the fleets and the listener start (so
    that a start-up failing after that can be looked at);
    ``tracing``: a caller's own exporter (tests), else the one ``cfg.tracing`` and ``OTEL_*`` ask for,
    started and closed here.

    ``role`` (routerd/workers.py): the daemon of workers (``PARENT``) starts Redis, Ray and the fleets
    but neither the queue consumer nor the listener — its workers do; a ``WORKER`` (index ``worker``,
    named in each response's ``X-Routerd-Worker``) serves on the daemon's ``sockets`` and never touches
    Ray: its launched fleets' instances come from the fleet state the controller publishes in Redis.
    ``collectors`` add to its ``/metrics``."""
    async with contextlib.AsyncExitStack() as stack:
        state = config_mod.state_dir(cfg)
        state.mkdir(parents=True, exist_ok=True)
        trust = Trust.load(cfg.control.secret, config_mod.state_dir(cfg))
        seals = Seals(trust)
        _log.info("control_secret", source=trust.source, fingerprint=trust.fingerprint)
        status("redis")
        redis_url = await _redis(cfg, stack, state)
        view_redis = None
        if redis_url:  # the shared view's client (routerd/peers/), closed last but Redis
            from .redis_server import redis_client

            view_redis = redis_client(redis_url, cfg.redis)
            stack.push_async_callback(view_redis.aclose)
        tracing = await _tracing(cfg, stack) if tracing is None else tracing
        session = make_session(cfg.routing)  # the one client session of the process
        stack.push_async_callback(session.close)
        control = ControlLease(_ident(cfg), url=redis_url, redis_cfg=cfg.redis, cfg=cfg.control,
                               candidate=role is not Role.WORKER)
        cluster: RayCluster | None = None
        fleets: FleetManager | None = None
        if launches(cfg) and role is not Role.WORKER:
            from .fleet import FleetManager, RayCluster

            status("ray")
            cluster = await RayCluster.connect(cfg.ray, state, fence=control.check)
            stack.push_async_callback(cluster.close)
            ray_connected()
            replica_store = None
            if view_redis is not None:
                from .peers.replicas import ReplicaStore
                from .redis_keys import RedisKeys

                replica_store = ReplicaStore(view_redis, RedisKeys.from_config(cfg.redis), seals=seals,
                                             op_timeout_s=cfg.redis.op_timeout_s)
            fleets = FleetManager(cfg, registry, cluster, session, replica_store=replica_store, clock=clock,
                                  control=control, engine_api_key=trust.engine_api_key)
        # After Ray's connect, which can hold the interpreter for seconds: a lease taken before it
        # could lapse before its first renew.
        await _take_control(control, stack)
        routerd = build(cfg, registry, session, tracing=tracing, redis_url=redis_url, view_redis=view_redis,
                        controls=controls, fleets=fleets, cluster=cluster, control=control, rng=rng,
                        clock=clock, role=role, collectors=[*collectors, seals.collector()], trust=trust,
                        seals=seals)
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
            if control.controls:  # else fleet control starts when this process takes the lease
                await fleets.start()
        if worker is not None:  # /metrics: every worker's page, whichever answers
            from .ingress.worker_pages import WorkerPages

            metrics = routerd.metrics
            routerd.http.pages = await stack.enter_async_context(WorkerPages(
                worker, config_mod.worker_count(cfg), state / "workers", lambda: metrics.render(False)))
        if role is not Role.PARENT:
            status("http")
            await stack.enter_async_context(routerd.listener)
            await routerd.listener.start(_admin_routes(routerd, worker), port=port, sockets=sockets)
        yield routerd


@contextlib.asynccontextmanager
async def running(cfg: Config, registry: Registry, *, port: int | None = 0,
                  sockets: Sequence[socket.socket] = (), stop_engines: bool = True, consume: bool = True,
                  tracing: Tracing | None = None, controls: Callable[[], bool] | None = None,
                  rng: random.Random | None = None,
                  clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Routerd]:
    """:func:`assemble` with its loops running (benchmarks, tests): on the way out the queue stops
    reading, the loops end, the engines stop (``stop_engines``), then the rest is undone. Without
    ``consume`` the queue consumer is built but not run: the caller runs ``routerd.queue.run()``."""
    async with assemble(cfg, registry, sockets=sockets, port=port, tracing=tracing, controls=controls,
                        rng=rng, clock=clock) as routerd:
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
            # The lease is still renewed (until assemble() ends): stopping the engines is a
            # controller's act, checked like any.
            if routerd.fleets is not None:
                await routerd.fleets.shutdown(stop_engines=stop_engines and routerd.control.controls)


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


def _ident(cfg: Config) -> str:
    """This process's name among several routerd: its queue consumer name (default: the hostname)."""
    return cfg.redis.consumer_name


async def _take_control(control: ControlLease, stack: contextlib.AsyncExitStack) -> None:
    """One attempt to take the control lease (so a routerd alone on its Redis adopts and launches
    before it binds, as without Redis), and the lease renewed from then on — through the rest of the
    start-up, the whole run and the drain, which may all act on the fleets; given up last on the way
    out, once fleet control has stopped. Sole control (no Redis): nothing to take."""
    if control.sole:
        return
    stack.push_async_callback(control.release)
    await control.step()
    renewing = asyncio.create_task(control.run(), name="control_lease")

    async def stop() -> None:
        if await cancel_and_wait({renewing}, 5.0):
            _log.error("control_lease_task_stuck")

    stack.push_async_callback(stop)


async def _redis(cfg: Config, stack: contextlib.AsyncExitStack, state: Path) -> str:
    """Redis reachable, or embedded and started (stopped by ``stack``); "" with [redis] disabled."""
    if not cfg.redis.enabled:
        return ""
    url = cfg.redis.url
    if url == "embedded":
        from .redis_server import EmbeddedRedis

        url = await stack.enter_async_context(EmbeddedRedis(state / "redis"))
    return url


def _admin_routes(routerd: Routerd, worker: int | None = None) -> Callable[[web.Application], None]:
    """The admin write routes — static-only too: a static instance is drained without Ray; what only
    launched engines have answers 400 without a fleet manager. The key is read per request, so a
    reload applies. A worker names itself in every response (``X-Routerd-Worker``)."""
    from .ingress.admin import add_admin_routes

    http = routerd.http

    def add(app: web.Application) -> None:
        add_admin_routes(app, routerd.fleets, routerd.static_health, lambda: http.cfg.http.admin_api_key,
                         routerd.admin_relay, routerd.lora.admin if routerd.lora is not None else None)
        if worker is not None:
            name = str(worker)

            async def name_worker(_: web.Request, response: web.StreamResponse) -> None:
                response.headers["X-Routerd-Worker"] = name

            app.on_response_prepare.append(name_worker)

    return add
