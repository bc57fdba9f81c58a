"""One keep-alive HTTP/1.1 connection to an engine (an asyncio Protocol): a request written in one
``write``, the response parsed by ``httptools`` (llhttp, uvicorn's parser) — its head, and its body
framed by ``Content-Length``, chunked encoding or the connection's end — and the body handed over as
raw bytes as they arrive, with the read timeout; the caller reads it through
:class:`~routerd.dataplane.engine_http.Response`. llhttp costs fewer instructions per request than the
framing routerd wrote by hand before it, most of all per event of a chunked stream (docs/benchmarks.md,
"HTTP/1.1 framing").

The pooling of connections per engine, connecting, and what the engine call sees of all this are
:mod:`routerd.dataplane.engine_http` (its docstring says why routerd has its own client); a connection
knows its pool only as a :class:`Keeper`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

import httptools

_MAX_HEAD = 64 * 1024  # response line + headers (llhttp itself has no bound)
_HIGH_WATER = 256 * 1024  # body bytes buffered before reading from the engine pauses

# where a connection is in its current exchange
_IDLE, _HEAD, _BODY, _DONE = range(4)


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


class Keeper(Protocol):
    """What keeps a connection between exchanges (:class:`~routerd.dataplane.engine_http.EnginePool`)."""

    read_timeout_s: float

    def conn_opened(self, conn: Connection) -> None: ...

    def conn_closed(self, conn: Connection) -> None: ...  # lost or closed: not to be reused

    def conn_done(self, conn: Connection) -> None: ...  # its response read or dropped: reuse or close


class Connection(asyncio.Protocol):
    """One connection to an engine and the exchange in progress on it."""

    def __init__(self, pool: Keeper, key: tuple[str, int, bool], loop: asyncio.AbstractEventLoop) -> None:
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
        self._until_close = False  # the body ends with the connection
        self._parser = httptools.HttpResponseParser(self)  # calls the on_* methods below
        self._head_bytes = 0  # bytes received while the head is awaited
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
        self._pool.conn_opened(self)

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state in (_HEAD, _BODY):
            if self._exc is None:
                if state == _HEAD:
                    self._answered = True
                    self._head_bytes += len(data)
                self._parse(data)
        else:  # bytes nobody asked for (idle, or after the response's end): not reusable
            self._keep_alive = False
            if state == _IDLE:
                self.close()
        self._wake()

    def eof_received(self) -> bool:
        self._connection_ended(None)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._connection_ended(exc)
        self._pool.conn_closed(self)
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
        self._head_bytes = 0
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

    def park(self, now: float) -> None:
        """Idle in its pool from ``now``, ready for the next exchange."""
        self.idle_since = now
        self.state = _IDLE

    def reusable(self) -> bool:
        return (self.state == _DONE and self._keep_alive and self._exc is None and self.open
                and self._transport is not None and not self._transport.is_closing())

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

    # parsing: llhttp's callbacks ----------------------------------------------------------------
    def _parse(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._protocol_error("the engine switched protocols")
        except httptools.HttpParserError as e:
            if self.state == _DONE:  # bytes past the response's end that are no response
                self._keep_alive = False
            else:
                cause = e.__context__ if isinstance(e.__context__, ProtocolError) else e
                self._protocol_error(str(cause))
        else:
            if self.state == _HEAD and self._head_bytes > _MAX_HEAD:
                self._protocol_error("the response head is too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state == _HEAD:
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1").strip(" \t")
            headers = self.headers
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        elif self.state == _DONE:  # a second response on the heels of the first
            raise ProtocolError("bytes past the response's end")
        # else a chunked body's trailer: not kept

    def on_headers_complete(self) -> None:
        if self.state != _HEAD:
            raise ProtocolError("bytes past the response's end")
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200:
            self.headers = {}  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            return
        self.status = status
        headers = self.headers
        self._keep_alive = parser.should_keep_alive()
        coding = headers.get("transfer-encoding")
        self._until_close = status not in (204, 304) and (
            coding.rsplit(",", 1)[-1].strip().lower() != "chunked" if coding is not None
            else "content-length" not in headers)
        self.state = _BODY

    def on_body(self, body: bytes) -> None:
        self._append(body)

    def on_message_complete(self) -> None:
        if self.state == _BODY:  # not an interim answer's end
            self.state = _DONE

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
        if self.state == _BODY and self._until_close and exc is None:
            self.state = _DONE  # the connection's end is the body's end
        elif self.state in (_HEAD, _BODY) and self._exc is None:
            where = "before answering" if self.state == _HEAD else "before the response ended"
            reason = f": {exc}" if exc is not None else ""
            self._exc = Disconnected(f"the engine closed the connection {where}{reason}",
                                     unanswered=not self._answered)

