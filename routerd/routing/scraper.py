"""Concurrent ``/metrics`` scrapes: one small loop per instance, each scrape bounded by a timeout.

Per-instance loops (not one gather per round) so that a hung engine, whose scrape waits for the whole
``scrape_timeout_s``, never delays the load figures of the others. Loops follow the registry: an
instance added by anyone (static fleet set-up, the fleet manager adopting a Ray actor) gets a loop
within one registry change; a removed or replaced one loses it.

The scraper is the one writer of ``snapshot``, ``inflight_at_scrape`` and the ``scrape_*`` fields, and
feeds each new snapshot to the instance's learned capacity and speed (:mod:`.speed`).
``inflight_at_scrape`` is routerd's in-flight count when the answer arrived: the engine's gauges
already include those requests, so only what routerd sends *after* it is added on top (see
``Instance.estimated_queue``). With several routerd processes that count is every process's
(``Instance.inflight_total``), and ``shared`` (:class:`ScrapeShare`, :mod:`routerd.peers.scrapes`)
decides per round whether this process scrapes at all: one process scrapes and publishes, the others
apply what it published while that is fresh.

Idle instances are scraped slowly. One with nothing in flight from routerd whose last scrape saw nothing
running or waiting (``Instance.idle``) is scraped every ``idle_scrape_interval_s`` (≤ half of
``stale_after_s``, so the router never counts it stale) instead of every ``scrape_interval_s``: the
cost of watching hundreds of instances is then that of the busy ones. Routing loses nothing it uses:
the engine's gauges of an idle instance are 0, and what routerd sends it is counted in ``inflight``
the moment it is sent (the in-flight correction above), so its figures stay exact for routerd's own
requests; only work the engine gets from elsewhere (another client, another routerd before the shared
view counts it) is seen up to one idle period late instead of one fast period. The first request sent
to an idle instance ends its nap within ``scrape_interval_s`` (``run()`` looks at the napping ones
each fast period), and from then on it is scraped at the fast period until it is idle again.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Protocol

import aiohttp

from .. import _aio, _net, log
from ..config import RoutingConfig
from ..registry import Instance, InstanceState, Registry
from ..telemetry import Telemetry
from ..vllm_wire import metrics_text

_log = log.get("routerd.scraper")

MAX_PAGE_BYTES = 8 * 1024 * 1024


class ScrapeShare(Protocol):
    """Scrapes shared between routerd processes: whether another process's scrape of ``inst`` stands
    in for this one's this round, and what to do with one this process made (publish it)."""

    def covers(self, inst: Instance) -> bool: ...

    def scraped(self, inst: Instance) -> None: ...


class Scraper:
    """Keeps every instance's ``snapshot`` fresh; ``run()`` until cancelled."""

    def __init__(self, registry: Registry, session: aiohttp.ClientSession, cfg: RoutingConfig,
                 telemetry: Telemetry | None = None, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, shared: ScrapeShare | None = None,
                 fetch: _net.Fetch | None = None) -> None:
        self.registry = registry
        self.shared = shared
        self.session = session
        self._fetch = fetch or _net.session_fetch(session)
        self.cfg = cfg
        self.telemetry = telemetry
        self.clock = clock
        self.rng = rng or random.Random()
        self._loops: dict[str, tuple[Instance, asyncio.Task[None]]] = {}
        self._naps = _aio.Naps()  # idle instances' loops, by instance id

    def update_config(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg

    async def run(self) -> None:
        """Start and stop per-instance loops as the registry changes."""
        version = self.registry.version
        try:
            while True:
                self._sync()
                self._wake_busy()
                # Each fast period while some loop naps, to end the nap of an instance sent a request.
                version = await self.registry.wait_changed(
                    version, timeout=self.cfg.scrape_interval_s if len(self._naps) else 1.0)
        finally:
            loops = [task for _, task in self._loops.values()]
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            self._loops.clear()

    def _sync(self) -> None:
        current = {inst.id: inst for inst in self.registry if inst.state is not InstanceState.STOPPED}
        for iid, (inst, task) in list(self._loops.items()):
            if task.done() and not task.cancelled() and task.exception() is not None:
                _log.error("scrape_loop_failed", instance=iid, exc_info=task.exception())
            if current.get(iid) is not inst or task.done():
                task.cancel()
                del self._loops[iid]
        for iid, inst in current.items():
            if iid not in self._loops:
                task = asyncio.create_task(self._loop(inst), name=f"scrape:{iid}")
                self._loops[iid] = (inst, task)

    def _wake_busy(self) -> None:
        for iid in self._naps.napping():
            entry = self._loops.get(str(iid))
            if entry is not None and not entry[0].idle():
                self._naps.wake(iid)

    def idle_interval(self) -> float:
        """The period of an idle instance's scrapes: ``idle_scrape_interval_s`` within its bounds."""
        return self.cfg.idle_scrape_period_s

    async def _loop(self, inst: Instance) -> None:
        # Spread the instances over the interval so their scrapes do not all land at once.
        await asyncio.sleep(self.rng.uniform(0, self.cfg.scrape_interval_s))
        while True:
            started = self.clock()
            # an instance waiting for placement has no URL yet: nothing to scrape
            if inst.url and (self.shared is None or not self.shared.covers(inst)):
                await self.scrape(inst)
                if self.shared is not None:
                    self.shared.scraped(inst)
            idle = self.idle_interval()
            if idle > self.cfg.scrape_interval_s and inst.idle():
                await self._naps.nap(inst.id, idle - (self.clock() - started))
            else:
                await asyncio.sleep(max(0.0, self.cfg.scrape_interval_s - (self.clock() - started)))

    async def scrape(self, inst: Instance) -> bool:
        """Scrape ``inst`` once; on failure keep the old snapshot and record the error. Returns success."""
        inst.last_scrape_attempt = self.clock()
        try:
            async with asyncio.timeout(self.cfg.scrape_timeout_s):
                status, page = await self._fetch(inst.url + "/metrics", MAX_PAGE_BYTES)
            if status != 200:
                raise metrics_text.ParseError(f"HTTP {status}")
            snap = metrics_text.parse_page(page, self.clock())
        except (aiohttp.ClientError, OSError, TimeoutError, metrics_text.ParseError) as e:
            message = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            if not inst.scrape_error:
                _log.info("scrape_failing", instance=inst.id, error=message)
            inst.scrape_error = message
            inst.scrape_errors_total += 1
            return False
        finally:
            if self.telemetry is not None:
                self.telemetry.scrape_seconds.observe(self.clock() - inst.last_scrape_attempt)
        if inst.scrape_error:
            _log.info("scrape_recovered", instance=inst.id)
        inst.snapshot = snap
        inst.shared_scrape = False
        inst.inflight_at_scrape = inst.inflight_total
        inst.scrape_error = ""
        inst.learned.observe(snap)
        return True
