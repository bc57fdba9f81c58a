"""A ``/v1/responses`` request made whole: its conversation read from the store and sent as ``input``.

routerd never relies on an engine's Responses state (vLLM keeps it in one engine's memory, only with
``VLLM_ENABLE_RESPONSES_API_STORE=1``, and never frees it). For every request with ``previous_response_id``
or ``conversation``, :func:`prepare` reads the conversation so far from routerd's store and sends the
engine the whole of it as ``input`` items — earlier turns' input and output items, then this turn's —
without ``previous_response_id`` or ``conversation``, with ``store: false`` and routerd's own
``request_id`` (so the engine's response id is the one routerd records). Any instance can serve it: the
one that served the turn before, another one after it restarted or was scaled away, one behind another
routerd. This costs no engine work: vLLM's own ``previous_response_id`` renders the stored messages
and outputs into the prompt again too (``_render_resolved_response_inputs``) — it saves only the bytes
of sending them.

Where it goes: the chain's session key (``X-Session-Id`` when the client sent one) keeps its turns on
the instance that served the last one while that instance is ready and not saturated (the router's
session affinity, shared by every routerd on the Redis); and since turn *n+1*'s rendered prompt starts
with turn *n*'s, cache-aware routing finds the instance holding the prefix even when the session is
not known. Routing sees the conversation as chat messages (:func:`routing_head`): the instructions as a
system message, each message item as its role and text, any other item (a tool call, its output,
reasoning) as its JSON under its type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import BadRequest
from ..openai import ChatHead, ChatMessage
from .store import ResponseRecord, Store, UnknownId, new_id, too_many_items

__all__ = ["Turn", "history_of", "input_items", "prepare", "routing_head"]

_decode = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.Encoder().encode


@dataclass(slots=True, kw_only=True)
class Turn:
    """One ``/v1/responses`` request, prepared: what the engine is sent and what is recorded after."""

    id: str  # routerd's id of the response (the engine's ``request_id``)
    tenant: str
    model: str
    body: bytes  # the body the engine is sent: the whole conversation, store false
    head: ChatHead  # routing's view of the whole conversation
    stream: bool
    store: bool  # the client's ``store`` (OpenAI's default: true)
    session: str  # routing's session key
    input: list[dict[str, Any]]  # this turn's input items, each with an id
    previous_response_id: str | None = None
    chain: list[str]  # the chain continued, root first (previous_response_id last); [] for a new one
    conversation: str | None = None
    history: int = 0  # items sent before this turn's (the conversation so far)
    served: tuple[str, int] | None = None  # the instance (id, generation) that served the chain's last turn


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as items with ids (a string is one user message). Items are kept as the
    client sent them, plus an ``id`` where they had none (OpenAI's items have one; vLLM accepts it)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value, "id": new_id("msg")}]
    if not isinstance(value, list) or not value:
        raise BadRequest("invalid request: `input` must be a string or a non-empty array of items",
                         param="input")
    out: list[dict[str, Any]] = []
    for n, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRequest(f"invalid request: `input[{n}]` must be an object", param="input")
        if not isinstance(item.get("id"), str):
            item = {**item, "id": new_id("msg" if item.get("type", "message") == "message" else "item")}
        out.append(item)
    return out


def _conversation_id(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise BadRequest("invalid request: `conversation` must be a conversation id or {\"id\": …}",
                         param="conversation")
    return value


async def history_of(store: Store, tenant: str,
                     previous: str) -> tuple[list[str], list[Any], ResponseRecord]:
    """The chain ending with response ``previous`` (root first), its items (each turn's input then
    output) and ``previous``'s record. :class:`UnknownId` if this tenant has no ``previous``, or no
    longer one of its chain (deleted): a conversation missing a turn is not continued as if it had never
    had it."""
    try:
        last = await store.response(tenant, previous)
    except UnknownId:
        raise UnknownId(f"Response with id '{previous}' not found.", param="previous_response_id") from None
    chain = [*last.chain, last.id]
    records: list[ResponseRecord | None] = [*await store.responses(tenant, last.chain), last]
    items: list[Any] = []
    for rid, rec in zip(chain, records, strict=True):
        if rec is None:
            raise UnknownId(f"Response with id '{rid}', part of the conversation '{previous}' continues, "
                            "is no longer stored.", param="previous_response_id")
        items += rec.input
        items += rec.output
    return chain, items, last


def _message_of(item: dict[str, Any]) -> ChatMessage:
    if item.get("type", "message") == "message":
        return ChatMessage(role=item.get("role"), content=item.get("content"))
    return ChatMessage(role=item.get("type"),
                       content={k: v for k, v in item.items() if k not in ("id", "status")})


def routing_head(model: str, instructions: Any, items: list[Any], body: dict[str, Any]) -> ChatHead:
    """The conversation as routing reads a chat request (see the module's docstring)."""
    messages = [ChatMessage(role="system", content=instructions)] if isinstance(instructions, str) else []
    messages += [_message_of(i) for i in items if isinstance(i, dict)]
    return ChatHead(model=model, messages=messages, stream=bool(body.get("stream")),
                    max_tokens=body.get("max_output_tokens"), user=body.get("user"))


async def prepare(store: Store, tenant: str, raw: bytes, *, session: str | None) -> Turn:
    """The request ``raw`` of ``tenant`` made whole (see the module's docstring). :class:`BadRequest` for
    a body routerd cannot serve, :class:`UnknownId` (404) for a previous response or conversation this
    tenant has not."""
    try:
        body = _decode(raw)
    except msgspec.ValidationError:
        raise BadRequest("the body must be a JSON object") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("invalid request: `model` must be a non-empty string", param="model")
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise BadRequest("invalid request: `stream` must be a boolean", param="stream")
    stored = body.get("store", True)
    if stored not in (None, True, False):
        raise BadRequest("invalid request: `store` must be a boolean", param="store")
    if body.get("background"):
        raise BadRequest("routerd does not run responses in the background: send `background: false` "
                         "(stream it instead)", param="background")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequest("invalid request: `previous_response_id` must be a string",
                         param="previous_response_id")
    conversation = _conversation_id(body.get("conversation"))
    if previous is not None and conversation is not None:
        raise BadRequest("Only one of `previous_response_id` and `conversation` can be set.",
                         param="previous_response_id")
    items = input_items(body.get("input"))
    chain: list[str] = []
    history: list[Any] = []
    turn_id = new_id("resp")
    served = None
    if previous is not None:
        chain, history, last = await history_of(store, tenant, previous)
        served = (last.instance, last.generation) if last.instance else None
        key = f"{tenant}/response/{chain[0]}"
    elif conversation is not None:
        history = await store.items(tenant, conversation)
        if len(history) + len(items) > store.cfg.max_conversation_items:
            raise too_many_items(store.cfg, conversation)
        key = f"{tenant}/conversation/{conversation}"
    else:
        key = f"{tenant}/response/{turn_id}"
    whole = [*history, *items]
    out = {k: v for k, v in body.items() if k not in ("previous_response_id", "conversation")}
    out.update(input=whole, store=False, request_id=turn_id)
    return Turn(id=turn_id, tenant=tenant, model=model, body=_encode(out),
                head=routing_head(model, body.get("instructions"), whole, body), stream=bool(stream),
                store=stored is not False, session=session if session and session != previous else key,
                input=items, previous_response_id=previous,
                chain=chain, conversation=conversation, history=len(history), served=served)
