"""The engine-watching bundle: load scrapes, static engines' rotation and heartbeats, the file_sd list.

In every role: a worker reads the scrapes the controller shares and the static rotation it follows (its
static instances still registered here, to route to); the daemon writes the one file_sd list.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .. import config as config_mod
from ..config import Config
from ..dataplane.engine_http import EnginePool
from ..file_sd import FileSdWriter
from ..fleet.static import StaticHealth
from ..routing import Scraper
from .core import Core, Loops, Role, while_controlling

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..peers import SharedMeasures


class EngineWatch:
    """Scraper, static health and the file_sd writer over their own lean keep-alive pool."""

    def __init__(self, core: Core, measures: SharedMeasures | None) -> None:
        cfg, self.core = core.cfg, core
        # Watching engines (scrapes, static heartbeats) on lean keep-alive connections of its own, apart
        # from the engine calls': with hundreds of instances aiohttp's per-request cost was most of it.
        self.pool = EnginePool(connect_timeout_s=cfg.routing.connect_timeout_s,
                               read_timeout_s=cfg.routing.scrape_timeout_s)
        self.scraper = Scraper(core.registry, core.session, cfg.routing, core.telemetry, clock=core.clock,
                               rng=core.rng, shared=measures.scrapes if measures is not None else None,
                               fetch=self.pool.fetch)
        self.static_health = StaticHealth(cfg, core.registry, core.session, clock=core.clock, rng=core.rng,
                                          fetch=self.pool.fetch)
        sd_path = (Path(cfg.daemon.file_sd_path) if cfg.daemon.file_sd_path
                   else config_mod.state_dir(cfg) / "file_sd" / "engines.json")
        self.file_sd = FileSdWriter(core.registry, sd_path)
        self.static_health.sync(cfg)  # the static fleets' instances registered

    def loops(self) -> Loops:
        # A follower does not probe static engines: their rotation is the controller's, followed.
        controls = self.core.controls
        static = self.static_health.run() if controls is None \
            else while_controlling(controls, self.static_health.run)
        loops: Loops = {"scraper": self.scraper.run(), "static_health": static, "watch_pool": self.pool.run()}
        if self.core.role is not Role.WORKER:  # one file for Prometheus, written by the daemon
            loops["file_sd"] = self.file_sd.run()
        return loops

    async def apply(self, cfg: Config) -> None:
        self.scraper.update_config(cfg.routing)
        self.static_health.update_config(cfg)
        self.pool.configure(connect_timeout_s=cfg.routing.connect_timeout_s,
                            read_timeout_s=cfg.routing.scrape_timeout_s)
        self.static_health.sync(cfg)
        registry = self.core.registry
        for name in registry.fleets():
            if cfg.fleet(name) is None and not registry.instances(name):
                registry.drop_fleet(name)

    def collectors(self) -> list[Collector]:
        return []
