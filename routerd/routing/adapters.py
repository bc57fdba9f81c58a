"""LoRA adapters as models: which adapters there are, which instance holds which, and where a request
for one goes.

- :class:`AdapterCatalog` — the adapters a client may name: the config's ``[[fleets.adapters]]`` and
  those added at run time (``POST /admin/fleets/{fleet}/adapters``, kept in Redis:
  :mod:`routerd.peers.adapters`), each with its fleet and path; adapters whose path did not load are
  marked failed (asked for, they answer 503 saying why; nothing retries them in a loop).
- :class:`AdapterSlots` — what each instance holds: what routerd loaded there, checked against the
  engine's own ``/v1/models`` every ``sync_interval_s`` (an engine restart empties it; a load that
  timed out is settled by asking the engine once it ended), with routerd's count of each adapter's
  requests in flight there (an adapter with none, and no request waiting for its load, is *idle*: it
  may be evicted). A listing the engine gave while routerd loaded or unloaded an adapter there may
  predate that move: it is not applied to that adapter (an unload in flight was read back as held, and
  requests routed to it got the engine's 404). That record is the controller's: only the process that
  controls the fleets loads, unloads and asks the engines; it publishes the record in the fleet state
  (:meth:`AdapterSlots.record`, routerd/peers/fleet_state.py), and a follower or a worker routes from
  the record it follows (:meth:`AdapterSlots.follow`) — held, loads in flight, adapters that failed —
  and asks the controller for a load it needs.

Routing (:meth:`AdapterSlots.narrow`, called by the router before the policy) keeps, of the
candidates, in this order the first group that is not empty:

1. ``adapter_loaded`` — instances holding the adapter with room (not saturated);
2. ``adapter_free_slot`` — instances where it is being loaded (the request joins that load), then
   instances with a free slot (fewer than ``max-loras`` held) and room: it is
   loaded there;
3. ``adapter_evicted`` — instances with room where an idle, unpinned adapter can go: the one with the
   least traffic per copy (the least recently used among equals) is unloaded and this one loaded;
4. when every instance is saturated: the holders (a request waits behind requests, never behind a load,
   where the adapter is held), then a free slot, then an eviction;
5. ``adapter_overflow`` — no slot anywhere (every adapter busy): loaded beyond the slots on the least
   loaded instance; vLLM keeps it in its CPU cache and its scheduler makes it wait for a slot.

Before an overflow the request waits, up to ``OVERFLOW_WAIT_S``, for the first slot to free anywhere
in the fleet (:meth:`AdapterSlots.wait_for_slot`: an adapter going idle, an unload): an instance
over its slots makes every request on it take turns for the slots, and the overflowing request itself
waited longest of all (its time to first byte was the p99 tail of ``routerd bench lora``). A victim
an eviction in flight has claimed is no one else's victim: two requests woken by one freed slot
would otherwise both unload it, and one of them would load beyond the slots after all.

The policy then chooses among that group as always (expected wait, prefix cache). A load is shared:
requests for the same adapter on the same instance wait for the one load in flight
(``load_timeout_s`` bounds it); a load that fails is retried on another instance by the caller; one
the engine refuses because the path holds no adapter marks the adapter failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import msgspec

from .. import _aio, log
from ..config import Config
from ..lora_placement import AdapterDemand, FleetPlacement, HeldAdapters, LoraRecord, Move
from ..plugins import Candidate
from ..registry import Instance, InstanceState, Registry

_log = log.get("routerd.adapters")

ADAPTER_LOADED = "adapter_loaded"
ADAPTER_FREE_SLOT = "adapter_free_slot"
ADAPTER_EVICTED = "adapter_evicted"
ADAPTER_OVERFLOW = "adapter_overflow"
# An adapter is spread to one more instance per this share of an instance's slots in flight for it
PER_COPY_SHARE = 0.5
# How long a request waits for a slot to free anywhere in its fleet before it loads beyond the slots
OVERFLOW_WAIT_S = 2.0
# ... looking again this often meanwhile (what frees a slot in another process is seen this way)
_RECHECK_S = 0.25

_K = TypeVar("_K", bound=Hashable)


def _release(counts: dict[_K, int], key: _K) -> None:
    """One fewer of ``key`` (a request, a waiter, an unload): a count that reaches none is dropped, so
    that a key present always means at least one."""
    if (left := counts.get(key, 0) - 1) > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _summed(*counts: dict[_K, int]) -> dict[_K, int]:
    """The counts added up key by key (this process's and the other processes')."""
    out: dict[_K, int] = {}
    for c in counts:
        for key, n in c.items():
            out[key] = out.get(key, 0) + n
    return out


def _flat(nested: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """A shared load's ``{outer: {inner: n}}`` as ``{(outer, inner): n}``."""
    return {(a, b): n for a, inner in nested.items() for b, n in inner.items()}


