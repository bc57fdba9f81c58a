"""Usage per tenant, fleet and LoRA adapter: counters in this process (``/metrics``) and per-day
counters in Redis.

Every request a tenant sent to a fleet ends in :meth:`UsageLedger.add`: served (``requests``),
failed (``errors``), refused by its rate limit (``rate_limited``), and the prompt and completion
tokens the engine reported. The process's totals since start feed ``/metrics``; the same increments
are summed per UTC day and written to Redis by :meth:`UsageLedger.run` every ``flush_interval_s`` as
``HINCRBY <ns>:usage:<day> <tenant>|<fleet>|<counter>`` (a LoRA adapter's requests:
``<tenant>|<fleet>:<adapter>|<counter>``; names hold neither ``|`` nor ``:``) — one command per counter
that moved, however many requests moved it — so the days survive restarts and every routerd on the same
Redis adds to the same figures. A failed write keeps its increments for the next one; on stop the last
ones are written (bounded). A crash loses at most one interval's. ``routerd usage`` reads them back
(:func:`read_days`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import redis.asyncio as aioredis
import redis.exceptions

from .. import _aio, log
from ..redis_keys import RedisKeys

__all__ = ["COUNTERS", "Usage", "UsageLedger", "day_of", "read_days"]

_log = log.get("routerd.tenants")
COUNTERS = ("requests", "errors", "rate_limited", "prompt_tokens", "completion_tokens")
_REDIS_ERRORS = (redis.exceptions.RedisError, OSError, TimeoutError)
_FINAL_FLUSH_S = 2.0


def day_of(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(epoch_s))


class Usage(NamedTuple):
    """Tokens the engine reported for one request."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageLedger:
    """Counts usage; :meth:`run` writes it to Redis (when there is one) until cancelled."""

    def __init__(self, client: Callable[[], aioredis.Redis] | None, keys: RedisKeys, *, retention_days: int,
                 flush_interval_s: float = 1.0, op_timeout_s: float = 5.0,
                 wall: Callable[[], float] = time.time) -> None:
        self._client = client
        self._keys = keys
        self.retention_days = retention_days
        self._interval = flush_interval_s
        self._op_timeout = op_timeout_s
        self._wall = wall
        self.totals: dict[tuple[str, str], list[int]] = {}  # (tenant, fleet) → COUNTERS, since start
        # (tenant, fleet, adapter) → COUNTERS since start, of a LoRA adapter's requests (in totals too)
        self.adapter_totals: dict[tuple[str, str, str], list[int]] = {}
        # (day, tenant, fleet, adapter) → increments not written yet
        self._pending: dict[tuple[str, str, str, str], list[int]] = {}
        self.flush_errors = 0

    def add(self, tenant: str, fleet: str, *, adapter: str = "", requests: int = 0, errors: int = 0,
            rate_limited: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        deltas = (requests, errors, rate_limited, prompt_tokens, completion_tokens)
        total = self.totals.get((tenant, fleet))
        if total is None:
            total = self.totals[(tenant, fleet)] = [0] * len(COUNTERS)
        if adapter:
            of_adapter = self.adapter_totals.setdefault((tenant, fleet, adapter), [0] * len(COUNTERS))
            for i, d in enumerate(deltas):
                of_adapter[i] += d
        if self._client is None:
            for i, d in enumerate(deltas):
                total[i] += d
            return
        key = (day_of(self._wall()), tenant, fleet, adapter)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = [0] * len(COUNTERS)
        for i, d in enumerate(deltas):
            total[i] += d
            pending[i] += d

    async def run(self) -> None:
        """Write the increments every interval; on cancellation write what is left, then re-raise."""
        if self._client is None:
            return
        try:
            while True:
                await asyncio.sleep(self._interval)
                await self.flush()
        finally:
            with contextlib.suppress(TimeoutError):
                async with _aio.timeout(_FINAL_FLUSH_S):
                    await self.flush()

    async def flush(self) -> bool:
        """Write the pending increments; when Redis did not take them, keep them for the next try.
        True if written.

        An increment Redis *refuses* (a field that is not an integer, a key of another type, a sum past
        2**63) is dropped and logged: it would be refused again every time, and the commands beside it
        in the pipeline were applied — keeping the batch added those again at every retry."""
        if not self._pending or self._client is None:
            return True
        batch, self._pending = self._pending, {}
        ttl = self.retention_days * 86_400
        fields: list[tuple[str, str]] = []  # (key, field) of each command; field "" for an EXPIRE
        try:
            async with _aio.timeout(self._op_timeout):  # redis-py can swallow a cancel: see _aio
                pipe = self._client().pipeline(transaction=False)
                for (day, tenant, fleet, adapter), deltas in batch.items():
                    key = self._keys.usage(day)
                    where = f"{tenant}|{fleet}:{adapter}" if adapter else f"{tenant}|{fleet}"
                    for name, d in zip(COUNTERS, deltas, strict=True):
                        if d:
                            pipe.hincrby(key, f"{where}|{name}", d)
                            fields.append((key, f"{where}|{name}"))
                    pipe.expire(key, ttl)
                    fields.append((key, ""))
                replies = await pipe.execute(raise_on_error=False)
        except _REDIS_ERRORS as e:
            for of, deltas in batch.items():  # added to what came meanwhile
                pending = self._pending.setdefault(of, [0] * len(COUNTERS))
                for i, d in enumerate(deltas):
                    pending[i] += d
            self.flush_errors += 1
            # redis-py's repr() of its errors drops the message ("server:ResponseError")
            _log.warning("usage_flush_failed", error=f"{type(e).__name__}: {e}", pending=len(self._pending))
            return False
        refused = [(key, field, reply) for (key, field), reply in zip(fields, replies, strict=True)
                   if isinstance(reply, redis.exceptions.RedisError)]
        if refused:
            self.flush_errors += 1
            key, field, reply = refused[0]
            _log.error("usage_write_refused", key=key, field=field or None, refused=len(refused),
                       error=f"{type(reply).__name__}: {reply}", reason="these increments are dropped")
            return False
        return True


async def read_days(client: Any, keys: RedisKeys, days: Iterable[str]) -> list[dict[str, Any]]:
    """Rows ``{day, tenant, fleet, adapter, <counters>, total_tokens}`` of the stored days, sorted
    (``adapter`` "": the fleet's own model)."""
    days = list(days)
    pipe = client.pipeline(transaction=False)
    for day in days:
        pipe.hgetall(keys.usage(day))
    rows: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for day, fields in zip(days, await pipe.execute(), strict=True):
        for field, value in fields.items():
            name = field.decode() if isinstance(field, bytes) else str(field)
            tenant, where, counter = name.rsplit("|", 2)
            fleet, _, adapter = where.partition(":")
            row = rows.setdefault((day, tenant, fleet, adapter),
                                  {"day": day, "tenant": tenant, "fleet": fleet, "adapter": adapter,
                                   **dict.fromkeys(COUNTERS, 0)})
            if counter in row:
                row[counter] += int(value)
    out = [rows[k] for k in sorted(rows)]
    for row in out:
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return out
