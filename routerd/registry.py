"""The instances of each fleet and everything known about them: the one piece of shared state.

Each field has one writer: the fleet manager adds, removes and sets ``state``/``url``/runtime info;
the scraper writes ``snapshot`` and feeds ``learned`` (capacity and speed, :mod:`routerd.speed`) — in a
process that applies another's scrapes, :mod:`routerd.peers.scrapes` does, instead of scraping;
the health monitor writes ``health``; upstream writes ``inflight`` and the circuit fields; the shared
view (:mod:`routerd.peers.load`) writes ``inflight_elsewhere`` and ``Registry.processes``. The router
reads, and writes only ``predicted_prefix_hit_ratio`` and ``estimated_prefix_hit_ratio``. Everything
runs on one event loop, so plain attributes are enough; what needs care is that a reader never sees an
instance in rotation that is not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import redact
from .snapshot import LoadSnapshot as LoadSnapshot  # re-exported: what the registry stores per instance
from .speed import Learned


class InstanceState(enum.StrEnum):
    """Lifecycle of one engine instance, as routing sees it."""

    STARTING = "starting"  # launched or adopted; not yet healthy and warmed up
    READY = "ready"  # in rotation
    UNHEALTHY = "unhealthy"  # failed its heartbeats; out of rotation, restart pending
    DRAINING = "draining"  # takes no new requests; finishes what it has
    STOPPED = "stopped"  # gone (kept briefly so status can show why)


class CircuitState(enum.StrEnum):
    """The circuit breaker's verdict on one instance, read by routing, status, ``/metrics`` and
    ``routerd status`` alike (:class:`routerd.routing.CircuitBreaker` alone moves it)."""

    CLOSED = "closed"  # in rotation
    OPEN = "open"  # failed ``circuit_failure_threshold`` times in a row: out until the cool-down ends
    HALF_OPEN = "half_open"  # cool-down over: one trial request at a time decides


@dataclass
class Instance:
    """One engine server routerd may send requests to."""

    id: str  # "<fleet>:<n>" (launched) or "<fleet>:static<n>"
    fleet: str
    url: str  # base URL, no trailing slash: "http://127.0.0.1:8001"
    state: InstanceState = InstanceState.STARTING
    capacity_hint: int = 256  # the fleet config's max_num_seqs: the prior, see capacity_source()
    static: bool = False  # at a configured URL (static fleet); else launched by the fleet manager
    launch_capacity: int | None = None  # max-num-seqs of the launch spec, when it states one
    # fleet manager
    generation: int = 0
    restarts: int = 0
    pid: int | None = None
    node: str = ""
    started_at: float = field(default_factory=time.time)
    state_reason: str = ""
    resources: dict[str, Any] = field(default_factory=dict)
    # scraper
    snapshot: LoadSnapshot | None = None
    learned: Learned = field(default_factory=Learned, repr=False, compare=False)
    inflight_at_scrape: int = 0
    scrape_error: str = ""
    shared_scrape: bool = False  # the snapshot came from another process's scrape (routerd.peers.scrapes)
    scrape_errors_total: int = 0
    last_scrape_attempt: float = 0.0
    # health monitor
    health: str = "unknown"
    last_heartbeat: float = 0.0  # wall clock of the last successful heartbeat
    # router: the prefix-cache hit ratio routing predicts for this instance, over the same window as the
    # engine's reported one (learned.prefix_hit_ratio), None until it predicts: over prompts it counted
    # in the engine's tokens (its tokenizer, or token ids), and apart over prompts whose tokens it could
    # only estimate from their bytes (a fleet routerd does not key)
    predicted_prefix_hit_ratio: float | None = None
    estimated_prefix_hit_ratio: float | None = None
    # KV-cache events (routerd.routing.engine_cache.subscriptions): where routing's picture of its cache
    # comes from
    # ("events" or "model") and how its event stream is doing, per rank
    cache_view: dict[str, Any] = field(default_factory=dict)
    # upstream
    inflight: int = 0
    # routerd.peers.load: what the other routerd processes sharing this Redis have in flight on it, as
    # they last published it (0 with one process); load figures count it with routerd's own
    inflight_elsewhere: int = 0
    consecutive_failures: int = 0
    circuit_open_until: float = 0.0  # monotonic; 0 = closed (read it through circuit())
    # wall clock of the last lose() (0: never): published, so a follower ends its own calls exactly when
    # the controller ended its — not whenever the instance leaves rotation (stale scrapes end nothing).
    # A time, not a count: a controller that takes over with fresh instances still moves it forward.
    lost_at: float = 0.0
    # what ends the engine calls in flight on this instance when its heartbeats declare it failed
    _on_lost: set[Callable[[str], None]] = field(default_factory=set, init=False, repr=False,
                                                 compare=False)

    def watch_lost(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(reason)`` if this instance is declared lost; returns the un-watch function.

        Upstream registers each engine call here: a hung engine never closes its sockets, so without
        this a stream on it would wait for ``read_timeout_s`` after the instance left rotation.
        """
        self._on_lost.add(callback)
        return lambda: self._on_lost.discard(callback)

    def lose(self, reason: str) -> int:
        """End every engine call in flight on this instance with ``reason``; returns how many."""
        self.lost_at = time.time()
        callbacks = list(self._on_lost)
        self._on_lost.clear()
        for callback in callbacks:
            callback(reason)
        return len(callbacks)

    @property
    def inflight_total(self) -> int:
        """Requests in flight on this instance from every routerd process: its own and the others'."""
        return self.inflight + self.inflight_elsewhere

    @property
    def capacity(self) -> int:
        """Requests the engine runs at once: :meth:`capacity_source`'s figure."""
        return self.capacity_source()[0]

    def capacity_source(self) -> tuple[int, str]:
        """Capacity and where it comes from, the first known of: ``launch`` (the launch spec's
        max-num-seqs), ``engine`` (the engine's ``*_info`` says it), ``learned`` (the engine showed it:
        a running plateau while requests wait, or more running than the config said) and ``config``
        (the fleet's ``max_num_seqs``, a prior)."""
        if self.launch_capacity:
            return self.launch_capacity, "launch"
        snap = self.snapshot
        if snap is not None and snap.capacity:
            return snap.capacity, "engine"
        learned = self.learned
        if learned.capacity is not None:
            return learned.capacity, "learned"
        if learned.max_running > self.capacity_hint:
            return math.ceil(learned.max_running), "learned"
        return self.capacity_hint, "config"

    def expected_wait_s(self, queue: float | None = None, capacity: int | None = None) -> float:
        """Seconds a request sent now would wait before its own prefill starts: the work queued ahead
        of it over what the instance gets through (:meth:`routerd.speed.Learned.wait_s`).

        The queue is :meth:`estimated_queue` (the scrape plus routerd's in-flight delta since); what is
        not yet prefilled is the scrape's waiting plus what routerd sent since. A caller that has just
        computed the queue and the capacity passes them in.
        """
        if capacity is None:
            capacity = self.capacity
        snap = self.snapshot
        inflight = self.inflight_total
        if snap is None:
            return self.learned.wait_s(float(inflight), 0.0, capacity)
        if queue is None:
            queue = self.estimated_queue()
        sent = inflight - self.inflight_at_scrape  # routerd's in-flight delta since the scrape
        unstarted = min(snap.waiting + max(sent, 0), queue)
        return self.learned.wait_s(queue, unstarted, capacity, snap)

    def idle(self) -> bool:
        """Nothing to watch closely: routerd (every process of it) has nothing in flight on it and its
        last scrape saw nothing running or waiting. Its watchers (scraper, heartbeats) may then slow to
        their idle periods: routerd's own requests are counted in ``inflight`` the moment they are sent,
        so the routing figures stay exact for what routerd sends, and a new request ends the idle
        period."""
        snap = self.snapshot
        return (self.inflight_total == 0 and snap is not None and snap.running == 0 and snap.waiting == 0
                and not self.scrape_error)

    def estimated_queue(self) -> float:
        """Requests the engine holds now: the scrape plus what routerd sent (or saw end) since.

        ``inflight - inflight_at_scrape`` is the in-flight delta since the scrape: a burst between two
        scrapes raises it at once, so the next choice already sees it. Never below routerd's own count.
        With several routerd processes both terms are fleet-wide — this process's in-flight plus
        ``inflight_elsewhere``, and ``inflight_at_scrape`` the same sum when the scrape was taken — since
        the engine's gauges count every process's requests.
        """
        snap = self.snapshot
        inflight = float(self.inflight_total)
        if snap is None:
            return inflight
        est = snap.running + snap.waiting + (inflight - self.inflight_at_scrape)
        return max(est, inflight)

    def load(self) -> float:
        """Normalised load: queue over capacity, plus KV pressure (a full cache means preemption).

        Blind to speed; routing ranks by :meth:`expected_wait_s`. Kept for ``routerd_instance_load`` and
        ``/admin/fleets``, where dashboards built on it expect it.
        """
        snap = self.snapshot
        kv = snap.kv_usage if snap is not None else 0.0
        return self.estimated_queue() / max(self.capacity, 1) + kv

    def circuit(self, now: float) -> CircuitState:
        """The circuit's state at monotonic ``now``: the one reading of the breaker's fields."""
        if self.circuit_open_until == 0.0:
            return CircuitState.CLOSED
        return CircuitState.OPEN if now < self.circuit_open_until else CircuitState.HALF_OPEN

    def routable(self, now: float) -> bool:
        return self.state is InstanceState.READY and self.circuit(now) is not CircuitState.OPEN

    def learned_status(self) -> dict[str, float | None]:
        """The learned speed figures and both prefix-cache hit ratios; ``None`` where not known yet
        (routing then uses a prior)."""
        learned = self.learned

        def r(v: float | None, digits: int) -> float | None:
            return None if v is None else round(v, digits)

        return {
            "decode_tokens_per_s": r(learned.decode_tokens_per_s, 1),
            "prefill_tokens_per_s": r(learned.prefill_tokens_per_s, 1),
            "request_running_s": r(learned.running_s, 4),
            "prefix_hit_ratio": r(learned.prefix_hit_ratio, 4),
            "predicted_prefix_hit_ratio": r(self.predicted_prefix_hit_ratio, 4),
            "estimated_prefix_hit_ratio": r(self.estimated_prefix_hit_ratio, 4),
        }

    def status(self, now_mono: float) -> dict[str, Any]:
        """The JSON shape of ``GET /admin/fleets`` for one instance."""
        snap = self.snapshot
        capacity, capacity_source = self.capacity_source()
        return {
            "id": self.id,
            "fleet": self.fleet,
            "url": redact.url(self.url),
            "state": self.state.value,
            "state_reason": self.state_reason,
            "health": self.health,
            "generation": self.generation,
            "restarts": self.restarts,
            "pid": self.pid,
            "node": self.node,
            "last_heartbeat": self.last_heartbeat or None,
            "inflight": self.inflight,
            "inflight_elsewhere": self.inflight_elsewhere,
            "load": round(self.load(), 4),
            "running": snap.running if snap else None,
            "waiting": snap.waiting if snap else None,
            "kv_usage": snap.kv_usage if snap else None,
            "capacity": capacity,
            "capacity_source": capacity_source,
            "expected_wait_s": round(self.expected_wait_s(), 4),
            **self.learned_status(),
            "scrape_age_s": round(now_mono - snap.scraped_at, 3) if snap else None,
            "scrape_error": redact.text(self.scrape_error) or None,
            "circuit": self.circuit(now_mono).value,
            "consecutive_failures": self.consecutive_failures,
            "resources": self.resources,
            "cache_view": self.cache_view or None,
        }


