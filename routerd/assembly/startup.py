"""The whole start-up, each step's undo on one ``AsyncExitStack``, so a start-up that fails half-way
undoes what it did (README, "Start-up order"): Redis (embedded or reachable) → the one
``aiohttp.ClientSession`` → Ray and the fleet manager → the control lease → the role's bundles
(:func:`~routerd.assembly.build.compose`) → fleets adopted or launched (by the controller) → the HTTP
listener bound. The loops are the caller's to run (:meth:`Routerd.start`); :func:`running` runs them
too, and stops through the daemon's own :meth:`Routerd.shutdown` (benchmarks, tests)::

    async with running(cfg, Registry()) as routerd:
        ... routerd.url ...
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import config as config_mod
from .. import log
from .._aio import cancel_and_wait, timeout
from ..config import Config
from ..dataplane.upstream import make_session
from ..peers.lease import ControlLease
from ..peers.sealed import Seals
from ..registry import Registry
from ..tracing import Tracing
from ..trust import Trust
from .build import compose, make_core
from .core import Role, launches
from .peers import replica_store
from .routerd import Routerd

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client.registry import Collector

    from ..redis_conn import RedisConn
    from .fleets import FleetControl

_log = log.get("routerd.assembly")


@contextlib.asynccontextmanager
async def assemble(cfg: Config, registry: Registry, *, sockets: Sequence[socket.socket] = (),
                   port: int | None = None, status: Callable[[str], None] = lambda step: None,
                   ray_connected: Callable[[], None] = lambda: None,
                   built: Callable[[Routerd], None] = lambda routerd: None, tracing: Tracing | None = None,
                   controls: Callable[[], bool] | None = None,
                   rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                   role: Role = Role.ONE, collectors: Sequence[Collector] = (),
                   worker: int | None = None) -> AsyncIterator[Routerd]:
    """routerd for ``cfg`` started, in the module docstring's order; on the way out (or when a step
    fails) everything done is undone, in reverse: the listener closed, the fleets' supervision ended
    (the engines keep running), Ray, the session and an embedded Redis closed.

    ``sockets``: systemd's (socket activation) or the parent's to serve on, else ``http.host``/``port``
    (``port`` overrides the config's: 0 picks a free one); ``status(step)`` is told each step
    (sd_notify); ``ray_connected()`` runs right after Ray connected (the daemon takes its signals back
    then); ``built(routerd)`` as soon as every bundle exists, before the fleets and the listener start;
    ``tracing``: a caller's own exporter (tests), else the one ``cfg.tracing`` and ``OTEL_*`` ask for.
    ``role`` chooses the bundles (routerd/assembly/build.py); a ``WORKER`` (index ``worker``, named in
    each response's ``X-Routerd-Worker``) serves every worker's ``/metrics`` (``collectors``: its own)."""
    async with contextlib.AsyncExitStack() as stack:
        state = config_mod.state_dir(cfg)
        state.mkdir(parents=True, exist_ok=True)
        trust = Trust.load(cfg.control.secret, state)
        seals = Seals(trust)
        _log.info("control_secret", source=trust.source, fingerprint=trust.fingerprint)
        status("redis")
        redis_url = await _redis(cfg, stack, state)
        redis = None
        if redis_url:  # every Redis client of the process comes from it; its pools closed last but Redis
            from ..redis_conn import RedisConn
            from ..redis_faults import RedisFaults
            from ..redis_keys import RedisKeys

            keys = RedisKeys.from_config(cfg.redis)  # a refusal on another key is a job's reply_to's
            redis = RedisConn(redis_url, cfg.redis,
                              faults=RedisFaults(owns=lambda key: keys.reserved(key) is not None))
            stack.push_async_callback(redis.aclose)
            await _watch_sentinels(redis, stack)
        tracing = await _tracing(cfg, stack) if tracing is None else tracing
        session = make_session(cfg.routing)  # the one client session of the process
        stack.push_async_callback(session.close)
        control = ControlLease(cfg.redis.consumer_name, redis=redis, cfg=cfg.control,
                               candidate=role.controls_fleets)
        core = make_core(cfg, registry, session, tracing=tracing, role=role, control=control,
                         controls=controls, redis=redis, trust=trust, seals=seals,
                         rng=rng, clock=clock)
        fleet: FleetControl | None = None
        if launches(cfg) and role.controls_fleets:
            from .fleets import FleetControl

            status("ray")
            fleet = await FleetControl.connect(core, stack, replica_store=replica_store(core),
                                               ray_connected=ray_connected)
        routerd = compose(core, fleet=fleet, collectors=[*collectors, seals.collector()])
        if routerd.kv is not None:
            stack.callback(routerd.kv.keying.close)
            routerd.kv.keying.start()  # seconds to spawn: begun now, not by the first long request
        built(routerd)
        # After Ray's connect and the build, which hold the interpreter without a pause (the build alone
        # 0.3 s of CPU, 1.6 s on a loaded host): a lease taken before them could lapse before its first
        # renew, and another replica take control in the middle of this one's start-up.
        await _take_control(control, stack)
        dp = routerd.dataplane
        if dp is not None and dp.queue is not None:
            await stack.enter_async_context(dp.queue)
        if fleet is not None:
            await fleet.start(core, stack)
        if dp is not None:
            if worker is not None:  # /metrics: every worker's page, whichever answers
                from ..ingress.worker_pages import WorkerPages

                metrics = core.metrics
                dp.http.pages = await stack.enter_async_context(WorkerPages(
                    worker, config_mod.worker_count(cfg), state / "workers", lambda: metrics.render(False)))
            status("http")
            await stack.enter_async_context(dp.listener)
            await dp.listener.start(_admin_routes(routerd, worker), port=port, sockets=sockets)
        yield routerd


@contextlib.asynccontextmanager
async def running(cfg: Config, registry: Registry, *, port: int | None = 0,
                  sockets: Sequence[socket.socket] = (), stop_engines: bool = True, consume: bool = True,
                  drain_timeout_s: float = 0.0, tracing: Tracing | None = None,
                  controls: Callable[[], bool] | None = None, rng: random.Random | None = None,
                  clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Routerd]:
    """:func:`assemble` with its loops running (benchmarks, tests); on the way out the daemon's stop
    (:meth:`Routerd.shutdown`), with in-flight work given ``drain_timeout_s`` (0: cut at once, as a
    second stop signal does) and the engines stopped (``stop_engines``, by the controller), then the rest
    undone. Without ``consume`` the queue consumer is built but not run: the caller runs
    ``routerd.queue.run()``."""
    async with assemble(cfg, registry, sockets=sockets, port=port, tracing=tracing, controls=controls,
                        rng=rng, clock=clock) as routerd:
        routerd.start(consume=consume)
        try:
            yield routerd
        finally:
            # The lease is still renewed (until assemble() ends): stopping the engines is a
            # controller's act, checked like any.
            await routerd.shutdown(drain_timeout_s=drain_timeout_s,
                                   stop_engines=stop_engines and routerd.core.control.controls)


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
    from .. import plugins

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


async def _watch_sentinels(redis: RedisConn, stack: contextlib.AsyncExitStack) -> None:
    """With ``[redis] sentinels``: what they say of the master, logged when it changes and read by
    ``/readyz`` (:meth:`RedisConn.health`) — asked once now, so a wrong address or service name is the
    first thing the log says, then every few seconds until the end (stopped by ``stack``)."""
    watch = redis.watch
    if watch is None:
        return
    task = asyncio.create_task(watch.run(), name="redis_sentinels")

    async def stop() -> None:
        if await cancel_and_wait({task}, 5.0):
            _log.error("redis_sentinel_watch_stuck")

    stack.push_async_callback(stop)
    # The first answer, bounded by the sentinels' time-outs: never a reason not to start.
    with contextlib.suppress(TimeoutError):
        async with timeout(redis.cfg.op_timeout_s * (len(redis.cfg.sentinels) + 1)):
            await watch.checked.wait()


async def _redis(cfg: Config, stack: contextlib.AsyncExitStack, state: Path) -> str:
    """Redis reachable, or embedded and started (stopped by ``stack``); "" with [redis] disabled."""
    if not cfg.redis.enabled:
        return ""
    url = cfg.redis.url
    if url == "embedded":
        from ..redis_server import EmbeddedRedis

        url = await stack.enter_async_context(EmbeddedRedis(state / "redis"))
    return url


def _admin_routes(routerd: Routerd, worker: int | None = None) -> Callable[[web.Application], None]:
    """The admin write routes — static-only too: a static instance is drained without Ray; what only
    launched engines have answers 400 without a fleet manager. The key is read per request, so a
    reload applies. Then each bundle's own routes (:class:`~routerd.assembly.core.HasRoutes`). A
    worker names itself in every response (``X-Routerd-Worker``)."""
    from ..ingress.admin import add_admin_routes
    from .core import HasRoutes

    http = routerd.http
    relay = routerd.peers.admin_relay if routerd.peers is not None else None

    def add(app: web.Application) -> None:
        add_admin_routes(app, routerd.fleets, routerd.watch.static_health,
                         lambda: http.cfg.http.admin_api_key, relay,
                         routerd.lora.admin if routerd.lora is not None else None)
        for bundle in routerd.bundles():
            if isinstance(bundle, HasRoutes):
                bundle.add_routes(app)
        if worker is not None:
            name = str(worker)

            async def name_worker(_: web.Request, response: web.StreamResponse) -> None:
                response.headers["X-Routerd-Worker"] = name

            app.on_response_prepare.append(name_worker)

    return add
