"""What one consumer holds: the jobs read (or claimed) here and not yet finished.

The consumer adds a job when it reads it, the job's task releases it in ``finally``; reclaim, keep-alive
and the cancel listener only look. ``unadmitted`` counts jobs read but not yet counted by admission, so
a read never asks for more than the fleets can take (see ``QueueIngress._want``). ``parked`` counts
jobs waiting for their tenant's rate limit: they hold no slot and must not stop other tenants' jobs
from being read, so the read bound leaves them out.

A rate-limited tenant may have more jobs queued than its quota lets run for hours. At most ``read_batch``
of them wait here per tenant (:meth:`Held.quota_room`); the others are *set aside*: their task ends,
their entry stays pending in Redis under this consumer (kept fresh by keep-alive like a held one, so
nobody takes it over; its delivery given back, see ``JobStore.set_aside``) and only a small
:class:`Aside` record stays here — the stream goes on being read for the other tenants. A set-aside job
comes back (claimed again) when its tenant's room has space, when its deadline passes (for its error
result), or when its producer cancels it.

Fleets have rooms too (issue 26): the stream is one line for every fleet, so a saturated fleet's jobs
must not fill this consumer's read bound while another fleet has free slots and its jobs wait further
down the stream. Jobs waiting here for a slot of one fleet count in that fleet's room
(``slot_by_fleet``), not against the read bound; a job that would wait for a fleet whose room is full
(or which has older jobs set aside) is set aside under the fleet, and comes back when its room has
space. A job between two deliveries (its last one failed: engine died, no instance) is set aside for its
backoff, under no room: it comes back when the backoff is over, holding nothing meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ..validate import Read

# Where a set-aside job waits to come back: its tenant's room (rate limit, max_concurrent) or its fleet's.
Room = tuple[Literal["tenant", "fleet"], str]


def tenant_room(tenant: str) -> Room:
    return ("tenant", tenant)


def fleet_room(fleet: str) -> Room:
    return ("fleet", fleet)


@dataclass
class Running:
    """One job held here, from its read to its result (or dead letter)."""

    entry_id: str
    task: asyncio.Task[None] | None = None
    job_id: str = ""
    delivery: int = 1
    touched: float = 0.0  # monotonic time of its last XCLAIM (keep-alive)
    cancel_requested: bool = False
    finishing: bool = False
    unadmitted: bool = True  # read, but not yet counted by admission
    body: bytes = b""  # the job's body as sent to the engine, encoded once
    # its checked body (routerd.surface.heads.read_body), decoded once for every delivery's routing
    head: Read | None = None
    preempted: int = 0  # times its slot was taken back (kept while it is set aside)
    returned: bool = False  # brought back from being set aside: it goes before its fleet's newer jobs


@dataclass(slots=True)
class Aside:
    """A job set aside (its room full, or between deliveries): pending in Redis, not held here."""

    entry_id: str
    job_id: str
    room: Room | None  # the room whose space brings it back; None: its ``deadline`` alone (a backoff)
    delivery: int  # the delivery it comes back as (the claim that brings it back counts it in Redis)
    deadline: float | None  # Unix seconds: it comes back then (for its error result, or its retry)
    preempted: int
    touched: float  # monotonic time of its last XCLAIM (keep-alive)
    due: bool = False  # cancelled by its producer: it comes back now


class Held:
    """The jobs held by this consumer, by stream entry id and by job id."""

    def __init__(self) -> None:
        self.by_entry: dict[str, Running] = {}
        self.by_job: dict[str, Running] = {}
        self.unadmitted = 0
        self.parked = 0
        self.parked_by: Counter[str] = Counter()  # tenant → its jobs waiting here for quota
        self.slot_by: Counter[str] = Counter()  # tenant → its jobs waiting for an admission slot
        self.slot_by_fleet: Counter[str] = Counter()  # fleet → its jobs waiting for an admission slot
        self.waiting = 0  # jobs waiting for a slot, all fleets: bounded by the fleets' rooms
        self.aside: dict[Room, dict[str, Aside]] = {}  # room → entry id → set aside, oldest first
        self.aside_entries: dict[str, Aside] = {}
        self.aside_jobs: dict[str, Aside] = {}  # job id → set aside (a producer's cancel finds it)
        self._cancelled: dict[str, Aside] = {}
        self._returning: dict[str, Room] = {}  # entry id → room: brought back, not yet waiting
        self._returning_by: Counter[Room] = Counter()
        self._next_deadline = math.inf  # no set-aside job's deadline comes before this
        self.idle = asyncio.Event()
        self.idle.set()
        self.wake = asyncio.Event()  # a tenant's room has space, or a set-aside job is due
        self.closing = False  # intake stopped: jobs waiting for quota are set aside
        self.moved = asyncio.Event()  # a job read here was admitted or ended: the read bound moved

    def __len__(self) -> int:
        return len(self.by_entry)

    def __contains__(self, entry_id: object) -> bool:
        """Held or set aside: either way this consumer owns the entry (no reclaim takes it again)."""
        return entry_id in self.by_entry or entry_id in self.aside_entries

    def add(self, running: Running) -> None:
        self.by_entry[running.entry_id] = running
        self.idle.clear()
        self.unadmitted += 1

    def name(self, running: Running, job_id: str) -> None:
        """The job's id is known (it decoded): a cancel can find it from now on."""
        running.job_id = job_id
        self.by_job[job_id] = running

    def admitted(self, running: Running) -> None:
        """Admission counts the job from now on (active or waiting), so the read bound stops counting it."""
        if running.unadmitted:
            running.unadmitted = False
            self.unadmitted -= 1
            self.moved.set()

    @contextlib.contextmanager
    def quota_room(self, running: Running, tenant: str, size: int) -> Iterator[Callable[[object], bool]]:
        """Around a job's look at its tenant's rate limit: gives the ``may_wait`` of
        ``Tenancy.wait_for_quota``, which lets it into its tenant's room (``size`` jobs) if there is
        space — counted ``parked`` from then on — else says it is to be set aside."""
        entered = False

        def may_wait(_: object) -> bool:
            nonlocal entered
            if self.closing:  # a drain: set aside, its delivery given back, rather than held up
                return False
            if not entered:
                if self.parked_by[tenant] >= size:
                    return False
                entered = True
                self.parked += 1
                self.parked_by[tenant] += 1
            return True

        try:
            yield may_wait
        finally:
            self.gone(running.entry_id)
            if entered:
                self.parked -= 1
                self.parked_by[tenant] -= 1
                if self.parked_by[tenant] <= 0:
                    del self.parked_by[tenant]
                if tenant_room(tenant) in self.aside:
                    self.wake.set()  # room for one of its set-aside jobs

    @contextlib.contextmanager
    def slot_room(self, tenant: str, fleet: str) -> Iterator[Callable[[], None]]:
        """Around a job's wait for an admission slot: counted in its tenant's ``slot_by`` and its fleet's
        ``slot_by_fleet`` until the ``granted`` it gives is called (or it ends). A tenant at its
        ``max_concurrent``, or a fleet with no free slot, with a room's worth of jobs waiting has the next
        set aside (``QueueIngress``'s reads go on)."""
        self.slot_by[tenant] += 1
        self.slot_by_fleet[fleet] += 1
        self.waiting += 1
        waiting = True

        def granted() -> None:
            nonlocal waiting
            if waiting:
                waiting = False
                self.waiting -= 1
                self.slot_by[tenant] -= 1
                if self.slot_by[tenant] <= 0:
                    del self.slot_by[tenant]
                self.slot_by_fleet[fleet] -= 1
                if self.slot_by_fleet[fleet] <= 0:
                    del self.slot_by_fleet[fleet]
                if tenant_room(tenant) in self.aside or fleet_room(fleet) in self.aside:
                    self.wake.set()  # room for one of its set-aside jobs

        try:
            yield granted
        finally:
            granted()

    @property
    def set_aside(self) -> int:
        return len(self.aside_entries)

    def in_room(self, room: Room) -> int:
        """The jobs counted in ``room``: waiting in it, or brought back to it and on their way."""
        kind, name = room
        here = self.parked_by[name] + self.slot_by[name] if kind == "tenant" else self.slot_by_fleet[name]
        return here + self._returning_by[room]

    def fleet_room_full(self, fleet: str, size: int, *, returned: bool) -> bool:
        """Whether a job of ``fleet`` that would wait for a slot is to be set aside instead: ``size`` of
        the fleet's jobs wait already, or (a job not itself brought back) older ones are set aside and
        go first."""
        return self.in_room(fleet_room(fleet)) >= size or (not returned and fleet_room(fleet) in self.aside)

    def put_aside(self, running: Running, room: Room | None, deadline: float | None, *,
                  delivery: int) -> None:
        """Set ``running`` aside (its task ends next and releases it; the entry stays pending): until
        ``room`` has space, or until ``deadline``; it comes back as delivery ``delivery``."""
        a = Aside(running.entry_id, running.job_id, room, delivery, deadline, running.preempted,
                  running.touched)
        if room is not None:
            self.aside.setdefault(room, {})[a.entry_id] = a
        self.aside_entries[a.entry_id] = a
        self.aside_jobs[a.job_id] = a
        if deadline is not None and deadline < self._next_deadline:
            self._next_deadline = deadline
            self.wake.set()  # the aside loop sleeps until the previous next deadline

    def due(self, room_size: Callable[[Room], int], limit: int, now: float | None = None) -> list[Aside]:
        """Up to ``limit`` set-aside jobs to bring back now, forgotten here (the caller holds them
        again): those cancelled, those past their deadline (or backoff), then the oldest of each room
        with space (``room_size(room)`` jobs)."""
        picked: dict[str, Aside] = {}

        def take(a: Aside) -> bool:
            if len(picked) >= limit:
                return False
            picked[a.entry_id] = a
            return True

        for a in list(self._cancelled.values()):
            take(a)
        now = time.time() if now is None else now
        if now >= self._next_deadline:  # a scan only when some deadline has come
            self._next_deadline = math.inf
            for a in self.aside_entries.values():
                if a.deadline is None or a.entry_id in picked:
                    continue
                if a.deadline > now or not take(a):  # not due, or due and left for the next call
                    self._next_deadline = min(self._next_deadline, a.deadline)
        for room, entries in self.aside.items():
            space = room_size(room) - self.in_room(room)
            for a in itertools.islice(entries.values(), max(0, space)):
                take(a)
        for a in picked.values():
            self._forget(a)
            if a.room is not None:
                self._returning[a.entry_id] = a.room  # counted in its room until it waits there
                self._returning_by[a.room] += 1
        return list(picked.values())

    @property
    def next_deadline(self) -> float:
        """The earliest deadline (Unix seconds) of a set-aside job not yet brought back; inf if none."""
        return self._next_deadline

    def restore(self, back: list[Aside]) -> None:
        """Set aside again what :meth:`due` gave and could not be brought back (Redis did not answer)."""
        for a in back:
            self.gone(a.entry_id)
            if a.room is not None:
                self.aside.setdefault(a.room, {})[a.entry_id] = a
            self.aside_entries[a.entry_id] = a
            self.aside_jobs.setdefault(a.job_id, a)
            if a.due:
                self._cancelled[a.entry_id] = a
            if a.deadline is not None:
                self._next_deadline = min(self._next_deadline, a.deadline)

    def gone(self, entry_id: str) -> None:
        """A job brought back is no longer on its way (it waits, ended, or was not found)."""
        room = self._returning.pop(entry_id, None)
        if room is not None:
            self._returning_by[room] -= 1
            if self._returning_by[room] <= 0:
                del self._returning_by[room]


    def cancel_aside(self, job_id: str) -> bool:
        """A producer cancelled a set-aside job: it comes back at once to get its result."""
        a = self.aside_jobs.get(job_id)
        if a is None or a.due:
            return False
        a.due = True
        self._cancelled[a.entry_id] = a
        self.wake.set()
        return True

    def _forget(self, a: Aside) -> None:
        if a.room is not None:
            entries = self.aside.get(a.room, {})
            entries.pop(a.entry_id, None)
            if not entries:
                self.aside.pop(a.room, None)
        self.aside_entries.pop(a.entry_id, None)
        self._cancelled.pop(a.entry_id, None)
        if self.aside_jobs.get(a.job_id) is a:
            del self.aside_jobs[a.job_id]

    def release(self, running: Running) -> None:
        self.gone(running.entry_id)
        self.admitted(running)
        self.by_entry.pop(running.entry_id, None)
        if self.by_job.get(running.job_id) is running:
            del self.by_job[running.job_id]
        self.moved.set()
        if not self.by_entry:
            self.idle.set()


def as_str(value: Any) -> str:
    """A Redis reply field as text (redis-py returns bytes unless decoding is on)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def text(value: Any) -> str | None:
    """A producer's string; None when it is bytes that are not UTF-8."""
    try:
        return as_str(value)
    except UnicodeDecodeError:
        return None
