"""Tenancy: the tenants of the config, their shared rate limits and their usage — one per data plane.

Both ways in use it the same way around the engine call::

    charge = await tenancy.charge(tenant, fleet, facts)       # HTTP: RateLimited (429) when over
    charge = await tenancy.wait_for_quota(name, fleet, facts, deadline)  # queue: waits instead
    ... admission ticket, upstream.forward(..., sink=UsageTap(...)) ...  # routerd/dataplane/dispatch.py
    tenancy.settle(charge, tap.usage(), status=tap.status, ok=...)  # usage counted, tokens corrected

It owns one Redis client (rate-limit scripts and usage writes), opened lazily and closed when
:meth:`run` ends; without Redis both work in this process alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..config import Config
from ..errors import BadRequest, DeadlineExceeded, PermissionDenied, RateLimited, quote
from ..redis_conn import RedisConn
from ..redis_keys import RedisKeys
from .body import RequestFacts
from .directory import Directory, Tenant
from .fairshare import Share
from .ratelimit import UNLIMITED, Grant, RateLimiter
from .usage import COUNTERS, Usage, UsageLedger

__all__ = ["Charge", "Tenancy"]

_QUOTA_POLL_MAX_S = 5.0  # a queue job over its limit looks again at least this often


@dataclass(slots=True)
class Charge:
    """What one request was charged against its tenant's buckets, until :meth:`Tenancy.settle`."""

    tenant: Tenant
    fleet: str
    estimate: int
    grant: Grant
    settled: bool = False
    adapter: str = ""  # the LoRA adapter asked for ("": the fleet's own model): usage is metered per adapter


