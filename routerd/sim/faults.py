"""Run-time fault injection for the simulated engine.

Failover, health checking and retry logic in routerd can only be tested against an engine that fails
the ways vLLM fails: the process dies (crash), it stops answering while its port stays open (hang),
it slows down, it answers some requests 500, it answers 500 to one kind of request on every replica
(an engine bug some input triggers: ``poison``), a stream breaks after it started (vLLM sends
``data: {"error": ...}`` then ``[DONE]``), or ``/health`` says 503. One :class:`Faults` object per engine
holds the current set; tests change it in Python, operators through ``POST /sim/faults`` or signals.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class FaultUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /sim/faults``: only the fields present change.

    ``fail_after_chunks`` < 0 clears that fault; ``poison: ""`` clears that one; ``crash: true`` ends
    the process at once.
    """

    crash: bool = False
    hang: bool | msgspec.UnsetType = msgspec.UNSET
    slow_factor: Annotated[float, msgspec.Meta(gt=0.0)] | msgspec.UnsetType = msgspec.UNSET
    error_rate: Fraction | msgspec.UnsetType = msgspec.UNSET
    fail_after_chunks: int | msgspec.UnsetType | None = msgspec.UNSET
    unhealthy: bool | msgspec.UnsetType = msgspec.UNSET
    poison: str | msgspec.UnsetType = msgspec.UNSET
    kv_events_drop_rate: Fraction | msgspec.UnsetType = msgspec.UNSET
    kv_events_reorder: bool | msgspec.UnsetType = msgspec.UNSET


class Faults:
    """The engine's current faults. Plain attributes for reading; change them with :meth:`set`.

    ``hang`` is backed by an event so that everything that must stop (HTTP handlers, the engine loop)
    can ``await wait_unhung()`` and resume the moment it is cleared. ``on_crash`` is what a crash does:
    ``os._exit`` in the ``routerd sim-engine`` process, an abrupt server stop in-process.
    """

    def __init__(self, *, seed: int = 0, on_crash: Callable[[], None] | None = None) -> None:
        self.slow_factor = 1.0
        self.error_rate = 0.0
        self.fail_after_chunks: int | None = None
        self.unhealthy = False
        self.poison = ""  # a request whose prompt (or rendered chat) contains it is answered 500
        # KV-event batches left unsent (still replayable), and one held back to go after the next
        self.kv_events_drop_rate = 0.0
        self.kv_events_reorder = False
        self._running = asyncio.Event()
        self._running.set()
        self._rng = random.Random(seed)
        self.on_crash = on_crash

    @property
    def hang(self) -> bool:
        return not self._running.is_set()

    def set(self, *, hang: bool | None = None, slow_factor: float | None = None,
            error_rate: float | None = None, fail_after_chunks: int | None = -1,
            unhealthy: bool | None = None, poison: str | None = None, crash: bool = False,
            kv_events_drop_rate: float | None = None, kv_events_reorder: bool | None = None) -> None:
        """Change the given faults (``None`` = leave as is; ``fail_after_chunks=None`` clears it,
        the default -1 leaves it; ``poison=""`` clears that one)."""
        if crash:
            self.crash()
        if hang is not None:
            (self._running.clear if hang else self._running.set)()
        if slow_factor is not None:
            if slow_factor <= 0:
                raise ValueError("slow_factor must be > 0")
            self.slow_factor = float(slow_factor)
        if error_rate is not None:
            if not 0.0 <= error_rate <= 1.0:
                raise ValueError("error_rate must be within [0, 1]")
            self.error_rate = float(error_rate)
        if fail_after_chunks is None or fail_after_chunks >= 0:
            self.fail_after_chunks = fail_after_chunks
        if unhealthy is not None:
            self.unhealthy = unhealthy
        if poison is not None:
            self.poison = poison
        if kv_events_drop_rate is not None:
            if not 0.0 <= kv_events_drop_rate <= 1.0:
                raise ValueError("kv_events_drop_rate must be within [0, 1]")
            self.kv_events_drop_rate = float(kv_events_drop_rate)
        if kv_events_reorder is not None:
            self.kv_events_reorder = kv_events_reorder

    def apply(self, update: FaultUpdate) -> None:
        """Apply a ``POST /sim/faults`` body."""
        fac = update.fail_after_chunks
        self.set(
            hang=None if update.hang is msgspec.UNSET else update.hang,
            slow_factor=None if update.slow_factor is msgspec.UNSET else update.slow_factor,
            error_rate=None if update.error_rate is msgspec.UNSET else update.error_rate,
            fail_after_chunks=-1 if fac is msgspec.UNSET else (None if fac is None or fac < 0 else fac),
            unhealthy=None if update.unhealthy is msgspec.UNSET else update.unhealthy,
            poison=None if update.poison is msgspec.UNSET else update.poison,
            crash=update.crash,
            kv_events_drop_rate=(None if update.kv_events_drop_rate is msgspec.UNSET
                                 else update.kv_events_drop_rate),
            kv_events_reorder=None if update.kv_events_reorder is msgspec.UNSET else update.kv_events_reorder,
        )

    def clear(self) -> None:
        """Back to a healthy engine (a crash cannot be undone)."""
        self._running.set()
        self.slow_factor = 1.0
        self.error_rate = 0.0
        self.fail_after_chunks = None
        self.unhealthy = False
        self.poison = ""
        self.kv_events_drop_rate = 0.0
        self.kv_events_reorder = False

    def crash(self) -> None:
        if self.on_crash is None:
            raise RuntimeError("this engine has no crash action")
        self.on_crash()

    async def wait_unhung(self) -> None:
        """Return at once unless hung; otherwise wait until the hang is cleared."""
        if not self._running.is_set():
            await self._running.wait()

    def draw_error(self) -> bool:
        """Whether this request should fail with a 500 (seeded, so a test run is repeatable)."""
        return self.error_rate > 0.0 and self._rng.random() < self.error_rate

    def draw_kv_drop(self) -> bool:
        """Whether to leave this KV-event batch unsent (seeded, like :meth:`draw_error`)."""
        return self.kv_events_drop_rate > 0.0 and self._rng.random() < self.kv_events_drop_rate

    def poisoned(self, prompt_text: str) -> bool:
        """Whether this request trips the ``poison`` fault (on every engine that has it set)."""
        return bool(self.poison) and self.poison in prompt_text

    def snapshot(self) -> dict[str, Any]:
        return {"hang": self.hang, "slow_factor": self.slow_factor, "error_rate": self.error_rate,
                "fail_after_chunks": self.fail_after_chunks, "unhealthy": self.unhealthy,
                "poison": self.poison, "kv_events_drop_rate": self.kv_events_drop_rate,
                "kv_events_reorder": self.kv_events_reorder}
