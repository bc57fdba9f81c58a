"""The engine call's HTTP/1.1 client: keep-alive connections on asyncio Protocols, pooled per engine.

Why not aiohttp's ``ClientSession``: on the request path its per-request machinery — URL objects,
request and response objects with header multidicts, a task of its own that writes the body (one more
event-loop iteration), timer contexts — was the largest single share of routerd's CPU per request (and
of the idle CPU of watching hundreds of engines: the scrapes and static heartbeats use ``fetch``).
This client does what the engine call needs and nothing else:

* one ``write`` per request: head and body together;
* a response framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the connection's end,
  its body handed over as raw bytes as they arrive (SSE passes through unchanged; nothing is
  decompressed: routerd asks for ``identity``); reading pauses while more than ``_HIGH_WATER`` bytes
  wait for a slow reader;
* timeouts: ``connect_timeout_s`` to connect (:class:`ConnectTimeout`), ``read_timeout_s`` without a
  byte from the engine while one is awaited (:class:`ReadTimeout`, aiohttp's ``sock_read``); the
  caller bounds the time to the first byte;
* a connection is reused only after a response read to its end with keep-alive. One idle for
  ``keepalive_s`` (below vLLM's 5 s) is not reused, one the engine closed leaves the pool at once, and
  a request sent on a reused connection that the engine closes without a byte of answer is sent once
  more on a new connection: the engine closed it idle, racing our write, and did not see the request;
* a response closed before its end closes its connection: that is how vLLM learns that the client is
  gone and aborts the request (cancellation, a lost instance);
* HTTP basic auth from the URL's userinfo (a static fleet's ``http://user:pw@host:port``), or the
  engine's API key (``Authorization: Bearer``, vLLM's ``--api-key``: routerd/trust.py) written into the
  constant part of the request's head once per URL, not per request; TLS for ``https`` with the default
  certificate checks.

The connection itself — the exchange on it, the response's framing — is
:mod:`routerd.dataplane.engine_conn`. Every error is an ``OSError`` (:class:`ConnectError`,
:class:`Disconnected`, :class:`ProtocolError`) or a ``TimeoutError`` (:class:`ConnectTimeout`,
:class:`ReadTimeout`).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import urllib.parse
from collections.abc import Mapping

from .engine_conn import (
    ConnectError,
    Connection,
    ConnectTimeout,
    Disconnected,
    Keeper,
    ProtocolError,
    ReadTimeout,
)

__all__ = ["ConnectError", "ConnectTimeout", "Disconnected", "EnginePool", "ProtocolError", "ReadTimeout",
           "Response"]

_MAX_TARGETS = 4096  # parsed URLs kept (instances come and go with restarts)


class _Target:
    """An engine URL taken apart once: where to connect and the constant part of a request's head."""

    __slots__ = ("bearer", "get", "host", "key", "port", "prefix", "server_hostname", "tls")

    def __init__(self, url: str, bearer: str = "") -> None:
        self.bearer = bearer
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ConnectError(f"not a usable engine URL: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConnectError(f"not an http(s) URL: scheme {parts.scheme!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.tls else 80)
        self.server_hostname = self.host if self.tls else None
        self.key = (self.host, self.port, self.tls)
        host = f"[{self.host}]" if ":" in self.host else self.host
        authority = host if port is None or port == (443 if self.tls else 80) else f"{host}:{port}"
        path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
        if parts.query:
            path += "?" + urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
        head = f" {path} HTTP/1.1\r\nHost: {authority}\r\n"
        if parts.username is not None or parts.password is not None:
            # As aiohttp does with a URL's userinfo: percent-decoded, latin-1.
            user = urllib.parse.unquote(parts.username or "")
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode("latin-1")).decode("ascii")
            head += f"Authorization: Basic {token}\r\n"
        elif bearer:
            if "\r" in bearer or "\n" in bearer:
                raise ValueError("an engine API key holds a line break")
            head += f"Authorization: Bearer {bearer}\r\n"
        self.prefix = ("POST" + head).encode("latin-1")
        self.get = ("GET" + head + "Accept-Encoding: identity\r\n\r\n").encode("latin-1")


