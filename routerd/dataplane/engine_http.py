"""The engine call's HTTP/1.1 client: keep-alive connections on asyncio Protocols, pooled per engine.

Why not aiohttp's ``ClientSession`` (which the scraper and the health checks keep using): on the
request path its per-request machinery — URL objects, request and response objects with header
multidicts, a task of its own that writes the body (one more event-loop iteration), timer contexts —
was the largest single share of routerd's CPU per request. This client does what the engine call
needs and nothing else:

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
* HTTP basic auth from the URL's userinfo (a static fleet's ``http://user:pw@host:port``), TLS for
  ``https`` with the default certificate checks.

Every error is an ``OSError`` (:class:`ConnectError`, :class:`Disconnected`, :class:`ProtocolError`)
or a ``TimeoutError`` (:class:`ConnectTimeout`, :class:`ReadTimeout`).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import urllib.parse
from collections.abc import Mapping
from typing import cast

_MAX_HEAD = 64 * 1024  # response line + headers; a chunk-size line is far shorter
_HIGH_WATER = 256 * 1024  # body bytes buffered before reading from the engine pauses
_MAX_TARGETS = 4096  # parsed URLs kept (instances come and go with restarts)

# where a connection is in its current exchange
_IDLE, _HEAD, _BODY, _DONE = range(4)
# how the body ends
_NONE, _LENGTH, _CHUNKED, _CLOSE = range(4)
# inside a chunked body
_CK_SIZE, _CK_DATA, _CK_CRLF, _CK_TRAILER = range(4)


class ConnectError(ConnectionError):
    """No connection to the engine could be made (refused, unreachable, a TLS failure)."""


class ConnectTimeout(TimeoutError):
    """No connection to the engine within ``connect_timeout_s``."""


class ReadTimeout(TimeoutError):
    """No byte from the engine for ``read_timeout_s`` while one was awaited."""


class Disconnected(ConnectionError):
    """The engine closed the connection before its response ended."""

    def __init__(self, message: str, *, unanswered: bool = False) -> None:
        super().__init__(message)
        self.unanswered = unanswered  # not one byte of the response had arrived


class ProtocolError(ConnectionError):
    """The engine's answer is not HTTP/1.x this client can read."""


class _Target:
    """An engine URL taken apart once: where to connect and the constant part of a request's head."""

    __slots__ = ("host", "key", "port", "prefix", "server_hostname", "tls")

    def __init__(self, url: str) -> None:
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
        head = f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n"
        if parts.username is not None or parts.password is not None:
            # As aiohttp does with a URL's userinfo: percent-decoded, latin-1.
            user = urllib.parse.unquote(parts.username or "")
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode("latin-1")).decode("ascii")
            head += f"Authorization: Basic {token}\r\n"
        self.prefix = head.encode("latin-1")


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
        self._idle: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._open: set[_Conn] = set()
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

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """Send ``body`` to ``url`` and wait for the response's head (status and headers).

        The caller reads the body from the :class:`Response` and then calls ``release()`` (read to its
        end: the connection may serve another request) or ``close()``.
        """
        target = self._target(url)
        head = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if head.count("\n") != len(headers) or head.count("\r") != len(headers):
            raise ValueError("a header name or value holds a line break")
        head += f"Content-Length: {len(body)}\r\n\r\n"
        request = target.prefix + head.encode("latin-1") + body
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
    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    def _take_idle(self, target: _Target) -> _Conn | None:
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

    async def _connect(self, target: _Target) -> _Conn:
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
                _, conn = await loop.create_connection(lambda: _Conn(self, target.key, loop), target.host,
                                                       target.port, ssl=tls,
                                                       server_hostname=target.server_hostname)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {target.host}:{target.port} within "
                                 f"{self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise ConnectError(f"cannot connect to {target.host}:{target.port}: {e}") from e
        self.connects += 1
        return conn

    def _release(self, conn: _Conn) -> None:
        if not conn.reusable():
            conn.close()
            return
        assert self._loop is not None
        conn.idle_since = self._loop.time()
        conn.state = _IDLE
        self._idle.setdefault(conn.key, []).append(conn)

    def _opened(self, conn: _Conn) -> None:
        self._open.add(conn)

    def _closed(self, conn: _Conn) -> None:
        self._open.discard(conn)
        conns = self._idle.get(conn.key)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._idle[conn.key]