class Adapter(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter clients may name: its fleet, its path on every node, whether it is pinned."""

    name: str
    fleet: str
    path: str
    pinned: bool = False
    source: str = "config"  # "config" | "admin" (added at run time)


class AdapterCatalog:
    """The adapters there are, by name (see the module docstring)."""

    def __init__(self, cfg: Config) -> None:
        self._config: dict[str, Adapter] = {}
        self._runtime: dict[str, Adapter] = {}
        self.parents: dict[str, str] = {}  # fleet → its model (an adapter's `parent`)
        self.slots: dict[str, int] = {}  # fleet → max-loras (0: no LoRA)
        self.load_timeouts: dict[str, float] = {}  # fleet → adapter_load_timeout_s
        self.failed: dict[str, str] = {}  # adapter → why its path did not load
        self.update_config(cfg)

    def update_config(self, cfg: Config) -> None:
        self._config = {a.name: Adapter(name=a.name, fleet=f.name, path=a.path, pinned=a.pinned)
                        for f in cfg.fleets for a in f.adapters}
        self.parents = {f.name: f.model for f in cfg.fleets}
        self.slots = {f.name: f.lora_slots() for f in cfg.fleets}
        self.load_timeouts = {f.name: f.adapter_load_timeout_s for f in cfg.fleets}

    def set_runtime(self, adapters: Iterable[Adapter]) -> None:
        """The run-time adapters as the shared store holds them now (a config adapter's name wins)."""
        self._runtime = {a.name: a for a in adapters if a.name not in self._config}

    def get(self, name: str) -> Adapter | None:
        found = self._config.get(name)
        return found if found is not None else self._runtime.get(name)

    def all(self) -> list[Adapter]:
        return [*self._config.values(), *self._runtime.values()]

    def of_fleet(self, fleet: str) -> list[Adapter]:
        return [a for a in self.all() if a.fleet == fleet]

    def mark_failed(self, name: str, why: str) -> None:
        if name not in self.failed:
            _log.warning("adapter_failed", adapter=name, error=why)
        self.failed[name] = why


class AdapterLoadFailed(Exception):
    """A load on one instance did not succeed; ``permanent``: the engine says the path holds no adapter
    (retrying elsewhere would fail alike); ``timed_out``: it did not end within the fleet's
    ``adapter_load_timeout_s`` (the engine may still finish it: it is asked what it holds after)."""

    def __init__(self, message: str, *, permanent: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.permanent = permanent
        self.timed_out = timed_out


@dataclass(eq=False)
class _Held:
    """One instance generation's adapters: name → last used (monotonic), least recently used first."""

    generation: int
    names: OrderedDict[str, float] = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class AdapterPlan:
    """What routing decided for an adapter request on one instance: the rule, and what to load there
    (``load``) after unloading ``evict``."""

    adapter: Adapter
    rule: str
    load: bool = False
    evict: str | None = None


class AdapterSlots:
    """Which instance holds which adapter, and loads and unloads on the engines (module docstring)."""

    def __init__(self, registry: Registry, catalog: AdapterCatalog, session: aiohttp.ClientSession, *,
                 bearer: Callable[[str], str] = lambda fleet: "", load_timeout_s: float = 60.0,
                 sync_interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.catalog = catalog
        self.session = session
        self.bearer = bearer
        self.load_timeout_s = load_timeout_s
        self.sync_interval_s = sync_interval_s
        self.clock = clock
        self._held: dict[str, _Held] = {}
        self._inflight: dict[tuple[str, str], int] = {}
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._joined: dict[tuple[str, str], int] = {}  # requests waiting for a load there
        self._unloading: dict[tuple[str, str], int] = {}
        # (instance, adapter) an eviction in flight will unload: no other plan's victim
        self._claimed: set[tuple[str, str]] = set()
        self._freed = asyncio.Event()  # set (and replaced) when a slot may have freed: see wait_for_slot
        self.overflow_waits: dict[str, int] = {}  # requests that waited for a slot, by fleet
        self.overflow_wait_seconds: dict[str, float] = {}
        # each load's and unload's start and end numbered: what a /v1/models answer may not know yet
        self._moves = 0
        self._moved: dict[tuple[str, str], int] = {}
        # a follower's: the loads in flight on the controller, as its published record says
        self._remote_loading: set[tuple[str, str]] = set()
        # ... and the adapters its own requests use or wait for (not idle, though no shared load says so yet)
        self._remote_busy: set[tuple[str, str]] = set()
        self._following = False  # routing from the controller's record (not asking the engines)
        # the other routerd processes' adapter traffic, as their shared load says: in flight by
        # (instance, adapter) — busy there, not to be evicted —, and requests routed by (fleet, adapter)
        self._inflight_elsewhere: dict[tuple[str, str], int] = {}
        self._requests_elsewhere: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # fleet → adapter → requests per second, as placement last measured them (the controller's:
        # its process runs placement; elsewhere empty, and eviction goes by recency alone)
        self._rates: dict[str, dict[str, float]] = {}
        # metrics: loads and unloads by fleet and adapter and outcome, load seconds, requests, slot waits
        self.loads: dict[tuple[str, str, str], int] = {}
        self.unloads: dict[tuple[str, str], int] = {}
        self.load_seconds: dict[str, float] = {}
        self.requests: dict[tuple[str, str], int] = {}
        self.slot_waits: dict[str, int] = {}
        self.slot_wait_seconds: dict[str, float] = {}  # requests' time waiting for a load, summed
        # the engine's own vllm:lora_requests_info, by instance (the scraper's, when it reads it)
        self.engine_info: dict[str, dict[str, Any]] = {}
        # Only the process that controls the fleets loads and unloads: in any other (a follower, a
        # worker) a load is asked of the controller (``remote``: the admin relay), while ``controls()``
        # says it does not control. None: a process alone (no Redis) loads itself.
        self.remote: Callable[[Instance, str, str | None], Awaitable[tuple[int, str]]] | None = None
        self.controls: Callable[[], bool] = lambda: True

    # ---- what is held ---------------------------------------------------------------------------

    def _of(self, inst: Instance) -> _Held:
        held = self._held.get(inst.id)
        if held is None or held.generation != inst.generation:
            held = self._held[inst.id] = _Held(inst.generation)
        return held

    def holds(self, inst: Instance, name: str) -> bool:
        return name in self._of(inst).names

    def held(self, inst: Instance) -> list[str]:
        return list(self._of(inst).names)

    def _is_loading(self, inst: Instance, name: str) -> bool:
        """A load of ``name`` is in flight on ``inst``: this process's, or the controller's it follows."""
        key = (inst.id, name)
        return key in self._loading or key in self._remote_loading

    def _idle(self, inst: Instance, name: str) -> bool:
        key = (inst.id, name)
        # a request whose load just ended is not yet in flight: it is one step from being sent
        return not self._inflight.get(key) and not self._inflight_elsewhere.get(key) \
            and not self._is_loading(inst, name) and not self._joined.get(key) \
            and key not in self._remote_busy

    def _move(self, key: tuple[str, str]) -> None:
        self._moves += 1
        self._moved[key] = self._moves

    def load_timeout(self, fleet: str) -> float:
        """How long a load on ``fleet``'s engines may take: its ``adapter_load_timeout_s``."""
        return self.catalog.load_timeouts.get(fleet, self.load_timeout_s)

    def _victim(self, inst: Instance, fleet: str) -> str | None:
        """The idle, unpinned adapter of ``inst`` whose traffic least needs it there, or None: the lowest
        request rate per copy in the fleet (as placement last measured it), the least recently used
        among equals. By recency alone a popular adapter that happened to be idle for a moment went
        before a rarely used one, and was loaded again soon after (each load stalls the engine)."""
        rates = self._rates.get(fleet, {})
        idle = [name for name in self._of(inst).names
                if ((a := self.catalog.get(name)) is None or not a.pinned) and self._idle(inst, name)
                and (inst.id, name) not in self._claimed]
        if len(idle) < 2 or not rates:
            return idle[0] if idle else None
        ready = self._ready(fleet)
        copies = {name: sum(1 for i in ready if self.holds(i, name)) for name in idle}
        return min(idle, key=lambda name: rates.get(name, 0.0) / max(1, copies[name]))

    # ---- routing ---------------------------------------------------------------------------------

    def narrow(self, adapter: Adapter, pairs: Sequence[tuple[Candidate, Instance]]
               ) -> tuple[list[tuple[Candidate, Instance]], dict[str, AdapterPlan]]:
        """The candidates an adapter request may go to, with each one's plan (module docstring)."""
        slots = self._slots(adapter.fleet)
        groups: tuple[list[tuple[Candidate, Instance]], ...] = ([], [], [], [])  # held, joining, free, evict
        plans: dict[str, AdapterPlan] = {}
        for cand, inst in pairs:
            if (found := self._plan_on(inst, adapter, slots)) is not None:
                rank, plans[inst.id] = found
                groups[rank].append((cand, inst))
        for group in groups:
            roomy = [p for p in group if not p[0].saturated]
            if roomy:
                return roomy, plans
        for group in groups:
            if group:
                return group, plans
        overflow = {i.id: AdapterPlan(adapter, ADAPTER_OVERFLOW, load=True) for _, i in pairs}
        return list(pairs), overflow

    def _plan_on(self, inst: Instance, adapter: Adapter, slots: int) -> tuple[int, AdapterPlan] | None:
        """``adapter`` on ``inst`` by rules 1–3, with its group (0 held, 1 joining its load, 2 a free
        slot, 3 an eviction); None where it has no slot (rule 5 there)."""
        name = adapter.name
        if self.holds(inst, name):
            return 0, AdapterPlan(adapter, ADAPTER_LOADED)
        if self._is_loading(inst, name):  # its slot is taken by this very load: join it
            return 1, AdapterPlan(adapter, ADAPTER_FREE_SLOT, load=True)
        if self._used(inst) < slots:
            return 2, AdapterPlan(adapter, ADAPTER_FREE_SLOT, load=True)
        if (victim := self._victim(inst, adapter.fleet)) is not None:
            return 3, AdapterPlan(adapter, ADAPTER_EVICTED, load=True, evict=victim)
        return None

    def no_slot(self, adapter: Adapter) -> bool:
        """Routing ``adapter`` now would overflow (rule 5): no ready instance of its fleet has a plan
        for it by rules 1–3. False without a ready instance (routing says so itself)."""
        slots = self._slots(adapter.fleet)
        ready = self._ready(adapter.fleet)
        return bool(ready) and all(self._plan_on(inst, adapter, slots) is None for inst in ready)

    async def wait_for_slot(self, adapter: Adapter, within_s: float = OVERFLOW_WAIT_S) -> float:
        """While routing ``adapter`` would overflow, wait (up to ``within_s``) for a slot anywhere in
        its fleet: woken when one may have freed here, looking again every ``_RECHECK_S`` for what
        other processes free. Returns the seconds waited (0.0: a slot was there). The wait counts as
        demand for the autoscaler, as a wait for a load does."""
        if not self.no_slot(adapter):
            return 0.0
        fleet = adapter.fleet
        started = self.clock()
        deadline = started + within_s
        waiting = self.registry.adapter_waiting
        waiting[fleet] = waiting.get(fleet, 0) + 1
        try:
            while (left := deadline - self.clock()) > 0 and self.no_slot(adapter):
                with contextlib.suppress(TimeoutError):
                    await _aio.wait_for(self._freed.wait(), min(left, _RECHECK_S))
        finally:
            _release(waiting, fleet)
            waited = self.clock() - started
            self.overflow_waits[fleet] = self.overflow_waits.get(fleet, 0) + 1
            self.overflow_wait_seconds[fleet] = self.overflow_wait_seconds.get(fleet, 0.0) + waited
        return waited

    def _slot_freed(self) -> None:
        """A slot may have freed (an adapter went idle, one was unloaded, a load ended): wake the
        requests waiting for one; each looks again (:meth:`wait_for_slot`)."""
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    def _slots(self, fleet: str) -> int:
        """The adapters an instance of ``fleet`` runs at once (its ``max-loras``; 1 at least)."""
        return max(1, self.catalog.slots.get(fleet, 1))

    def _used(self, inst: Instance) -> int:
        """Slots taken on ``inst``: the adapters it holds and those being loaded there."""
        return len(self._of(inst).names) + self._loads_to(inst)

    def _ready(self, fleet: str) -> list[Instance]:
        return [i for i in self.registry.instances(fleet) if i.state is InstanceState.READY]

    def _loads_to(self, inst: Instance) -> int:
        held = self._of(inst).names
        return sum(1 for (iid, name) in {*self._loading, *self._remote_loading}
                   if iid == inst.id and name not in held)

    @contextlib.contextmanager
    def using(self, inst: Instance, name: str) -> Any:
        """Around one request of adapter ``name`` on ``inst``: it is busy there (not evictable)."""
        key = (inst.id, name)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        fleet_key = (inst.fleet, name)
        self.requests[fleet_key] = self.requests.get(fleet_key, 0) + 1
        held = self._of(inst).names
        if name in held:
            held[name] = self.clock()
            held.move_to_end(name)
        try:
            yield
        finally:
            _release(self._inflight, key)
            if key not in self._inflight:
                self._slot_freed()

    # ---- loading ---------------------------------------------------------------------------------

    async def ensure(self, inst: Instance, plan: AdapterPlan) -> None:
        """Make ``plan.adapter`` held on ``inst``: join the load in flight there, or start one (after
        unloading ``plan.evict``). Bounded by ``load_timeout_s``; raises :class:`AdapterLoadFailed`."""
        adapter = plan.adapter
        if self.holds(inst, adapter.name):
            return
        key = (inst.id, adapter.name)
        task = self._loading.get(key)
        if task is None:
            self.slot_waits[inst.fleet] = self.slot_waits.get(inst.fleet, 0) + 1
            if plan.evict is not None:
                self._claimed.add((inst.id, plan.evict))  # before the load's first step: see _victim
            task = asyncio.get_running_loop().create_task(self._load(inst, adapter, plan.evict),
                                                          name=f"adapter-load:{inst.id}:{adapter.name}")
            self._loading[key] = task
            task.add_done_callback(lambda t, k=key: self._loaded(k, t))  # type: ignore[misc]
            self._changed()
        started = self.clock()
        # A request's wait is demand the autoscaler counts, as requests in admission. Placement's own
        # loads keep nobody waiting, and a load relayed here is counted by the process whose request
        # waits for it (its shared load carries it): counted once.
        ours = plan.rule not in ("placement", "relayed")
        waiting = self.registry.adapter_waiting if ours else {}
        waiting[inst.fleet] = waiting.get(inst.fleet, 0) + 1
        self._joined[key] = self._joined.get(key, 0) + 1
        timeout_s = self.load_timeout(inst.fleet)
        try:
            # shield: one waiter giving up (its client left) does not cancel the others' load
            await _aio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            # no half-state: once the load's own call has ended, the engine is asked what it holds
            settle = asyncio.get_running_loop().create_task(self._settle(inst, task),
                                                            name=f"adapter-settle:{inst.id}")
            self._tasks.add(settle)
            settle.add_done_callback(self._tasks.discard)
            raise AdapterLoadFailed(f"loading adapter {adapter.name!r} on {inst.id} took over "
                                    f"{timeout_s:g} s (fleets.adapter_load_timeout_s)",
                                    timed_out=True) from None
        finally:
            if ours:
                waited = self.slot_wait_seconds.get(inst.fleet, 0.0) + self.clock() - started
                self.slot_wait_seconds[inst.fleet] = waited
            _release(waiting, inst.fleet)
            _release(self._joined, key)

    def _loaded(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]
            self._changed()
        self._slot_freed()  # a failed load leaves its slot; a done one, requests that may now join
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it already

    async def _settle(self, inst: Instance, load: asyncio.Task[None]) -> None:
        """After a load that timed out: wait for its call to end (bounded by its own timeout), then ask
        the engine what it holds — it may have finished the load after all, or not. A follower asks
        nothing: its record is the controller's, which settles its own."""
        with contextlib.suppress(Exception):  # its outcome was every waiter's; only its end matters here
            await _aio.wait_for(asyncio.shield(load), self.load_timeout(inst.fleet) + 5.0)
        if not self._following:
            await self.sync(inst)

    def _changed(self) -> None:
        """The record changed: while this process controls, the fleet state goes out at once (a
        follower's own changes wait for the controller's record)."""
        if self.remote is None or self.controls():
            self.registry.notify()

    async def _load(self, inst: Instance, adapter: Adapter, evict: str | None) -> None:
        keys = [(inst.id, adapter.name), *([(inst.id, evict)] if evict is not None else [])]
        for key in keys:
            self._move(key)
        try:
            await self._load_once(inst, adapter, evict)
        finally:
            if evict is not None:
                self._claimed.discard((inst.id, evict))
            for key in keys:
                self._move(key)

    async def _load_once(self, inst: Instance, adapter: Adapter, evict: str | None) -> None:
        started = self.clock()
        relayed = self.remote is not None and not self.controls()
        if self.remote is not None and relayed:
            # the controller loads (evicting there), fenced by its lease; its record is the engine's
            if evict is not None and self._idle(inst, evict):
                self._of(inst).names.pop(evict, None)
            else:
                evict = None
            status, text = await self.remote(inst, adapter.name, evict)
        else:
            if evict is not None and self._idle(inst, evict):
                await self.unload(inst, evict)
            await self._fit(inst)
            status, text = await self._post(inst, "/v1/load_lora_adapter",
                                            {"lora_name": adapter.name, "lora_path": adapter.path})
        if status == 400 and "already been loaded" in text:
            status = 200  # loaded by someone else meanwhile (another routerd, the placement loop)
        outcome = "ok" if status == 200 else "error"
        lk = (inst.fleet, adapter.name, outcome)
        self.loads[lk] = self.loads.get(lk, 0) + 1
        if status != 200:
            permanent = status == 404  # vLLM: "No adapter found for <path>"
            message = f"loading adapter {adapter.name!r} on {inst.id}: engine answered {status}: {text[:300]}"
            if permanent:
                self.catalog.mark_failed(adapter.name, message)
            raise AdapterLoadFailed(message, permanent=permanent)
        took = self.clock() - started
        self.load_seconds[inst.fleet] = self.load_seconds.get(inst.fleet, 0.0) + took
        held = self._of(inst).names
        held[adapter.name] = self.clock()
        held.move_to_end(adapter.name)
        self.catalog.failed.pop(adapter.name, None)
        self._changed()
        _log.info("adapter_loaded", instance=inst.id, adapter=adapter.name, load_ms=round(took * 1000, 1),
                  evicted=evict, by="controller" if relayed else "here")

    async def _fit(self, inst: Instance) -> None:
        """Before a load on ``inst``: an instance over its slots (an overflow there) unloads idle
        adapters until the load fits. An eviction that swapped one adapter for another kept it over
        its slots, and the engine made every request there take turns for them (seconds each: the
        tail of ``routerd bench lora``)."""
        slots = self._slots(inst.fleet)
        while self._used(inst) > slots and (victim := self._victim(inst, inst.fleet)) is not None:
            await self.unload(inst, victim)

    async def unload(self, inst: Instance, name: str) -> bool:
        """Unload ``name`` from ``inst``; True when the engine no longer has it."""
        key = (inst.id, name)
        self._of(inst).names.pop(name, None)
        self._changed()
        self._slot_freed()
        self._unloading[key] = self._unloading.get(key, 0) + 1
        self._move(key)
        try:
            status, _ = await self._post(inst, "/v1/unload_lora_adapter", {"lora_name": name})
        finally:
            self._move(key)
            _release(self._unloading, key)
        uk = (inst.fleet, name)
        self.unloads[uk] = self.unloads.get(uk, 0) + 1
        _log.info("adapter_unloaded", instance=inst.id, adapter=name, status=status)
        return status in (200, 404)

    async def _post(self, inst: Instance, path: str, body: dict[str, Any]) -> tuple[int, str]:
        headers = {}
        if key := self.bearer(inst.fleet):
            headers["Authorization"] = f"Bearer {key}"
        try:
            async with _aio.timeout(self.load_timeout(inst.fleet)), \
                    self.session.post(inst.url + path, json=body, headers=headers) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return 0, repr(e)

    # ---- what the engines say they hold -------------------------------------------------------

    async def sync(self, inst: Instance) -> None:
        """Ask the engine what it holds (``/v1/models``): its adapters replace routerd's record (a load
        routerd made that the engine does not list was lost: a restart, a load that timed out) — but
        for an adapter routerd loaded or unloaded there while the question was out: the answer may
        predate that, and routerd's record of it stands."""
        asked_at = self._moves
        headers = {}
        if key := self.bearer(inst.fleet):
            headers["Authorization"] = f"Bearer {key}"
        try:
            async with _aio.timeout(min(self.sync_interval_s * 2, 10.0)), \
                    self.session.get(inst.url + "/v1/models", headers=headers) as r:
                if r.status != 200:
                    return
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            return
        listed = [m["id"] for m in data
                  if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)]
        held = self._of(inst).names
        before = list(held)
        now = self.clock()

        def moved(name: str) -> bool:
            key = (inst.id, name)
            return (self._moved.get(key, 0) > asked_at or self._is_loading(inst, name)
                    or key in self._unloading)

        for name in list(held):
            if name not in listed and not moved(name):
                del held[name]
        for name in listed:
            if name not in held and not moved(name):
                held[name] = now
                held.move_to_end(name, last=False)  # not used by routerd yet: first to go
        if set(held) != set(before):
            self._changed()

    async def run(self) -> None:
        """Keep every LoRA fleet's record true to its engines, until cancelled — while this process
        keeps the record: a follower that has the controller's record routes from it."""
        while True:
            if self._following and (self.remote is None or self.controls()):
                self._following = False  # this process took control: its own record from here
                self._remote_loading, self._remote_busy = set(), set()
            insts = [i for fleet, n in self.catalog.slots.items() if n for i in self._ready(fleet)]
            for inst in insts if not self._following else ():
                await self.sync(inst)
            live = {i.id for f in self.registry.fleets() for i in self.registry.instances(f)
                    if i.state is InstanceState.READY}
            # out of rotation (dead, restarting, gone): what it held is not counted on; a static
            # instance keeps its generation across an engine restart, so this is what forgets it
            for iid in [k for k in self._held if k not in live]:
                del self._held[iid]
            for key in [k for k in self._moved if k[0] not in live and k not in self._loading]:
                del self._moved[key]
            await asyncio.sleep(self.sync_interval_s)

    # ---- the shared view (routerd/peers/fleet_state.py) --------------------------------------------

    def record(self) -> LoraRecord | None:
        """What the controller publishes: each ready instance of a LoRA fleet with its adapters (least
        recently used first) and its loads in flight, and the adapters that failed to load."""
        fleets = self.lora_fleets()
        if not fleets:
            return None
        out: dict[str, HeldAdapters] = {}
        busy = {*self._inflight, *self._joined}  # (instance, adapter); _release drops a key at zero
        for fleet in fleets:
            for inst in self.registry.instances(fleet):
                if inst.state is InstanceState.READY:
                    out[inst.id] = HeldAdapters(
                        generation=inst.generation, held=self.held(inst),
                        loading=sorted(n for (iid, n) in self._loading if iid == inst.id),
                        busy=sorted({n for (iid, n) in busy if iid == inst.id}))
        return LoraRecord(instances=out, failed=dict(self.catalog.failed))

    def follow(self, record: LoraRecord | None) -> None:
        """A follower's or a worker's record becomes the controller's (each instance of the same engine
        generation as here); None — the controller publishes none — leaves this process asking the
        engines itself."""
        if record is None or self.remote is None or self.controls():
            self._following = False
            self._remote_loading, self._remote_busy = set(), set()
            return
        self._following = True
        now = self.clock()
        for inst in [i for f in self.lora_fleets() for i in self.registry.instances(f)]:
            theirs = record.instances.get(inst.id)
            held = self._of(inst)
            if theirs is None or theirs.generation != inst.generation:
                held.names.clear()  # not in rotation on the controller (or another engine): nothing held
                continue
            held.names = OrderedDict((n, held.names.get(n, now)) for n in theirs.held)
        self._remote_loading = {(iid, n) for iid, h in record.instances.items() for n in h.loading}
        self._remote_busy = {(iid, n) for iid, h in record.instances.items() for n in h.busy}
        for name in set(self.catalog.failed) - set(record.failed):
            del self.catalog.failed[name]
        for name, why in record.failed.items():
            self.catalog.mark_failed(name, why)

    def demand(self) -> AdapterDemand:
        """This process's adapter traffic, as its shared load publishes it (routerd/peers/load.py)."""
        inflight: dict[str, dict[str, int]] = {}
        for (iid, name), n in self._inflight.items():
            inflight.setdefault(iid, {})[name] = n
        requests: dict[str, dict[str, int]] = {}
        for (fleet, name), n in self.requests.items():
            requests.setdefault(fleet, {})[name] = n
        return AdapterDemand(inflight=inflight, requests=requests,
                             waiting=dict(self.registry.adapter_waiting))

    def elsewhere(self, others: dict[str, AdapterDemand]) -> None:
        """The other processes' adapter traffic (each one's last record): what is busy where, their
        requests for placement to measure, their waits for a load for the autoscaler."""
        recs = list(others.values())
        self._inflight_elsewhere = _summed(*(_flat(r.inflight) for r in recs))
        self._requests_elsewhere = _summed(*(_flat(r.requests) for r in recs))
        self.registry.adapter_waiting_elsewhere = _summed(*(r.waiting for r in recs))

    # ---- what placement (routerd/fleet/adapters.py) asks ------------------------------------------

    def lora_fleets(self) -> list[str]:
        return [f for f, n in self.catalog.slots.items() if n]

    def request_counts(self) -> dict[tuple[str, str], int]:
        """(fleet, adapter) → requests routed so far, by this process and the others on its Redis."""
        return _summed(self.requests, self._requests_elsewhere)

    def _all_inflight(self) -> dict[tuple[str, str], int]:
        """(instance, adapter) → requests in flight from every process."""
        return _summed(self._inflight, self._inflight_elsewhere)

    def in_flight(self) -> dict[tuple[str, str], int]:
        """(fleet, adapter) → its requests in flight from every process, on any instance."""
        out: dict[tuple[str, str], int] = {}
        for (iid, name), n in self._all_inflight().items():
            inst = self.registry.get(iid)
            if inst is not None:
                out[(inst.fleet, name)] = out.get((inst.fleet, name), 0) + n
        return out

    def placement(self, fleet: str, rates: dict[str, float], demand: dict[str, float]
                  ) -> FleetPlacement | None:
        """The fleet as the planner sees it: its ready instances' adapters, what is busy, the rates and
        demand, and what one copy serves: half an instance's slots (its capacity, as routing knows it)."""
        self._rates[fleet] = dict(rates)  # for routing's evictions between two rounds (_victim)
        insts = self._ready(fleet)
        if not insts:
            return None
        per_copy = PER_COPY_SHARE * sum(i.capacity_source()[0] for i in insts) / len(insts)
        busy = [*self._all_inflight(), *self._loading]  # (instance, adapter): once, not per instance
        return FleetPlacement(
            slots=self.catalog.slots.get(fleet, 0),
            adapters={a.name: a.pinned for a in self.catalog.of_fleet(fleet)
                      if a.name not in self.catalog.failed},
            held={i.id: self._taken(i) for i in insts},
            busy={i.id: {n for (iid, n) in busy if iid == i.id} for i in insts},
            rates=rates, demand=demand, per_copy=per_copy)

    def _taken(self, inst: Instance) -> list[str]:
        """The adapters that take ``inst``'s slots: those held (least recently used first), then those
        being loaded there (a load in flight has its slot: nothing else is planned into it)."""
        held = self.held(inst)
        return held + sorted({n for (iid, n) in self._loading if iid == inst.id} - set(held))

    async def place(self, fleet: str, move: Move) -> bool:
        """Carry out one of placement's moves (a load is shared with requests waiting for it)."""
        inst = self.registry.get(move.instance)
        adapter = self.catalog.get(move.adapter)
        if inst is None or inst.state is not InstanceState.READY:
            return False
        if move.kind == "unload":
            return self._idle(inst, move.adapter) and await self.unload(inst, move.adapter)
        if adapter is None:
            return False
        try:
            await self.ensure(inst, AdapterPlan(adapter, "placement", load=True))
        except AdapterLoadFailed:
            return False
        return True

    def status(self, inst: Instance) -> dict[str, Any]:
        """What ``/admin/fleets`` shows of an instance's adapters: routerd's record (held, least
        recently used first; loading; requests in flight) beside the engine's own
        ``vllm:lora_requests_info`` as last scraped."""
        snap = inst.snapshot
        engine = None if snap is None or snap.max_lora is None else {
            "running": list(snap.lora_running), "waiting": list(snap.lora_waiting), "max_lora": snap.max_lora}
        return {"held": self.held(inst), "slots": self.catalog.slots.get(inst.fleet, 0),
                "loading": sorted(n for (iid, n) in {*self._loading, *self._remote_loading}
                                  if iid == inst.id),
                "in_flight": {n: c for (iid, n), c in self._all_inflight().items() if iid == inst.id},
                "engine": engine}

