"""Where routerd keeps Responses-API records and conversations: Redis when routerd has one
(:class:`RedisStore`, seen by every routerd on it), else this process's memory (:class:`MemoryStore`).
Both have one interface, :class:`Store`.

A record is data, not a command: it is never sealed, but every read checks it against the tenant that
asks, and one of another tenant is :class:`UnknownId` (404), as one that does not exist — a tenant cannot
tell another's ids from made-up ones.

Bounds (``[responses]``): each record expires ``ttl_s`` after its last use — writing it, or continuing a
chain it is part of (the chain's turns are touched together, so a long conversation in use never loses
its beginning) — and each tenant keeps at most ``max_per_tenant`` responses and as many conversations, the
least recently used going first. A conversation holds at most ``max_conversation_items`` items: adding
beyond is refused (400), never silently truncated.

In Redis a response is ``<ns>:response:<id>`` (msgpack :class:`ResponseRecord`) indexed in the tenant's
``<ns>:responses:<tenant>`` (sorted by last use); a conversation is ``<ns>:conversation:<id>`` plus the
list ``<ns>:conversation_items:<id>`` of its items (JSON), indexed in ``<ns>:conversations:<tenant>``.
Each write with its index upkeep (expiry, the tenant's cap) is one Lua script: atomic, one round trip.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import redis.asyncio as aioredis

from .. import _aio
from ..config import ResponsesConfig
from ..errors import BadRequest, NotFound, RouterdError
from ..redis_keys import RedisKeys

__all__ = ["ConversationRecord", "MemoryStore", "RedisStore", "ResponseRecord", "Store", "StoreUnavailable",
           "UnknownId", "new_id"]


def new_id(prefix: str) -> str:
    """An id in OpenAI's form: ``resp_``, ``conv_``, ``msg_`` + 48 hex digits (192 random bits)."""
    return f"{prefix}_{secrets.token_hex(24)}"


class UnknownId(NotFound):
    """An id this tenant has no record of (never made, expired, evicted, deleted, or another tenant's):
    vLLM's and OpenAI's 404 ``invalid_request_error``."""

    type = "invalid_request_error"


class StoreUnavailable(RouterdError):
    """Redis did not answer in time: the request cannot be answered from (or recorded in) the store."""

    status, type = 503, "ServiceUnavailableError"


class ResponseRecord(msgspec.Struct, kw_only=True):
    """One stored response: what its turn added to the conversation and where it was served."""

    id: str
    tenant: str
    model: str
    created_at: int  # epoch seconds, as the response object's ``created_at``
    status: str  # the response's: completed | incomplete | failed | cancelled
    input: list[Any]  # this turn's input items as sent (a string input is one user message), each with an id
    output: list[Any]  # the response's output items
    previous_response_id: str | None = None
    chain: list[str] = []  # every earlier response of the chain, root first (previous_response_id last)
    conversation: str | None = None  # the conversation it was part of, if any
    instance: str = ""  # the instance that served it, and that instance's generation
    generation: int = 0
    response: dict[str, Any] = {}  # the response object as the client got it (GET answers it)


