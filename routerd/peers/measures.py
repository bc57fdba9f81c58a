"""Load, scrapes and sessions: what every routerd process on one Redis measures and the others must see.

``load`` — each process's in-flight requests per instance, so every process routes and admits on the
whole fleet's load; ``scrapes`` — the engines scraped once per interval in total, by the process that
controls the fleets, and applied by the others; ``sessions`` — a session's instance, whichever process
receives its next turn. :class:`SharedMeasures` builds the three over one Redis client and runs their loops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..config import Config
from ..redis_keys import RedisKeys
from ..registry import Registry
from .load import SharedLoad
from .scrapes import SharedScrapes
from .sealed import Seals
from .sessions import SharedSessions

if TYPE_CHECKING:
    import redis.asyncio as aioredis


class SharedMeasures:
    """Shared load, scrapes and sessions of one process over one Redis client; ``run()`` until
    cancelled (the client is closed then)."""

    def __init__(self, cfg: Config, registry: Registry, redis: aioredis.Redis, *, seals: Seals,
                 ident: str | None = None,
                 is_scraper: Callable[[], bool] | None = None, serves: bool = True,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """``ident``: this process's name among them (default ``redis.consumer``, else the hostname);
        ``is_scraper()``: whether this process scrapes the engines and publishes (the controller; None:
        always — each process scrapes for itself, as one routerd does); not ``serves`` (the daemon of workers,
        which takes no request): it reads the others' load and publishes none, and is not counted among
        the processes that share a fleet's admission bounds. ``seals``: the process's (every record
        exchanged is sealed). ``redis``: a client for short commands (routerd/redis_conn.py)."""
        self.ident = ident or cfg.redis.consumer_name
        self.redis = redis
        keys = RedisKeys.from_config(cfg.redis)
        op = cfg.redis.op_timeout_s
        interval = cfg.routing.scrape_interval_s
        self.load = SharedLoad(registry, self.redis, keys, self.ident, seals=seals,
                               scrape_interval_s=interval, op_timeout_s=op, publish=serves, clock=clock)
        self.scrapes = SharedScrapes(registry, self.redis, keys, seals=seals,
                                     is_scraper=is_scraper or (lambda: True),
                                     scrape_interval_s=interval, op_timeout_s=op,
                                     idle_period_s=cfg.routing.idle_scrape_period_s, clock=clock, wall=wall)
        self.sessions = SharedSessions(self.redis, keys, seals=seals, processes=lambda: registry.processes,
                                       max_entries=cfg.routing.sessions_max, op_timeout_s=op, clock=clock)
        self.registry = registry

    def update_config(self, cfg: Config) -> None:
        self.load.update_config(cfg.routing.scrape_interval_s)
        self.scrapes.update_config(cfg.routing.scrape_interval_s, cfg.routing.idle_scrape_period_s)
        self.sessions.max_entries = cfg.routing.sessions_max

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.load.run(), name="view:load")
                tg.create_task(self.scrapes.run(), name="view:scrapes")
                tg.create_task(self.sessions.run(), name="view:sessions")
        finally:
            await self.redis.aclose()

    def collector(self) -> Collector:
        return _MeasuresCollector(self)


class _MeasuresCollector(Collector):
    """The shared view's state at collection time."""

    def __init__(self, view: SharedMeasures) -> None:
        self._view = view

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        view = self._view
        processes = GaugeMetricFamily("routerd_view_processes", "routerd processes sharing this one's "
                                      "Redis view (itself included)")
        processes.add_metric([], view.registry.processes)
        own = CounterMetricFamily("routerd_view_own_scrapes", "Scrapes this process made itself because "
                                  "the shared ones were stale (not the scraping process)")
        own.add_metric([], view.scrapes.own_scrapes_total)
        scraping = GaugeMetricFamily("routerd_view_scraping_own", "1 per instance this process scrapes "
                                     "itself for want of fresh shared scrapes", labels=["instance"])
        for iid in sorted(view.scrapes.own):
            scraping.add_metric([iid], 1.0)
        lookups = CounterMetricFamily("routerd_view_session_lookups", "Lookups of a session another "
                                      "process routed, by outcome", labels=["outcome"])
        for outcome, n in view.sessions.lookups.items():
            lookups.add_metric([outcome], n)
        yield from (processes, own, scraping, lookups)
