"""Weighted fair share of a saturated fleet's admission slots between tenants (pure; time is passed in).

Each tenant's work in one fleet is a :class:`Line`: its waiters, in its own priority/deadline order,
and the slots it holds. When a slot frees and more than one tenant waits, :func:`pick` chooses whose
next waiter gets it: the tenant with the least *virtual time* — slot-seconds held so far divided by
its weight. A tenant that holds few slots falls behind in virtual time and is served next, so when
every tenant is backlogged each one's slot occupancy tends to its weight's share (exactly, over time:
the integral corrects the rounding of whole slots), and a slot that one tenant does not use goes to
whoever waits (work-conserving).

A tenant that had no waiting work must not come back with unbounded credit for the time it was away
(it would then take every slot until it caught up), nor with a debt from an earlier burst that starves
it: when a line starts waiting its virtual time is moved into the range of the lines already waiting
(:meth:`Line.join`) — the start-time rule of fair queueing — except for a bounded *credit*: it may stay
up to ``credit`` behind the least of them (a few seconds of its share, as a scheduler lets a task that
slept keep a little of its lag). Without that credit an interactive tenant that holds fewer slots than
its share, and so empties its line between requests, was put level with a flood on every request and
had to wait its turn for a slot like the flood's next job. Ties go to the tenant holding fewer slots
for its weight, then to the one served least recently.

Slots free up only as requests end, so a tenant arriving at a fleet that another tenant fills waits
for the next one to end — on average a job's length over the number of slots, at worst a whole job.
Admission may therefore take a slot back (:func:`victim`): when a tenant below its share waits on a
full fleet, the most recently started *preemptible* request of the tenant furthest above its share is
aborted and runs again later (admission only offers requests whose output nobody has seen yet — a
queue job not streamed — and each at most a few times). A latency-sensitive request (HTTP) may also
take one back when its tenant holds its share of slots *now* but is behind *over time* — its virtual
time more than ``margin`` below the holder's: a chat tenant using less than its share on average still
bursts past it, and without this its burst waited for a flood's job to end. Batch work never takes a
slot back this way, so two floods do not abort each other's jobs over the usual gap of a job or two.

Cost per decision: one pass over the tenants *waiting* in that fleet (usually one to three).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Line", "Share", "pick", "victim"]


class _Waiting(Protocol):
    def __lt__(self, other: Any) -> bool: ...

    def done(self) -> bool: ...


W = TypeVar("W", bound=_Waiting)


@dataclass(frozen=True, slots=True)
class Share:
    """What admission needs of a tenant: its weight and how many requests it may have in flight
    (this process, all fleets; 0 = no bound)."""

    weight: float = 1.0
    max_concurrent: int = 0


class Line(Generic[W]):
    """One tenant's waiters and held slots in one fleet."""

    __slots__ = ("active", "admitted_total", "bonus", "heap", "preemptible", "queued_http", "queued_queue",
                 "served", "since", "slot_seconds", "tenant", "weight")

    def __init__(self, tenant: str, weight: float, now: float) -> None:
        self.tenant = tenant
        self.weight = weight
        self.heap: list[W] = []
        self.active = 0
        self.queued_http = 0
        self.queued_queue = 0
        self.admitted_total = 0
        self.slot_seconds = 0.0  # slots × seconds held, up to ``since``
        self.since = now
        self.bonus = 0.0  # slot-seconds added to the virtual time only (see join)
        self.served = 0  # the dispatch number of its last grant
        # held slots that may be taken back, oldest first: grant number → abort (False: too late)
        self.preemptible: dict[int, Callable[[], bool]] = {}

    def occupancy(self, now: float) -> float:
        """Slot-seconds held since the line was made, up to ``now``."""
        return self.slot_seconds + self.active * (now - self.since)

    def vtime(self, now: float) -> float:
        return (self.occupancy(now) + self.bonus) / self.weight

    def take(self, now: float, served: int) -> None:
        """One more slot held from ``now``."""
        self.slot_seconds += self.active * (now - self.since)
        self.since = now
        self.active += 1
        self.admitted_total += 1
        self.served = served

    def give_back(self, now: float) -> None:
        self.slot_seconds += self.active * (now - self.since)
        self.since = now
        self.active -= 1

    def join(self, waiting: Iterable[Line[W]], now: float, credit: float = 0.0) -> None:
        """The line starts waiting: bring its virtual time within that of the lines already waiting,
        keeping at most ``credit`` (virtual seconds) of what it is behind the least of them."""
        times = [line.vtime(now) for line in waiting if line is not self]
        if not times:
            return
        own = self.vtime(now)
        target = min(max(own, min(times) - credit), max(times))
        self.bonus += (target - own) * self.weight

    def top(self) -> W | None:
        """The line's first waiter still waiting (those done meanwhile are dropped)."""
        heap = self.heap
        while heap and heap[0].done():
            heapq.heappop(heap)
        return heap[0] if heap else None


def pick(waiting: Iterable[Line[W]], now: float, capped: Callable[[str], bool]) -> Line[W] | None:
    """The line whose first waiter gets the next slot, or None if none may (all capped or empty)."""
    best: Line[W] | None = None
    best_key = (0.0, 0.0, 0)
    for line in waiting:
        if line.top() is None or capped(line.tenant):
            continue
        key = (line.vtime(now), line.active / line.weight, line.served)
        if best is None or key < best_key:
            best, best_key = line, key
    return best


def victim(lines: Iterable[Line[W]], waiting: Line[W], slots: int, now: float = 0.0,
           margin: float | None = None) -> Line[W] | None:
    """The line to take a preemptible slot from so that ``waiting`` (a line with a waiter, on a fleet
    of ``slots`` all held) gets its share now; None when it holds its share already, or no line holds
    a preemptible slot and more than its share even after giving one up.

    With ``margin`` (virtual seconds; latency-sensitive waiters only) a line holding its share now may
    still take a slot from the line furthest ahead in virtual time, if that one is more than ``margin``
    ahead of it: the waiting tenant used less than its share over time."""
    demand = [line for line in lines if line.active or line.top() is not None]
    total = sum(line.weight for line in demand)
    if total <= 0:
        return None
    best: Line[W] | None = None
    if waiting.active < slots * waiting.weight / total:
        for line in demand:
            if line is waiting or not line.preemptible or line.active - 1 < slots * line.weight / total:
                continue
            if best is None or line.active / line.weight > best.active / best.weight:
                best = line
        return best
    if margin is None:
        return None
    behind = waiting.vtime(now) + margin
    ahead = 0.0
    for line in demand:
        if line is waiting or not line.preemptible:
            continue
        vt = line.vtime(now)
        if vt > behind and (best is None or vt > ahead):
            best, ahead = line, vt
    return best
