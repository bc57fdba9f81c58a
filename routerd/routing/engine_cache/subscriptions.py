"""One KV-event subscription per engine (and data-parallel rank), kept in step with the registry.

For every ready instance routerd asks the engine where it publishes — ``GET /kv_event_sources``, which
vLLM 0.32 and the sim answer with each rank's endpoint, replay endpoint and topic — and runs a
:class:`~routerd.routing.engine_cache.subscriber.KvEventSubscriber` per rank into an
:class:`~routerd.routing.engine_cache.blocks.EngineBlocks`. A wildcard host in a published endpoint
(``tcp://*:P``) is the engine's own host, taken from its URL. An instance that restarts (its
``generation`` moves) is looked up again — routerd's launchers choose new ports for each start — and an
engine that publishes nothing (no route, ``{}``, events off) is asked again every ``retry_s``; until
then it has no view and routing models its cache from what routerd sent it.

:meth:`EngineEvents.match` is what routing asks: how many leading blocks of a request's engine keys
the instance holds, or None when the instance has no *usable* view (none, stale). A data-parallel
engine holds several caches; a request lands on one of them, so the best rank's match is the
prediction. Each task is owned here (``run`` is the one loop; the subscribers are its children).

**Restarts and counters.** A subscription ends whenever its instance leaves rotation, restarts or its
subscriber fails; the *stream* — each rank's counters, ``routerd_kv_events_*_total`` — outlives it, kept
per instance and rank for as long as routerd runs, so a counter never goes back. A new engine behind
the instance (its generation, URL or pid moved: routerd's launchers start each generation on new
ports) is counted as one restart of each of its ranks' streams; an engine restarted behind the same
instance and ports while no subscription listened is found by the next subscription, whose first
history is judged against where the last one left the stream (:mod:`routerd.routing.engine_cache.subscriber`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from ... import log
from ...config import FleetConfig
from ...registry import InstanceState, Registry
from ...vllm_wire import block_hash
from .block_keys import EngineKeyer, load_keyer
from .blocks import EngineBlocks
from .subscriber import KvEventSubscriber, SubscriberStats, ViewHealth

_log = log.get("routerd.routing.engine_cache.subscriptions")
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
_MAX_STREAMS = 4096  # instances whose counters are kept; past it, those of instances gone are dropped


def connect_endpoint(published: str, engine_url: str) -> str:
    """Where to connect for an endpoint an engine binds: its wildcard host replaced by the engine's."""
    if not published.startswith("tcp://"):
        return published
    host, _, port = published[len("tcp://"):].rpartition(":")
    if host in _WILDCARDS or not host:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"tcp://{host}:{port}"


@dataclass
class _Rank:
    sub: KvEventSubscriber
    view: EngineBlocks
    task: asyncio.Task[None]


@dataclass
class _Stream:
    """What outlives the subscriptions to one instance: each rank's counters, and which engine they
    were last counting (a different one is a restart)."""

    generation: int
    url: str
    pid: int | None
    ranks: dict[str, SubscriberStats] = field(default_factory=dict)


@dataclass
class _Engine:
    """What is kept for one instance: its ranks' subscriptions, or why it has none."""

    generation: int
    url: str
    ranks: dict[str, _Rank] = field(default_factory=dict)
    error: str = ""
    next_try: float = 0.0