class ConversationRecord(msgspec.Struct, kw_only=True):
    id: str
    tenant: str
    created_at: int
    metadata: dict[str, str] = {}

    def obj(self) -> dict[str, Any]:
        """OpenAI's conversation object."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


_enc = msgspec.msgpack.Encoder()
_dec_response = msgspec.msgpack.Decoder(ResponseRecord)
_dec_conversation = msgspec.msgpack.Decoder(ConversationRecord)
_json = msgspec.json.Encoder()
_dec_json = msgspec.json.Decoder(dict[str, Any])


def unknown_response(response_id: str) -> UnknownId:
    return UnknownId(f"Response with id '{response_id}' not found.", param="response_id")


def unknown_conversation(conversation_id: str) -> UnknownId:
    return UnknownId(f"Conversation with id '{conversation_id}' not found.", param="conversation_id")


def unknown_item(item_id: str) -> UnknownId:
    return UnknownId(f"Item with id '{item_id}' not found.", param="item_id")


def too_many_items(cfg: ResponsesConfig, conversation_id: str) -> BadRequest:
    return BadRequest(f"Conversation '{conversation_id}' would hold more than "
                      f"{cfg.max_conversation_items} items ([responses] max_conversation_items).",
                      param="items")


class Store(Protocol):
    """The records of responses and conversations, per tenant (see the module's docstring)."""

    cfg: ResponsesConfig

    async def put_response(self, rec: ResponseRecord) -> None:
        """Store a new response, touching the chain it continues (``rec.chain``)."""
        ...

    async def response(self, tenant: str, response_id: str) -> ResponseRecord:
        """The record, or :class:`UnknownId`."""
        ...

    async def responses(self, tenant: str, ids: Sequence[str]) -> list[ResponseRecord | None]:
        """Several records at once (a chain), None for each this tenant has not."""
        ...

    async def delete_response(self, tenant: str, response_id: str) -> None:
        """Delete it, or :class:`UnknownId`."""
        ...

    async def create_conversation(self, conv: ConversationRecord, items: list[dict[str, Any]]) -> None: ...

    async def conversation(self, tenant: str, conversation_id: str) -> ConversationRecord: ...

    async def update_conversation(self, tenant: str, conversation_id: str,
                                  metadata: dict[str, str]) -> ConversationRecord: ...

    async def delete_conversation(self, tenant: str, conversation_id: str) -> None: ...

    async def items(self, tenant: str, conversation_id: str) -> list[dict[str, Any]]:
        """Every item of the conversation, oldest first."""
        ...

    async def add_items(self, tenant: str, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Append items (each with its ``id``); :class:`BadRequest` beyond ``max_conversation_items``."""
        ...

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> None: ...


# KEYS: the record's key, the tenant's index. ARGV: the record, ttl ms, now ms, the tenant's cap, the
# record's id, the records' key prefix, the second prefix of each record's companion key ("" for none),
# then ids of the tenant's records to touch (a chain continued). Returns -1 if the id exists already
# (never overwritten), else how many least recently used records were evicted.
_PUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local ttl = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[5])
for i = 8, #ARGV do
  if redis.call('PEXPIRE', ARGV[6] .. ARGV[i], ttl) == 1 then
    redis.call('ZADD', KEYS[2], 'XX', now, ARGV[i])
    if ARGV[7] ~= '' then redis.call('PEXPIRE', ARGV[7] .. ARGV[i], ttl) end
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #old, 2 do
    redis.call('DEL', ARGV[6] .. old[i])
    if ARGV[7] ~= '' then redis.call('DEL', ARGV[7] .. old[i]) end
  end
else
  over = 0
end
redis.call('PEXPIRE', KEYS[2], ttl)
return over
"""

# KEYS: the conversation, its items, the tenant's index. ARGV: ttl ms, now ms, max items, the
# conversation's id, then the items (JSON). Returns -1 if the conversation is gone, -2 if the items would
# be too many, else the new length.
_ADD_ITEMS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local n = #ARGV - 4
if redis.call('LLEN', KEYS[2]) + n > tonumber(ARGV[3]) then return -2 end
local len = redis.call('LLEN', KEYS[2])
if n > 0 then len = redis.call('RPUSH', KEYS[2], unpack(ARGV, 5)) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], 'XX', ARGV[2], ARGV[4])
return len
"""


class RedisStore:
    """:class:`Store` in Redis, shared by every routerd on it. Every call is bounded by ``op_timeout_s``
    (past it: :class:`StoreUnavailable`, 503)."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, cfg: ResponsesConfig, *, op_timeout_s: float,
                 wall: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.keys = keys
        self.cfg = cfg
        self.op_timeout_s = op_timeout_s
        self.wall = wall
        self._put = redis.register_script(_PUT)
        self._add = redis.register_script(_ADD_ITEMS)

    async def _call(self, aw: Any) -> Any:
        try:
            async with _aio.timeout(self.op_timeout_s):
                return await aw
        except (TimeoutError, OSError, aioredis.RedisError) as e:
            raise StoreUnavailable(f"the response store (Redis) did not answer: {type(e).__name__}") from e

    def _now_ms(self) -> int:
        return int(self.wall() * 1000)

    def _ttl_ms(self) -> int:
        return int(self.cfg.ttl_s * 1000)

    async def put_response(self, rec: ResponseRecord) -> None:
        k = self.keys
        prefix = k.response("")
        done = await self._call(self._put(
            keys=[k.response(rec.id), k.responses(rec.tenant)],
            args=[_enc.encode(rec), self._ttl_ms(), self._now_ms(), self.cfg.max_per_tenant, rec.id, prefix,
                  "", *rec.chain]))
        if done == -1:
            raise BadRequest(f"a response with id '{rec.id}' is stored already", param="request_id")

    def _open_response(self, tenant: str, raw: bytes | None) -> ResponseRecord | None:
        if raw is None:
            return None
        try:
            rec = _dec_response.decode(raw)
        except msgspec.DecodeError:
            return None
        return rec if rec.tenant == tenant else None

    async def response(self, tenant: str, response_id: str) -> ResponseRecord:
        rec = self._open_response(tenant, await self._call(self.redis.get(self.keys.response(response_id))))
        if rec is None:
            raise unknown_response(response_id)
        return rec

    async def responses(self, tenant: str, ids: Sequence[str]) -> list[ResponseRecord | None]:
        if not ids:
            return []
        raws = await self._call(self.redis.mget([self.keys.response(i) for i in ids]))
        return [self._open_response(tenant, raw) for raw in raws]

    async def delete_response(self, tenant: str, response_id: str) -> None:
        await self.response(tenant, response_id)  # another tenant's is not found
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.response(response_id))
        pipe.zrem(self.keys.responses(tenant), response_id)
        await self._call(pipe.execute())

    async def create_conversation(self, conv: ConversationRecord, items: list[dict[str, Any]]) -> None:
        if len(items) > self.cfg.max_conversation_items:
            raise too_many_items(self.cfg, conv.id)
        k = self.keys
        await self._call(self._put(
            keys=[k.conversation(conv.id), k.conversations(conv.tenant)],
            args=[_enc.encode(conv), self._ttl_ms(), self._now_ms(), self.cfg.max_per_tenant, conv.id,
                  k.conversation(""), k.conversation_items("")]))
        if items:
            await self.add_items(conv.tenant, conv.id, items)

    def _open_conversation(self, tenant: str, raw: bytes | None) -> ConversationRecord | None:
        if raw is None:
            return None
        try:
            conv = _dec_conversation.decode(raw)
        except msgspec.DecodeError:
            return None
        return conv if conv.tenant == tenant else None

    async def conversation(self, tenant: str, conversation_id: str) -> ConversationRecord:
        raw = await self._call(self.redis.get(self.keys.conversation(conversation_id)))
        conv = self._open_conversation(tenant, raw)
        if conv is None:
            raise unknown_conversation(conversation_id)
        return conv

    async def update_conversation(self, tenant: str, conversation_id: str,
                                  metadata: dict[str, str]) -> ConversationRecord:
        conv = await self.conversation(tenant, conversation_id)
        conv.metadata = metadata
        await self._call(self.redis.set(self.keys.conversation(conversation_id), _enc.encode(conv),
                                        px=self._ttl_ms(), xx=True))
        await self._touch_items(tenant, conversation_id, [])
        return conv

    async def delete_conversation(self, tenant: str, conversation_id: str) -> None:
        await self.conversation(tenant, conversation_id)
        k = self.keys
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(k.conversation(conversation_id), k.conversation_items(conversation_id))
        pipe.zrem(k.conversations(tenant), conversation_id)
        await self._call(pipe.execute())

    async def items(self, tenant: str, conversation_id: str) -> list[dict[str, Any]]:
        k = self.keys
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(k.conversation(conversation_id))
        pipe.lrange(k.conversation_items(conversation_id), 0, -1)
        raw, items = await self._call(pipe.execute())
        if self._open_conversation(tenant, raw) is None:
            raise unknown_conversation(conversation_id)
        return [_dec_json.decode(i) for i in items]

    async def add_items(self, tenant: str, conversation_id: str, items: list[dict[str, Any]]) -> None:
        await self.conversation(tenant, conversation_id)
        await self._touch_items(tenant, conversation_id, items)

    async def _touch_items(self, tenant: str, conversation_id: str, items: list[dict[str, Any]]) -> None:
        k = self.keys
        n = await self._call(self._add(
            keys=[k.conversation(conversation_id), k.conversation_items(conversation_id),
                  k.conversations(tenant)],
            args=[self._ttl_ms(), self._now_ms(), self.cfg.max_conversation_items, conversation_id,
                  *(_json.encode(i) for i in items)]))
        if n == -1:
            raise unknown_conversation(conversation_id)
        if n == -2:
            raise too_many_items(self.cfg, conversation_id)

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> None:
        k = self.keys
        await self.conversation(tenant, conversation_id)
        raws = await self._call(self.redis.lrange(k.conversation_items(conversation_id), 0, -1))
        for raw in raws:
            if _dec_json.decode(raw).get("id") == item_id:
                await self._call(self.redis.lrem(k.conversation_items(conversation_id), 1, raw))
                return
        raise unknown_item(item_id)


