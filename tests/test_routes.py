"""Every route a vLLM fleet serves, both ways in (issue 29): a real routerd (its HTTP listener and its
queue consumer on a real redis-server) in front of simulated engines that speak every route, one test
per route family; Anthropic-shaped errors on ``/v1/messages*``; ``[http] passthrough`` on and off;
tokenize answered while the fleet's slots are full; bad input refused in the route's own shape, and
nothing forwarded half-read."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from routerd.assembly import Routerd, running
from routerd.client import QueueClient
from routerd.config import Config, parse
from routerd.registry import Registry
from routerd.sim.config import SimConfig
from routerd.sim.server import SimEngine
from routerd.surface import ROUTES
from tests.fixtures.helpers import event_pairs
from tests.fixtures.redis_server import RedisServer

MODEL = "m"
WAV = b"".join((b"RIFF", (36 + 32000).to_bytes(4, "little"), b"WAVEfmt ", (16).to_bytes(4, "little"),
                b"\x01\x00\x01\x00", (16000).to_bytes(4, "little"), (32000).to_bytes(4, "little"),
                b"\x02\x00\x10\x00", b"data", (32000).to_bytes(4, "little"), bytes(32000)))  # 1 s of silence


@dataclass
class Plane:
    url: str
    dp: Routerd
    sims: list[SimEngine]
    queue: QueueClient | None

    async def metrics(self, s: aiohttp.ClientSession) -> str:
        async with s.get(self.url + "/metrics") as r:
            return await r.text()


def _config(urls: list[str], redis_url: str | None, http: dict[str, Any] | None = None,
            tenants: list[dict[str, Any]] | None = None, max_num_seqs: int = 4,
            admission: dict[str, Any] | None = None) -> Config:
    return parse({
        "http": {"host": "127.0.0.1", "port": 0, **(http or {})},
        "redis": {"url": redis_url, "consumer": "t1", "block_ms": 100, "op_timeout_s": 2.0} if redis_url
        else {"enabled": False},
        "routing": {"scrape_interval_s": 0.05, "scrape_timeout_s": 0.5, "stale_after_s": 1.0,
                    "retry_backoff_ms": 1},
        "admission": admission or {},
        "fleets": [{"name": "f", "model": MODEL, "engine": "static", "urls": urls,
                    "max_num_seqs": max_num_seqs}],
        "tenants": tenants or []}, environ={})


@contextlib.asynccontextmanager
async def plane(redis: RedisServer | None = None, *, engines: int = 2, http: dict[str, Any] | None = None,
                tenants: list[dict[str, Any]] | None = None, max_num_seqs: int = 4,
                admission: dict[str, Any] | None = None, **sim: Any) -> AsyncIterator[Plane]:
    """Simulated engines speaking every route, and one routerd (HTTP, and the queue when ``redis``)."""
    sims = [SimEngine(SimConfig(**{"model": MODEL, "max_num_seqs": max_num_seqs, "ttft_ms": 2, "itl_ms": 1,
                                   **sim})) for _ in range(engines)]
    try:
        urls = [await e.start(host="127.0.0.1", port=0) for e in sims]
        registry = Registry()
        cfg = _config(urls, redis.url if redis else None, http, tenants, max_num_seqs, admission)
        async with running(cfg, registry) as dp:
            deadline = time.monotonic() + 20
            while registry.ready_count("f") < engines:
                assert time.monotonic() < deadline, dp.status()
                await asyncio.sleep(0.02)
            if redis is None:
                yield Plane(dp.url, dp, sims, None)
                return
            client = aioredis.Redis.from_url(redis.url, socket_timeout=10)
            try:
                yield Plane(dp.url, dp, sims, QueueClient(client))
            finally:
                await client.aclose()
    finally:
        for e in sims:
            await e.stop()


async def post(s: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any, bytes]:
    async with s.post(url, json=body, **kw) as r:
        raw = await r.read()
        doc = msgspec.json.decode(raw) if r.content_type == "application/json" else None
        return r.status, doc, raw


# What each family is asked and what its answer must hold: (route, body, check of the JSON answer,
# the named events a stream of it ends with, or None: not streamed).
Check = Callable[[dict[str, Any]], bool]
FAMILIES: dict[str, tuple[str, dict[str, Any], Check, str | None]] = {
    "responses": ("/v1/responses", {"model": MODEL, "input": "tell me a story", "max_output_tokens": 6},
                  lambda d: d["object"] == "response" and d["status"] in ("completed", "incomplete")
                  and d["usage"]["output_tokens"] > 0, "response.completed"),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 6, "system": "be brief",
                                  "messages": [{"role": "user", "content": "hello there"}]},
                 lambda d: d["type"] == "message" and d["content"][0]["type"] == "text"
                 and d["usage"]["output_tokens"] > 0, "message_stop"),
    "embeddings": ("/v1/embeddings", {"model": MODEL, "input": ["one text", "another text"]},
                   lambda d: len(d["data"]) == 2 and len(d["data"][0]["embedding"]) > 1
                   and d["usage"]["prompt_tokens"] > 0, None),
    "rerank": ("/v1/rerank", {"model": MODEL, "query": "a question", "documents": ["yes", "no"]},
               lambda d: len(d["results"]) == 2, None),
    "classify": ("/classify", {"model": MODEL, "input": "a sentence"},
                 lambda d: len(d["data"]) == 1 and d["usage"]["prompt_tokens"] > 0, None),
    "tokenize": ("/tokenize", {"model": MODEL, "prompt": "count these words"},
                 lambda d: d["count"] == len(d["tokens"]) > 0, None),
}


@pytest.mark.redis
@pytest.mark.parametrize("family", list(FAMILIES))
async def test_route_family_both_ways_in(family: str, redis_server: RedisServer) -> None:
    route, body, check, last_event = FAMILIES[family]
    async with plane(redis_server) as p, aiohttp.ClientSession() as s:
        assert p.queue is not None
        status, doc, raw = await post(s, p.url + route, body)
        assert status == 200, raw[:500]
        assert check(doc), doc
        job = await p.queue.submit(body, endpoint=route)
        res = await p.queue.wait(job, timeout=30)
        assert res.status == "ok", res.error
        assert check(res.response), res.response  # the engine's JSON, as HTTP got it
        if last_event is not None:  # streamed: the route's own events, both ways in
            async with s.post(p.url + route, json={**body, "stream": True}) as r:
                assert r.status == 200
                assert r.content_type == "text/event-stream"
                streamed = event_pairs(await r.read())
            assert streamed[-1][0] in ROUTES[route].terminal_events, streamed[-1]
            assert all(e == d["type"] for e, d in streamed)
            job = await p.queue.submit({**body, "stream": True}, endpoint=route)
            chunks = [c async for c in p.queue.chunks(job, timeout=30)]
            result = chunks.pop()
            assert result.status == "ok", result
            types = [c.data["type"] for c in chunks]  # type: ignore[union-attr]
            assert types == [d["type"] for _, d in streamed]
            assert result.response["usage"] is not None
        # the tenant was billed what the engine counted, and the metrics name the route
        assert p.dp.serving.tenancy.ledger.totals[("default", "f")][0] >= (4 if last_event else 2)
        assert 'code="200",fleet="f",instance="f:static' in await p.metrics(s)
        assert f'route="{route}"' in await p.metrics(s)


async def test_audio_is_forwarded_as_the_form_the_client_sent() -> None:
    async with plane(engines=1) as p, aiohttp.ClientSession() as s:
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            form = aiohttp.FormData()
            form.add_field("file", WAV, filename="a.wav", content_type="audio/wav")
            form.add_field("model", MODEL)
            async with s.post(p.url + path, data=form) as r:
                assert r.status == 200, await r.text()
                assert isinstance((await r.json())["text"], str)
                assert r.headers["X-Routerd-Instance"] == "f:static0"


async def test_messages_errors_are_anthropic_shaped() -> None:
    async with plane(engines=1, tenants=[{"name": "t", "api_keys": ["k1"]}]) as p, \
            aiohttp.ClientSession() as s:
        key = {"Authorization": "Bearer k1"}
        body = FAMILIES["messages"][1]
        cases = [
            (await post(s, p.url + "/v1/messages", {**body, "model": "nope"}, headers=key), 404,
             "not_found_error"),
            (await post(s, p.url + "/v1/messages", {"model": MODEL, "messages": []}, headers=key), 400,
             "invalid_request_error"),
            (await post(s, p.url + "/v1/messages/count_tokens", body,
                        headers={"Authorization": "Bearer wrong"}), 401, "authentication_error"),
        ]
        for (status, doc, raw), want, kind in cases:
            assert status == want, raw
            assert doc["type"] == "error", doc
            assert doc["error"]["type"] == kind, doc
            assert doc["error"]["message"]
        async with s.get(p.url + "/v1/messages") as r:  # aiohttp's own answer, in the route's shape
            assert r.status == 405
            assert (await r.json())["type"] == "error"
        # the same refusal on an OpenAI route keeps OpenAI's shape
        status, doc, _ = await post(s, p.url + "/v1/embeddings", {"model": "nope", "input": "x"}, headers=key)
        assert status == 404
        assert doc["error"]["code"] == 404
        status, doc, _ = await post(s, p.url + "/v1/messages/count_tokens", body, headers=key)
        assert status == 200
        assert doc["input_tokens"] > 0


async def test_passthrough_off_names_the_routes_and_on_forwards() -> None:
    seen: list[tuple[str, str, bytes]] = []

    async def custom(request: web.Request) -> web.Response:
        seen.append((request.path_qs, request.headers["Content-Type"], await request.read()))
        return web.json_response({"object": "custom", "usage": {"prompt_tokens": 3, "completion_tokens": 0}})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
                                 'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n')

    app = web.Application()  # an engine with a route of its own (a vLLM plugin's)
    app.router.add_post("/v1/custom/thing", custom)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    body = {"model": MODEL, "anything": [1, 2]}
    try:
        async with aiohttp.ClientSession() as s:
            for passthrough in (False, True):
                registry = Registry()
                cfg = _config([url], None, {"passthrough": passthrough})
                async with running(cfg, registry) as dp:
                    deadline = time.monotonic() + 20
                    while registry.ready_count("f") < 1:
                        assert time.monotonic() < deadline, dp.status()
                        await asyncio.sleep(0.02)
                    status, doc, raw = await post(s, dp.url + "/v1/custom/thing?x=1", body)
                    if not passthrough:
                        assert status == 404, raw
                        assert "/v1/embeddings" in doc["error"]["message"]
                        assert not seen
                        continue
                    assert status == 200, raw
                    assert doc["object"] == "custom"
                    assert [(path, ctype, msgspec.json.decode(b)) for path, ctype, b in seen] == \
                        [("/v1/custom/thing?x=1", "application/json", body)]
                    status, doc, _ = await post(s, dp.url + "/v1/custom/thing", {"model": "nope"})
                    assert status == 404
                    assert doc["error"]["param"] == "model"
                    async with s.get(dp.url + "/metrics") as r:
                        assert 'route="passthrough"' in await r.text()
    finally:
        await runner.cleanup()


async def test_tokenize_takes_no_slot() -> None:
    """Every slot of the fleet held by a long generation: tokenize, detokenize and count_tokens are
    answered meanwhile, and a generating request waits for a slot."""
    async with plane(engines=1, max_num_seqs=2, itl_ms=50, admission={"engine_queue_per_instance": 0}) as p, \
            aiohttp.ClientSession() as s:
        limit = p.dp.admission.stats("f")["limit"]
        long = {"model": MODEL, "prompt": "go on", "max_tokens": 400, "ignore_eos": True}
        held = [asyncio.create_task(post(s, p.url + "/v1/completions", long)) for _ in range(limit)]
        waiting = asyncio.create_task(post(s, p.url + "/v1/completions", {**long, "max_tokens": 1}))
        try:
            deadline = time.monotonic() + 20
            while p.dp.admission.stats("f")["active"] < limit or not p.dp.admission.stats("f")["queued_http"]:
                assert time.monotonic() < deadline, p.dp.admission.stats("f")
                await asyncio.sleep(0.02)
            status, doc, raw = await post(s, p.url + "/tokenize", {"model": MODEL, "prompt": "a b c"})
            assert status == 200, raw
            for route, body in (("/detokenize", {"model": MODEL, "tokens": doc["tokens"]}),
                                ("/v1/messages/count_tokens", FAMILIES["messages"][1])):
                status, _, raw = await post(s, p.url + route, body)
                assert status == 200, raw
            stats = p.dp.admission.stats("f")
            assert stats["active"] == limit
            assert stats["queued_http"] >= 1
            assert not waiting.done()
        finally:
            for t in (*held, waiting):
                t.cancel()
            await asyncio.gather(*held, waiting, return_exceptions=True)


@pytest.mark.redis
async def test_bad_input_is_refused_in_the_routes_shape(redis_server: RedisServer) -> None:
    async with plane(redis_server, engines=1, http={"max_audio_bytes": 4096}) as p, \
            aiohttp.ClientSession() as s:
        audio = p.url + "/v1/audio/transcriptions"
        form = aiohttp.FormData()
        form.add_field("file", WAV[:1000], filename="a.wav", content_type="audio/wav")
        async with s.post(audio, data=form) as r:  # no `model` field
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "model"
        async with s.post(audio, json={"model": MODEL}) as r:  # JSON where a form is due
            assert r.status == 415
        form = aiohttp.FormData()
        form.add_field("file", WAV[:1000], filename="a.wav", content_type="audio/wav")
        form.add_field("model", MODEL)
        async with s.post(p.url + "/v1/embeddings", data=form) as r:  # a form where JSON is due
            assert r.status == 415
            assert (await r.json())["error"]["code"] == 415
        async with s.post(p.url + "/v1/messages", data=b"model=m",
                          headers={"Content-Type": "application/x-www-form-urlencoded"}) as r:
            assert r.status == 415
            assert (await r.json())["error"]["type"] == "invalid_request_error"

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused while it is read
            yield b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
            yield b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
            for _ in range(8):
                yield bytes(1024)
        for data in (chunked(), WAV):
            headers = {"Content-Type": "multipart/form-data; boundary=B"}
            async with s.post(audio, data=data, headers=headers) as r:
                assert r.status == 413
        assert p.sims[0].runner.server_load == 0
        text = await p.metrics(s)
        assert 'instance="f:static0",route="/v1/audio/transcriptions"' not in text  # nothing forwarded
        assert p.queue is not None
        for endpoint, why in (("/v1/audio/transcriptions", "multipart"), ("/v1/nope", "not a route")):
            job = await p.queue.submit({"model": MODEL}, endpoint=endpoint)
            res = await p.queue.wait(job, timeout=30)
            assert res.status == "error"
            assert res.error is not None
            assert why in res.error["message"]
            assert res.error["code"] == 400
        job = await p.queue.submit({"model": MODEL, "input": 5}, endpoint="/v1/embeddings")
        res = await p.queue.wait(job, timeout=30)
        assert res.status == "error"
        assert res.error is not None
        assert "input" in res.error["message"]


async def test_a_responses_chain_continues_where_its_previous_response_is() -> None:
    """The engines keep stored responses in their own memory: each turn naming its previous response
    must reach the instance that made it (two instances; three chains of three turns)."""
    async with plane(engines=2) as p, aiohttp.ClientSession() as s:
        for chain in range(3):
            status, doc, raw = await post(s, p.url + "/v1/responses",
                                          {"model": MODEL, "input": f"chain {chain}", "max_output_tokens": 4})
            assert status == 200, raw
            for turn in range(2):
                async with s.post(p.url + "/v1/responses", json={
                        "model": MODEL, "input": f"turn {turn}", "max_output_tokens": 4,
                        "previous_response_id": doc["id"], "stream": turn == 1}) as r:
                    assert r.status == 200, await r.text()
                    raw = await r.read()
                if turn == 1:
                    assert event_pairs(raw)[-1][0] in ROUTES["/v1/responses"].terminal_events
                else:
                    doc = msgspec.json.decode(raw)


async def test_a_route_hook_prepares_the_body_and_observes_the_answer() -> None:
    """What a conversation layer relies on: its hook's body is what the engine gets, its sink sees
    the answer."""
    seen: list[bytes] = []

    class Tap:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def start(self, status: int, headers: Any) -> None:
            await self.inner.start(status, headers)

        async def write(self, chunk: bytes) -> None:
            seen.append(chunk)
            await self.inner.write(chunk)

    class Hook:
        async def prepare(self, req: Any) -> None:
            req.body = msgspec.json.encode({"model": MODEL, "input": "rewritten", "max_output_tokens": 2})
            req.context = "turn state"

        def observe(self, req: Any, sink: Any) -> Any:
            return Tap(sink)

        async def finished(self, req: Any, result: Any) -> None:
            assert req.context == "turn state"
            seen.append(b"finished ok" if result.ok else b"finished failed")

    async with plane(engines=1) as p, aiohttp.ClientSession() as s:
        p.dp.serving.dispatch.hooks["/v1/responses"] = Hook()
        status, doc, raw = await post(s, p.url + "/v1/responses",
                                      {"model": MODEL, "input": "original", "max_output_tokens": 5})
        assert status == 200, raw
        assert doc["usage"]["output_tokens"] == 2
        assert b"".join(seen[:-1]) == raw
        assert seen[-1] == b"finished ok"


async def test_failures_are_retried_before_the_first_byte_and_end_in_the_routes_event_after() -> None:
    async with plane(engines=2) as p, aiohttp.ClientSession() as s:
        p.sims[0].faults.set(error_rate=1.0)  # every request there answered 500: retried on the other
        for name in ("embeddings", "messages", "responses"):
            route, body, check, _ = FAMILIES[name]
            for _ in range(3):
                status, doc, raw = await post(s, p.url + route, body)
                assert status == 200, raw
                assert check(doc)
        p.sims[0].faults.set(error_rate=0.0)
        for sim in p.sims:
            sim.faults.set(fail_after_chunks=3)  # every stream breaks after its third event
        for name in ("messages", "responses"):
            route, body, _, _ = FAMILIES[name]
            budget = "max_tokens" if name == "messages" else "max_output_tokens"
            async with s.post(p.url + route, json={**body, budget: 50, "stream": True}) as r:
                assert r.status == 200
                last, data = event_pairs(await r.read())[-1]
            assert last == "error"  # the stream says it ended badly, in its own shape
            assert data["type"] == "error"
            assert (data["error"] if name == "messages" else data)["message"]
