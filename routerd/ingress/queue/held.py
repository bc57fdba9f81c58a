"""What one consumer holds: the jobs read (or claimed) here and not yet finished.

The consumer adds a job when it reads it, the job's task releases it in ``finally``; reclaim, keep-alive
and the cancel listener only look. ``unadmitted`` counts jobs read but not yet counted by admission, so
a read never asks for more than the fleets can take (see ``QueueIngress._want``; the jobs waiting for
their tenant's rate limit are counted by the dispatch, ``Dispatch.quota_waiting``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..validate import ChatHead, CompletionHead


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
    # its checked head (validate.read_head), decoded once for every delivery's routing
    head: CompletionHead | ChatHead | None = None


class Held:
    """The jobs held by this consumer, by stream entry id and by job id."""

    def __init__(self) -> None:
        self.by_entry: dict[str, Running] = {}
        self.by_job: dict[str, Running] = {}
        self.unadmitted = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def __len__(self) -> int:
        return len(self.by_entry)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self.by_entry

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

    def release(self, running: Running) -> None:
        self.admitted(running)
        self.by_entry.pop(running.entry_id, None)
        if self.by_job.get(running.job_id) is running:
            del self.by_job[running.job_id]
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
