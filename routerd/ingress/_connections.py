"""Client connections of the HTTP listener: how many may be open, and how long each phase may take.

aiohttp bounds only the idle keep-alive time. Everything else a client controls was unbounded: a
slowloris that trickles its headers or its body, or a streaming client that stops reading, held its
connection (and, once admitted, its fleet's admission slot and an engine sequence) for as long as it
liked. :class:`ClientConnection` — aiohttp's own protocol class with four additions — closes:

- a connection whose request headers are not complete ``client_header_timeout_s`` after it opened (or,
  on a kept-alive connection, after the next request's first byte): a ``408`` in OpenAI's JSON, then close;
- a request whose body has not fully arrived ``client_body_timeout_s`` after its headers: the body
  read raises :class:`BodyTimeout` (a ``408`` from the handler), and the connection is closed after it
  (as after any body aiohttp cannot read: bad chunking, bad ``Content-Encoding``);
- a connection whose writes have not moved for ``client_write_timeout_s`` (the transport stayed paused
  above its high-water mark): aborted, which cancels the handler (``handler_cancellation``), releases
  the admission slot and closes the engine connection, so the engine aborts the generation;
- a connection beyond ``max_connections``: answered at once with ``503`` + ``Retry-After`` in OpenAI's
  JSON, without reading a request, and closed (the listener keeps accepting, so clients get an answer
  they can act on instead of a connect timeout).

It also answers aiohttp's own errors (a malformed request line, bad header bytes, headers too long) in
OpenAI's JSON rather than plain text, and gives every request an ``X-Request-Id``: the client's when it
is sane (1–128 printable ASCII characters), a new one otherwise.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import socket
import ssl
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import StreamReader, web
from multidict import CIMultiDictProxy

from .. import log, redact
from ..config import HttpConfig
from ..errors import RouterdError, ShuttingDown, error_json, error_type, quote
from ..telemetry import Telemetry

_log = log.get("routerd.http")

REQUEST_ID = web.RequestKey("request_id", str)
_SANE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
_REFUSED_LINGER_S = 2.0  # a refused client gets this long to read its 503 before the socket closes

RequestHandlerFn = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class BodyTimeout(RouterdError):
    """The request body did not arrive within ``client_body_timeout_s`` (raised by the body's reader)."""

    status, type = 408, "RequestTimeoutError"


def new_request_id() -> str:
    """32 random hex digits (what ``uuid4().hex`` gives, from the same ``os.urandom``, for an eighth of
    the work: most clients send no id, so this runs for most requests)."""
    return os.urandom(16).hex()


def client_request_id(headers: CIMultiDictProxy[str]) -> str:
    """The client's ``X-Request-Id`` when it is 1–128 printable ASCII characters, else a new one."""
    sent = headers.get("X-Request-Id", "")
    return sent if _SANE_REQUEST_ID.fullmatch(sent) else new_request_id()


def request_id(request: web.BaseRequest) -> str:
    """This request's id (assigned once, on first use)."""
    try:
        return request[REQUEST_ID]
    except KeyError:
        rid = request[REQUEST_ID] = client_request_id(request.headers)
        return rid


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An error answer in OpenAI's shape for a status routerd did not raise itself (aiohttp's)."""
    return web.Response(status=status, body=error_json(message, error_type(status), status),
                        content_type="application/json", headers=headers)


def _raw_answer(status: int, message: str, extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 error response as bytes, for a connection no request handler serves."""
    body = error_json(message, error_type(status), status)
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Request-Id: {new_request_id()}\r\n{extra_headers}"
            "Connection: close\r\n\r\n")
    return head.encode("ascii") + body


