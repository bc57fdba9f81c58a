"""The batches bundle (issue 31): the OpenAI Batch API's runner over the queue, its routes and its
``/metrics``. With the queue (Redis, a role that serves), unless ``[batches] enabled = false``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import Config
from .core import Core, Loops

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..batches import BatchRunner
    from .dataplane import DataPlane


class Batches:
    """One runner per process: it finds the batches nobody runs and runs them as queue jobs."""

    def __init__(self, core: Core, dataplane: DataPlane) -> None:
        from ..batches import BatchRunner, add_batch_routes

        tenancy = dataplane.tenancy
        assert core.redis is not None, "with the queue"
        self.runner: BatchRunner = BatchRunner(core.cfg, core.redis, tenancy, core.ident)
        runner = self.runner
        dataplane.http.batch_routes = lambda app: add_batch_routes(app, runner, tenancy)
        dataplane.http.batch_status = runner.status  # its part of /admin/fleets

    @classmethod
    def for_config(cls, core: Core, dataplane: DataPlane | None) -> Batches | None:
        if dataplane is None or dataplane.queue is None or not core.cfg.batches.enabled:
            return None
        return cls(core, dataplane)

    def loops(self) -> Loops:
        return {"batches": self.runner.run()}

    async def apply(self, cfg: Config) -> None:
        self.runner.update_config(cfg)

    def collectors(self) -> list[Collector]:
        from ..batches import BatchCollector

        return [BatchCollector(self.runner)]