class EnginePool:
    """Keep-alive connections to engines, for one :class:`~routerd.dataplane.upstream.Upstream`.

    No limit on connections: admission bounds how many requests run at once, and a pool wait would be
    an unbounded, untimed queue.
    """

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 4.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._ssl = ssl_context
        self._targets: dict[str, _Target] = {}
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._open: set[Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shut = False
        self.connects = 0  # connections opened, ever (tests and figures: how often one is reused)

    def configure(self, *, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s

    @property
    def idle(self) -> int:
        """Connections waiting in the pool."""
        return sum(len(c) for c in self._idle.values())

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], bearer: str = "") -> Response:
        """Send ``body`` to ``url`` and wait for the response's head (status and headers); ``bearer``:
        the engine's API key ("" none).

        The caller reads the body from the :class:`Response` and then calls ``release()`` (read to its
        end: the connection may serve another request) or ``close()``.
        """
        target = self._target(url, bearer)
        head = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if head.count("\n") != len(headers) or head.count("\r") != len(headers):
            raise ValueError("a header name or value holds a line break")
        head += f"Content-Length: {len(body)}\r\n\r\n"
        return await self._exchange(target, target.prefix + head.encode("latin-1") + body)

    async def fetch(self, url: str, limit: int) -> tuple[int, bytes]:
        """``GET url``: its status and whole body (``identity``-encoded). Past ``limit`` body bytes it
        raises :class:`ProtocolError`. The caller bounds the time (each wait for a byte is bounded by
        ``read_timeout_s``).

        What the scraper and the static heartbeats use to watch engines: a ``/metrics`` scrape costs a
        fraction of an aiohttp ``ClientSession.get`` (measured by ``routerd_bench.scale_idle``), which
        counts when hundreds of instances are watched."""
        target = self._target(url)
        resp = await self._exchange(target, target.get)
        try:
            parts: list[bytes] = []
            size = 0
            while chunk := await resp.readany():
                size += len(chunk)
                if size > limit:
                    raise ProtocolError(f"response body larger than {limit} bytes")
                parts.append(chunk)
        except BaseException:
            resp.close()
            raise
        resp.release()
        return resp.status, b"".join(parts)

    async def _exchange(self, target: _Target, request: bytes) -> Response:
        conn = self._take_idle(target)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(target)
        try:
            try:
                conn.send(request)
                await conn.wait_head()
            except Disconnected as e:
                if not (reused and e.unanswered):
                    raise
                conn.close()  # the engine closed it idle as we wrote: it never saw the request
                conn = await self._connect(target)
                conn.send(request)
                await conn.wait_head()
        except BaseException:
            conn.close()
            raise
        return Response(conn, self)

    async def run(self) -> None:
        """Until cancelled: close connections idle for ``keepalive_s`` (rather than leave them until
        the engine does); on the way out, close every connection and open no more."""
        try:
            while True:
                await asyncio.sleep(self.keepalive_s / 2)
                self.reap()
        finally:
            self.close()

    def reap(self) -> None:
        """Close the idle connections that will not be used again."""
        if self._loop is None:
            return
        oldest = self._loop.time() - self.keepalive_s
        for conns in list(self._idle.values()):
            for conn in [c for c in conns if c.idle_since <= oldest or not c.alive()]:
                conn.close()  # connection_lost takes it out of the pool

    def close(self) -> None:
        """Close every connection, idle or in use; later requests fail with :class:`ConnectError`."""
        self._shut = True
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    # internals --------------------------------------------------------------------------------
    def _target(self, url: str, bearer: str = "") -> _Target:
        target = self._targets.get(url)
        if target is None or target.bearer != bearer:  # the same str object each time: compared by identity
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            target = self._targets[url] = _Target(url, bearer)
        return target

    def _take_idle(self, target: _Target) -> Connection | None:
        conns = self._idle.get(target.key)
        if not conns:
            return None
        assert self._loop is not None
        oldest = self._loop.time() - self.keepalive_s
        while conns:
            conn = conns.pop()  # the most recently used: the others age out
            if conn.idle_since > oldest and conn.alive():
                if not conns:
                    del self._idle[target.key]
                return conn
            conn.close()
        del self._idle[target.key]
        return None

    async def _connect(self, target: _Target) -> Connection:
        if self._shut:
            raise ConnectError("routerd is closing its engine connections")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if target.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, target.key, loop), target.host, target.port, ssl=tls,
                                                       server_hostname=target.server_hostname)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {target.host}:{target.port} within "
                                 f"{self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise ConnectError(f"cannot connect to {target.host}:{target.port}: {e}") from e
        self.connects += 1
        return conn

    def conn_done(self, conn: Connection) -> None:
        if not conn.reusable():
            conn.close()
            return
        assert self._loop is not None
        conn.park(self._loop.time())
        self._idle.setdefault(conn.key, []).append(conn)

    def conn_opened(self, conn: Connection) -> None:
        self._open.add(conn)

    def conn_closed(self, conn: Connection) -> None:
        self._open.discard(conn)
        conns = self._idle.get(conn.key)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._idle[conn.key]


class Response:
    """One response from an engine: status, headers (names in lower case), then the raw body."""

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, conn: Connection, pool: Keeper) -> None:
        self._conn: Connection | None = conn
        self._pool = pool
        self.status = conn.status
        self.headers = conn.headers

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none has); ``b""`` at its end."""
        if self._conn is None:
            return b""
        return await self._conn.readany()

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def set_exception(self, exc: BaseException) -> None:
        """Make the pending and every later read raise ``exc``."""
        if self._conn is not None:
            self._conn.fail(exc)

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool if the body was read to its end
        and the engine keeps the connection alive; otherwise it is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.conn_done(conn)

    def close(self) -> None:
        """Done with the response, whatever is left of it: its connection is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
