"""``/metrics`` of a routerd with workers: the whole daemon's page, whichever worker answers.

The workers share one listening socket, so a scrape reaches one of them, chosen by the kernel. A page
of that worker's own figures alone would make every series flap from one scrape to the next (Prometheus
marks a series that a scrape lacks stale at once), and no scrape target can name one worker. So the
answering worker gives the page of all of them, as one target of a multi-process server is expected
to: each worker also serves its own page on a private Unix socket in the state dir
(``<state_dir>/workers/w<i>.sock``); the answering one reads its siblings' (each within
``_SIBLING_TIMEOUT_S``, concurrently), and every sample carries ``worker="<i>"``, so per-worker series
stay apart and ``sum without (worker)`` is the daemon's. A sibling that does not answer (it is being
started again) is left out of that scrape; ``routerd_workers_pages_missing`` says how many were. The
merged page is the text format (no exemplars).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .. import log

_log = log.get("routerd.worker_pages")

_SIBLING_TIMEOUT_S = 1.0  # a sibling's page, or the scrape goes on without it


class WorkerPages:
    """Worker ``index`` of ``count``: its own page served to its siblings, and the merged page."""

    def __init__(self, index: int, count: int, directory: Path, render: Callable[[], bytes]) -> None:
        self.index = index
        self.count = count
        self.directory = directory
        self._render = render  # this worker's own page, text format
        self._runner: web.AppRunner | None = None

    def path(self, index: int) -> Path:
        return self.directory / f"w{index}.sock"

    async def __aenter__(self) -> WorkerPages:
        """Serve this worker's own page on its socket (one started again replaces its old socket)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(self.index)
        path.unlink(missing_ok=True)
        app = web.Application()
        app.router.add_get("/metrics", self._own)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        self._runner = runner
        try:
            await web.UnixSite(runner, str(path)).start()
        except OSError as e:  # a state dir too deep for a socket's path: each worker's page is its own
            _log.warning("worker_page_not_shared", path=str(path), error=repr(e))
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        with contextlib.suppress(OSError):
            self.path(self.index).unlink(missing_ok=True)

    async def _own(self, _: web.Request) -> web.Response:
        return web.Response(body=self._render(), content_type="text/plain")

    async def _sibling(self, index: int) -> str | None:
        try:
            connector = aiohttp.UnixConnector(path=str(self.path(index)))
            timeout = aiohttp.ClientTimeout(total=_SIBLING_TIMEOUT_S)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s, \
                    s.get("http://worker/metrics") as r:
                if r.status != 200:
                    return None
                return await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def page(self) -> bytes:
        """Every worker's page, each sample labelled with its worker (text format)."""
        others = [i for i in range(self.count) if i != self.index]
        texts = await asyncio.gather(*(self._sibling(i) for i in others))
        pages = {self.index: self._render().decode()}
        pages.update({i: t for i, t in zip(others, texts, strict=True) if t is not None})
        missing = len(others) - (len(pages) - 1)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(pages, missing))
        data: bytes = generate_latest(registry)
        return data


class _Merged(Collector):
    """The pages' families, each family's samples from every page together, labelled by worker."""

    def __init__(self, pages: dict[int, str], missing: int) -> None:
        self._pages = pages
        self._missing = missing

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for index, text in sorted(self._pages.items()):
            worker = str(index)
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for s in family.samples:
                    merged.samples.append(s._replace(labels={**s.labels, "worker": worker}))
        yield from families.values()
        gauge = GaugeMetricFamily("routerd_workers_pages_missing",
                                  "Workers whose page this scrape could not read (left out of it)")
        gauge.add_metric([], self._missing)
        yield gauge
