"""LoRA adapters added at run time (``POST /admin/fleets/{fleet}/adapters``), kept in Redis.

Like the run-time replica counts (routerd/peers/replicas.py): in one process's memory an adapter
added by an admin would die with it; kept in the hash :meth:`routerd.redis_keys.RedisKeys.adapters`,
every routerd on the Redis serves it (each reads the hash every ``refresh_s``) and the next controller
starts from it.

Each entry is sealed for its adapter's name (routerd/peers/sealed.py): one written by hand, by a routerd
with another secret, or copied under another name is refused (counted, logged) and never served. Without
Redis (one routerd alone) the entries live in this process only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from .. import _aio, log
from ..errors import RouterdError
from ..redis_keys import RedisKeys
from ..redis_server import REDIS_DOWN
from ..trust import Rejected
from .sealed import ADAPTERS, Seals

_log = log.get("routerd.peers")


class AdaptersNotStored(RouterdError):
    """Redis did not take the change: the adapter is not added (or removed) anywhere."""

    status, type = 503, "ServiceUnavailableError"


class StoredAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """One run-time adapter: its fleet and path (its name is the hash field it is sealed for)."""

    fleet: str
    path: str


class AdapterStore:
    """The run-time adapters of every fleet; ``client`` None: this process's memory only."""

    def __init__(self, client: aioredis.Redis | None, keys: RedisKeys | None, *, seals: Seals | None,
                 op_timeout_s: float = 5.0, refresh_s: float = 1.0) -> None:
        self.client = client
        self.keys = keys
        self.seals = seals
        self.op_timeout_s = op_timeout_s
        self.refresh_s = refresh_s
        self._local: dict[str, StoredAdapter] = {}
        self.entries: dict[str, StoredAdapter] = {}  # as last read (or set, without Redis)
        self.on_change: Callable[[dict[str, StoredAdapter]], None] = lambda entries: None

    async def load(self) -> dict[str, StoredAdapter]:
        """Every genuine entry (refused ones are counted and skipped); raises Redis's errors."""
        if self.client is None or self.keys is None or self.seals is None:
            return dict(self._local)
        async with _aio.timeout(self.op_timeout_s):
            raw: dict[Any, Any] = await self.client.hgetall(self.keys.adapters())
        out: dict[str, StoredAdapter] = {}
        for key, value in raw.items():
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            try:
                out[name] = msgspec.json.decode(self.seals.open(ADAPTERS, value, name, adapter=name),
                                                type=StoredAdapter)
            except (Rejected, msgspec.DecodeError):
                continue  # counted and logged by the seals (or unreadable): never served
        return out

    async def refresh(self) -> None:
        entries = await self.load()
        if entries != self.entries:
            self.entries = entries
            self.on_change(entries)

    async def set(self, name: str, entry: StoredAdapter) -> None:
        """Keep ``name``; :class:`AdaptersNotStored` when Redis does not take it."""
        if self.client is None or self.keys is None or self.seals is None:
            self._local[name] = entry
        else:
            try:
                async with _aio.timeout(self.op_timeout_s):
                    await self.client.hset(self.keys.adapters(), name,
                                           self.seals.seal(ADAPTERS, msgspec.json.encode(entry), name))
            except REDIS_DOWN as e:
                raise AdaptersNotStored(f"adapter {name!r} was not added: Redis did not store it ({e!r}); "
                                        "try again") from None
        await self.refresh()

    async def unset(self, name: str) -> None:
        """Drop ``name``; :class:`AdaptersNotStored` when Redis does not take it."""
        if self.client is None or self.keys is None:
            self._local.pop(name, None)
        else:
            try:
                async with _aio.timeout(self.op_timeout_s):
                    await self.client.hdel(self.keys.adapters(), name)
            except REDIS_DOWN as e:
                raise AdaptersNotStored(f"adapter {name!r} was not removed: Redis did not drop it ({e!r}); "
                                        "try again") from None
        await self.refresh()

    async def run(self) -> None:
        """Follow the hash until cancelled (what another routerd added shows here within ``refresh_s``)."""
        while True:
            try:
                await self.refresh()
            except REDIS_DOWN as e:
                _log.warning("adapters_refresh_failed", error=repr(e))
            await asyncio.sleep(self.refresh_s)