@dataclass(slots=True)
class _Entry:
    value: Any
    expires: float  # wall seconds
    items: list[dict[str, Any]] = field(default_factory=list)


class MemoryStore:
    """:class:`Store` in this process's memory, for a routerd without Redis: the same bounds (per tenant,
    least recently used first; expiry on read and on each write), lost when the process ends."""

    def __init__(self, cfg: ResponsesConfig, *, wall: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.wall = wall
        self._responses: dict[str, OrderedDict[str, _Entry]] = {}  # tenant → id → entry, LRU first
        self._conversations: dict[str, OrderedDict[str, _Entry]] = {}

    def _live(self, table: dict[str, OrderedDict[str, _Entry]], tenant: str, key: str,
              touch: bool = False) -> _Entry | None:
        entries = table.get(tenant)
        entry = entries.get(key) if entries is not None else None
        if entry is None or entries is None:
            return None
        now = self.wall()
        if entry.expires <= now:
            del entries[key]
            return None
        if touch:
            entry.expires = now + self.cfg.ttl_s
            entries.move_to_end(key)
        return entry

    def _insert(self, table: dict[str, OrderedDict[str, _Entry]], tenant: str, key: str,
                entry: _Entry) -> None:
        entries = table.setdefault(tenant, OrderedDict())
        entries[key] = entry
        entries.move_to_end(key)
        now = self.wall()
        for k in [k for k, e in entries.items() if e.expires <= now]:
            del entries[k]
        while len(entries) > self.cfg.max_per_tenant:
            entries.popitem(last=False)

    async def put_response(self, rec: ResponseRecord) -> None:
        if any(rec.id in entries for entries in self._responses.values()):
            raise BadRequest(f"a response with id '{rec.id}' is stored already", param="request_id")
        for i in rec.chain:
            self._live(self._responses, rec.tenant, i, touch=True)
        self._insert(self._responses, rec.tenant, rec.id, _Entry(rec, self.wall() + self.cfg.ttl_s))

    async def response(self, tenant: str, response_id: str) -> ResponseRecord:
        entry = self._live(self._responses, tenant, response_id)
        if entry is None:
            raise unknown_response(response_id)
        rec: ResponseRecord = entry.value
        return msgspec.structs.replace(rec)

    async def responses(self, tenant: str, ids: Sequence[str]) -> list[ResponseRecord | None]:
        out: list[ResponseRecord | None] = []
        for i in ids:
            entry = self._live(self._responses, tenant, i)
            out.append(None if entry is None else entry.value)
        return out

    async def delete_response(self, tenant: str, response_id: str) -> None:
        if self._live(self._responses, tenant, response_id) is None:
            raise unknown_response(response_id)
        del self._responses[tenant][response_id]

    async def create_conversation(self, conv: ConversationRecord, items: list[dict[str, Any]]) -> None:
        if len(items) > self.cfg.max_conversation_items:
            raise too_many_items(self.cfg, conv.id)
        self._insert(self._conversations, conv.tenant, conv.id,
                     _Entry(conv, self.wall() + self.cfg.ttl_s, list(items)))

    def _conv(self, tenant: str, conversation_id: str, touch: bool = False) -> _Entry:
        entry = self._live(self._conversations, tenant, conversation_id, touch=touch)
        if entry is None:
            raise unknown_conversation(conversation_id)
        return entry

    async def conversation(self, tenant: str, conversation_id: str) -> ConversationRecord:
        conv: ConversationRecord = self._conv(tenant, conversation_id).value
        return msgspec.structs.replace(conv)

    async def update_conversation(self, tenant: str, conversation_id: str,
                                  metadata: dict[str, str]) -> ConversationRecord:
        conv: ConversationRecord = self._conv(tenant, conversation_id, touch=True).value
        conv.metadata = metadata
        return msgspec.structs.replace(conv)

    async def delete_conversation(self, tenant: str, conversation_id: str) -> None:
        self._conv(tenant, conversation_id)
        del self._conversations[tenant][conversation_id]

    async def items(self, tenant: str, conversation_id: str) -> list[dict[str, Any]]:
        return list(self._conv(tenant, conversation_id).items)

    async def add_items(self, tenant: str, conversation_id: str, items: list[dict[str, Any]]) -> None:
        entry = self._conv(tenant, conversation_id)
        if len(entry.items) + len(items) > self.cfg.max_conversation_items:
            raise too_many_items(self.cfg, conversation_id)
        self._conv(tenant, conversation_id, touch=True)
        entry.items.extend(items)

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> None:
        entry = self._conv(tenant, conversation_id)
        for n, item in enumerate(entry.items):
            if item.get("id") == item_id:
                del entry.items[n]
                return
        raise unknown_item(item_id)
