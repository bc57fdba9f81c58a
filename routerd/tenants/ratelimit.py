"""Tenants' rate limits: token buckets in Redis, shared by every routerd on the same Redis.

Each limited tenant has two buckets in one hash (``<ns>:ratelimit:<tenant>``): requests and tokens,
holding up to a minute's allowance and refilled continuously (``requests_per_minute / 60`` per
second). A Lua script refills, checks and charges them atomically with Redis' own clock (``TIME``),
so two routerds never both spend the last request, and their clocks do not matter.

A request is charged one request and its *estimated* prompt tokens when it is admitted; when it ends,
:meth:`RateLimiter.settle` corrects the tokens by what the engine reported (prompt + completion), or
refunds what was never served. The token bucket may go below zero after a correction (a long answer):
the tenant then waits until it refills — at most an hour's allowance of debt, so that no report, however
absurd, leaves a bucket that locks its tenant out for good or overflows the script's arithmetic. A
request larger than a whole minute's tokens is let through when the bucket is full (it could never pass
otherwise) and leaves it in debt.

Every concurrent check of one routerd goes to Redis as *one* script call (the records of everything
that arrived meanwhile), so the cost is a round trip per batch, not per request. When Redis is not
configured, or does not answer within ``_REDIS_TIMEOUT_S``, the same buckets are kept in this process
for ``_DOWN_S`` before Redis is tried again: each routerd then enforces the limits alone (N routerds
let through up to N times the limit) — a Redis outage never stops the HTTP way in. Redis answering
with an error is logged as that error, not as an outage: when the whole script is refused, the same
local fallback; when one tenant's key is not a bucket, only that tenant's checks are decided locally.
A check that fails for any other reason fails its request alone (:class:`RateLimitFailed`): nothing
one request brings can end the batching loop every tenant's checks go through.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from .. import _aio, log
from ..errors import RateLimitFailed
from ..redis_keys import RedisKeys
from ..redis_server import REDIS_DOWN
from .directory import Tenant

__all__ = ["Grant", "LocalBuckets", "RateLimiter", "duration"]

_log = log.get("routerd.tenants")
_pack = msgspec.msgpack.Encoder().encode
_REDIS_TIMEOUT_S = 0.25  # a check waits this long for Redis before this routerd decides alone
_DOWN_S = 1.0  # after a failed call, decide locally this long before asking Redis again
_MINUTE_MS = 60_000.0
# Redis did not answer (or the connection broke): every tenant's check is decided here for _DOWN_S.
# Any other RedisError is Redis answering with an error, logged as one.
_NO_ANSWER = REDIS_DOWN
_MAX_DEBT_MINUTES = 60  # the token bucket's debt is capped at an hour of the limit (as in the script)
# A correction's tokens are clamped to what a double holds exactly: an engine's absurd usage report must
# not make the batch it travels in unsendable (msgpack stops at 2**64) for the others in it.
_MAX_CORRECTION = 2**53
_BUCKET_LOG_EVERY_S = 10.0  # one tenant's unreadable bucket is logged at most this often

# ARGV[1]: msgpack list of records {key, rpm, tpm, requests, tokens, check}. check = 1: charge only if
# both buckets hold enough (a request); 0: apply the deltas whatever the level (a correction, a refund).
# Per record: {allowed, requests left, tokens left, ms until enough, ms until requests full, ms until
# tokens full}, or {-1, 0, 0, 0, 0, 0, error} when its key cannot be read as a bucket (then only that
# record fails, not the batch) — but on a Redis Cluster node that no longer serves the buckets' slot the
# whole call fails, before anything is written, and is sent to the slot's master (routerd/redis_cluster.py).
# A bucket's level never rises above its limit (a refund of a full bucket
# is lost). A dimension without a limit keeps no level: a limit added later starts with a full bucket,
# not with the debt of every request sent while there was none.
BUCKETS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i, r in ipairs(cmsgpack.unpack(ARGV[1])) do
  local key, rpm, tpm, nreq, ntok, check = r[1], r[2], r[3], r[4], r[5], r[6]
  local s = redis.pcall('HMGET', key, 'r', 't', 'ts')
  if s.err and string.find(s.err, 'non local key', 1, true) then
    return redis.error_reply(s.err)
  elseif s.err then
    out[i] = {-1, 0, 0, 0, 0, 0, s.err}
  else
    local rl, tl = tonumber(s[1]) or rpm, tonumber(s[2]) or tpm
    local dt = math.max(0, now - (tonumber(s[3]) or now))
    rl = math.min(rpm, rl + dt * rpm / 60000)
    tl = math.min(tpm, tl + dt * tpm / 60000)
    local ok, wait = 1, 0
    if check == 1 then
      if rpm > 0 and rl < nreq then ok = 0; wait = (nreq - rl) * 60000 / rpm end
      local need = math.min(ntok, tpm)
      if tpm > 0 and tl < need then ok = 0; wait = math.max(wait, (need - tl) * 60000 / tpm) end
    end
    if ok == 1 then
      rl = math.min(rpm, rl - nreq)
      tl = math.max(-60 * tpm, math.min(tpm, tl - ntok))
    end
    if rpm == 0 then rl = 0 end
    if tpm == 0 then tl = 0 end
    local rr, rt = 0, 0
    if rpm > 0 then rr = math.ceil((rpm - rl) * 60000 / rpm) end
    if tpm > 0 then rt = math.ceil((tpm - tl) * 60000 / tpm) end
    if rpm > 0 then redis.call('HSET', key, 'r', tostring(rl)) else redis.call('HDEL', key, 'r') end
    if tpm > 0 then redis.call('HSET', key, 't', tostring(tl)) else redis.call('HDEL', key, 't') end
    redis.call('HSET', key, 'ts', now)
    redis.call('PEXPIRE', key, math.max(rr, rt) + 60000)
    out[i] = {ok, math.floor(rl), math.floor(tl), math.ceil(wait), rr, rt}
  end
end
return out
"""


