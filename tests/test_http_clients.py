"""Hostile and broken HTTP clients over real sockets: slowloris headers and bodies, a stream nobody
reads, idle keep-alive, and more connections than ``http.max_connections``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.fixtures.dataplane import EngineFactory, PlaneFactory, RunningPlane

COMP = "/v1/completions"
BODY = {"model": "m", "prompt": "x", "max_tokens": 4}


def _addr(plane: RunningPlane) -> tuple[str, int]:
    host, port = plane.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


@contextlib.asynccontextmanager
async def raw_connection(plane: RunningPlane) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                                     asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(*_addr(plane))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if it does not within ``timeout``."""
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
    except ConnectionResetError:
        pass  # routerd closed while this client was still sending: what it sent before is in ``data``
    except TimeoutError:
        raise AssertionError(f"the connection is still open after {timeout} s; got {data[:300]!r}") from None
    return data


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def openai_error(raw: bytes, status: int) -> dict[str, Any]:
    """``raw`` is a ``status`` answer in OpenAI's error JSON with ``X-Request-Id``, then a close."""
    code, headers, body = parse(raw)
    assert code == status, raw[:500]
    assert headers["content-type"].startswith("application/json")
    assert headers.get("connection", "").lower() == "close" or raw.startswith(b"HTTP/1.0 ")  # 1.0: implied
    assert headers["x-request-id"]
    err: dict[str, Any] = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    return err


async def metrics(plane: RunningPlane) -> str:
    async with aiohttp.ClientSession() as s, s.get(plane.url + "/metrics") as r:
        return await r.text()


async def slowloris(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, byte: bytes,
                    timeout: float) -> bytes:
    """Send ``byte`` every 0.1 s until routerd answers; return all it sends until it closes.

    The trickle stops at routerd's first byte: bytes sent after routerd closed would draw a reset that
    can reach this client before it read the answer."""
    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(byte)
                await writer.drain()
                await asyncio.sleep(0.1)

    sender = asyncio.create_task(send())
    try:
        async with asyncio.timeout(timeout):
            first = await reader.read(65536)
    except TimeoutError:
        raise AssertionError(f"no answer and no close within {timeout} s") from None
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    return first + await read_until_closed(reader, timeout) if first else first


