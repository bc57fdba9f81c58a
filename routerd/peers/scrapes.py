"""Engine scrapes shared between routerd processes: the engines are scraped at the configured rate in
total, not once per process (issue #20).

The *scraping* process (the controller: ``is_scraper()``) scrapes every instance as one routerd does and
publishes each result — the parsed :class:`~routerd.snapshot.LoadSnapshot`, the wall-clock time of the
scrape, and the fleet-wide in-flight count when it was taken (its own plus ``inflight_elsewhere``) — in
one hash, ``<ns>:view:scrapes`` (instance id → record), written once per scrape interval in one
``HSET`` and expiring three intervals after the slowest next scrape. Every other process reads the
records of its instances (one ``HMGET`` per interval) and applies them as its own scraper would: the
snapshot (its ``scraped_at`` moved onto this process's monotonic clock by the record's age),
``inflight_at_scrape`` = the published fleet-wide count — the engine's gauges at that moment counted
every process's requests, so :meth:`Instance.estimated_queue` adds only what the fleet sent since —
and ``learned`` fed with it.

A process that is not the scraper does not scrape an instance while its shared record is fresh (until
three scrape intervals past the scraper's next scrape of it — an idle instance's next scrape is an idle
period away, ``routing.idle_scrape_interval_s`` —; :meth:`SharedScrapes.covers`, the scraper's
per-instance loop asks):
when the controller is gone or Redis is slow it scrapes for itself rather than route blind, says so in
its log (``shared_scrapes_stale``) and counts it (``routerd_view_own_scrapes_total``), and stops once
fresh records come back. A new process, and one that has just stopped being the scraper, waits three
intervals for the first records before it does.

A record's age is the reader's wall clock minus the scraper's: hosts are assumed within a fraction of a
scrape interval of each other (NTP); a record that looks older than that is not used.

Each record is sealed for its instance (routerd/peers/sealed.py): a scrape written by hand (an idle-looking
engine that draws every process's traffic), by a routerd with another secret, or copied to another
instance is refused and counted, never applied; a genuine older one written again is not newer than the
one applied, and is skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import _aio, log
from ..redis_keys import RedisKeys
from ..registry import Instance, Registry
from ..snapshot import LoadSnapshot
from ..trust import Rejected
from .outage import Outage
from .sealed import SCRAPE, Seals

_log = log.get("routerd.peers.scrapes")

FRESH_INTERVALS = 3  # a shared scrape stands in for an own one while at most this many intervals old


class ScrapeRecord(msgspec.Struct, frozen=True, array_like=True):
    """One scrape of one instance as the scraping process published it."""

    at: float  # wall clock (s) of the attempt
    url: str  # the engine it scraped: a record for another engine at the same id is not used
    inflight: int  # every process's requests in flight on it when the answer arrived
    snapshot: LoadSnapshot | None  # None: the scrape failed (``error``), the last good one stands
    error: str = ""
    # when the scraper scrapes it next, from ``at``: an idle instance's period is the idle one
    # (``routing.idle_scrape_interval_s``), and its record stays fresh that much longer
    period: float = 0.0


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(ScrapeRecord).decode


class SharedScrapes:
    """The scraper's seam (:class:`routerd.routing.scraper.ScrapeShare`) and the publish/apply loop;
    ``run()`` until cancelled."""

    def __init__(self, registry: Registry, redis: aioredis.Redis, keys: RedisKeys, *, seals: Seals,
                 is_scraper: Callable[[], bool], scrape_interval_s: float, op_timeout_s: float,
                 idle_period_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.redis = redis
        self.keys = keys
        self.seals = seals
        self.is_scraper = is_scraper
        self.interval_s = scrape_interval_s
        self.idle_period_s = idle_period_s if idle_period_s is not None else scrape_interval_s
        self.op_timeout_s = op_timeout_s
        self.clock = clock
        self.wall = wall
        self._pending: dict[str, bytes] = {}  # instance id → record to publish
        self._fresh_until: dict[str, float] = {}  # instance id → monotonic end of its record's use
        self._applied: dict[str, float] = {}  # instance id → ``at`` of the last record applied
        self._grace_until = clock() + FRESH_INTERVALS * scrape_interval_s
        self._own: set[str] = set()  # instances this process scrapes itself for want of fresh records
        self.own_scrapes_total = 0

    def update_config(self, scrape_interval_s: float, idle_period_s: float | None = None) -> None:
        self.interval_s = scrape_interval_s
        self.idle_period_s = idle_period_s if idle_period_s is not None else scrape_interval_s

    # the scraper's seam ------------------------------------------------------------------------
    def covers(self, inst: Instance) -> bool:
        """Whether a shared scrape stands in for scraping ``inst`` now (never on the scraper)."""
        if self.is_scraper():
            self._own.discard(inst.id)
            return False
        now = self.clock()
        if now < self._fresh_until.get(inst.id, 0.0) or now < self._grace_until:
            if inst.id in self._own:
                self._own.discard(inst.id)
                _log.info("shared_scrapes_fresh", instance=inst.id)
            return True
        if inst.id not in self._own:
            self._own.add(inst.id)
            _log.warning("shared_scrapes_stale", instance=inst.id,
                         effect="this process scrapes the instance itself until shared figures return")
        self.own_scrapes_total += 1
        return False

    def scraped(self, inst: Instance) -> None:
        """``inst`` was just scraped here: the scraper publishes the result with the next write (alone,
        it publishes nothing: a process that joins waits three intervals, and one is enough)."""
        if self.registry.processes <= 1 or not self.is_scraper():
            return
        snap = inst.snapshot if not inst.scrape_error else None
        self._pending[inst.id] = self.seals.seal(SCRAPE, _encode(ScrapeRecord(
            at=self.wall() - (self.clock() - inst.last_scrape_attempt), url=inst.url,
            inflight=inst.inflight_at_scrape if snap is not None else inst.inflight_total,
            snapshot=snap, error=inst.scrape_error,
            period=self.idle_period_s if inst.idle() else self.interval_s)), inst.id)

    @property
    def own(self) -> frozenset[str]:
        """The instances this process scrapes itself now for want of fresh shared figures."""
        return frozenset(self._own)

    # the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Every scrape interval: publish (the scraper) or read and apply (the others)."""
        outage = Outage(_log, "shared_scrapes")
        was_scraper = False
        while True:
            started = self.clock()
            scraper = self.is_scraper()
            if was_scraper and not scraper:  # control passed on: the next scraper's records come soon
                self._grace_until = started + FRESH_INTERVALS * self.interval_s
            was_scraper = scraper
            try:
                async with _aio.timeout(self.op_timeout_s):
                    if scraper:
                        if self._pending:
                            await self.publish()
                    else:
                        self._pending.clear()
                        await self.follow()
                outage.answered()
            except (RedisError, OSError, TimeoutError) as e:
                outage.failed(e)
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))

    async def publish(self) -> None:
        """Write the scrapes made since the last write, in one ``HSET``; drop records of instances
        this process no longer has."""
        pending, self._pending = self._pending, {}
        key = self.keys.scrapes
        pipe = self.redis.pipeline(transaction=False)
        if pending:
            pipe.hset(key, mapping=pending)  # type: ignore[arg-type]  # redis-py's stub wants str values
        pipe.pexpire(key, int((self.interval_s * FRESH_INTERVALS + self.idle_period_s) * 1000))
        pipe.hkeys(key)
        replies = await pipe.execute()
        stale = [k for k in replies[-1]
                 if self.registry.get(k.decode() if isinstance(k, bytes) else k) is None]
        if stale:
            await self.redis.hdel(key, *stale)

    async def follow(self) -> None:
        """Read this process's instances' records and apply the new ones."""
        instances = [inst for inst in self.registry if inst.url]
        if not instances:
            return
        ids = [inst.id for inst in instances]
        for gone in self._applied.keys() - set(ids):  # removed or replaced
            self._applied.pop(gone, None)
            self._fresh_until.pop(gone, None)
        raws = await self.redis.hmget(self.keys.scrapes, ids)
        now, wall = self.clock(), self.wall()
        fresh_s = self.interval_s * FRESH_INTERVALS  # past the scraper's next scrape of the instance
        for inst, raw in zip(instances, raws, strict=True):
            if raw is None:
                continue
            try:
                record = raw if isinstance(raw, bytes) else raw.encode()
                rec = _decode(self.seals.open(SCRAPE, record, inst.id, instance=inst.id))
            except Rejected:
                continue
            except msgspec.DecodeError:
                _log.warning("shared_scrape_undecodable", instance=inst.id)
                continue
            at = now - max(0.0, wall - rec.at)  # the scrape on this process's monotonic clock
            until = at + max(0.0, rec.period - self.interval_s) + fresh_s
            if rec.url != inst.url or now > until:
                continue
            self._fresh_until[inst.id] = until
            if rec.at > self._applied.get(inst.id, 0.0):  # each record once
                self._applied[inst.id] = rec.at
                self.apply(inst, rec, at)

    def apply(self, inst: Instance, rec: ScrapeRecord, at: float) -> None:
        """``rec`` (taken at monotonic ``at`` here) as if this process had scraped it; one older than
        this process's own last scrape of ``inst`` is ignored."""
        if at <= inst.last_scrape_attempt:
            return
        inst.last_scrape_attempt = at
        if rec.snapshot is None:
            inst.scrape_errors_total += 1
            inst.scrape_error = rec.error
            return
        snap = msgspec.structs.replace(rec.snapshot, scraped_at=at)
        inst.snapshot = snap
        inst.shared_scrape = True
        inst.inflight_at_scrape = rec.inflight
        inst.scrape_error = ""
        inst.learned.observe(snap)
