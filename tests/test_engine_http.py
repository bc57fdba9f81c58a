"""The engine call's HTTP/1.1 client (routerd/dataplane/engine_http.py, engine_conn.py) against real sockets.

Each test runs a TCP server whose bytes on the wire are exact (framing split at awkward places, a
connection closed at the worst moment, a server that stalls), which an HTTP framework would not let a
test choose. What upstream.py relies on: bodies framed by Content-Length, chunked encoding or the
connection's end; keep-alive reuse, and never a stale connection counted as a failure; every wait
bounded; a response closed early closes its connection, so the engine sees the client go.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from routerd.dataplane.engine_http import (
    ConnectError,
    ConnectTimeout,
    Disconnected,
    EnginePool,
    ProtocolError,
    ReadTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
JSON = {"Content-Type": "application/json"}


class RawServer:
    """A TCP server on a free loopback port; ``handler`` serves each connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body) of every request read
        self.closed_by_peer = 0  # connections the client closed (EOF seen while reading)
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self, tls: ssl.SSLContext | None = None) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=tls)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        return self.url

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
        """One request (head, body), or None when the client closed the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_peer += 1
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        return head, body

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def server() -> AsyncIterator[Callable[[Handler], Awaitable[RawServer]]]:
    servers: list[RawServer] = []

    async def make(handler: Handler) -> RawServer:
        s = RawServer(handler)
        await s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        await s.stop()


@pytest.fixture
async def pool() -> AsyncIterator[EnginePool]:
    p = EnginePool(connect_timeout_s=2.0, read_timeout_s=5.0, keepalive_s=4.0)
    yield p
    p.close()
    await asyncio.sleep(0)


def answer(body: bytes, *, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status.encode(), len(body), extra, body)


def chunked(*pieces: bytes, trailer: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    for i, p in enumerate(pieces):
        ext = b";ext=1" if i == 0 else b""  # a chunk extension is ignored
        out += b"%x%s\r\n%s\r\n" % (len(p), ext, p)
    return out + b"0\r\n" + trailer + b"\r\n"


def keep_answering(reply: Callable[[bytes], bytes], server_ref: list[RawServer]) -> Handler:
    """A keep-alive handler: every request on the connection gets ``reply(body)``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (req := await server_ref[0].read_request(reader)) is not None:
            writer.write(reply(req[1]))
            await writer.drain()

    return handle


async def keep_alive_server(server: Callable[[Handler], Awaitable[RawServer]],
                            reply: Callable[[bytes], bytes]) -> RawServer:
    ref: list[RawServer] = []
    s = await server(keep_answering(reply, ref))
    ref.append(s)
    return s