async def test_slowloris_bodies_are_cut_after_the_body_timeout(
        scripted_engine: EngineFactory, dataplane: PlaneFactory) -> None:
    eng = await scripted_engine()
    p = await dataplane([eng.url], http={"client_body_timeout_s": 0.5})
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{")

    async def one() -> bytes:
        async with raw_connection(p) as (reader, writer):
            writer.write(head)
            return await slowloris(reader, writer, b" ", timeout=5.0)

    for raw in await asyncio.gather(*(one() for _ in range(5))):
        err = openai_error(raw, 408)
        assert "did not arrive within 0.5 s" in err["message"]
    assert eng.requests == 0
    await p.wait_for(lambda: p.dp.http is not None and not p.dp.http.handlers, what="handlers done")
    assert 'routerd_http_connections_shed_total{reason="body_timeout"} 5.0' in await metrics(p)


async def test_partial_headers_are_cut_after_the_header_timeout(
        scripted_engine: EngineFactory, dataplane: PlaneFactory) -> None:
    eng = await scripted_engine()
    # keep-alive stays long, so what closes these connections is the header timeout
    p = await dataplane([eng.url], http={"client_header_timeout_s": 0.5, "keepalive_timeout_s": 60})
    async with raw_connection(p) as (reader, writer):  # a new connection trickling its headers
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\nX-Slow: ")
        err = openai_error(await slowloris(reader, writer, b"a", timeout=5.0), 408)
        assert "headers did not arrive within 0.5 s" in err["message"]
    async with raw_connection(p) as (reader, writer):  # one request, then the next one's headers trickle
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: routerd\r\n\r\n")
        status_line = await reader.readuntil(b"\r\n\r\n")
        assert status_line.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(16) == b'{"status": "ok"}'
        await asyncio.sleep(0.8)  # idle between requests is the keep-alive timeout's business
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        openai_error(await slowloris(reader, writer, b"a", timeout=5.0), 408)
    async with raw_connection(p) as (reader, _):  # a connection that never sends a byte
        assert await read_until_closed(reader, timeout=5.0) == b""
    assert 'routerd_http_connections_shed_total{reason="header_timeout"} 3.0' in await metrics(p)


async def test_a_client_that_stops_reading_a_stream_releases_its_slot_and_the_engine_aborts(
        scripted_engine: EngineFactory, dataplane: PlaneFactory) -> None:
    # An engine that would stream for far longer than the test (64 MiB), in SSE frames.
    frame = b'data: {"choices":[{"index":0,"text":"' + b"x" * 4000 + b'"}]}\n\n'
    eng = await scripted_engine(replay=frame * (64 * 1024 * 1024 // len(frame)), replay_piece=256 * 1024)
    p = await dataplane([eng.url], http={"client_write_timeout_s": 2.0})
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, _addr(p))
        body = json.dumps({**BODY, "stream": True}).encode()
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\n"
                                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(body), body))
        await p.wait_for(lambda: p.dp.admission.stats("f")["active"] == 1, what="the stream admitted")
        await p.wait_for(lambda: eng.cancelled == 1, timeout=20.0, what="the engine request aborted")
        await p.wait_for(lambda: p.dp.admission.stats("f")["active"] == 0, what="the admission slot freed")
        assert p.inflight() == 0
        text = await metrics(p)
        assert 'routerd_admission_active{fleet="f"} 0.0' in text
        assert 'routerd_http_connections_shed_total{reason="write_timeout"} 1.0' in text
        assert eng.completed == 0
    finally:
        sock.close()


async def test_connections_beyond_max_connections_get_503_while_open_ones_keep_working(
        scripted_engine: EngineFactory, dataplane: PlaneFactory) -> None:
    eng = await scripted_engine()
    p = await dataplane([eng.url], http={"max_connections": 3})
    assert p.dp.http is not None
    conns = p.dp.http.connections
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept, \
            contextlib.AsyncExitStack() as stack:
        async with kept.post(p.url + COMP, json=BODY) as r:  # connection 1, kept alive
            assert r.status == 200
        idle = [await stack.enter_async_context(raw_connection(p)) for _ in range(2)]  # 2 and 3
        await p.wait_for(lambda: conns.open == 3, what="three open connections")
        async with raw_connection(p) as (reader, writer):  # the fourth: refused at once, clearly
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\nContent-Length: 2\r\n\r\n{}")
            raw = await read_until_closed(reader, timeout=5.0)
        err = openai_error(raw, 503)
        assert "max_connections" in err["message"]
        assert parse(raw)[1]["retry-after"] == "1"
        async with aiohttp.ClientSession() as fresh, fresh.post(p.url + COMP, json=BODY) as r:
            assert r.status == 503  # an ordinary client reads the refusal as a response
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["type"] == "ServiceUnavailableError"
        async with kept.post(p.url + COMP, json=BODY) as r:  # the open connection is served as before
            assert r.status == 200
        async with kept.get(p.url + "/metrics") as r:
            text = await r.text()
        assert 'routerd_http_connections_shed_total{reason="refused"} 2.0' in text
        assert "routerd_http_connections 3.0" in text
        idle[0][1].close()
        await p.wait_for(lambda: conns.open == 2, what="a connection closed")
        async with aiohttp.ClientSession() as fresh, fresh.post(p.url + COMP, json=BODY) as r:
            assert r.status == 200  # room again
    await p.wait_for(lambda: conns.open == 0, what="every connection closed")


