"""One fleet's admission state: its slots in use, its tenants' lines of waiters, its figures.

The scheduling over it — who gets a freed slot, deadlines, the waiting room, preemption — is
:class:`~routerd.dataplane.admission.Admission`'s; this is what it keeps per fleet, and the few rules
that read only that state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from ..errors import DeadlineExceeded, RouterdError
from ..tenants.fairshare import Line

__all__ = ["FleetSlots", "Source", "Waiter"]

_CREDIT_S = 5.0  # seconds of its fair share a tenant that starts waiting may be behind the others

Source = Literal["http", "queue"]


@dataclass(slots=True)
class Waiter:
    """One request waiting for a slot."""

    key: tuple[float, float, int]  # the heap's order (see admission's docstring)
    future: asyncio.Future[None]
    source: Source = "http"
    enqueued: float = 0.0
    deadline: float | None = None

    def __lt__(self, other: Waiter) -> bool:
        return self.key < other.key

    def done(self) -> bool:
        return self.future.done()


@dataclass
class FleetSlots:
    active: int = 0
    lines: dict[str, Line[Waiter]] = field(default_factory=dict)  # every tenant seen in this fleet
    waiting: dict[str, Line[Waiter]] = field(default_factory=dict)  # those with waiters (maybe done)
    queued_http: int = 0
    queued_queue: int = 0
    admitted_total: int = 0
    rejected_total: int = 0
    expired_total: int = 0
    preempted_total: int = 0
    unready_since: float | None = None  # when the fleet last lost its last ready instance
    # the fleet's limit and ready count, as of registry version ``version`` (see Admission._slots)
    limit: int = 0
    ready: int = 0
    version: int = -1
    fresh_until: float = 0.0

    def count(self, line: Line[Waiter], source: Source, delta: int) -> int:
        """One more (``delta`` 1) or one less (-1) waiter of ``line``; how many wait now in all."""
        if source == "http":
            self.queued_http += delta
            line.queued_http += delta
        else:
            self.queued_queue += delta
            line.queued_queue += delta
        return self.queued_http + self.queued_queue

    def credit(self, line: Line[Waiter]) -> float:
        """How far behind the waiting tenants (virtual seconds) a tenant starting to wait may stay:
        ``_CREDIT_S`` seconds of its fair share of the fleet's slots (fairshare's module docstring)."""
        total = line.weight + sum(other.weight for other in self.lines.values()
                                  if other is not line and (other.active or other.heap))
        return _CREDIT_S * self.limit / total

    def retry_after(self) -> float:
        """An HTTP request refused for a full waiting room: when to try again."""
        return max(1.0, min(30.0, self.queued_http / max(self.active, 1)))

    def shed(self, source: Source, error: Callable[[], RouterdError]) -> int:
        """Fail every waiter of ``source`` with ``error()``; how many were failed."""
        shed = 0
        for w in [w for line in self.waiting.values() for w in line.heap]:
            if w.source == source and not w.future.done():
                self.rejected_total += 1
                w.future.set_exception(error())
                shed += 1
        return shed

    def sweep(self, now: float, waiting_room_s: float, no_ready: Callable[[], RouterdError]) -> None:
        """Fail the waiters whose deadline passed, and the HTTP ones past the waiting room of a fleet
        with no ready instance (``no_ready()``)."""
        for w in [w for line in self.waiting.values() for w in line.heap]:
            if w.future.done():
                continue
            err: RouterdError | None = None
            if w.deadline is not None and w.deadline <= now:
                err = self.expired()
            elif (w.source == "http" and self.unready_since is not None
                  and now - max(self.unready_since, w.enqueued) >= waiting_room_s):
                self.rejected_total += 1
                err = no_ready()
            if err is not None:
                w.future.set_exception(err)
        self.prune()

    def expired(self) -> DeadlineExceeded:
        """A waiter (or an arrival) whose deadline passed before a slot: counted, never given one."""
        self.expired_total += 1
        return DeadlineExceeded("the job's deadline passed before it could be dispatched")

    def prune(self) -> None:
        """Drop the lines whose waiters are all gone from ``waiting``."""
        for name, line in list(self.waiting.items()):
            if line.top() is None:
                del self.waiting[name]

    def stats(self, limit: int) -> dict[str, int]:
        return {"active": self.active, "queued_http": self.queued_http, "queued_queue": self.queued_queue,
                "limit": limit, "admitted_total": self.admitted_total, "rejected_total": self.rejected_total,
                "expired_total": self.expired_total, "preempted_total": self.preempted_total}

    def tenant_stats(self, now: float) -> Iterator[tuple[str, dict[str, float]]]:
        for name, line in self.lines.items():
            yield name, {"active": line.active, "queued": line.queued_http + line.queued_queue,
                         "admitted_total": line.admitted_total, "slot_seconds": line.occupancy(now)}