async def test_content_length_bodies_and_one_connection_reused(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    s = await keep_alive_server(server, lambda body: answer(b'{"echo": ' + body + b"}"))
    for i in range(5):
        resp = await pool.post(s.url + "/v1/completions", b'"%d"' % i, {**JSON, "X-Request-Id": f"r{i}"})
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/json"
        assert await resp.read() == b'{"echo": "%d"}' % i
        resp.release()
    assert (s.connections, pool.connects, pool.idle) == (1, 1, 1)
    head, body = s.requests[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in head
    assert b"\r\nX-Request-Id: r0\r\n" in head
    assert b"\r\nContent-Length: 3\r\n" in head
    assert body == b'"0"'


async def test_the_engine_api_key_goes_in_every_request_head_once(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    s = await keep_alive_server(server, lambda body: answer(b"ok"))
    for key in ("rtd-one", "rtd-one", "rtd-two", ""):  # a reload may change a static fleet's key
        resp = await pool.post(s.url + "/v1/completions", b"{}", JSON, key)
        assert await resp.read() == b"ok"
        resp.release()
    heads = [head for head, _ in s.requests]
    assert [h.count(b"Authorization") for h in heads] == [1, 1, 1, 0]
    assert all(b"\r\nAuthorization: Bearer rtd-one\r\n" in h for h in heads[:2])
    assert b"\r\nAuthorization: Bearer rtd-two\r\n" in heads[2]
    with pytest.raises(ValueError, match="line break"):  # no header of ours smuggled in by a key
        await pool.post(s.url + "/v1/completions", b"{}", JSON, "k\r\nX-Evil: 1")


async def test_chunked_body_split_at_every_byte_passes_through_raw(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    events = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
    wire = chunked(*events, trailer=b"X-Trailer: t\r\n")
    ref: list[RawServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await ref[0].read_request(reader) is not None:
            for i in range(len(wire)):  # one byte per segment
                writer.write(wire[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0)

    s = await server(handle)
    ref.append(s)
    for _ in range(2):
        resp = await pool.post(s.url + "/v1/completions", b"{}", JSON)
        assert resp.headers["transfer-encoding"] == "chunked"
        got = b""
        while chunk := await resp.readany():
            got += chunk
        assert got == b"".join(events)  # de-chunked, nothing added or lost
        resp.release()
    assert s.connections == 1  # the chunked response ended cleanly: its connection was reused


async def test_a_body_ended_by_the_connection_is_read_and_not_reused(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    ref: list[RawServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\": ")
        await writer.drain()
        writer.write(b"1}")
        writer.close()

    s = await server(handle)
    ref.append(s)
    for _ in range(2):
        resp = await pool.post(s.url + "/x", b"{}", JSON)
        assert await resp.read() == b'{"a": 1}'
        resp.release()
    assert (s.connections, pool.idle) == (2, 0)


async def test_no_body_statuses_and_http10_without_keep_alive(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    s = await keep_alive_server(server,
                                lambda _: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
    resp = await pool.post(s.url + "/x", b"{}", JSON)
    assert (resp.status, await resp.read()) == (204, b"")  # the interim 100 is skipped
    resp.release()
    assert pool.idle == 1
    s10 = await keep_alive_server(server, lambda _: b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
    resp = await pool.post(s10.url + "/x", b"{}", JSON)
    assert await resp.read() == b"ok"
    resp.release()
    assert pool.idle == 1  # only the HTTP/1.1 one: HTTP/1.0 without keep-alive closes


def closing_server(close_after: Callable[[int, int], str], ref: list[RawServer]) -> Handler:
    """A keep-alive handler asking ``close_after(connection, request)`` what to do with each request
    on the connection: ``"answer"``, ``"answer_close"`` (answer, then close it) or ``"abort"``
    (read it and close without a byte of answer)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ref[0].connections
        n = 0
        while await ref[0].read_request(reader) is not None:
            n += 1
            what = close_after(conn, n)
            if what == "abort":
                writer.transport.abort()
                return
            writer.write(answer(b"ok"))
            await writer.drain()
            if what == "answer_close":
                return

    return handle


async def closing(server: Callable[[Handler], Awaitable[RawServer]],
                  close_after: Callable[[int, int], str]) -> RawServer:
    ref: list[RawServer] = []
    s = await server(closing_server(close_after, ref))
    ref.append(s)
    return s


async def ok(pool: EnginePool, url: str) -> None:
    resp = await pool.post(url + "/x", b"{}", JSON)
    assert (resp.status, await resp.read()) == (200, b"ok")
    resp.release()


async def test_a_kept_alive_connection_the_engine_closed_is_never_a_failure(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    """The engine closes idle connections (uvicorn after 5 s). Seen in time, the connection leaves the
    pool; racing our write (the engine takes the request and closes without a byte), the request is
    sent once more on a new connection — the engine never processed it."""
    noticed = await closing(server, lambda conn, n: "answer_close")
    await ok(pool, noticed.url)
    await asyncio.sleep(0.1)  # the close arrives while the connection is idle
    assert pool.idle == 0
    await ok(pool, noticed.url)
    assert noticed.connections == 2

    raced = await closing(server, lambda conn, n: "abort" if (conn, n) == (1, 2) else "answer")
    await ok(pool, raced.url)
    await ok(pool, raced.url)  # sent on the kept-alive connection, closed unanswered, sent again
    assert (raced.connections, len(raced.requests)) == (2, 3)

    # A new connection closed without an answer is the engine failing: no second try.
    failing = await closing(server, lambda conn, n: "abort")
    with pytest.raises(Disconnected):
        await pool.post(failing.url + "/x", b"{}", JSON)
    assert failing.connections == 1


async def test_connect_refused_and_connect_timeout(pool: EnginePool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectError):
            await pool.post(f"http://127.0.0.1:{port}/x", b"{}", JSON)
    # A listener that never accepts, its backlog full: SYNs are dropped and connect hangs.
    slow = EnginePool(connect_timeout_s=0.3, read_timeout_s=5.0)
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(0)
        port = lsock.getsockname()[1]
        fillers = []
        try:
            for _ in range(8):
                f = socket.socket()
                f.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    f.connect(("127.0.0.1", port))
                fillers.append(f)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(ConnectTimeout):
                await slow.post(f"http://127.0.0.1:{port}/x", b"{}", JSON)
            assert loop.time() - t0 < 2.0
        finally:
            for f in fillers:
                f.close()
            slow.close()


async def test_read_timeout_while_waiting_for_the_head_and_for_the_body(
        server: Callable[[Handler], Awaitable[RawServer]]) -> None:
    ref: list[RawServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = await ref[0].read_request(reader)
        assert req is not None
        if req[1] == b"body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
            await writer.drain()
        await asyncio.sleep(30)

    s = await server(handle)
    ref.append(s)
    short = EnginePool(connect_timeout_s=2.0, read_timeout_s=0.3)
    try:
        with pytest.raises(ReadTimeout):
            await short.post(s.url + "/x", b"head", JSON)
        resp = await short.post(s.url + "/x", b"body", JSON)
        assert await resp.readany() == b"12345"
        with pytest.raises(ReadTimeout):
            await resp.readany()
        resp.close()
        assert short.idle == 0
    finally:
        short.close()


async def test_cancelling_a_call_closes_its_connection_so_the_engine_sees_it(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    ref: list[RawServer] = []
    gone = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].read_request(reader)
        if await reader.read(1) == b"":  # nothing more comes: EOF when the client closes
            gone.set()

    s = await server(handle)
    ref.append(s)
    call = asyncio.create_task(pool.post(s.url + "/x", b"{}", JSON))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(gone.wait(), 2.0)
    assert pool.idle == 0


async def test_closing_a_response_mid_body_closes_the_connection(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    ref: list[RawServer] = []
    gone = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        if await reader.read(1) == b"":
            gone.set()

    s = await server(handle)
    ref.append(s)
    resp = await pool.post(s.url + "/x", b"{}", JSON)
    assert await resp.readany() == b"hello"
    resp.release()  # not read to its end: closed, not pooled
    await asyncio.wait_for(gone.wait(), 2.0)
    assert pool.idle == 0


async def test_a_stream_cut_mid_body_returns_what_came_then_fails(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    ref: list[RawServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nwo")
        await writer.drain()
        writer.transport.abort()

    s = await server(handle)
    ref.append(s)
    resp = await pool.post(s.url + "/x", b"{}", JSON)
    got = b""
    while len(got) < 7:
        got += await resp.readany()
    assert got == b"hellowo"  # what came before the cut reaches the reader ...
    with pytest.raises(Disconnected):  # ... then the cut
        await resp.readany()
    resp.close()


async def test_set_exception_fails_the_pending_read(server: Callable[[Handler], Awaitable[RawServer]],
                                                    pool: EnginePool) -> None:
    ref: list[RawServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    s = await server(handle)
    ref.append(s)
    resp = await pool.post(s.url + "/x", b"{}", JSON)
    read = asyncio.create_task(resp.readany())
    await asyncio.sleep(0.05)
    resp.set_exception(ConnectionAbortedError("instance lost"))
    with pytest.raises(ConnectionAbortedError):
        await read
    resp.close()


@pytest.mark.parametrize("wire", [
    b"SPDY/3 200 OK\r\n\r\n",
    b"HTTP/1.1 2x0 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded: header\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
])
async def test_unreadable_answers_are_protocol_errors(server: Callable[[Handler], Awaitable[RawServer]],
                                                      pool: EnginePool, wire: bytes) -> None:
    ref: list[RawServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].read_request(reader)
        writer.write(wire)
        await writer.drain()
        await asyncio.sleep(5)

    s = await server(handle)
    ref.append(s)
    async def call() -> None:
        resp = await pool.post(s.url + "/x", b"{}", JSON)
        try:
            await resp.read()
        finally:
            resp.close()

    with pytest.raises(ProtocolError):
        await call()
    assert pool.idle == 0


async def test_basic_auth_from_the_url_userinfo(server: Callable[[Handler], Awaitable[RawServer]],
                                                pool: EnginePool) -> None:
    s = await keep_alive_server(server, lambda _: answer(b"ok"))
    url = s.url.replace("http://", "http://us%40er:p%3Ass@")
    resp = await pool.post(url + "/v1/completions", b"{}", JSON)
    assert await resp.read() == b"ok"
    resp.release()
    head = s.requests[0][0]
    token = base64.b64encode(b"us@er:p:ss").decode()
    assert f"\r\nAuthorization: Basic {token}\r\n".encode() in head
    assert b"us%40er" not in head  # the Host header carries no userinfo
    assert b"@127.0.0.1" not in head


async def test_idle_connections_expire_and_a_closed_pool_opens_none(
        server: Callable[[Handler], Awaitable[RawServer]]) -> None:
    s = await keep_alive_server(server, lambda _: answer(b"ok"))
    short = EnginePool(connect_timeout_s=2.0, read_timeout_s=5.0, keepalive_s=0.2)
    for _ in range(2):
        resp = await short.post(s.url + "/x", b"{}", JSON)
        assert await resp.read() == b"ok"
        resp.release()
        await asyncio.sleep(0.3)  # idle past keepalive_s: not reused
    assert short.connects == 2
    short.reap()
    await asyncio.sleep(0.05)
    assert short.idle == 0
    short.close()
    with pytest.raises(ConnectError):
        await short.post(s.url + "/x", b"{}", JSON)


async def test_a_large_body_is_read_whole_through_flow_control(
        server: Callable[[Handler], Awaitable[RawServer]], pool: EnginePool) -> None:
    big = bytes(range(256)) * 8192  # 2 MiB, far above the reading pause's high-water mark
    s = await keep_alive_server(server, lambda _: answer(big))
    for _ in range(2):
        resp = await pool.post(s.url + "/x", b"{}", JSON)
        await asyncio.sleep(0.2)  # the engine fills the buffer while nobody reads
        assert await resp.read() == big
        resp.release()
    assert s.connections == 1


async def test_a_header_with_a_line_break_is_refused(pool: EnginePool) -> None:
    with pytest.raises(ValueError, match="line break"):
        await pool.post("http://127.0.0.1:1/x", b"{}", {"X-Request-Id": "a\r\nX-Injected: 1"})


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=engine",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=30)
    return cert, key


async def test_https_engines_with_certificate_checks(tls_files: tuple[Path, Path]) -> None:
    """A static fleet may list ``https://`` engines: TLS, with the certificate checked by default."""
    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    ref: list[RawServer] = []
    raw = RawServer(keep_answering(lambda _: answer(b"secure"), ref))
    ref.append(raw)
    url = await raw.start(tls=server_ctx) + "/v1/completions"
    trusting = EnginePool(connect_timeout_s=5.0, read_timeout_s=5.0,
                          ssl_context=ssl.create_default_context(cafile=str(cert)))
    default = EnginePool(connect_timeout_s=5.0, read_timeout_s=5.0)
    try:
        for _ in range(2):
            resp = await trusting.post(url, b"{}", JSON)
            assert await resp.read() == b"secure"
            resp.release()
        assert raw.connections == 1  # kept alive over TLS too
        assert raw.requests[0][0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # self-signed: refused
            await default.post(url, b"{}", JSON)
    finally:
        trusting.close()
        default.close()
        await raw.stop()