class ClientConnections:
    """The listener's connection bounds (``[http]`` timeouts and ``max_connections``); one per ingress.

    :meth:`install` hooks the per-request entry of an aiohttp server, :meth:`site` makes the listener
    whose connections are :class:`ClientConnection`. Settings are read when used, so a reload applies
    to the next connection or request."""

    def __init__(self, cfg: HttpConfig, telemetry: Telemetry) -> None:
        self.cfg = cfg
        self.telemetry = telemetry
        self.open = 0  # counted connections (refused ones are not)
        self.last_request_end = 0.0  # loop time the last request on any connection ended (a handover's quiet)
        # The bodies still arriving, with their connections (a request itself is not hashable).
        self._receiving: dict[StreamReader, web.RequestHandler] = {}
        telemetry.http_connections.set_function(lambda: self.open)

    def update_config(self, cfg: HttpConfig) -> None:
        self.cfg = cfg

    def shed(self, reason: str, conn: ClientConnection, *, quiet: bool = False, **fields: Any) -> None:
        """Count (and log, unless ``quiet``) a connection routerd closes or refuses itself."""
        self.telemetry.http_connections_shed.labels(reason).inc()
        if not quiet:
            _log.info("client_connection_shed", reason=reason, remote=conn.remote(), **fields)

    # wiring ------------------------------------------------------------------------------------
    def install(self, server: web.Server) -> None:
        """Wrap ``server``'s request entry point (before routing and middlewares) with :meth:`_serve`."""
        server.request_handler = self._wrap(server.request_handler)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = self.cfg.max_connections + 256  # client sockets, plus engines, Redis, Ray and slack
        if soft != resource.RLIM_INFINITY and soft < need:
            _log.warning("http_max_connections_above_fd_limit", max_connections=self.cfg.max_connections,
                         fd_limit=soft, hint=f"raise the open-files limit to {need} (LimitNOFILE=) "
                         "or lower http.max_connections")

    def site(self, runner: web.BaseRunner, host: str | None = None, port: int | None = None, *,
             sock: socket.socket | None = None, backlog: int = 1024,
             tls: ssl.SSLContext | None = None) -> web.BaseSite:
        """A listener on ``host``:``port``, or on ``sock`` already bound (socket activation); HTTPS
        with ``tls``, whose handshake must end within ``client_header_timeout_s``."""
        return _Site(runner, self, host, port, sock=sock, backlog=backlog, tls=tls)

    def connection(self, server: web.Server) -> ClientConnection:
        """The protocol factory of the listener (aiohttp's ``Server()`` with our class)."""
        kwargs: dict[str, Any] = {"keepalive_timeout": self.cfg.keepalive_timeout_s, "access_log": None}
        return ClientConnection(server, self, loop=asyncio.get_running_loop(), **kwargs)

    def _wrap(self, handler: RequestHandlerFn) -> RequestHandlerFn:
        async def serve(request: web.BaseRequest) -> web.StreamResponse:
            return await self._serve(request, handler)
        return serve

    # one request -------------------------------------------------------------------------------
    async def _serve(self, request: web.BaseRequest, handler: RequestHandlerFn) -> web.StreamResponse:
        """Every request: its id, the end of the header phase, the body deadline, and JSON for what
        aiohttp raises before the middlewares run (its ``Expect:`` handling)."""
        log.bind_request_id(request_id=request_id(request))
        conn = request.protocol if isinstance(request.protocol, ClientConnection) else None
        if conn is not None:
            conn.request_started(request)
        timer: asyncio.TimerHandle | None = None
        if request.body_exists and not request.content.is_eof():
            self._receiving[request.content] = request.protocol
            timer = (conn._timers if conn is not None else asyncio.get_running_loop()).call_later(
                self.cfg.client_body_timeout_s, self._body_expired, request, conn)
        try:
            try:
                response = await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                response = http_error(e.status, quote(e.text or e.reason))
            if request.content.exception() is not None:
                # The body failed (timed out, bad chunking or encoding): nothing more is read from this
                # connection. Ending the body here also keeps aiohttp's lingering read of the rest from
                # raising the same error again as an unhandled one.
                if not response.prepared:
                    response.force_close()
                request.content.feed_eof()
                request.protocol.close()
            return response
        finally:
            if timer is not None:
                timer.cancel()
            self._receiving.pop(request.content, None)
            if conn is not None:
                conn.request_finished()

    def end_pending_bodies(self, reason: str) -> None:
        """On drain: a request still receiving its body is answered 503 now rather than holding the
        drain for up to ``client_body_timeout_s`` (it was never going to be forwarded before the end)."""
        for body, protocol in list(self._receiving.items()):
            if not body.is_eof():
                body.set_exception(ShuttingDown(reason))
                protocol.close()

    def _body_expired(self, request: web.BaseRequest, conn: ClientConnection | None) -> None:
        if request.content.is_eof():
            return  # all of it arrived; the handler just has not read it yet
        timeout = self.cfg.client_body_timeout_s
        request.content.set_exception(BodyTimeout(f"the request body did not arrive within {timeout:g} s"))
        if conn is not None:
            self.shed("body_timeout", conn, path=quote(request.path))
            conn.close()  # stop reading it; close once the handler has answered


