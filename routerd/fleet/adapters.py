"""LoRA placement by demand: which instance holds which adapter, planned from measured traffic.

Routing loads an adapter where a request finds no holder with room (routerd/routing/adapters.py); this
loop, run only by the process that controls the fleets, plans ahead of the requests:

- **copies by demand.** An adapter with traffic (its request rate, smoothed over ``window_s``) is held
  on one instance; it is spread over more as its load grows: one copy per ``per_copy`` of its requests
  in flight fleet-wide (half an instance's slots: a copy is added before the instances holding it
  overload), a pinned one on every instance — within the slots there are (``max-loras`` × instances;
  over that, the coldest lose copies first). A trickle of requests for the only adapter in use does
  not fill every free slot with it: the next adapter then finds a free slot, not an eviction.
- **loads** go to instances with a free slot (the fewest held first), else in place of an idle adapter
  that has more copies than it needs (or none needed).
- **hysteresis.** A copy goes only after its adapter has wanted fewer copies for ``cold_s``
  uninterrupted, and an adapter with no traffic for ``cold_s`` is unloaded everywhere (pinned ones
  never): a burst that pauses does not unload what the next burst needs.
- **within the slots.** An instance holding more adapters than ``max-loras`` (routing loads one beyond
  the slots when every adapter everywhere is busy) is brought back to its slots as soon as the extra
  ones are idle — a spare copy first, else the least recently used — not after ``cold_s``: vLLM runs
  at most ``max-loras`` adapters in a batch, so there every request waits its turn for one.
- **restarts.** An instance that restarted, or a new one, holds nothing: the next round loads what the
  demand asks for there.

At most ``max_moves`` loads and unloads a round, so a change of traffic moves adapters over a few
rounds rather than stalling every engine at once. The plan (:meth:`AdapterPlanner.plan`) is pure, with
an injected clock; :class:`AdapterPlacer` runs it against a :class:`PlacementTarget` (the routing
side's record of who holds what) while ``controls()`` says so — the lease fences it like every other
engine change.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Protocol

from .. import log
from ..lora_placement import FleetPlacement, Move

_log = log.get("routerd.fleet.adapters")


class AdapterPlanner:
    """Copies per adapter from its traffic share, with hysteresis (module docstring)."""

    def __init__(self, *, cold_s: float = 60.0, min_rate: float = 1e-3, max_moves: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cold_s = cold_s
        self.min_rate = min_rate
        self.max_moves = max_moves
        self.clock = clock
        self._fewer_since: dict[str, float] = {}  # adapter → since when it wanted fewer copies than held

    def wanted(self, p: FleetPlacement) -> dict[str, int]:
        """Copies each adapter should have now (before hysteresis)."""
        n = len(p.held)
        if n == 0:
            return {}
        want: dict[str, int] = {}
        for a, pinned in p.adapters.items():
            demand = p.demand.get(a, 0.0)
            if pinned:
                want[a] = n
            elif p.rates.get(a, 0.0) > self.min_rate or demand > 0:
                spread = math.ceil(demand / p.per_copy - 1e-9) if p.per_copy > 0 else 1
                want[a] = min(n, max(1, spread))
            else:
                want[a] = 0
        room = p.slots * n
        # over the slots: the coldest (least traffic per copy) give up copies first, down to one
        while sum(want.values()) > room:
            cut = [a for a, c in want.items() if c > 1 and not p.adapters[a]] or \
                  [a for a, c in want.items() if c > 0 and not p.adapters[a]]
            if not cut:
                break
            coldest = min(cut, key=lambda a: (p.demand.get(a, 0.0) + p.rates.get(a, 0.0)) / want[a])
            want[coldest] -= 1
        return want

    def plan(self, p: FleetPlacement) -> list[Move]:
        """The moves of this round (at most ``max_moves``)."""
        now = self.clock()
        want = self.wanted(p)
        copies = {a: sum(1 for h in p.held.values() if a in h) for a in p.adapters}
        moves: list[Move] = []
        for a, have in copies.items():
            if have > want.get(a, 0):
                self._fewer_since.setdefault(a, now)
            else:
                self._fewer_since.pop(a, None)
        held = {i: list(h) for i, h in p.held.items()}
        self._shed(held, p, want, copies, moves)
        # loads, hottest adapter first
        for a in sorted(p.adapters, key=lambda x: -p.rates.get(x, 0.0)):
            while copies.get(a, 0) < want.get(a, 0) and len(moves) < self.max_moves:
                target = self._target(a, held, p, want, copies)
                if target is None:
                    break
                inst, victim = target
                if victim is not None:
                    moves.append(Move("unload", inst, victim))
                    held[inst].remove(victim)
                    copies[victim] -= 1
                moves.append(Move("load", inst, a))
                held[inst].append(a)
                copies[a] = copies.get(a, 0) + 1
        # unloads: cold long enough, idle there
        for a, since in list(self._fewer_since.items()):
            if now - since < self.cold_s or a not in p.adapters:
                continue
            for inst in [i for i, h in held.items() if a in h]:
                if copies[a] <= want.get(a, 0) or len(moves) >= self.max_moves:
                    break
                if a not in p.busy.get(inst, set()):
                    moves.append(Move("unload", inst, a))
                    held[inst].remove(a)
                    copies[a] -= 1
        # held by instances but no longer an adapter of the fleet (removed): nothing to plan for it
        return moves

    def _shed(self, held: dict[str, list[str]], p: FleetPlacement, want: dict[str, int],
              copies: dict[str, int], moves: list[Move]) -> None:
        """Back within the slots: an instance holding more than it runs at once (routing's overflow load,
        made when every adapter everywhere was busy) makes vLLM hold requests back there. Its idle extra
        adapters go — a spare copy (more than its adapter wants) first, else the least recently used."""
        for inst, h in held.items():
            while len(h) > p.slots and len(moves) < self.max_moves:
                idle = [v for v in h if not p.adapters.get(v, False) and v not in p.busy.get(inst, set())]
                if not idle:
                    break
                victim = min(idle, key=lambda v: (copies.get(v, 0) <= want.get(v, 0), h.index(v)))
                moves.append(Move("unload", inst, victim))
                h.remove(victim)
                copies[victim] = copies.get(victim, 0) - 1

    def _target(self, a: str, held: dict[str, list[str]], p: FleetPlacement, want: dict[str, int],
                copies: dict[str, int]) -> tuple[str, str | None] | None:
        """Where a copy of ``a`` goes: a free slot (fewest held), else an idle adapter there that has
        more copies than it wants."""
        free = [i for i, h in held.items() if a not in h and len(h) < p.slots]
        if free:
            return min(free, key=lambda i: (len(held[i]), i)), None
        for inst, h in sorted(held.items()):
            if a in h:
                continue
            for victim in h:  # least recently used first
                if p.adapters.get(victim, False) or victim in p.busy.get(inst, set()):
                    continue
                if copies.get(victim, 0) > want.get(victim, 0):
                    return inst, victim
        return None


class PlacementTarget(Protocol):
    """What placement needs of the routing side's record (``routing.adapters.AdapterSlots`` is it)."""

    def placement(self, fleet: str, rates: dict[str, float], demand: dict[str, float]
                  ) -> FleetPlacement | None: ...

    def lora_fleets(self) -> list[str]: ...

    def request_counts(self) -> dict[tuple[str, str], int]: ...

    def in_flight(self) -> dict[tuple[str, str], int]: ...

    async def place(self, fleet: str, move: Move) -> bool: ...


