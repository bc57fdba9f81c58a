"""What every bundle of one routerd process shares: the role, the clock and randomness, the one client
session, the registry, the request path's counters, the control lease, the shared secret, Redis.

A *bundle* (the other modules of this package) is one lifecycle object over a few components: it is
built from a :class:`Core` (and the bundles below it), and says what it runs (:meth:`Bundle.loops`),
what a reload gives it (:meth:`Bundle.apply`) and what it adds to ``/metrics``
(:meth:`Bundle.collectors`). A role (:class:`Role`) is a choice of bundles (routerd/assembly/build.py).
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import aiohttp

from ..config import Config
from ..peers.lease import ControlLease
from ..peers.sealed import Seals
from ..registry import Registry
from ..telemetry import Metrics, Telemetry
from ..tracing import Tracing
from ..trust import Trust

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client.registry import Collector

    from ..redis_conn import RedisConn

Loops = dict[str, Coroutine[Any, Any, None]]


class Role(enum.Enum):
    """What one process of a routerd does (``[daemon] workers``, routerd/workers.py)."""

    ONE = "one"  # workers = 1: every bundle, in this one process
    PARENT = "parent"  # workers > 1, the daemon: fleet control, peers and engine watching; serves nothing
    WORKER = "worker"  # workers > 1, one of them: the data plane, KV routing, peers; no Ray, no fleet manager

    @property
    def serves(self) -> bool:
        """Whether this process takes requests (HTTP and the queue): it has a data plane."""
        return self is not Role.PARENT

    @property
    def controls_fleets(self) -> bool:
        """Whether this process may control the fleets (a candidate for the lease; Ray when launched)."""
        return self is not Role.WORKER


class Bundle(Protocol):
    """One lifecycle object of the assembly: a few components built together, started and stopped as one."""

    def loops(self) -> Loops:
        """Its long-running loops, by task name, for the owner's TaskGroup (each runs until cancelled)."""
        ...

    async def apply(self, cfg: Config) -> None:
        """A reloaded config: each of its components gets its part."""
        ...

    def collectors(self) -> list[Collector]:
        """What it adds to ``/metrics`` (read at scrape time)."""
        ...


@runtime_checkable
class HasRoutes(Protocol):
    """A bundle that serves HTTP routes of its own (beside the OpenAI routes of ingress/http.py): they
    are added to the listener's application before it starts, in a role with a data plane."""

    def add_routes(self, app: web.Application) -> None: ...


@dataclass(eq=False)
class Core:
    """What every bundle shares. ``redis`` (every Redis client of the process comes from it) is None
    with ``[redis] enabled = false``;
    ``controls()`` says whether this process controls the fleets now (None: always — sole control)."""

    cfg: Config  # as at start-up; a reload hands each bundle the new one
    role: Role
    registry: Registry
    session: aiohttp.ClientSession  # the one client session of the process
    tracing: Tracing
    telemetry: Telemetry
    metrics: Metrics  # ``/metrics``: every bundle's collectors, added once all are built
    control: ControlLease
    controls: Callable[[], bool] | None
    clock: Callable[[], float]
    rng: random.Random
    trust: Trust | None = None  # None: engines are sent no API key (a test's own engines)
    seals: Seals | None = None  # required with Redis: every shared record is sealed
    redis: RedisConn | None = None

    @property
    def redis_url(self) -> str:
        """The Redis this process uses (the embedded server's once started); "" without Redis."""
        return self.redis.url if self.redis is not None else ""

    @property
    def ident(self) -> str:
        """This process's name among several routerd: its queue consumer name (default: the hostname)."""
        return self.cfg.redis.consumer_name

    @property
    def sealed(self) -> Seals:
        if self.seals is None:
            raise ValueError("a routerd sharing Redis needs its seals: Core(..., seals=Seals(trust))")
        return self.seals

    def controlling(self) -> Callable[[], bool]:
        """``controls`` as a callable that is always there (sole control: always True)."""
        return self.controls if self.controls is not None else _always


def controls_for(role: Role, control: ControlLease,
                 given: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """Whether this process controls the fleets now: a worker never; else the caller's answer (tests),
    else the lease's verdict read each time; None with sole control (no Redis): always."""
    if role is Role.WORKER:
        return _never
    if given is None and not control.sole:
        return lambda: control.controls
    return given


def launches(cfg: Config) -> bool:
    """Whether any fleet is launched by routerd (and so needs Ray), rather than static URLs."""
    return any(f.engine != "static" for f in cfg.fleets)


def _never() -> bool:
    return False


def _always() -> bool:
    return True


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
