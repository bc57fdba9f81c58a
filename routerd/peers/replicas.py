"""Replica counts set at run time (``POST /admin/fleets/{fleet}/replicas``), kept in Redis.

In a process's memory alone such a count dies with it: the next controller would start from the file's
count and stop the engines the admin asked for as unwanted. Kept in the hash
:meth:`routerd.redis_keys.RedisKeys.replicas`, the next controller starts from it. Each entry remembers the
file's ``replicas`` and ``autoscale`` it was set over: a controller whose file says otherwise for that
fleet drops it (the file changed the count or bounds: the file wins — the rule a reload follows too).

Each entry is sealed for its fleet (routerd/peers/sealed.py): one written by hand, by a routerd with
another secret, or copied from another fleet's field is refused (counted, logged) and dropped, never
applied. A genuine entry of the same fleet written back later can only restore a count an admin set
before over the same file.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import redis.asyncio as aioredis

from .. import _aio, log
from ..config import FleetConfig
from ..errors import RouterdError
from ..redis_keys import RedisKeys
from ..redis_server import REDIS_DOWN
from ..trust import Rejected
from .sealed import REPLICAS, Seals

_log = log.get("routerd.peers")


class ReplicasNotStored(RouterdError):
    """Redis did not take a run-time replica count: the count is not changed (a count only this process
    knew would be undone by the next controller)."""

    status, type = 503, "ServiceUnavailableError"


class _Pin(msgspec.Struct, frozen=True):
    replicas: int
    file: str  # the file's count and bounds the pin was set over (file_of)


def file_of(fleet: FleetConfig) -> str:
    """What of the file a pin overrides: the fleet's ``replicas`` and ``autoscale``."""
    return hashlib.sha256(msgspec.json.encode([fleet.replicas, fleet.autoscale])).hexdigest()[:16]


class ReplicaStore:
    """The run-time replica counts of every fleet, in Redis; the fleet manager reads and writes it."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, *, seals: Seals,
                 op_timeout_s: float = 5.0) -> None:
        """``client``: the caller's (it closes it); ``seals``: the process's (entries are sealed)."""
        self.client = client
        self.keys = keys
        self.seals = seals
        self.op_timeout_s = op_timeout_s

    async def load(self, fleets: list[FleetConfig]) -> dict[str, int]:
        """The pins that still hold for ``fleets`` (launched ones); the others are dropped and logged."""
        async with _aio.timeout(self.op_timeout_s):
            raw: dict[Any, Any] = await self.client.hgetall(self.keys.replicas())
        by_name = {f.name: f for f in fleets}
        out: dict[str, int] = {}
        for key, value in raw.items():
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            fleet = by_name.get(name)
            pin: _Pin | None = None
            why = "unreadable"
            try:
                pin = msgspec.json.decode(self.seals.open(REPLICAS, value, name, fleet=name), type=_Pin)
            except Rejected as e:
                why = f"refused ({e.why.value})"
            except msgspec.DecodeError:
                pass
            if fleet is None or pin is None or pin.file != file_of(fleet):
                _log.info("replicas_pin_dropped", fleet=name,
                          why="no such launched fleet" if fleet is None else
                          why if pin is None else "the file's replicas or autoscale changed since")
                await self.unset(name)
                continue
            out[name] = pin.replicas
        return out

    async def set(self, fleet: FleetConfig, replicas: int) -> None:
        """Keep ``fleet``'s count; :class:`ReplicasNotStored` when Redis does not take it."""
        try:
            async with _aio.timeout(self.op_timeout_s):
                pin = msgspec.json.encode(_Pin(replicas=replicas, file=file_of(fleet)))
                await self.client.hset(self.keys.replicas(), fleet.name,
                                       self.seals.seal(REPLICAS, pin, fleet.name))
        except REDIS_DOWN as e:
            raise ReplicasNotStored(f"the replica count of fleet {fleet.name!r} was not changed: Redis did "
                                    f"not store it ({e!r}); try again") from None

    async def unset(self, fleet: str) -> None:
        """Drop ``fleet``'s count; :class:`ReplicasNotStored` when Redis does not take it."""
        try:
            async with _aio.timeout(self.op_timeout_s):
                await self.client.hdel(self.keys.replicas(), fleet)
        except REDIS_DOWN as e:
            raise ReplicasNotStored(f"the replica count of fleet {fleet!r} was not changed: Redis did not "
                                    f"drop it ({e!r}); try again") from None
