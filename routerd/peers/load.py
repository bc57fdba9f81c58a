"""Every routerd process's in-flight requests per instance, seen by every other (issue #20).

A process knows exactly what it has in flight on each instance (upstream counts it before it awaits
anything); the engine's gauges count every process's requests, but only at the last scrape. So each
process publishes its own counts every ``period`` and reads the others': the registry's
``inflight_elsewhere`` of each instance is their sum, which least-load, expected wait and admission add
to their own. ``Registry.processes`` is how many processes publish (itself included), from which
admission takes this process's part of each fleet's bounds.

One round trip per period, a pipeline: ``SET <ns>:load:<ident>`` (its counts, ``PX`` three periods but
at least a second — a loaded host stalls its event loop for more than 0.3 s at times, and the others
would count it gone and back —, so a dead process's figures expire on their own), ``SADD
<ns>:view:processes``, ``SMEMBERS`` of that set, and ``MGET`` of the loads of the processes the previous
round found (a new process is counted from the next round, one period later). A member whose load key
has expired is removed (``SREM``) in the next round. No clock is compared across hosts: liveness is the
key's expiry, kept by Redis.

The period is half the scrape interval (``routing.scrape_interval_s``; 0.1 s by default), kept within
0.05–0.1 s: the figures the others publish are then never older than half a scrape, and a scrape's
in-flight correction (``Instance.inflight_at_scrape``, taken fleet-wide) lags the truth by no more than
that. Its cost is one small pipeline per period per process, whatever the number of instances, so a slow
scrape interval does not slow it. When Redis does not answer for as long as figures live, the others'
figures are dropped (each process routes on its own again) and the failure is logged once.

Each process's figures are sealed for its ident (routerd/peers/sealed.py): a record written by hand, by a
routerd with another secret, or copied to another ident's key is refused — its figures not added, its
writer not counted among the processes (a phantom process would shrink every process's part of the
admission bounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .. import _aio, log
from ..lora_placement import AdapterDemand
from ..redis_keys import RedisKeys
from ..registry import Registry
from ..trust import Rejected
from .outage import Outage
from .sealed import LOAD, Seals

_log = log.get("routerd.peers.load")

MIN_PERIOD_S = 0.05
MAX_PERIOD_S = 0.1
EXPIRY_PERIODS = 3  # a process's figures outlive it by this many periods …
MIN_EXPIRY_S = 1.0  # … or this long: a stall of a busy host's event loop is not a death


class LoadRecord(msgspec.Struct, frozen=True, array_like=True):
    """What one process has in flight: instance id → requests (instances with none left out); with a
    fleet that serves LoRA adapters, its adapter traffic too."""

    inflight: dict[str, int]
    lora: AdapterDemand | None = None


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(LoadRecord).decode


def period_of(scrape_interval_s: float) -> float:
    """The publish period for a scrape interval: half of it, within [:data:`MIN_PERIOD_S`,
    :data:`MAX_PERIOD_S`] — a slow scrape (many idle instances) does not slow the load figures, whose
    cost does not grow with the instances."""
    return min(MAX_PERIOD_S, max(MIN_PERIOD_S, scrape_interval_s / 2))


class SharedLoad:
    """Publishes this process's in-flight counts and keeps ``inflight_elsewhere`` from the others';
    ``run()`` until cancelled (the one writer of ``inflight_elsewhere`` and ``Registry.processes``)."""

    def __init__(self, registry: Registry, redis: aioredis.Redis, keys: RedisKeys, ident: str, *,
                 seals: Seals,
                 scrape_interval_s: float, op_timeout_s: float, publish: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Not ``publish``: a process that takes no request (the daemon of workers) reads the others'
        figures only, and does not count itself among the processes."""
        self.registry = registry
        self.publish = publish
        self.redis = redis
        self.keys = keys
        self.seals = seals
        self.ident = ident
        self.op_timeout_s = op_timeout_s
        self.clock = clock
        self.period_s = period_of(scrape_interval_s)
        self._members: list[str] = []  # the other processes the last round found
        self._gone: list[str] = []  # members whose load had expired: removed in the next round
        self._ok_at = clock()
        self._outage = Outage(_log, "shared_load",
                              effect="routing on this process's own in-flight counts until Redis answers")
        self.exchanges_total = 0
        # LoRA adapters (routerd/routing/adapters.py): this process's adapter traffic to publish, and
        # the others' (by process) handed back on every exchange
        self.lora_of: Callable[[], AdapterDemand | None] = lambda: None
        self.on_lora: Callable[[dict[str, AdapterDemand]], None] = lambda others: None

    def update_config(self, scrape_interval_s: float) -> None:
        self.period_s = period_of(scrape_interval_s)

    @property
    def expiry_s(self) -> float:
        """How long this process's figures outlive their last renewal."""
        return max(MIN_EXPIRY_S, self.period_s * EXPIRY_PERIODS)

    async def run(self) -> None:
        """Exchange every period until cancelled; then withdraw this process's figures at once."""
        try:
            while True:
                started = self.clock()
                await self.exchange()
                await asyncio.sleep(max(0.0, self.period_s - (self.clock() - started)))
        finally:
            # Gone now rather than when they expire: the others stop counting this process's requests.
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with _aio.timeout(self.op_timeout_s):
                    pipe = self.redis.pipeline(transaction=False)
                    pipe.delete(self.keys.load(self.ident))
                    pipe.srem(self.keys.processes, self.ident)
                    await pipe.execute()

    def record(self) -> LoadRecord:
        """This process's own in-flight counts, as published."""
        return LoadRecord({inst.id: inst.inflight for inst in self.registry if inst.inflight},
                          lora=self.lora_of())

    async def exchange(self) -> bool:
        """One round trip: publish, read the others, apply. False (and nothing applied) when Redis did
        not answer in time; the others' figures are then dropped once they would have expired."""
        keys = self.keys
        members = self._members
        pipe = self.redis.pipeline(transaction=False)
        if self.publish:
            pipe.set(keys.load(self.ident), self.seals.seal(LOAD, _encode(self.record()), self.ident),
                     px=int(self.expiry_s * 1000))
            pipe.sadd(keys.processes, self.ident)
        if self._gone:
            pipe.srem(keys.processes, *self._gone)
        pipe.smembers(keys.processes)
        if members:
            pipe.mget([keys.load(m) for m in members])
        try:
            async with _aio.timeout(self.op_timeout_s):
                replies = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            self._outage.failed(e)
            if self.clock() - self._ok_at > self.expiry_s:
                self.apply({})
            return False
        self._outage.answered()
        self._ok_at = self.clock()
        self.exchanges_total += 1
        loads = replies[-1] if members else []
        found = {m.decode() if isinstance(m, bytes) else str(m) for m in replies[-2 if members else -1]}
        found.discard(self.ident)
        self._members = sorted(found)
        others: dict[str, LoadRecord] = {}
        self._gone = []
        for member, raw in zip(members, loads, strict=True):
            if raw is None:
                self._gone.append(member)
                continue
            try:
                others[member] = _decode(self.seals.open(LOAD, raw, member, process=member))
            except Rejected:
                continue
            except msgspec.DecodeError:
                _log.warning("shared_load_undecodable", process=member)
        self.apply(others)
        return True

    def apply(self, others: dict[str, LoadRecord]) -> None:
        """Set every instance's ``inflight_elsewhere`` to the sum of ``others``' counts."""
        total: dict[str, int] = {}
        for rec in others.values():
            for iid, n in rec.inflight.items():
                total[iid] = total.get(iid, 0) + n
        for inst in self.registry:
            inst.inflight_elsewhere = total.get(inst.id, 0)
        self.on_lora({m: rec.lora for m, rec in others.items() if rec.lora is not None})
        processes = max(1, int(self.publish) + len(others))
        if processes != self.registry.processes:
            _log.info("shared_view_processes", processes=processes, others=sorted(others))
            self.registry.processes = processes
            self.registry.notify()  # admission recomputes its part of each fleet
