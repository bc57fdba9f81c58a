"""The HTTP listener of one :class:`~routerd.ingress.http.HttpIngress`: bind, stop intake, drain, close.

The daemon opens it on its ``AsyncExitStack``; the benchmarks and the test fixtures use the same
object, so the listener is started and stopped one way everywhere::

    async with HttpListener(plane.http) as listener:        # close() on the way out
        url = await listener.start(extra_routes=..., port=0)  # bind (port 0 picks a free one)
        ...
        await listener.stop_intake(); await listener.wait_idle(t); await listener.close_streams("…")
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from aiohttp import web

from .. import log
from .http import ExtraRoutes, HttpIngress

_log = log.get("routerd.listener")


class HttpListener:
    """One aiohttp runner and its sites for ``http``; ``close()`` is safe to call more than once."""

    def __init__(self, http: HttpIngress) -> None:
        self.http = http
        self.app: web.Application | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._sites: list[web.BaseSite] = []

    async def __aenter__(self) -> HttpListener:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self, extra_routes: ExtraRoutes | None = None, *, host: str | None = None,
                    port: int | None = None) -> str:
        """Bind the listener (``host``/``port`` default to ``http.*`` of the config); its base URL."""
        self.app = self.http.build_app(extra_routes)
        http_cfg = self.http.cfg.http
        # Connections are ClientConnection (bounded count, client timeouts): see ingress/_connections.py.
        # By the time the runner is cleaned up the drain is over and every handler was ended, so what
        # is left is at most a connection lingering over a refused body: 1 s, not aiohttp's 60.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._runner = runner
        assert runner.server is not None
        self.http.connections.install(runner.server)
        site = self.http.connections.site(runner, host or http_cfg.host,
                                          http_cfg.port if port is None else port, backlog=1024)
        await site.start()
        self._sites.append(site)
        bound = runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        _log.info("http_listening", url=self.url)
        return self.url

    async def stop_intake(self) -> None:
        """Stop taking new requests: close the listener; requests on open connections get 503, and so
        do those still receiving their bodies (a slowloris does not hold the drain)."""
        self.http.draining = True
        self.http.connections.end_pending_bodies("routerd is shutting down")
        for site in self._sites:
            await site.stop()
        self._sites.clear()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) until no HTTP request is in progress; True when idle."""
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self.http.idle.wait()
        except TimeoutError:
            return False
        return True

    async def close_streams(self, reason: str) -> None:
        """End what is still in flight: streams get a terminal error event saying ``reason``."""
        if not self.http.handlers:
            return
        self.http.close_reason = reason
        handlers = list(self.http.handlers)
        for task in handlers:
            task.cancel()
        await asyncio.wait(handlers, timeout=3.0)

    async def close(self) -> None:
        """Close the runner (and with it every open connection)."""
        runner, self._runner = self._runner, None
        self._sites.clear()
        if runner is not None:
            await runner.cleanup()
