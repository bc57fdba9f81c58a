"""Roles as choices of bundles: :func:`compose` builds, over one :class:`Core`, the bundles a role takes,
in dependency order; :func:`build` is that over a plain core (a test that drives the parts by hand).

| role     | engine watch | fleet control     | peers      | KV routing          | data plane |
|----------|--------------|-------------------|------------|---------------------|------------|
| ONE      | yes          | a launched fleet  | with Redis | fleets that publish | yes        |
| PARENT   | yes          | a launched fleet  | with Redis | —                   | —          |
| WORKER   | yes          | —                 | with Redis | fleets that publish | yes        |

LoRA adapters (``lora.py``, issue 30) are built in every role with a fleet that serves them.

**A new component** (say batches, or conversations) is a bundle: a module of this package with a class
taking the :class:`~routerd.assembly.core.Core` (and the bundles it needs, e.g. the data plane's
dispatch) in its constructor, with ``loops()`` (its tasks, by name), ``apply(cfg)`` (its part of a
reload) and ``collectors()`` (its ``/metrics``); with ``add_routes(app)`` too if it serves HTTP routes
of its own (core.HasRoutes: added to the listener's application, after the admin routes). It gets one
field of :class:`~routerd.assembly.routerd.Routerd` (placed in the reload order) and one line in
:func:`compose` (built in a role that wants it, below what it needs). Start, reload, ``/metrics`` and the
one ordered stop then reach it with no other edit; a resource it opens at start-up (a process, a
socket) is entered in ``startup.assemble`` next to the keying process's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp

from ..config import Config
from ..peers.lease import ControlLease
from ..peers.sealed import Seals
from ..registry import Registry
from ..telemetry import Metrics, Telemetry
from ..tracing import Tracing
from ..trust import Trust
from .batches import Batches
from .core import Core, Role, controls_for
from .dataplane import DataPlane
from .kv import KvRouting
from .lora import Lora
from .peers import Peers, shared_measures
from .routerd import Routerd
from .watch import EngineWatch

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..redis_conn import RedisConn
    from .fleets import FleetControl


def compose(core: Core, *, fleet: FleetControl | None = None,
            collectors: Sequence[Collector] = ()) -> Routerd:
    """The bundles ``core.role`` takes, built in dependency order (nothing started), with every one's
    collectors and ``collectors`` (the caller's own) on ``/metrics``."""
    measures = shared_measures(core)
    watch = EngineWatch(core, measures)
    lora = Lora.for_config(core)  # issue 30: a fleet that serves LoRA adapters
    peers = Peers(core, measures, fleet, watch.static_health,
                  adapters=lora.admin if lora is not None else None) if core.redis is not None else None
    if lora is not None and peers is not None:
        # only the controller loads; the others follow its record and share their demand
        lora.with_peers(peers.admin_relay, peers.fleet_state, measures.load if measures is not None else None)
    kv = dataplane = None
    if core.role.serves:
        # Fleets whose engines publish KV events and whose tokens routerd can compute: routing scores
        # their instances by the engines' own cache views.
        kv = KvRouting.for_config(core)
        dataplane = DataPlane(core, measures=measures, peers=peers, fleet=fleet, kv=kv, lora=lora)
    batches = Batches.for_config(core, dataplane)  # issue 31
    routerd = Routerd(core=core, watch=watch, fleet=fleet, peers=peers, kv=kv, dataplane=dataplane,
                      batches=batches, lora=lora)
    core.metrics.add([*routerd.collectors(), *collectors])
    return routerd


def make_core(cfg: Config, registry: Registry, session: aiohttp.ClientSession, *, tracing: Tracing,
              role: Role = Role.ONE, control: ControlLease | None = None,
              controls: Callable[[], bool] | None = None, redis: RedisConn | None = None,
              trust: Trust | None = None, seals: Seals | None = None,
              rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> Core:
    """The shared part of every bundle. ``redis``: the process's one Redis factory (None: no Redis);
    ``control``: the lease (None: sole control, no Redis);
    ``controls()``: whether this process controls the fleets now (None: the lease says)."""
    control = control if control is not None else ControlLease(cfg.redis.consumer_name)
    telemetry = Telemetry()
    return Core(cfg=cfg, role=role, registry=registry, session=session, tracing=tracing, telemetry=telemetry,
                metrics=Metrics(telemetry), control=control, controls=controls_for(role, control, controls),
                clock=clock, rng=rng if rng is not None else random.Random(), trust=trust, seals=seals,
                redis=redis)


def build(cfg: Config, registry: Registry, session: aiohttp.ClientSession, *, tracing: Tracing,
          rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> Routerd:
    """Every bundle of one process for ``cfg`` without Redis or Ray, over ``session``, with the static
    fleets' instances registered; nothing started (a test that drives the parts by hand)."""
    return compose(make_core(cfg, registry, session, tracing=tracing, rng=rng, clock=clock))
