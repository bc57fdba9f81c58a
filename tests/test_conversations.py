"""Responses-API records and conversations kept by routerd (routerd/conversations/), against a real Redis:
a chain continued through another routerd's client, made whole for any engine; tenants kept apart; the
records bounded by ttl and by each tenant's cap; the stored routes in OpenAI's shapes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

from routerd.config import ResponsesConfig
from routerd.conversations import (
    ConversationRoutes,
    MemoryStore,
    RedisStore,
    ResponseRecord,
    Store,
    UnknownId,
    prepare,
)
from routerd.errors import BadRequest, RouterdError, error_json
from routerd.redis_keys import RedisKeys
from tests.fixtures.redis_server import RedisServer


def _record(rid: str, tenant: str, text: str, answer: str, *,
            chain: list[str] | None = None) -> ResponseRecord:
    chain = chain or []
    return ResponseRecord(
        id=rid, tenant=tenant, model="m", created_at=1, status="completed",
        input=[{"type": "message", "role": "user", "content": text, "id": f"msg_in_{rid}"}],
        output=[{"type": "message", "role": "assistant", "id": f"msg_out_{rid}", "status": "completed",
                 "content": [{"type": "output_text", "text": answer, "annotations": []}]}],
        previous_response_id=chain[-1] if chain else None, chain=chain, instance="sim-0", generation=1,
        response={"id": rid, "object": "response", "status": "completed", "model": "m"})


@contextlib.asynccontextmanager
async def _redis_store(url: str, cfg: ResponsesConfig) -> AsyncIterator[RedisStore]:
    client = aioredis.Redis.from_url(url, socket_timeout=10)
    try:
        yield RedisStore(client, RedisKeys(), cfg, op_timeout_s=5.0)
    finally:
        await client.aclose()


async def test_a_chain_is_continued_through_another_routerd_whole_and_never_by_another_tenant(
        redis_server: RedisServer) -> None:
    cfg = ResponsesConfig()
    async with _redis_store(redis_server.url, cfg) as a, _redis_store(redis_server.url, cfg) as b:
        await a.put_response(_record("resp_1", "acme", "hello", "hi there"))
        await a.put_response(_record("resp_2", "acme", "and then?", "then this", chain=["resp_1"]))

        # b, another routerd on the same Redis, continues the chain: the engine gets all of it
        body = {"model": "m", "input": "last one", "previous_response_id": "resp_2",
                "instructions": "be brief", "stream": True, "temperature": 0.5}
        turn = await prepare(b, "acme", msgspec.json.encode(body), session=None)
        sent = msgspec.json.decode(turn.body)
        assert "previous_response_id" not in sent
        assert "conversation" not in sent
        assert sent["store"] is False
        assert sent["request_id"] == turn.id
        assert sent["temperature"] == 0.5
        texts = [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"]
                 for i in sent["input"]]
        assert texts == ["hello", "hi there", "and then?", "then this", "last one"]
        assert turn.chain == ["resp_1", "resp_2"]
        assert turn.stream
        assert turn.store
        assert turn.session == "acme/response/resp_1"  # every turn of the chain: one session
        assert turn.served == ("sim-0", 1)  # where its last turn was served: routing's first choice
        # routing sees the conversation as chat: the next turn's rendering starts with this one's
        assert [m.role for m in turn.head.messages] == ["system", "user", "assistant", "user", "assistant",
                                                        "user"]

        # another tenant cannot continue, read or delete it: as if it did not exist
        with pytest.raises(UnknownId) as e:
            await prepare(b, "other", msgspec.json.encode(body), session=None)
        assert (e.value.status, e.value.type) == (404, "invalid_request_error")
        assert e.value.message == "Response with id 'resp_2' not found."
        with pytest.raises(UnknownId):
            await b.delete_response("other", "resp_1")
        assert (await b.response("acme", "resp_1")).output[0]["content"][0]["text"] == "hi there"

        # an unknown previous response is OpenAI's 404
        with pytest.raises(UnknownId) as e:
            await prepare(b, "acme", msgspec.json.encode({**body, "previous_response_id": "resp_nope"}),
                          session=None)
        err = e.value
        assert msgspec.json.decode(error_json(err.message, err.type, err.status, err.param)) == {
            "error": {"message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error",
                      "param": "previous_response_id", "code": 404}}

        # a turn of the chain deleted: the chain is not continued as if it had never had it
        await a.delete_response("acme", "resp_1")
        with pytest.raises(UnknownId, match="resp_1"):
            await prepare(b, "acme", msgspec.json.encode(body), session=None)

        # bad bodies are the client's 400
        for bad in ({"model": "m", "input": 3}, {"model": "m", "input": "x", "background": True},
                    {"model": "m", "input": "x", "previous_response_id": "resp_2", "conversation": "conv_1"}):
            with pytest.raises(BadRequest):
                await prepare(b, "acme", msgspec.json.encode(bad), session=None)


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_each_tenant_keeps_its_most_recently_used_records_and_they_expire(
        kind: str, redis_server: RedisServer) -> None:
    cfg = ResponsesConfig(max_per_tenant=3, ttl_s=3600)
    now = [1_000_000.0]
    async with contextlib.AsyncExitStack() as stack:
        if kind == "redis":
            store: Store = await stack.enter_async_context(_redis_store(redis_server.url, cfg))
            store.wall = lambda: now[0]  # type: ignore[attr-defined]  # the index's clock
        else:
            store = MemoryStore(cfg, wall=lambda: now[0])
        for n in range(1, 4):
            await store.put_response(_record(f"resp_{n}", "acme", "q", "a"))
            now[0] += 1
        await store.put_response(_record("resp_x", "other", "q", "a"))  # another tenant's cap is its own
        # resp_4 continues resp_1: the chain is used, so resp_2 is the least recently used and goes
        await store.put_response(_record("resp_4", "acme", "q", "a", chain=["resp_1"]))
        held = await store.responses("acme", ["resp_1", "resp_2", "resp_3", "resp_4"])
        assert [r.id if r else None for r in held] == ["resp_1", None, "resp_3", "resp_4"]
        assert (await store.response("other", "resp_x")).id == "resp_x"
        if isinstance(store, RedisStore):  # Redis expires them itself, ttl_s after their last use
            ttl = await store.redis.pttl(store.keys.response("resp_1"))
            assert 3_590_000 < ttl <= 3_600_000
        else:
            now[0] += 3601
            with pytest.raises(UnknownId):
                await store.response("acme", "resp_4")


async def _call(session: aiohttp.ClientSession, method: str, url: str, tenant: str,
                body: Any = None) -> tuple[int, Any]:
    async with session.request(method, url, json=body, headers={"X-Tenant": tenant}) as r:
        return r.status, await r.json()


async def test_the_stored_routes_answer_in_openais_shapes_and_only_to_their_tenant(
        redis_server: RedisServer) -> None:
    cfg = ResponsesConfig(max_conversation_items=5)
    async with _redis_store(redis_server.url, cfg) as store:
        await store.put_response(_record("resp_1", "acme", "hello", "hi"))
        app = web.Application(middlewares=[_errors])
        ConversationRoutes(store).add_to(app, _tenant_header)
        async with TestServer(app) as server, aiohttp.ClientSession(str(server.make_url(""))) as s:
            assert await _call(s, "GET", "/v1/responses/resp_1", "acme") == (200, _record(
                "resp_1", "acme", "", "").response)
            status, items = await _call(s, "GET", "/v1/responses/resp_1/input_items", "acme")
            assert status == 200
            assert [i["id"] for i in items["data"]] == ["msg_in_resp_1"]
            status, err = await _call(s, "GET", "/v1/responses/resp_1", "other")
            assert status == 404
            assert err["error"]["type"] == "invalid_request_error"
            status, err = await _call(s, "POST", "/v1/responses/resp_1/cancel", "acme")
            assert status == 400
            assert "synchronous" in err["error"]["message"]

            status, conv = await _call(s, "POST", "/v1/conversations", "acme", {
                "metadata": {"topic": "demo"},
                "items": [{"type": "message", "role": "user", "content": "a"},
                          {"type": "message", "role": "user", "content": "b"}]})
            assert status == 200
            assert conv["object"] == "conversation"
            assert conv["metadata"] == {"topic": "demo"}
            cid = conv["id"]
            status, added = await _call(s, "POST", f"/v1/conversations/{cid}/items", "acme",
                                        {"items": [{"type": "message", "role": "user", "content": "c"}]})
            assert status == 200
            assert len(added["data"]) == 1
            status, listed = await _call(s, "GET", f"/v1/conversations/{cid}/items?order=asc&limit=2", "acme")
            assert [i["content"] for i in listed["data"]] == ["a", "b"]
            assert listed["has_more"]
            status, rest = await _call(s, "GET", f"/v1/conversations/{cid}/items?order=asc&after="
                                       f"{listed['last_id']}", "acme")
            assert [i["content"] for i in rest["data"]] == ["c"]
            assert not rest["has_more"]
            status, newest = await _call(s, "GET", f"/v1/conversations/{cid}/items?limit=1", "acme")
            assert [i["content"] for i in newest["data"]] == ["c"]  # desc by default, as OpenAI

            # a conversation is a turn of the chain: /v1/responses with it gets its items before its input
            turn = await prepare(store, "acme", msgspec.json.encode(
                {"model": "m", "input": "d", "conversation": {"id": cid}}), session=None)
            assert [i["content"] for i in msgspec.json.decode(turn.body)["input"]] == ["a", "b", "c", "d"]
            assert turn.session == f"acme/conversation/{cid}"

            status, err = await _call(s, "POST", f"/v1/conversations/{cid}/items", "acme",
                                      {"items": [{"role": "user", "content": str(n)} for n in range(3)]})
            assert status == 400
            assert "max_conversation_items" in err["error"]["message"]
            assert await _call(s, "GET", f"/v1/conversations/{cid}", "other") == (404, {"error": {
                "message": f"Conversation with id '{cid}' not found.", "type": "invalid_request_error",
                "param": "conversation_id", "code": 404}})
            first_item = f"/v1/conversations/{cid}/items/{added['first_id']}"
            status, _ = await _call(s, "DELETE", first_item, "other")
            assert status == 404

            status, conv = await _call(s, "POST", f"/v1/conversations/{cid}", "acme",
                                       {"metadata": {"k": "v"}})
            assert conv["metadata"] == {"k": "v"}
            status, conv = await _call(s, "DELETE", first_item, "acme")
            assert status == 200
            assert conv["id"] == cid
            status, listed = await _call(s, "GET", f"/v1/conversations/{cid}/items?order=asc", "acme")
            assert [i["content"] for i in listed["data"]] == ["a", "b"]
            assert await _call(s, "DELETE", f"/v1/conversations/{cid}", "acme") == (
                200, {"id": cid, "object": "conversation.deleted", "deleted": True})
            assert (await _call(s, "GET", f"/v1/conversations/{cid}/items", "acme"))[0] == 404
            assert not await store.redis.exists(store.keys.conversation_items(cid))

            assert await _call(s, "DELETE", "/v1/responses/resp_1", "acme") == (
                200, {"id": "resp_1", "object": "response", "deleted": True})
            assert (await _call(s, "GET", "/v1/responses/resp_1", "acme"))[0] == 404


def _tenant_header(request: web.Request) -> str:
    return request.headers["X-Tenant"]


@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Any]) -> web.StreamResponse:  # the ingress's, in short
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except RouterdError as e:
        return web.Response(status=e.status, body=error_json(e.message, e.type, e.status, e.param),
                            content_type="application/json")