def duration(ms: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(0, math.ceil(ms))}ms"
    if ms < _MINUTE_MS:
        return f"{round(ms / 1000, 3):g}s"
    minutes, rest = divmod(ms / 1000, 60)
    return f"{int(minutes)}m{round(rest, 3):g}s"


@dataclass(frozen=True, slots=True)
class Grant:
    """A check's answer: allowed or not (then when to come back), and what is left for the headers."""

    allowed: bool
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    requests_left: int = 0
    tokens_left: int = 0
    retry_after_ms: int = 0
    requests_reset_ms: int = 0
    tokens_reset_ms: int = 0

    @classmethod
    def of(cls, tenant: Tenant, reply: list[Any] | tuple[Any, ...]) -> Grant:
        ok, r_left, t_left, wait, r_reset, t_reset = (int(x) for x in reply)
        return cls(allowed=ok == 1, requests_per_minute=tenant.requests_per_minute,
                   tokens_per_minute=tenant.tokens_per_minute, requests_left=max(0, r_left),
                   tokens_left=max(0, t_left), retry_after_ms=max(0, wait), requests_reset_ms=r_reset,
                   tokens_reset_ms=t_reset)

    @property
    def retry_after_s(self) -> float:
        return self.retry_after_ms / 1000

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the tenant's limits (none when it has none)."""
        h: dict[str, str] = {}
        if self.requests_per_minute:
            h["x-ratelimit-limit-requests"] = str(self.requests_per_minute)
            h["x-ratelimit-remaining-requests"] = str(self.requests_left)
            h["x-ratelimit-reset-requests"] = duration(self.requests_reset_ms)
        if self.tokens_per_minute:
            h["x-ratelimit-limit-tokens"] = str(self.tokens_per_minute)
            h["x-ratelimit-remaining-tokens"] = str(self.tokens_left)
            h["x-ratelimit-reset-tokens"] = duration(self.tokens_reset_ms)
        return h


UNLIMITED = Grant(allowed=True)


