"""The stored side of the Responses API and OpenAI's Conversations API, answered from routerd's store
(no engine is asked: vLLM does not serve conversations, and a response's record is routerd's).

Each handler takes the tenant the ingress authenticated and answers in OpenAI's shapes; what is wrong is
raised as a :class:`~routerd.errors.RouterdError` (an id this tenant has not: 404
``invalid_request_error``), which the ingress answers in OpenAI's error shape.

| route | answers |
|---|---|
| ``GET /v1/responses/{id}`` | the response object as the client got it |
| ``GET /v1/responses/{id}/input_items`` | that turn's input items (``after``, ``limit``, ``order``) |
| ``DELETE /v1/responses/{id}`` | ``{"id", "object": "response", "deleted": true}`` |
| ``POST /v1/responses/{id}/cancel`` | 400: routerd runs no response in the background: none to cancel |
| ``POST /v1/conversations`` | a new conversation (``items``, at most 20; ``metadata``) |
| ``GET``/``POST``/``DELETE /v1/conversations/{id}`` | retrieve, update ``metadata``, delete |
| ``GET``/``POST /v1/conversations/{id}/items`` | list (``after``, ``limit``, ``order``), add (``items``) |
| ``GET``/``DELETE /v1/conversations/{id}/items/{item_id}`` | one item; delete one (answers the conv.) |
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from ..errors import BadRequest
from .chain import input_items
from .store import ConversationRecord, Store, new_id, unknown_item

__all__ = ["ConversationRoutes", "page"]

MAX_CREATE_ITEMS = 20  # OpenAI's bound on the items one create or add call carries
MAX_METADATA = 16  # OpenAI's metadata bounds: 16 pairs, keys ≤ 64, values ≤ 512 characters

Handler = Callable[[str, web.Request], Awaitable[web.StreamResponse]]
_decode = msgspec.json.Decoder(dict[str, Any]).decode


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


def page(items: list[dict[str, Any]], query: Any, *, default_order: str = "desc") -> dict[str, Any]:
    """OpenAI's list of ``items`` (oldest first) for ``after``, ``limit`` (1–100, default 20) and ``order``
    (``asc`` | ``desc``)."""
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise BadRequest("invalid request: `order` must be `asc` or `desc`", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("invalid request: `limit` must be an integer from 1 to 100", param="limit")
    seq = items if order == "asc" else items[::-1]
    start = 0
    after = query.get("after")
    if after:
        start = next((n + 1 for n, i in enumerate(seq) if i.get("id") == after), -1)
        if start < 0:
            raise unknown_item(after)
    data = seq[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None, "has_more": start + limit < len(seq)}


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items()):
        raise BadRequest(f"invalid request: `metadata` must be an object of at most {MAX_METADATA} string "
                         "pairs (keys up to 64 characters, values up to 512)", param="metadata")
    return dict(value)


def _items(value: Any, *, required: bool) -> list[dict[str, Any]]:
    if value is None and not required:
        return []
    if not isinstance(value, list) or len(value) > MAX_CREATE_ITEMS or (required and not value):
        raise BadRequest(f"invalid request: `items` must be an array of 1 to {MAX_CREATE_ITEMS} items",
                         param="items")
    return input_items(value) if value else []


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        return _decode(raw)
    except msgspec.ValidationError:
        raise BadRequest("the body must be a JSON object") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None


class ConversationRoutes:
    """The handlers over one :class:`~routerd.conversations.store.Store`."""

    def __init__(self, store: Store, *, wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.wall = wall

    def add_to(self, app: web.Application, tenant_of: Callable[[web.Request], str]) -> None:
        """Register every route; ``tenant_of(request)`` authenticates the caller (raising to refuse)."""
        def bound(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
            async def handle(request: web.Request) -> web.StreamResponse:
                return await handler(tenant_of(request), request)
            return handle

        r = app.router
        r.add_get("/v1/responses/{id}", bound(self.get_response))
        r.add_get("/v1/responses/{id}/input_items", bound(self.response_input_items))
        r.add_delete("/v1/responses/{id}", bound(self.delete_response))
        r.add_post("/v1/responses/{id}/cancel", bound(self.cancel_response))
        r.add_post("/v1/conversations", bound(self.create_conversation))
        r.add_get("/v1/conversations/{id}", bound(self.get_conversation))
        r.add_post("/v1/conversations/{id}", bound(self.update_conversation))
        r.add_delete("/v1/conversations/{id}", bound(self.delete_conversation))
        r.add_get("/v1/conversations/{id}/items", bound(self.list_items))
        r.add_post("/v1/conversations/{id}/items", bound(self.add_items))
        r.add_get("/v1/conversations/{id}/items/{item_id}", bound(self.get_item))
        r.add_delete("/v1/conversations/{id}/items/{item_id}", bound(self.delete_item))

    # responses --------------------------------------------------------------------------------
    async def get_response(self, tenant: str, request: web.Request) -> web.Response:
        rec = await self.store.response(tenant, request.match_info["id"])
        return _json(rec.response)

    async def response_input_items(self, tenant: str, request: web.Request) -> web.Response:
        rec = await self.store.response(tenant, request.match_info["id"])
        return _json(page(rec.input, request.query))

    async def delete_response(self, tenant: str, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        await self.store.delete_response(tenant, rid)
        return _json({"id": rid, "object": "response", "deleted": True})

    async def cancel_response(self, tenant: str, request: web.Request) -> web.Response:
        await self.store.response(tenant, request.match_info["id"])  # 404 first, as vLLM
        raise BadRequest("Cannot cancel a synchronous response.", param="response_id")

    # conversations ----------------------------------------------------------------------------
    async def create_conversation(self, tenant: str, request: web.Request) -> web.Response:
        body = await _body(request)
        items = _items(body.get("items"), required=False)
        conv = ConversationRecord(id=new_id("conv"), tenant=tenant, created_at=int(self.wall()),
                                  metadata=_metadata(body.get("metadata")))
        await self.store.create_conversation(conv, items)
        return _json(conv.obj())

    async def get_conversation(self, tenant: str, request: web.Request) -> web.Response:
        return _json((await self.store.conversation(tenant, request.match_info["id"])).obj())

    async def update_conversation(self, tenant: str, request: web.Request) -> web.Response:
        body = await _body(request)
        if "metadata" not in body:
            raise BadRequest("invalid request: `metadata` is required", param="metadata")
        conv = await self.store.update_conversation(tenant, request.match_info["id"],
                                                    _metadata(body["metadata"]))
        return _json(conv.obj())

    async def delete_conversation(self, tenant: str, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        await self.store.delete_conversation(tenant, cid)
        return _json({"id": cid, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, tenant: str, request: web.Request) -> web.Response:
        items = await self.store.items(tenant, request.match_info["id"])
        return _json(page(items, request.query))

    async def add_items(self, tenant: str, request: web.Request) -> web.Response:
        body = await _body(request)
        items = _items(body.get("items"), required=True)
        await self.store.add_items(tenant, request.match_info["id"], items)
        return _json({"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"],
                      "has_more": False})

    async def get_item(self, tenant: str, request: web.Request) -> web.Response:
        item_id = request.match_info["item_id"]
        for item in await self.store.items(tenant, request.match_info["id"]):
            if item.get("id") == item_id:
                return _json(item)
        raise unknown_item(item_id)

    async def delete_item(self, tenant: str, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        await self.store.delete_item(tenant, cid, request.match_info["item_id"])
        return _json((await self.store.conversation(tenant, cid)).obj())