class EngineEvents:
    """The subscriptions of every ready instance in ``registry`` (see the module docstring)."""

    def __init__(self, registry: Registry, session: aiohttp.ClientSession, *, fleets: Sequence[str] | None,
                 sources: dict[str, dict[str, Any]] | None = None,
                 discover_timeout_s: float = 2.0, retry_s: float = 30.0, probe_interval_s: float = 2.0,
                 replay_timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.session = session
        self.fleets = None if fleets is None else set(fleets)
        # engine URL → its publisher, as configured (a static fleet's): used instead of asking the engine
        self.sources = sources or {}
        self.discover_timeout_s = discover_timeout_s
        self.retry_s = retry_s
        self.probe_interval_s = probe_interval_s
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self._engines: dict[str, _Engine] = {}
        # instance → its streams; kept after the instance leaves, so that one coming back under the same
        # id goes on counting where it left off (ids are a config's fleets × indexes: few; bounded anyway)
        self._streams: dict[str, _Stream] = {}

    # ---- what routing and status read -------------------------------------------------------------

    def streams(self, instance_id: str) -> dict[str, SubscriberStats]:
        """Each rank's counters for the instance (rank → stats), subscribed now or not."""
        st = self._streams.get(instance_id)
        return {} if st is None else dict(st.ranks)

    def views(self, instance_id: str) -> list[tuple[KvEventSubscriber, EngineBlocks]]:
        e = self._engines.get(instance_id)
        return [] if e is None else [(r.sub, r.view) for r in e.ranks.values()]

    def match(self, instance_id: str, keys: Sequence[int]) -> int | None:
        """Leading blocks of ``keys`` the instance holds by its own events; None: no usable view."""
        best: int | None = None
        for sub, view in self.views(instance_id):
            if sub.health is not ViewHealth.STALE:
                n = view.matched_blocks(keys)
                best = n if best is None else max(best, n)
        return best

    def speculate(self, instance_id: str, keys: Sequence[int]) -> None:
        """A request was sent there: its blocks count as held until the engine says (one rank only — of
        several, which one takes it is the engine's choice)."""
        views = self.views(instance_id)
        if len(views) == 1 and views[0][0].health is not ViewHealth.STALE:
            views[0][1].speculate(keys)

    def fleet_block_size(self, fleet: str) -> int | None:
        """The block size a fleet's engines state in their events (the first one that has)."""
        for inst in self.registry.instances(fleet):
            size = self.block_size(inst.id)
            if size:
                return size
        return None

    def block_size(self, instance_id: str) -> int | None:
        """The engine's block size as its events state it (None before its first BlockStored)."""
        sizes = [v.block_size for _, v in self.views(instance_id) if v.block_size]
        return sizes[0] if sizes else None

    def status(self, instance_id: str) -> dict[str, Any]:
        """For ``/admin/fleets``: where the cache picture comes from, and how the stream is doing."""
        e = self._engines.get(instance_id)
        if e is None or not e.ranks:
            return {"cache_view": "model", "events_error": e.error if e is not None else "not subscribed"}
        now = self.clock()
        ranks = []
        for rank, r in e.ranks.items():
            s = r.sub.stats
            ranks.append({
                "rank": rank, "health": r.sub.health.value, "blocks": len(r.view), "seq": s.last_seq,
                "events": s.events, "gaps": s.gaps, "gaps_replayed": s.gaps - s.unrecovered_gaps,
                "gaps_unrecovered": s.unrecovered_gaps, "restarts": s.restarts,
                "skipped_events": s.skipped_events,
                "heard_ago_s": None if s.last_heard is None else round(now - s.last_heard, 3),
                # the engine's clock against ours: meaningful across hosts only with synced clocks
                "lag_s": (None if s.last_event_ts is None
                          else round(max(0.0, time.time() - s.last_event_ts), 3)),
            })
        usable = any(r["health"] != ViewHealth.STALE.value for r in ranks)
        return {"cache_view": "events" if usable else "model", "event_ranks": ranks}

    # ---- the loop ---------------------------------------------------------------------------------

    async def run(self, interval_s: float = 1.0) -> None:
        """Reconcile with the registry on each change (at least every ``interval_s``) until cancelled;
        every subscription is cancelled on the way out."""
        version = -1
        try:
            while True:
                version = await self.registry.wait_changed(version, interval_s)
                try:
                    await self.reconcile()
                except Exception:  # noqa: BLE001 — loop boundary: log and try again on the next turn
                    _log.exception("kv_events_reconcile_failed")
        finally:
            await self.aclose()

    async def reconcile(self) -> None:
        """Subscribe what became ready, drop what left or restarted, bound each view by its engine's
        KV capacity as last scraped; the engines still to be asked are asked at once (each bounded by
        ``discover_timeout_s``), so one that does not answer holds up no other."""
        now = self.clock()
        wanted = {i.id: i for i in self.registry
                  if i.state is InstanceState.READY and (self.fleets is None or i.fleet in self.fleets)}
        for iid in [k for k in self._engines if k not in wanted]:
            await self._drop(iid)
        if len(self._streams) > _MAX_STREAMS:
            for iid in [k for k in self._streams if self.registry.get(k) is None]:
                del self._streams[iid]
        asks: list[tuple[str, Coroutine[Any, Any, None]]] = []
        for iid, inst in wanted.items():
            e = self._engines.get(iid)
            if self._new_engine(inst.id, inst.generation, inst.url, inst.pid) or (
                    e is not None and any(r.task.done() for r in e.ranks.values())):
                # restarted (new ports), moved, or a subscriber ended (logged by _drop): look again
                await self._drop(iid)
                e = None
            if e is None:
                e = self._engines[iid] = _Engine(generation=inst.generation, url=inst.url)
            capacity = inst.snapshot.num_gpu_blocks if inst.snapshot is not None else None
            for r in e.ranks.values():
                r.view.capacity_blocks = capacity or r.view.capacity_blocks
            if not e.ranks and now >= e.next_try:
                asks.append((iid, self._discover(iid, e, capacity)))
        # every ask runs to its end (each is bounded), whatever another's outcome
        results = await asyncio.gather(*(a for _, a in asks), return_exceptions=True)
        for (iid, _), res in zip(asks, results, strict=True):
            if isinstance(res, Exception):
                _log.error("kv_events_discover_failed", instance=iid, error=repr(res))
        for iid, inst in wanted.items():
            inst.cache_view = self.status(iid)

    def _new_engine(self, iid: str, generation: int, url: str, pid: int | None) -> bool:
        """Whether another engine than the one the instance's streams last counted is behind it now —
        then each rank's stream counts a restart, and its last position (the old engine's) is let go."""
        st = self._streams.get(iid)
        if st is None:
            self._streams[iid] = _Stream(generation, url, pid)
            return False
        moved = (st.generation, st.url) != (generation, url) or (
            st.pid is not None and pid is not None and st.pid != pid)
        st.pid = pid if pid is not None else st.pid
        if not moved:
            return False
        _log.info("kv_events_engine_restarted", instance=iid, generation=generation, was=st.generation,
                  ranks=sorted(st.ranks))
        st.generation, st.url = generation, url
        for stats in st.ranks.values():
            stats.restarts += 1
            stats.last_seq = stats.last_crc = None
        return True

    async def _discover(self, iid: str, e: _Engine, capacity: int | None) -> None:
        e.next_try = self.clock() + self.retry_s
        configured = self.sources.get(e.url)
        if configured is not None:
            self._subscribe(iid, e, {"0": configured}, capacity)
            return
        try:
            async with asyncio.timeout(self.discover_timeout_s), \
                    self.session.get(f"{e.url}/kv_event_sources") as r:
                if r.status != 200:
                    e.error = f"GET /kv_event_sources: {r.status}"
                    return
                sources = await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            e.error = f"GET /kv_event_sources: {exc!r}"
            return
        if not isinstance(sources, dict) or not sources:
            e.error = "the engine publishes no KV events"
            return
        self._subscribe(iid, e, sources, capacity)

    def _subscribe(self, iid: str, e: _Engine, sources: dict[str, Any], capacity: int | None) -> None:
        stream = self._streams.setdefault(iid, _Stream(e.generation, e.url, None))
        for rank, src in sources.items():
            if not isinstance(src, dict) or not isinstance(src.get("endpoint"), str):
                continue
            replay = src.get("replay_endpoint")
            view = EngineBlocks(capacity)
            stats = stream.ranks.setdefault(str(rank), SubscriberStats())
            sub = KvEventSubscriber(
                connect_endpoint(src["endpoint"], e.url), view,
                replay_endpoint=connect_endpoint(replay, e.url) if isinstance(replay, str) else None,
                topic=str(src.get("topic") or ""), name=f"{iid}/{rank}", stats=stats,
                probe_interval_s=self.probe_interval_s, replay_timeout_s=self.replay_timeout_s)
            task = asyncio.create_task(sub.run(), name=f"kv-events:{iid}/{rank}")
            e.ranks[str(rank)] = _Rank(sub, view, task)
        e.error = "" if e.ranks else "no usable endpoint in /kv_event_sources"
        _log.info("kv_events_subscribed", instance=iid, ranks=sorted(e.ranks),
                  endpoints=[r.sub.endpoint for r in e.ranks.values()])

    async def _drop(self, iid: str) -> None:
        e = self._engines.pop(iid, None)
        if e is None:
            return
        tasks = [r.task for r in e.ranks.values()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                _log.error("kv_events_subscriber_failed", instance=iid, error=repr(t.exception()))

    async def aclose(self) -> None:
        for iid in list(self._engines):
            await self._drop(iid)


def _arg(args: dict[str, Any], name: str, default: Any = None) -> Any:
    return args.get(name, args.get(name.replace("-", "_"), default))


def static_sources(fleets: Sequence[FleetConfig]) -> dict[str, dict[str, Any]]:
    """The publishers static fleets name for their URLs: ``engine_args.kv-event-sources``, one table per
    URL in ``urls`` order (``endpoint``, ``replay_endpoint``, ``topic``) — for engines that do not
    answer ``GET /kv_event_sources`` (older vLLM) or publish somewhere their URL's host is not."""
    out: dict[str, dict[str, Any]] = {}
    for f in fleets:
        listed = _arg(f.engine_args, "kv-event-sources")
        if f.engine != "static" or not isinstance(listed, list):
            continue
        for url, src in zip(f.urls, listed, strict=False):
            if isinstance(src, dict) and isinstance(src.get("endpoint"), str):
                out[url.rstrip("/")] = src
    return out


def fleet_keyers(fleets: Sequence[FleetConfig]) -> dict[str, tuple[EngineKeyer, int | None, bytes]]:
    """How each fleet's engines key their blocks, for the fleets whose engines publish KV events:

    - launched with them on (``routerd_builtin.launchers.kv_events``): the sim's tokens, or the vLLM
      model directory's own tokenizer, seeded as routerd seeds them;
    - a static fleet that says so: ``engine_args.kv-events = true``, ``engine_args.tokenizer`` (a model
      directory, or ``"sim"``) and ``engine_args.hash-seed`` (the engines' ``PYTHONHASHSEED``; unset:
      vLLM's own default for sha256).

    No tokenizer there (or ``routerd[kv]`` not installed): the fleet keeps the request-side model. The
    block size is ``engine_args.block-size`` when set, else what the engines' events state."""
    out: dict[str, tuple[EngineKeyer, int | None, bytes]] = {}
    for f in fleets:
        args = f.engine_args
        on = _arg(args, "kv-events", f.engine == "vllm")
        if f.engine not in ("sim", "vllm", "static") or not on:
            continue
        engine, source = f.engine, str(_arg(args, "model", f.model))
        root = block_hash.none_hash(block_hash.LAUNCH_SEED)
        if engine == "static":
            source = str(_arg(args, "tokenizer", ""))
            engine = "sim" if source == "sim" else "vllm"
            seed = _arg(args, "hash-seed")
            root = block_hash.none_hash(None if seed is None else str(seed))
        keyer = load_keyer(engine, source)
        if keyer is None:
            _log.info("kv_events_no_tokenizer", fleet=f.name, tokenizer=source)
            continue
        size = _arg(args, "block-size")
        out[f.name] = (keyer, int(size) if size else (16 if engine == "sim" else None), root)
    return out


class EngineEventsCollector:
    """``routerd_kv_events_*``: each engine rank's event stream and view, read at collection time."""

    def __init__(self, events: EngineEvents) -> None:
        self.events = events

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["fleet", "instance", "rank"]
        counters = {name: CounterMetricFamily(f"routerd_kv_events_{name}", text, labels=labels)
                    for name, text in (
            ("batches", "KV-event batches applied to the engine's view, in seq order (replayed ones too)"),
            ("events", "KV events applied (BlockStored, BlockRemoved, AllBlocksCleared)"),
            ("skipped", "KV events not understood (an unknown kind or shape) and skipped"),
            ("undecodable", "KV-event messages or batches that could not be read at all"),
            ("gaps", "Seq gaps seen in the live stream (missed batches)"),
            ("gaps_unrecovered", "Gaps the replay buffer no longer held: the view was emptied and rebuilt"),
            ("replayed_batches", "Batches applied from the replay socket (gaps, late subscription, probes)"),
            ("restarts", "Engine restarts: a new engine behind the instance (generation, URL, pid), or "
                         "the stream's seq went back; the view was rebuilt, the counters go on"),
        )}
        health = GaugeMetricFamily("routerd_kv_events_view", "1 for the view's state: complete, partial "
                                   "(history missing, used), stale (not used: routing models the cache)",
                                   labels=[*labels, "health"])
        blocks = GaugeMetricFamily("routerd_kv_events_view_blocks", "Blocks the engine holds by its events",
                                   labels=labels)
        lag = GaugeMetricFamily("routerd_kv_events_heard_seconds", "Seconds since the engine's publisher "
                                "last answered (a batch or a replay probe)", labels=labels)
        now = self.events.clock()
        for inst in self.events.registry:
            # the counters of every stream the instance had, subscribed now or not (between two
            # subscriptions a series neither vanishes nor starts again from 0)
            for rank, s in self.events.streams(inst.id).items():
                lv = [inst.fleet, inst.id, rank]
                for name, value in (("batches", s.batches), ("events", s.events),
                                    ("skipped", s.skipped_events), ("undecodable", s.undecodable),
                                    ("gaps", s.gaps),
                                    ("gaps_unrecovered", s.unrecovered_gaps),
                                    ("replayed_batches", s.replayed_batches), ("restarts", s.restarts)):
                    counters[name].add_metric(lv, value)
            for sub, view in self.events.views(inst.id):
                lv = [inst.fleet, inst.id, sub.name.rsplit("/", 1)[-1]]
                s = sub.stats
                for h in ViewHealth:
                    health.add_metric([*lv, h.value], 1.0 if sub.health is h else 0.0)
                blocks.add_metric(lv, len(view))
                if s.last_heard is not None:
                    lag.add_metric(lv, now - s.last_heard)
        yield from counters.values()
        yield from (health, blocks, lag)