class Tenancy:
    """The tenant directory, rate limiter and usage ledger of one data plane."""

    def __init__(self, cfg: Config, redis: RedisConn | None = None, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        """``redis`` (None: limits and usage kept in this process alone): shares limits and usage with
        every routerd on that Redis."""
        self._conn = redis
        self._redis: aioredis.Redis | None = None
        self._rng = rng or random.Random()
        self._wall = wall
        keys = RedisKeys.from_config(cfg.redis)
        client = self._client if redis is not None else None
        self.directory = Directory(cfg)
        self._look_again = asyncio.Event()  # set (and replaced) by look_again(): waiters wake
        self.limiter = RateLimiter(client, keys, clock=clock)
        self.ledger = UsageLedger(client, keys, retention_days=cfg.redis.usage_retention_days,
                                  op_timeout_s=cfg.redis.op_timeout_s, wall=wall)

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            assert self._conn is not None
            self._redis = self._conn.ops()
        return self._redis

    def update_config(self, cfg: Config) -> None:
        """Reload: tenants, keys and limits (buckets in Redis keep their levels); queue jobs waiting
        for quota look again at once, under the new limits."""
        self.directory = Directory(cfg)
        self.ledger.retention_days = cfg.redis.usage_retention_days
        self.look_again()

    def look_again(self) -> None:
        """Queue jobs waiting for quota look at their tenant's bucket (and ``may_wait``) again now:
        after a reload, or when a drain sets them aside."""
        self._look_again.set()
        self._look_again = asyncio.Event()

    async def run(self) -> None:
        """Batch rate-limit checks to Redis and write usage there, until cancelled; then close."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.limiter.run(), name="tenant-limits")
                tg.create_task(self.ledger.run(), name="tenant-usage")
        finally:
            if self._redis is not None:
                client, self._redis = self._redis, None
                with contextlib.suppress(TimeoutError, OSError):
                    async with asyncio.timeout(2.0):
                        await client.aclose()

    def shares(self) -> dict[str, Share] | None:
        """Each tenant's weight and concurrency bound, for admission's fair share; None without
        ``[[tenants]]``."""
        if not self.directory.configured:
            return None
        return {t.name: Share(t.weight, t.max_concurrent) for t in self.directory.tenants.values()}

    # the request path ----------------------------------------------------------------------------
    def tenant(self, name: str) -> Tenant | None:
        return self.directory.get(name)

    def named(self, name: str) -> Tenant:
        """The tenant a queue job names, else :class:`BadRequest` listing the tenants."""
        tenant = self.directory.get(name)
        if tenant is None:
            known = ", ".join(sorted(self.directory.tenants))
            raise BadRequest(f"tenant: no tenant named {quote(repr(name))} (tenants: {known})",
                             param="tenant")
        return tenant

    def check_fleet(self, tenant: Tenant, fleet: str, adapter: str | None = None) -> None:
        """:class:`PermissionDenied` (403) unless ``tenant`` may use ``fleet`` (or its LoRA ``adapter``)
        — both ways in."""
        if not tenant.allows(fleet, adapter):
            what = f"adapter {adapter!r}" if adapter is not None else f"fleet {fleet!r}"
            raise PermissionDenied(f"tenant {tenant.name!r} may not use {what} "
                                   f"(fleets allowed: {', '.join(sorted(tenant.fleets))})", param="model")

    async def charge(self, tenant: Tenant, fleet: str, facts: RequestFacts, adapter: str = "") -> Charge:
        """Charge one request (HTTP); :class:`RateLimited` with the headers when over a limit."""
        grant = await self._grant(tenant, facts)
        if not grant.allowed:
            self.ledger.add(tenant.name, fleet, adapter=adapter, rate_limited=1)
            raise RateLimited(f"tenant {tenant.name!r} is over its rate limit "
                              f"({_limits(tenant)}); retry after {grant.retry_after_s:.3g} s",
                              retry_after_s=grant.retry_after_s, headers=grant.headers())
        return Charge(tenant, fleet, facts.prompt_tokens, grant, adapter=adapter)

    async def wait_for_quota(self, name: str, fleet: str, facts: RequestFacts,
                             deadline_epoch_s: float | None, *,
                             may_wait: Callable[[Tenant], bool] | None = None, adapter: str = ""
                             ) -> Charge | None:
        """Charge one request (a queue job) of the tenant ``name``, waiting while it is over a limit;
        raises :class:`DeadlineExceeded` when the quota would come after the job's deadline. None when
        it is over a limit and ``may_wait`` says it may not wait here (the queue then sets it aside).

        The tenant is looked up by name at every check, and a reload wakes every waiter: a job that
        waits sees the limits of the current config, not those it was read under (a tenant removed by a
        reload: the default's). A job that waits is not refused: only one whose deadline comes first
        counts as ``rate_limited``, once — not once per look at the bucket."""
        while True:
            tenant = self.tenant(name) or self.directory.default
            woken = self._look_again
            grant = await self._grant(tenant, facts)
            if grant.allowed:
                return Charge(tenant, fleet, facts.prompt_tokens, grant, adapter=adapter)
            wait = min(max(grant.retry_after_s, 0.01), _QUOTA_POLL_MAX_S) * (1 + 0.1 * self._rng.random())
            if deadline_epoch_s is not None and self._wall() + wait >= deadline_epoch_s:
                self.ledger.add(tenant.name, fleet, adapter=adapter, rate_limited=1)
                raise DeadlineExceeded("the job's deadline passed while its tenant "
                                       f"{tenant.name!r} was over its rate limit")
            if may_wait is not None and not may_wait(tenant):
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await woken.wait()

    async def _grant(self, tenant: Tenant, facts: RequestFacts) -> Grant:
        return await self.limiter.acquire(tenant, facts.prompt_tokens) if tenant.limited else UNLIMITED

    def settle(self, charge: Charge | None, usage: Usage | None, *, status: int, ok: bool) -> None:
        """The request ended: count it and correct its charge by what the engine reported.

        ``status``: the engine's answer (0: none reached the client); ``ok``: it ended well. With the
        engine's usage the tokens are corrected to its count — also for a stream that ended early (its
        client gone, cut by routerd or its engine: the count read so far is what the engine generated,
        and the request counts as an error). A 2xx without one (an engine that does not report) keeps
        the estimate: the engine did work, how much is unknown. An error answer gives the tokens back;
        a request no engine answered (routerd's failure, or one it refused) is given back whole."""
        if charge is None or charge.settled:
            return
        charge.settled = True
        t, fleet, adapter = charge.tenant, charge.fleet, charge.adapter
        if usage is not None:
            self.ledger.add(t.name, fleet, adapter=adapter, requests=1 if ok else 0, errors=0 if ok else 1,
                            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
            self.limiter.settle(t, 0, usage.total - charge.estimate)
        elif 200 <= status < 300:
            self.ledger.add(t.name, fleet, adapter=adapter, requests=1 if ok else 0, errors=0 if ok else 1)
        else:
            self.ledger.add(t.name, fleet, adapter=adapter, errors=1)
            self.limiter.settle(t, 0 if status else -1, -charge.estimate)

    def withdraw(self, charge: Charge | None) -> None:
        """The request is taken back before it ended (preempted, to run again): give its charge back
        and count nothing — the run that ends it is counted."""
        if charge is None or charge.settled:
            return
        charge.settled = True
        self.limiter.settle(charge.tenant, -1, -charge.estimate)

    def collector(self, tenant_stats: Callable[[], Iterator[tuple[str, str, dict[str, float]]]]) -> Any:
        """The ``routerd_tenant_*`` metrics: usage from the ledger, admission from ``tenant_stats``."""
        return _Collector(self.ledger, self.limiter, tenant_stats)


def _limits(t: Tenant) -> str:
    parts = []
    if t.requests_per_minute:
        parts.append(f"{t.requests_per_minute} requests/min")
    if t.tokens_per_minute:
        parts.append(f"{t.tokens_per_minute} tokens/min")
    return ", ".join(parts)


_OUTCOMES = (("ok", "requests"), ("error", "errors"), ("rate_limited", "rate_limited"))


class _Collector:
    """Read at scrape time: nothing is mirrored into gauges that could drift."""

    def __init__(self, ledger: UsageLedger, limiter: RateLimiter,
                 tenant_stats: Callable[[], Iterator[tuple[str, str, dict[str, float]]]]) -> None:
        self._ledger = ledger
        self._limiter = limiter
        self._stats = tenant_stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        labels = ["tenant", "fleet"]
        requests = CounterMetricFamily("routerd_tenant_requests", "Requests per tenant and fleet by "
                                       "outcome: ok (an engine served it), error, rate_limited",
                                       labels=[*labels, "outcome"])
        tokens = CounterMetricFamily("routerd_tenant_tokens", "Tokens the engines reported per tenant "
                                     "and fleet, by kind (prompt, completion)", labels=[*labels, "kind"])
        by_adapter = ["tenant", "fleet", "adapter"]
        adapter_requests = CounterMetricFamily("routerd_tenant_adapter_requests", "Requests per tenant and "
                                               "LoRA adapter by outcome (in routerd_tenant_requests too)",
                                               labels=[*by_adapter, "outcome"])
        adapter_tokens = CounterMetricFamily("routerd_tenant_adapter_tokens", "Tokens the engines reported "
                                             "per tenant and LoRA adapter, by kind (in routerd_tenant_tokens "
                                             "too)", labels=[*by_adapter, "kind"])
        idx = {name: i for i, name in enumerate(COUNTERS)}
        for (tenant, fleet, adapter), c in self._ledger.adapter_totals.items():
            for outcome, name in _OUTCOMES:
                adapter_requests.add_metric([tenant, fleet, adapter, outcome], c[idx[name]])
            adapter_tokens.add_metric([tenant, fleet, adapter, "prompt"], c[idx["prompt_tokens"]])
            adapter_tokens.add_metric([tenant, fleet, adapter, "completion"], c[idx["completion_tokens"]])
        for (tenant, fleet), c in self._ledger.totals.items():
            for outcome, name in _OUTCOMES:
                requests.add_metric([tenant, fleet, outcome], c[idx[name]])
            tokens.add_metric([tenant, fleet, "prompt"], c[idx["prompt_tokens"]])
            tokens.add_metric([tenant, fleet, "completion"], c[idx["completion_tokens"]])
        active = GaugeMetricFamily("routerd_tenant_active", "Requests of the tenant holding an admission "
                                   "slot of the fleet", labels=labels)
        queued = GaugeMetricFamily("routerd_tenant_queued", "Requests of the tenant waiting for an "
                                   "admission slot of the fleet", labels=labels)
        slot_seconds = CounterMetricFamily("routerd_tenant_slot_seconds", "Admission slots × seconds the "
                                           "tenant held in the fleet (its share when saturated)",
                                           labels=labels)
        for tenant, fleet, s in self._stats():
            active.add_metric([tenant, fleet], s["active"])
            queued.add_metric([tenant, fleet], s["queued"])
            slot_seconds.add_metric([tenant, fleet], s["slot_seconds"])
        yield from (requests, tokens, adapter_requests, adapter_tokens, active, queued, slot_seconds)
        yield CounterMetricFamily("routerd_tenant_ratelimit_redis_errors", "Rate-limit calls Redis did not "
                                  "answer or answered with an error, a tenant's unusable bucket included "
                                  "(this routerd then decided alone: see the log)",
                                  value=self._limiter.redis_errors)
        yield CounterMetricFamily("routerd_tenant_usage_flush_errors", "Failed writes of usage to Redis "
                                  "(kept and written with the next; increments Redis refused are dropped, "
                                  "logged)", value=self._ledger.flush_errors)