class AdapterPlacer:
    """The loop: every ``interval_s`` while ``controls()``, measure each adapter's rate and demand and
    carry out the planner's moves."""

    def __init__(self, target: PlacementTarget, controls: Callable[[], bool], *, interval_s: float = 2.0,
                 window_s: float = 30.0, planner: AdapterPlanner | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.controls = controls
        self.interval_s = interval_s
        self.window_s = window_s
        self.planner = planner or AdapterPlanner(clock=clock)
        self.clock = clock
        self.rates: dict[tuple[str, str], float] = {}
        self.demand: dict[tuple[str, str], float] = {}
        self._last: dict[tuple[str, str], int] = {}
        self._last_at: float | None = None
        self.moves = 0

    def measure(self) -> None:
        """Smooth each adapter's request rate since the last call (exponential, over ``window_s``), and
        its demand: its requests in flight now, or the smoothed figure when more (a burst spreads an
        adapter at once; its copies go only as the smoothed demand falls, and after ``cold_s``)."""
        now = self.clock()
        counts = self.target.request_counts()
        flying = self.target.in_flight()
        if self._last_at is not None and now > self._last_at:
            dt = now - self._last_at
            alpha = 1.0 - math.exp(-dt / self.window_s)
            for key in {*counts, *self.rates}:
                # counts are every process's: one that left takes its count along (not a negative rate)
                r = max(0, counts.get(key, 0) - self._last.get(key, 0)) / dt
                self.rates[key] = self.rates.get(key, 0.0) + alpha * (r - self.rates.get(key, 0.0))
            for key in {*flying, *self.demand}:
                now_in = float(flying.get(key, 0))
                smoothed = self.demand.get(key, 0.0) + alpha * (now_in - self.demand.get(key, 0.0))
                self.demand[key] = max(now_in, smoothed)
        else:
            self.demand = {k: float(v) for k, v in flying.items()}
        self._last, self._last_at = dict(counts), now

    async def step(self) -> None:
        self.measure()
        for fleet in self.target.lora_fleets():
            rates = {a: r for (f, a), r in self.rates.items() if f == fleet}
            demand = {a: d for (f, a), d in self.demand.items() if f == fleet}
            p = self.target.placement(fleet, rates, demand)
            if p is None:
                continue
            for move in self.planner.plan(p):
                if not self.controls():
                    return  # the lease went: no engine change from here
                ok = await self.target.place(fleet, move)
                self.moves += 1
                _log.info("adapter_placed", fleet=fleet, move=move.kind, instance=move.instance,
                          adapter=move.adapter, ok=ok)

    async def run(self) -> None:
        """Until cancelled; a failed round is logged and the next one runs."""
        while True:
            if self.controls():
                try:
                    await self.step()
                except Exception:  # noqa: BLE001 — loop boundary: log, go on with the next round
                    _log.exception("adapter_placement_failed")
            await asyncio.sleep(self.interval_s)
