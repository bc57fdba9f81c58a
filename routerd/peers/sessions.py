"""Sessions that keep their instance whichever routerd process receives the next turn (issue #20).

The router's session table (:class:`routerd.routing.Sessions`) knows the sessions this process routed.
Each decision for a session is also written to Redis, ``<ns>:session:<digest>`` → ``(instance id,
generation)`` with a TTL (``SESSION_TTL_S``) — in the background, batched: the request never waits for
it. A process that receives a turn of a session it does not know, while other processes share the
Redis, looks it up before routing (:meth:`SharedSessions.recall`), bounded by ``LOOKUP_TIMEOUT_S``:
past that it routes without it (the session then starts over where routing puts it, as a session new
to one routerd does). A process alone never looks up, so one routerd routes exactly as before.

A write is made when a session's instance or generation changes, and otherwise at most every quarter
of the TTL (so a long conversation on one instance does not expire in Redis). What a process already
knows it does not look up again: if another process moved the session meanwhile (its instance was
saturated), this one keeps sending its turns where it last did until its own entry leaves the LRU.

Each entry is sealed for its session's digest (routerd/peers/sealed.py): one written by hand (a
conversation pinned where its writer chose) or copied from another session is refused and counted; the
turn is routed as a new session's.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import _aio, log
from ..redis_keys import RedisKeys
from ..trust import Rejected
from .outage import Outage
from .sealed import SESSION, Seals

_log = log.get("routerd.peers.sessions")

SESSION_TTL_S = 3600.0
LOOKUP_TIMEOUT_S = 0.01  # the most a request with an unknown session waits for Redis before routing
MAX_PENDING = 10_000  # writes waiting for the next batch; beyond, the oldest are dropped


class SessionRecord(msgspec.Struct, frozen=True, array_like=True):
    instance: str
    generation: int


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(SessionRecord).decode


def digest(session: str) -> str:
    """A fixed-size key for a session id of any length (a client's ``user`` may be long)."""
    return hashlib.blake2b(session.encode(), digest_size=16).hexdigest()


class SharedSessions:
    """The shared backing of the router's session table; ``run()`` (the batched writes) until
    cancelled."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, *, seals: Seals, processes: Callable[[], int],
                 max_entries: int, op_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 lookup_timeout_s: float = LOOKUP_TIMEOUT_S, ttl_s: float = SESSION_TTL_S) -> None:
        """``processes()``: how many routerd processes share the Redis (lookups only when > 1)."""
        self.redis = redis
        self.keys = keys
        self.seals = seals
        self.processes = processes
        self.max_entries = max_entries
        self.op_timeout_s = op_timeout_s
        self.clock = clock
        self.lookup_timeout_s = lookup_timeout_s
        self.ttl_s = ttl_s
        self._written: OrderedDict[str, tuple[str, int, float]] = OrderedDict()  # LRU: last write
        self._pending: dict[str, SessionRecord] = {}  # session → record to write
        self._wake = asyncio.Event()
        self.lookups = {"found": 0, "unknown": 0, "timeout": 0, "error": 0}

    def noted(self, session: str, instance: str, generation: int) -> None:
        """The router sent a turn of ``session`` to ``instance``: publish it (in the background)."""
        now = self.clock()
        last = self._written.get(session)
        if last is not None and last[:2] == (instance, generation) and now - last[2] < self.ttl_s / 4:
            self._written.move_to_end(session)
            return
        self._written[session] = (instance, generation, now)
        self._written.move_to_end(session)
        while len(self._written) > self.max_entries:
            self._written.popitem(last=False)
        if len(self._pending) >= MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[session] = SessionRecord(instance, generation)
        self._wake.set()

    async def recall(self, session: str) -> tuple[str, int] | None:
        """Where another process last sent ``session``, if it says so within the lookup timeout."""
        if self.processes() <= 1:
            return None
        key = digest(session)
        try:
            async with _aio.timeout(self.lookup_timeout_s):
                raw = await self.redis.get(self.keys.session(key))
        except TimeoutError:
            self.lookups["timeout"] += 1
            return None
        except (RedisError, OSError):
            self.lookups["error"] += 1
            return None
        if raw is None:
            self.lookups["unknown"] += 1
            return None
        try:
            rec = _decode(self.seals.open(SESSION, raw if isinstance(raw, bytes) else raw.encode(), key))
        except (Rejected, msgspec.DecodeError):
            self.lookups["error"] += 1
            return None
        self.lookups["found"] += 1
        self._written[session] = (rec.instance, rec.generation, self.clock())  # known there already
        return rec.instance, rec.generation

    async def run(self) -> None:
        """Write what was noted, one pipeline per batch."""
        outage = Outage(_log, "shared_sessions", effect="other processes route this one's sessions anew")
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            if not pending:
                continue
            pipe = self.redis.pipeline(transaction=False)
            px = int(self.ttl_s * 1000)
            for session, rec in pending.items():
                key = digest(session)
                pipe.set(self.keys.session(key), self.seals.seal(SESSION, _encode(rec), key), px=px)
            try:
                async with _aio.timeout(self.op_timeout_s):
                    await pipe.execute()
                outage.answered()
            except (RedisError, OSError, TimeoutError) as e:
                outage.failed(e)
                for session in pending:  # not written: the session's next turn writes it again
                    self._written.pop(session, None)
