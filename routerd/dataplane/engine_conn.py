"""One keep-alive HTTP/1.1 connection to an engine (an asyncio Protocol): a request written in one
``write``, the response's head parsed and its body framed (``Content-Length``, chunked, or the
connection's end) and handed over as raw bytes as they arrive, with the read timeout; the caller reads it
through :class:`~routerd.dataplane.engine_http.Response`.

The pooling of connections per engine, connecting, and what the engine call sees of all this are
:mod:`routerd.dataplane.engine_http` (its docstring says why routerd has its own client); a connection
knows its pool only as a :class:`Keeper`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

_MAX_HEAD = 64 * 1024  # response line + headers; a chunk-size line is far shorter
_HIGH_WATER = 256 * 1024  # body bytes buffered before reading from the engine pauses

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
        self._pool.conn_opened(self)

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

    def park(self, now: float) -> None:
        """Idle in its pool from ``now``, ready for the next exchange."""
        self.idle_since = now
        self.state = _IDLE

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