class Response:
    """One response from an engine: status, headers (names in lower case), then the raw body."""

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, conn: _Conn, pool: EnginePool) -> None:
        self._conn: _Conn | None = conn
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
            self._pool._release(conn)

    def close(self) -> None:
        """Done with the response, whatever is left of it: its connection is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class _Conn(asyncio.Protocol):
    """One connection to an engine and the exchange in progress on it."""

    def __init__(self, pool: EnginePool, key: tuple[str, int, bool], loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self.key = key
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self.open = False
        self.state = _IDLE
        self.idle_since = 0.0
        self.status = 0
        self.headers: dict[str, str] = {}
        self._keep_alive = False
        self._framing = _NONE
        self._left = 0  # body bytes still expected (Content-Length), or of the current chunk
        self._chunk_state = _CK_SIZE
        self._buf = bytearray()  # bytes not parsed yet: a head or a chunk-size line in pieces
        self._body: list[bytes] = []
        self._body_size = 0
        self._answered = False  # a byte of the current response has arrived
        self._exc: BaseException | None = None
        self._eof = False  # the engine closed its side, or the connection is lost
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream transport (TCP or TLS)
        self.open = True
        self._pool._opened(self)

    def data_received(self, data: bytes) -> None:
        if self.state == _HEAD:
            self._answered = True
            self._buf += data
            self._parse_head()
        elif self.state == _BODY:
            self._feed(data)
        else:  # bytes nobody asked for (idle, or after the response's end): not reusable
            self._keep_alive = False
            if self.state == _IDLE:
                self.close()
        self._wake()

    def eof_received(self) -> bool:
        self._connection_ended(None)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._connection_ended(exc)
        self._pool._closed(self)
        self._wake()

    # the exchange -------------------------------------------------------------------------------
    def alive(self) -> bool:
        return not self._eof and self._transport is not None and not self._transport.is_closing()

    def send(self, request: bytes) -> None:
        """Start an exchange: the request goes out in one write (the transport buffers what the
        socket does not take at once; nothing waits on a drain)."""
        transport = self._transport
        if not self.alive() or transport is None:
            raise Disconnected("the connection to the engine is closed", unanswered=True)
        self.state = _HEAD
        self.status = 0
        self.headers = {}
        self._buf.clear()
        self._body.clear()
        self._body_size = 0
        self._answered = False
        self._exc = None
        if self._paused:  # the previous response was left unread in part
            self._paused = False
            transport.resume_reading()
        transport.write(request)

    async def wait_head(self) -> None:
        while self.state == _HEAD:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def readany(self) -> bytes:
        while True:
            if self._body:
                body = self._body
                chunk = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self._body_size = 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                return chunk
            if self._exc is not None:
                raise self._exc
            if self.state == _DONE:
                return b""
            await self._wait()

    def fail(self, exc: BaseException) -> None:
        """Fail the pending and every later read with ``exc`` (what was buffered is dropped)."""
        self._exc = exc
        self._body.clear()
        self._keep_alive = False
        self._wake()

    def reusable(self) -> bool:
        return (self.state == _DONE and self._keep_alive and self._exc is None and self.open
                and not self._buf and self._transport is not None and not self._transport.is_closing())

    def close(self) -> None:
        self._keep_alive = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # waiting ------------------------------------------------------------------------------------
    async def _wait(self) -> None:
        """Until bytes arrive or the connection ends (any byte ends the wait, so the silence is
        measured from the last one); :class:`ReadTimeout` after ``read_timeout_s`` without a byte."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(self._pool.read_timeout_s, self._read_timed_out)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _read_timed_out(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._keep_alive = False
            waiter.set_exception(ReadTimeout(f"no data from the engine for {self._pool.read_timeout_s:g} s"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # parsing ------------------------------------------------------------------------------------
    def _parse_head(self) -> None:
        while self.state == _HEAD:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    self._protocol_error("the response head is too large")
                return
            head = bytes(self._buf[:end])
            del self._buf[:end + 4]
            try:
                self._read_head(head)
            except ProtocolError as e:
                self._protocol_error(str(e))
                return
        if self._buf and self.state == _BODY:
            rest = bytes(self._buf)
            self._buf.clear()
            self._feed(rest)
        elif self._buf:  # bytes past a response without a body
            self._keep_alive = False
            self._buf.clear()

    def _read_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200 and status != 101:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name[-1] in " \t" or line[0] in " \t":
                raise ProtocolError(f"malformed header line: {line[:80]!r}")
            key = name.lower()
            value = value.strip(" \t")
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        self.status = status
        self.headers = headers
        connection = headers.get("connection", "").lower()
        self._keep_alive = ("close" not in connection if version == "HTTP/1.1"
                            else "keep-alive" in connection)
        self._framing, self._left = self._body_framing(status, headers)
        if self._framing == _CLOSE:
            self._keep_alive = False
        self.state = _DONE if self._framing == _NONE else _BODY
        self._chunk_state = _CK_SIZE

    def _body_framing(self, status: int, headers: dict[str, str]) -> tuple[int, int]:
        if status in (204, 304) or status < 200:
            return _NONE, 0
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if "content-length" in headers:
                self._keep_alive = False  # both: chunked wins (RFC 9112 §6.3), the connection is suspect
            return (_CHUNKED if coding.rsplit(",", 1)[-1].strip().lower() == "chunked" else _CLOSE), 0
        length = headers.get("content-length")
        if length is None:
            return _CLOSE, 0
        values = {v.strip() for v in length.split(",")}
        if len(values) != 1 or not (n := values.pop()).isdigit():
            raise ProtocolError(f"bad Content-Length: {length[:40]!r}")
        return (_LENGTH, int(n)) if int(n) else (_NONE, 0)

    def _feed(self, data: bytes) -> None:
        framing = self._framing
        if framing == _LENGTH:
            take = data[:self._left] if len(data) > self._left else data
            self._left -= len(take)
            self._append(take)
            if not self._left:
                self.state = _DONE
                if len(data) > len(take):
                    self._keep_alive = False  # bytes past the response's end
        elif framing == _CHUNKED:
            self._buf += data
            self._feed_chunked()
        else:
            self._append(data)

    def _feed_chunked(self) -> None:
        buf = self._buf
        pos = 0
        while self.state == _BODY and pos >= 0:
            last = pos
            if self._chunk_state == _CK_DATA:
                n = min(self._left, len(buf) - pos)
                if not n:
                    break
                self._append(bytes(buf[pos:pos + n]))
                pos += n
                self._left -= n
                if not self._left:
                    self._chunk_state = _CK_CRLF
            else:
                pos = self._chunk_line(buf, pos)
        if pos < 0:
            pos = last
        if self._exc is None:
            del buf[:pos]
            if self.state == _DONE and buf:  # bytes past the response's end
                self._keep_alive = False
                buf.clear()

    def _chunk_line(self, buf: bytearray, pos: int) -> int:
        """Parse the line at ``pos`` (a chunk's size, the CRLF that ends its data, a trailer); the
        position after it, or -1 when it has not fully arrived (or is malformed: then ``_exc``)."""
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            if len(buf) - pos > _MAX_HEAD:
                self._protocol_error("a chunk-size or trailer line is too long")
            return -1
        line = bytes(buf[pos:nl])
        if self._chunk_state == _CK_CRLF:
            if line:
                self._protocol_error("a chunk's data is longer than its size")
                return -1
            self._chunk_state = _CK_SIZE
        elif self._chunk_state == _CK_TRAILER:
            if not line:
                self.state = _DONE
        else:
            size = line.split(b";", 1)[0].strip()
            if not size or size.strip(b"0123456789abcdefABCDEF"):
                self._protocol_error(f"bad chunk size {size[:20]!r}")
                return -1
            self._left = int(size, 16)
            self._chunk_state = _CK_DATA if self._left else _CK_TRAILER
        return nl + 2

    def _append(self, data: bytes) -> None:
        if not data:
            return
        self._body.append(data)
        self._body_size += len(data)
        if self._body_size > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def _protocol_error(self, message: str) -> None:
        self._exc = ProtocolError(f"unreadable response from the engine: {message}")
        self._keep_alive = False
        self.close()

    def _connection_ended(self, exc: BaseException | None) -> None:
        if self._eof:
            return
        self._eof = True
        self._keep_alive = False
        if self.state == _BODY and self._framing == _CLOSE and exc is None:
            self.state = _DONE  # the connection's end is the body's end
        elif self.state in (_HEAD, _BODY) and self._exc is None:
            where = "before answering" if self.state == _HEAD else "before the response ended"
            reason = f": {exc}" if exc is not None else ""
            self._exc = Disconnected(f"the engine closed the connection {where}{reason}",
                                     unanswered=not self._answered)