class Registry:
    """All instances by id and by fleet, with a change signal for whoever waits on readiness."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._instances: dict[str, Instance] = {}
        self._fleets: dict[str, dict[str, Instance]] = {}
        self._changed = asyncio.Event()
        self._version = 0
        self.clock = clock
        # Requests waiting in admission for a slot of each fleet: written by admission alone, read by
        # the autoscaler as demand (the one state both share, so neither holds the other).
        self.queued: dict[str, int] = {}
        # Requests waiting for a LoRA adapter to load before they reach an engine (their slot: an
        # adapter's): written by routing.adapters alone, read by the autoscaler as demand, as above.
        self.adapter_waiting: dict[str, int] = {}
        # … and those of the other routerd processes on this Redis (a daemon's workers, the replicas),
        # as their shared load says: written by routing.adapters from it, read by the autoscaler
        self.adapter_waiting_elsewhere: dict[str, int] = {}
        # routerd processes sharing this one's Redis and serving now, itself included (1 alone): written
        # by routerd.peers.load alone, read by admission, which bounds a fleet per fleet, not per process
        self.processes = 1

    # writers -------------------------------------------------------------------------------
    def ensure_fleet(self, fleet: str) -> None:
        self._fleets.setdefault(fleet, {})

    def drop_fleet(self, fleet: str) -> None:
        for inst in list(self._fleets.get(fleet, {}).values()):
            self.remove(inst.id)
        self._fleets.pop(fleet, None)
        self.notify()

    def add(self, inst: Instance) -> Instance:
        self._instances[inst.id] = inst
        self._fleets.setdefault(inst.fleet, {})[inst.id] = inst
        self.notify()
        return inst

    def remove(self, instance_id: str) -> Instance | None:
        inst = self._instances.pop(instance_id, None)
        if inst is not None:
            self._fleets.get(inst.fleet, {}).pop(instance_id, None)
            self.notify()
        return inst

    def set_state(self, inst: Instance, state: InstanceState, reason: str = "") -> None:
        if inst.state is not state or inst.state_reason != reason:
            inst.state = state
            inst.state_reason = reason
            self.notify()

    def notify(self) -> None:
        """Wake everyone waiting in :meth:`wait_changed` (readiness, file_sd, admission)."""
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    # readers -------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def wait_changed(self, since: int, timeout: float) -> int:
        """Wait until the registry changed after ``since`` (or ``timeout``); return the new version."""
        if self._version == since:
            # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancellation that arrives as the
            # event is set, and a cancelled loop would then wait forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
        return self._version

    async def wait_idle(self, inst: Instance, timeout_s: float) -> None:
        """Wait (≤ ``timeout_s``) until ``inst`` has no request in flight: an admin drain's wait."""
        deadline = self.clock() + timeout_s
        since = self._version
        while inst.inflight > 0 and self.clock() < deadline:
            since = await self.wait_changed(since, timeout=0.1)

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._instances.values()))

    def fleets(self) -> list[str]:
        return list(self._fleets)

    def instances(self, fleet: str) -> list[Instance]:
        return list(self._fleets.get(fleet, {}).values())

    def routable(self, fleet: str) -> list[Instance]:
        now = self.clock()
        return [i for i in self._fleets.get(fleet, {}).values() if i.routable(now)]

    def ready_count(self, fleet: str) -> int:
        return sum(1 for i in self._fleets.get(fleet, {}).values() if i.state is InstanceState.READY)