async def test_idle_keepalive_connections_are_closed(scripted_engine: EngineFactory,
                                                     dataplane: PlaneFactory) -> None:
    eng = await scripted_engine()
    p = await dataplane([eng.url], http={"keepalive_timeout_s": 0.5})
    assert p.dp.http is not None
    async with raw_connection(p) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: routerd\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"Connection: close" not in head
        assert await reader.readexactly(16) == b'{"status": "ok"}'
        assert await read_until_closed(reader, timeout=5.0) == b""
    await p.wait_for(lambda: p.dp.http is not None and p.dp.http.connections.open == 0,
                     what="no open connection")


@pytest.fixture
async def plane(scripted_engine: EngineFactory, dataplane: PlaneFactory) -> RunningPlane:
    return await dataplane([(await scripted_engine()).url])


@pytest.mark.parametrize(("request_bytes", "says"), [
    (b"GARBAGE\r\n\r\n", "Invalid method"),
    (b"GET /healthz HTTP/1.1\r\nHost: routerd\r\nX-A: \x01b\r\n\r\n", "Invalid header value char"),
    (b"GET /healthz HTTP/1.1\r\nHost: routerd\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n", "more than 8190 bytes"),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: routerd\r\n\r\n", "more than 8190 bytes"),
], ids=["request-line", "header-bytes", "header-too-long", "request-line-too-long"])
async def test_requests_aiohttp_cannot_parse_get_400_in_openai_json(plane: RunningPlane, request_bytes: bytes,
                                                                    says: str) -> None:
    async with raw_connection(plane) as (reader, writer):
        writer.write(request_bytes)
        err = openai_error(await read_until_closed(reader, timeout=5.0), 400)
    assert err["type"] == "BadRequestError"
    assert says in err["message"]
    assert len(err["message"]) < 300  # what the client sent is quoted cut short


async def test_bodies_aiohttp_cannot_read_get_400_and_no_traceback(
        plane: RunningPlane, caplog: pytest.LogCaptureFixture) -> None:
    async with raw_connection(plane) as (reader, writer):
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: 10\r\n\r\nnot-gzip!!")
        err = openai_error(await read_until_closed(reader, timeout=5.0), 400)
    assert "content-encoding" in err["message"].lower()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_an_unknown_expectation_gets_417_in_openai_json(plane: RunningPlane) -> None:
    async with raw_connection(plane) as (reader, writer):
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\nExpect: bogus\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        code, headers, body = parse(await read_until_closed(reader, timeout=5.0))
    assert code == 417
    assert headers["x-request-id"]
    assert json.loads(body)["error"]["code"] == 417


async def test_drain_answers_requests_still_receiving_their_body_at_once(
        scripted_engine: EngineFactory, dataplane: PlaneFactory) -> None:
    eng = await scripted_engine()
    p = await dataplane([eng.url])  # the body timeout stays at its default (60 s)
    assert p.dp.http is not None
    async with raw_connection(p) as (reader, writer):
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\nContent-Length: 100\r\n\r\n{")
        await p.wait_for(lambda: p.dp.http is not None and len(p.dp.http.handlers) == 1, what="body awaited")
        await p.listener.stop_intake()
        assert await p.listener.wait_idle(5.0)  # not the body timeout's 60 s
        err = openai_error(await read_until_closed(reader, timeout=5.0), 503)
    assert "shutting down" in err["message"]
    assert eng.requests == 0


async def test_an_undecodable_admin_key_is_401(scripted_engine: EngineFactory,
                                               dataplane: PlaneFactory) -> None:
    p = await dataplane([(await scripted_engine()).url], http={"admin_api_key": "adm"})
    async with raw_connection(p) as (reader, writer):
        writer.write(b"GET /admin/fleets HTTP/1.1\r\nHost: routerd\r\nAuthorization: Bearer \xff\xfeadm\r\n"
                     b"Connection: close\r\n\r\n")
        err = openai_error(await read_until_closed(reader, timeout=5.0), 401)
    assert err["type"] == "AuthenticationError"