class ClientConnection(web.RequestHandler):
    """aiohttp's HTTP protocol with the header and write timeouts and the connection bound."""

    __slots__ = ("_busy", "_header_timer", "_last_body", "_limits", "_partial", "_refused", "_timers",
                 "_write_timer", "close_reason")

    def __init__(self, manager: web.Server, limits: ClientConnections, *, loop: asyncio.AbstractEventLoop,
                 **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._limits = limits
        self._timers = loop  # kept: Python 3.11's get_running_loop() is a getpid() syscall per call
        self._refused = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._busy = False  # a request is being handled
        self._partial = False  # bytes of a request whose headers are not complete yet
        self._last_body: Any = None  # the previous request's body stream (its tail is not a new request)
        self.close_reason = ""  # why routerd closed this connection, for the request's log line

    def remote(self) -> str:
        peer = self.peername
        return str(peer[0]) if isinstance(peer, tuple) else str(peer or "")

    # asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        limits = self._limits
        if limits.open >= limits.cfg.max_connections:
            self._refuse(transport)
            return
        limits.open += 1
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped, so closing later sends FIN rather than a reset
        if not self._busy and (self._last_body is None or self._last_body.is_eof()):
            self._partial = True
            if self._header_timer is None:
                self._arm_header_timer()
        super().data_received(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None and not self._refused:
            self._write_timer = self._timers.call_later(
                self._limits.cfg.client_write_timeout_s, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = None
        if self._refused:
            return  # aiohttp never saw this connection
        self._limits.open -= 1
        super().connection_lost(exc)

    # aiohttp's own error answers (malformed request line, bad header bytes, headers too long) -------
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response "
                                  "with the error message")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            text = "internal error in routerd"
        else:
            # aiohttp quotes the line it could not parse: a key in its query string or a secret
            # header's value would be logged whole (a key configured as sha256: is unknown to the log).
            said = message or str(exc or HTTPStatus(status).phrase)
            text = f"malformed HTTP request: {quote(redact.request_head(said))}"
            _log.info("bad_http_request", status=status, error=text, remote=self.remote())
        response = http_error(status, text, headers={"X-Request-Id": new_request_id()})
        response.force_close()
        return response

    # the request's phases (called by ClientConnections._serve) -------------------------------------
    def request_started(self, request: web.BaseRequest) -> None:
        self._busy = True
        self._partial = False
        self._last_body = request.content
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def request_finished(self) -> None:
        self._busy = False
        self._limits.last_request_end = self._timers.time()

    def hand_over(self, *, close_idle: bool) -> None:
        """End this connection so that its client's next request opens a new one (a socket-activated
        drain, routerd/ingress/listener.py).

        A request in progress (aiohttp's own flag: its handler runs or its answer is being written):
        the connection closes once the answer is sent. A request arriving: its answer says
        ``Connection: close``, which ends it. Idle: closed only with ``close_idle`` — a request its
        client sends just as the server closes it fails, so the caller waits until clients have
        stopped sending on old connections."""
        if self._request_in_progress:
            self.close()  # no waiter while a request runs: this only marks it to close after the answer
        elif close_idle and not self._partial:
            self.force_close()

    @property
    def idle(self) -> bool:
        return not self._request_in_progress and not self._partial

    # expiry -------------------------------------------------------------------------------------
    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        self._refused = True
        transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        # A flood of refusals shows in the counter, not as a flood of log lines.
        self._limits.shed("refused", self, quiet=True)
        transport.write(_raw_answer(503, f"routerd is at its connection limit "
                                    f"(http.max_connections = {self._limits.cfg.max_connections}); "
                                    "retry shortly", "Retry-After: 1\r\n"))
        if transport.can_write_eof():
            transport.write_eof()
        # The client normally reads the answer and closes; this bounds one that does not (the header
        # timer's slot is free: a refused connection has no header phase).
        self._header_timer = self._timers.call_later(_REFUSED_LINGER_S, transport.close)

    def _arm_header_timer(self) -> None:
        self._header_timer = self._timers.call_later(
            self._limits.cfg.client_header_timeout_s, self._header_expired)

    def _header_expired(self) -> None:
        self._header_timer = None
        transport = self.transport
        if self._busy or transport is None or transport.is_closing():
            return
        timeout = self._limits.cfg.client_header_timeout_s
        # Mid-request: say why. A new connection that sent nothing is closed quietly (a preconnect).
        self._limits.shed("header_timeout", self, quiet=not self._partial)
        if self._partial:
            transport.write(_raw_answer(408, f"the request headers did not arrive within {timeout:g} s"))
        self.force_close()

    def _write_expired(self) -> None:
        self._write_timer = None
        transport = self.transport
        if transport is None:
            return
        timeout = self._limits.cfg.client_write_timeout_s
        self.close_reason = f"the client read nothing for {timeout:g} s"
        self._limits.shed("write_timeout", self)
        transport.abort()  # close() would wait for the unread buffer to drain, which never happens


class _Site(web.BaseSite):
    """A TCP listener like ``web.TCPSite`` (or ``web.SockSite``, given ``sock``) whose connections are
    :class:`ClientConnection`."""

    __slots__ = ("_connections", "_host", "_port", "_sock", "_tls")

    def __init__(self, runner: web.BaseRunner, connections: ClientConnections, host: str | None,
                 port: int | None, *, sock: socket.socket | None = None, backlog: int,
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._sock, self._connections = host, port, sock, connections
        self._tls = tls

    @property
    def name(self) -> str:
        if self._sock is not None:
            return f"fd {self._sock.fileno()}"
        return f"{'https' if self._tls else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {}
        if self._tls is not None:
            tls = {"ssl": self._tls, "ssl_handshake_timeout": self._connections.cfg.client_header_timeout_s}
        if self._sock is not None:
            self._server = await loop.create_server(lambda: self._connections.connection(server),
                                                    sock=self._sock, backlog=self._backlog, **tls)
        else:
            assert self._port is not None, "a port, or a socket"
            self._server = await loop.create_server(
                lambda: self._connections.connection(server), self._host, self._port, backlog=self._backlog,
                **tls)
