"""The HTTP listener of one :class:`~routerd.ingress.http.HttpIngress`: bind, stop intake, drain, close.

The daemon opens it on its ``AsyncExitStack``; the benchmarks and the test fixtures use the same
object, so the listener is started and stopped one way everywhere::

    async with HttpListener(plane.http) as listener:        # close() on the way out
        url = await listener.start(extra_routes=..., port=0)  # bind (port 0 picks a free one)
        ...
        await listener.stop_intake(); await listener.wait_idle(t); await listener.close_streams("…")

Socket activation (``systemd/routerd.socket``): systemd binds the port and passes the listening socket
(``LISTEN_FDS``, fd 3 on); :func:`systemd_sockets` takes it and ``start(sockets=…)`` serves on it instead
of binding. The socket then outlives the process — systemd keeps its own copy — so a restart refuses no
connection: while one routerd drains and the next one starts, new connections wait in the kernel's
accept queue and are served by the next one. Draining such a listener is a *handover*: requests that
arrive on connections already open are still served rather than answered 503 (where else would they
go?), every response says ``Connection: close`` so the client's next request opens a connection the
next routerd accepts, and idle connections are closed only at the end.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import MutableMapping, Sequence
from types import TracebackType

from aiohttp import web

from .. import log
from .._net import server_tls
from ..errors import ShuttingDown
from ._connections import ClientConnection
from .http import ExtraRoutes, HttpIngress

_log = log.get("routerd.listener")

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): passed descriptors start here
_HANDOVER_CLOSE_S = 2.0  # at the end of a handover, open connections get this long to be ended cleanly
_HANDOVER_QUIET_S = 0.25  # ... and idle ones are closed once no request has run on any for this long
_ANSWER_S = 1.0  # at the end of a drain, requests waiting for admission get this long to be answered 503


class SocketActivationError(RuntimeError):
    """``LISTEN_FDS`` names a descriptor routerd cannot serve HTTP on (not a listening stream socket)."""


def systemd_sockets(environ: MutableMapping[str, str] | None = None) -> list[socket.socket]:
    """The listening sockets systemd passed to this process (socket activation), or ``[]``.

    Follows sd_listen_fds(3): only when ``LISTEN_PID`` is this process; the ``LISTEN_*`` variables are
    removed either way so that no child takes them for its own, and the descriptors are made
    close-on-exec so that no child (the Ray head, redis-server) holds the socket open.
    """
    env = os.environ if environ is None else environ
    pid, count = env.pop("LISTEN_PID", ""), env.pop("LISTEN_FDS", "")
    env.pop("LISTEN_FDNAMES", None)
    if pid != str(os.getpid()) or not count.isdigit():
        return []
    sockets: list[socket.socket] = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise SocketActivationError(f"LISTEN_FDS: fd {fd} is not a listening stream socket "
                                        f"(ListenStream= in routerd.socket)")
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def bind_sockets(host: str, port: int, backlog: int = 1024) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to (as aiohttp's own site binds), for
    processes that serve on them together (``[daemon] workers``): bound once here, inherited by each.
    Port 0 picks one free port, the same on every address."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _url(address: object, scheme: str = "http") -> str:
    if isinstance(address, tuple):
        host = str(address[0])
        return f"{scheme}://[{host}]:{address[1]}" if ":" in host else f"{scheme}://{host}:{address[1]}"
    return f"{scheme}+unix://{address!s}"


class HttpListener:
    """One aiohttp runner and its sites for ``http``; ``close()`` is safe to call more than once."""

    def __init__(self, http: HttpIngress) -> None:
        self.http = http
        self.app: web.Application | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._sites: list[web.BaseSite] = []
        self.inherited = False  # serving on sockets systemd holds: a drain hands over to the next routerd
        self._tls: ssl.SSLContext | None = None  # the HTTPS context new handshakes use

    async def __aenter__(self) -> HttpListener:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self, extra_routes: ExtraRoutes | None = None, *, host: str | None = None,
                    port: int | None = None, sockets: Sequence[socket.socket] = ()) -> str:
        """Serve on ``sockets`` (socket activation) if any, else bind ``host``/``port`` (default
        ``http.*`` of the config; port 0 picks a free one); returns the (first) base URL."""
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
        # TLS wraps each process's own site: socket activation and workers pass the listening socket
        # (plain TCP) on, and every process that accepts on it does its own handshakes.
        tls = None
        if http_cfg.tls_cert:
            # The sites keep this context; each handshake switches to the current one (SNI callback,
            # which OpenSSL calls for every ClientHello), so a reload can swap in a renewed certificate.
            tls = server_tls(http_cfg.tls_cert, http_cfg.tls_key)
            self._tls = tls
            tls.sni_callback = self._current_tls
        if sockets:
            # The accept queue's length is the socket unit's (Backlog=); listen() again must not cut it.
            new = [self.http.connections.site(runner, sock=s, backlog=socket.SOMAXCONN, tls=tls)
                   for s in sockets]
            self.inherited = True
        else:
            new = [self.http.connections.site(runner, host or http_cfg.host,
                                              http_cfg.port if port is None else port, backlog=1024, tls=tls)]
        for site in new:
            await site.start()
            self._sites.append(site)
        scheme = "https" if tls is not None else "http"
        self.url = _url(runner.addresses[0], scheme)
        _log.info("http_listening", url=self.url, urls=[_url(a, scheme) for a in runner.addresses],
                  socket_activated=self.inherited)
        return self.url

    def _current_tls(self, conn: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        if self._tls is not None and self._tls is not ctx:
            conn.context = self._tls

    def reload_tls(self) -> None:
        """SIGHUP: read the certificate and key again (a renewed certificate at the same paths, the
        paths being restart-only); new handshakes use them, open connections keep theirs. Files that
        no longer load leave the certificate in use, and say so."""
        if self._tls is None:
            return
        http_cfg = self.http.cfg.http
        try:
            fresh = server_tls(http_cfg.tls_cert, http_cfg.tls_key)  # a few KB read: not worth a thread
        except (OSError, ssl.SSLError) as e:
            _log.error("tls_reload_failed", cert=http_cfg.tls_cert, key=http_cfg.tls_key, error=str(e),
                       keeping="the certificate in use")
            return
        fresh.sni_callback = self._current_tls
        self._tls = fresh
        _log.info("tls_reloaded", cert=http_cfg.tls_cert)

    async def stop_intake(self) -> None:
        """Stop taking new connections (close our listening sockets).

        Bound here: requests on open connections get 503, and so do those still receiving their bodies
        (a slowloris does not hold the drain). Socket-activated: a handover (module docstring) — those
        requests are served, each response closing its connection."""
        self.http.draining = True
        self.http.handover = self.inherited
        if not self.inherited:
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
        """End what is still in flight: streams get a terminal error event saying ``reason``.

        After a handover, the open connections are first ended cleanly, within ``_HANDOVER_CLOSE_S``:
        busy ones after their answer, idle ones once no request has run on any old connection for
        ``_HANDOVER_QUIET_S``. A busy client picks its pooled connections one after another (each
        answer closing the one it used); closing an idle one while it still does would race with a
        request on its way. What is left at the end is closed with the runner."""
        server = self._runner.server if self._runner is not None else None
        if self.http.handover and server is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _HANDOVER_CLOSE_S
            limits = self.http.connections
            started, before = loop.time(), len(server.connections)
            while server.connections and loop.time() < deadline:
                conns = [c for c in server.connections if isinstance(c, ClientConnection)]
                quiet = (all(c.idle for c in conns)
                         and loop.time() - limits.last_request_end >= _HANDOVER_QUIET_S)
                for conn in conns:
                    conn.hand_over(close_idle=quiet)
                await asyncio.sleep(0.05)
            _log.info("http_handed_over", connections=before, left_open=len(server.connections),
                      took_s=round(loop.time() - started, 3))
        await self._answer_waiting(reason)
        if not self.http.handlers:
            return
        self.http.close_reason = reason
        handlers = list(self.http.handlers)
        for task in handlers:
            task.cancel()
        await asyncio.wait(handlers, timeout=3.0)

    async def _answer_waiting(self, reason: str) -> None:
        """Requests still waiting for an admission slot get 503 + ``Retry-After`` (OpenAI's JSON), and
        up to ``_ANSWER_S`` to write it, before the handlers left are cancelled: a request never sent
        to an engine is answered, not cut off by a closed connection."""
        pending = set(self.http.handlers)
        shed = self.http.admission.shed("http", lambda: ShuttingDown(reason))
        if not shed:
            return
        answered = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ANSWER_S
        while answered < shed and pending and loop.time() < deadline:
            done, pending = await asyncio.wait(pending, timeout=deadline - loop.time(),
                                               return_when=asyncio.FIRST_COMPLETED)
            answered += len(done)
        _log.info("http_waiting_answered", requests=shed, status=ShuttingDown.status)

    async def close(self) -> None:
        """Close the runner (and with it every open connection)."""
        runner, self._runner = self._runner, None
        self._sites.clear()
        if runner is not None:
            await runner.cleanup()