class LocalBuckets:
    """The script's buckets in this process: used without Redis, and while Redis does not answer."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # tenant → (requests, tokens, at ms); None: no limit on that dimension, so no level (no debt)
        self._levels: dict[str, tuple[float | None, float | None, float]] = {}

    def apply(self, tenant: Tenant, requests: int, tokens: int, *, check: bool) -> Grant:
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        now = self._clock() * 1000
        r_was, t_was, at = self._levels.get(tenant.name, (None, None, now))
        rl = float(rpm) if r_was is None else r_was
        tl = float(tpm) if t_was is None else t_was
        dt = max(0.0, now - at)
        rl = min(rpm, rl + dt * rpm / _MINUTE_MS)
        tl = min(tpm, tl + dt * tpm / _MINUTE_MS)
        ok, wait = True, 0.0
        if check:
            if rpm > 0 and rl < requests:
                ok, wait = False, (requests - rl) * _MINUTE_MS / rpm
            need = min(tokens, tpm)
            if tpm > 0 and tl < need:
                ok, wait = False, max(wait, (need - tl) * _MINUTE_MS / tpm)
        if ok:
            rl, tl = min(rpm, rl - requests), max(-_MAX_DEBT_MINUTES * tpm, min(tpm, tl - tokens))
        rl, tl = (rl if rpm else 0.0), (tl if tpm else 0.0)
        self._levels[tenant.name] = (rl if rpm else None, tl if tpm else None, now)
        r_reset = math.ceil((rpm - rl) * _MINUTE_MS / rpm) if rpm else 0
        t_reset = math.ceil((tpm - tl) * _MINUTE_MS / tpm) if tpm else 0
        return Grant.of(tenant, (int(ok), math.floor(rl), math.floor(tl), math.ceil(wait), r_reset, t_reset))


@dataclass(slots=True)
class _Record:
    tenant: Tenant
    requests: int
    tokens: int
    future: asyncio.Future[Grant] | None  # None: a correction nobody waits for


class RateLimiter:
    """Checks and corrections against the shared buckets; :meth:`run` sends them to Redis in batches."""

    def __init__(self, client: Callable[[], aioredis.Redis] | None, keys: RedisKeys, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self._clock = clock
        self.local = LocalBuckets(clock)
        self._pending: list[_Record] = []
        self._wake = asyncio.Event()
        self._script: Any = None
        self._down_until = 0.0 if client is not None else math.inf
        self.redis_errors = 0
        self._down_since: float | None = None  # when this outage began (logged once, and when it ends)
        self._down_said: set[str] = set()  # the kinds of failure logged in this outage
        self._bucket_logged: dict[str, float] = {}  # tenant → when its unusable bucket was last logged

    @property
    def shared(self) -> bool:
        """Whether checks go to Redis right now (else this process decides alone)."""
        return self._clock() >= self._down_until

    async def acquire(self, tenant: Tenant, tokens: int) -> Grant:
        """Charge one request and ``tokens`` if both buckets hold enough, else say when to retry."""
        if not tenant.limited:
            return UNLIMITED
        if not self.shared:
            return self.local.apply(tenant, 1, tokens, check=True)
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        record = _Record(tenant, 1, tokens, future)
        self._pending.append(record)
        self._wake.set()
        try:
            async with asyncio.timeout(_REDIS_TIMEOUT_S * 2):
                return await future
        except TimeoutError:
            if record in self._pending:  # never sent: it must not be charged in Redis later as well
                self._pending.remove(record)
            self._mark_down("rate_limits_local", f"no answer in {_REDIS_TIMEOUT_S * 2:g} s",
                            "Redis did not answer: this routerd enforces tenants' limits alone")
            return self.local.apply(tenant, 1, tokens, check=True)

    def settle(self, tenant: Tenant, requests: int, tokens: int) -> None:
        """Correct a charge (negative = refund); sent with the next batch, nobody waits for it."""
        if not tenant.limited or (requests == 0 and tokens == 0):
            return
        tokens = max(-_MAX_CORRECTION, min(tokens, _MAX_CORRECTION))
        if not self.shared:
            self.local.apply(tenant, requests, tokens, check=False)
            return
        self._pending.append(_Record(tenant, requests, tokens, None))
        self._wake.set()

    async def run(self) -> None:
        """Send what is pending as one script call at a time, until cancelled."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._pending = self._pending, []
                if batch:
                    await self._send(batch)
        finally:
            batch, self._pending = self._pending, []
            self._decide_locally(batch)

    async def _send(self, batch: list[_Record]) -> None:
        """One script call for the batch. Whatever goes wrong stays with this batch and never ends
        :meth:`run` (every tenant's checks go through it): Redis not answering, or answering with an
        error, → decided in this process; anything else (a value that cannot be sent, a bug) → logged
        with its traceback and these checks fail (their requests are answered with an error)."""
        if not self.shared or self._client is None:
            self._decide_locally(batch)
            return
        try:
            records = [[self._keys.ratelimit(r.tenant.name), r.tenant.requests_per_minute,
                        r.tenant.tokens_per_minute, r.requests, r.tokens, 1 if r.future is not None else 0]
                       for r in batch]
            client = self._client()
            if self._script is None:
                self._script = client.register_script(BUCKETS)
            async with _aio.timeout(_REDIS_TIMEOUT_S):  # redis-py can swallow a cancel: see _aio
                replies = await self._script(args=[_pack(records)], client=client)
            self._back()
            for r, reply in zip(batch, replies, strict=True):
                self._answer(r, reply)
        except _NO_ANSWER as e:
            self._mark_down("rate_limits_local", f"{type(e).__name__}: {e}",
                            "Redis did not answer: this routerd enforces tenants' limits alone")
            self._decide_locally(batch)
        except redis.exceptions.RedisError as e:
            self._mark_down("rate_limits_redis_error", f"{type(e).__name__}: {e}",
                            "Redis refused the rate-limit script: this routerd enforces the limits alone")
            self._decide_locally(batch)
        except Exception as e:  # noqa: BLE001  # the batch loop's boundary: this batch fails, the loop goes on
            _log.exception("rate_limit_batch_failed", records=len(batch),
                           tenants=sorted({r.tenant.name for r in batch}))
            for r in batch:
                if r.future is not None and not r.future.done():
                    r.future.set_exception(RateLimitFailed(
                        f"routerd could not check tenant {r.tenant.name!r}'s rate limit: {type(e).__name__}"))

    def _answer(self, r: _Record, reply: list[Any]) -> None:
        """One record's reply; a bucket Redis could not use (its key holds something else) is that
        tenant's alone: logged as the error it is, decided in this process, the others stay shared."""
        if int(reply[0]) == -1:
            error = reply[6].decode(errors="replace") if isinstance(reply[6], bytes) else str(reply[6])
            self.redis_errors += 1
            now = self._clock()
            if now >= self._bucket_logged.get(r.tenant.name, -math.inf) + _BUCKET_LOG_EVERY_S:
                self._bucket_logged[r.tenant.name] = now
                _log.error("rate_limit_bucket_error", tenant=r.tenant.name,
                           key=self._keys.ratelimit(r.tenant.name), error=error,
                           reason="this tenant's limits are enforced by each routerd alone")
            self._decide_locally([r])
        elif r.future is not None and not r.future.done():
            r.future.set_result(Grant.of(r.tenant, reply))

    def _decide_locally(self, batch: list[_Record]) -> None:
        for r in batch:
            grant = self.local.apply(r.tenant, r.requests, r.tokens, check=r.future is not None)
            if r.future is not None and not r.future.done():
                r.future.set_result(grant)

    def _mark_down(self, event: str, error: str, reason: str) -> None:
        """Decide locally for ``_DOWN_S``; each kind logged once an outage, however many retries fail."""
        self.redis_errors += 1
        if self._down_since is None:
            self._down_since = self._clock()
        if event not in self._down_said:
            self._down_said.add(event)
            _log.warning(event, error=error, retry_in_s=_DOWN_S, reason=reason)
        self._down_until = self._clock() + _DOWN_S

    def _back(self) -> None:
        """Redis answered: an outage, if there was one, is over (after a Sentinel failover, this is
        the promoted master answering)."""
        if self._down_since is not None:
            _log.info("rate_limits_shared", local_s=round(self._clock() - self._down_since, 3),
                      reason="Redis answers again: tenants' limits are shared again")
            self._down_since = None
            self._down_said.clear()
