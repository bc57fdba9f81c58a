"""One routerd process as its bundles: what runs, what a reload reaches, and the one ordered stop.

The daemon, the tests and the benchmarks all stop a routerd through :meth:`Routerd.shutdown` (then the
start-up's ``AsyncExitStack`` closes the rest in reverse start order): intake stopped (queue reads,
HTTP sites), in-flight work waited for up to the drain bound, streams still open closed, fleet control
ended (its engines stopped or kept), the loops cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .. import _aio, log
from ..config import Config
from .core import Bundle, Core, Loops

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..dataplane.admission import Admission
    from ..fleet import FleetManager, RayCluster
    from ..ingress.http import HttpIngress
    from ..ingress.queue import QueueIngress
    from ..registry import Registry
    from .batches import Batches
    from .dataplane import DataPlane
    from .fleets import FleetControl
    from .kv import KvRouting
    from .lora import Lora
    from .peers import Peers
    from .watch import EngineWatch

_log = log.get("routerd.assembly")

_INTAKE_STOP_S = 5.0  # closing the listening sites
_STREAMS_CLOSE_S = 5.0  # ending what is still in flight after the drain
_FLEETS_STOP_S = 10.0  # ending fleet control, the engines kept
_ENGINES_STOP_S = 90.0  # ... with its engines stopped (each gets a graceful stop)
_TASKS_STOP_S = 15.0  # for the loops to end once cancelled (the queue's take up to 7 s)
_NOT_BUNDLES = ("core", "_tasks")


@dataclass(eq=False, kw_only=True)
class Routerd:
    """Every bundle of one process (None: not in this role, or not configured). The fields' order is
    the order a reload reaches them in: the data plane first (its bounds apply at once), fleet control
    last (its launches and stops act on all the rest). A new bundle is one more field here."""

    core: Core
    dataplane: DataPlane | None = None  # a role that serves
    batches: Batches | None = None  # the Batch API's runner, with the queue (issue 31)
    lora: Lora | None = None  # a fleet that serves LoRA adapters (issue 30)
    watch: EngineWatch
    kv: KvRouting | None = None  # fleets whose engines publish KV events, in a role that serves
    peers: Peers | None = None  # with Redis
    fleet: FleetControl | None = None  # a launched fleet, not in a worker
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def bundles(self) -> list[Bundle]:
        """This process's bundles, in the fields' order."""
        values = (getattr(self, f.name) for f in fields(self) if f.name not in _NOT_BUNDLES)
        return [b for b in values if b is not None]

    # what runs --------------------------------------------------------------------------------
    def loops(self) -> Loops:
        """Every bundle's long-running loops, by task name, for the owner's TaskGroup."""
        loops: Loops = {}
        for bundle in self.bundles():
            loops.update(bundle.loops())
        return loops

    def collectors(self) -> list[Collector]:
        """Every bundle's part of ``/metrics``, with the process's own (the lease, tracing)."""
        out: list[Collector] = [c for b in self.bundles() for c in b.collectors()]
        if self.core.tracing.on:
            out.append(self.core.tracing.collector())
        out.append(self.core.control.collector())
        return out

    def start(self, tg: asyncio.TaskGroup | None = None, *, consume: bool = True) -> None:
        """Run the loops (in ``tg``, else as tasks of their own), owned here until :meth:`shutdown`.
        Without ``consume`` the queue consumer is not run (a test runs ``queue.run()`` itself)."""
        loops = self.loops()
        if not consume and "queue" in loops:
            loops.pop("queue").close()  # never started
        spawn = tg.create_task if tg is not None else asyncio.create_task
        self._tasks += [spawn(coro, name=name) for name, coro in loops.items()]

    async def apply(self, cfg: Config) -> None:
        """A reloaded config (its bound-at-start-up keys already kept by the caller): each bundle gets
        its part, once, in start order; the lease its own."""
        for bundle in self.bundles():
            if bundle is self.fleet:
                self.core.control.update_config(cfg.control)
            await bundle.apply(cfg)
        if self.fleet is None:
            self.core.control.update_config(cfg.control)

    # the one stop -----------------------------------------------------------------------------
    async def shutdown(self, *, drain_timeout_s: float, stop_engines: bool,
                       force: asyncio.Event | None = None) -> int:
        """Stop intake, let in-flight work finish up to ``drain_timeout_s`` (or until ``force`` is set),
        end what is left, end fleet control (``stop_engines``: its engines too), cancel the loops.
        Each step is bounded; returns how many loops did not end when cancelled."""
        started = time.monotonic()
        dp = self.dataplane
        if dp is not None:
            if dp.queue is not None:
                dp.queue.stop_intake()
            await _bounded("stop_intake", dp.listener.stop_intake(), _INTAKE_STOP_S)
            await self._drain(dp, started + drain_timeout_s, force)
            await _bounded("close_streams", dp.listener.close_streams("routerd is shutting down"),
                           _STREAMS_CLOSE_S)
        if self.fleet is not None:
            await _bounded("fleets", self.fleet.fleets.shutdown(stop_engines=stop_engines),
                           _ENGINES_STOP_S if stop_engines else _FLEETS_STOP_S)
        stuck = await _aio.cancel_and_wait(self._tasks, _TASKS_STOP_S)
        self._tasks = []
        return len(stuck)

    @staticmethod
    async def _drain(dp: DataPlane, deadline: float, force: asyncio.Event | None) -> None:
        waits = [dp.listener.wait_idle(deadline - time.monotonic())]
        if dp.queue is not None:
            waits.append(dp.queue.wait_idle(deadline - time.monotonic()))
        drained: asyncio.Future[Any] = asyncio.gather(*waits)
        forced: asyncio.Future[Any] = asyncio.create_task((force or asyncio.Event()).wait())
        done, _ = await asyncio.wait({drained, forced}, timeout=max(0.0, deadline - time.monotonic()) + 1.0,
                                     return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if drained not in done:
            drained.cancel()
            # a wait that fails while being cancelled (a second SIGTERM forces this) leaves its error on
            # the gather: retrieved here, or asyncio logs "exception was never retrieved" at exit
            drained.add_done_callback(_retrieve)
            if forced in done:
                _log.warning("drain_interrupted")
        elif drained.exception() is not None:  # retrieved, so it is logged once, here
            _log.error("drain_wait_failed", exc_info=drained.exception())

    # shortcuts: the components tests and tools reach most ---------------------------------------
    @property
    def registry(self) -> Registry:
        return self.core.registry

    @property
    def redis_url(self) -> str:
        return self.core.redis_url

    @property
    def url(self) -> str:
        """The HTTP listener's base URL once bound ("" in a role that serves nothing)."""
        return self.dataplane.listener.url if self.dataplane is not None else ""

    @property
    def serving(self) -> DataPlane:
        """The data plane (a role that serves has one: any other is a caller's mistake)."""
        if self.dataplane is None:
            raise AttributeError(f"a routerd of role {self.core.role.value} has no data plane")
        return self.dataplane

    @property
    def http(self) -> HttpIngress:
        return self.serving.http

    @property
    def admission(self) -> Admission:
        return self.serving.admission

    @property
    def queue(self) -> QueueIngress | None:
        return self.dataplane.queue if self.dataplane is not None else None

    @property
    def fleets(self) -> FleetManager | None:
        return self.fleet.fleets if self.fleet is not None else None

    @property
    def cluster(self) -> RayCluster | None:
        return self.fleet.cluster if self.fleet is not None else None

    def status(self) -> dict[str, Any]:
        return self.http.fleets_status()


async def _bounded(step: str, aw: Awaitable[Any], timeout_s: float) -> None:
    try:
        await _aio.wait_for(aw, timeout_s)
    except TimeoutError:
        _log.error("stop_step_timed_out", step=step, timeout_s=timeout_s)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's outcome as seen (an abandoned wait's error is not news at shutdown)."""
    if not future.cancelled():
        future.exception()
