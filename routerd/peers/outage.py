"""A shared-view loop's Redis round trips as the log tells them: once when they start failing, once
when Redis answers again.

The view's loops (:mod:`.load`, :mod:`.scrapes`, :mod:`.sessions`) each make a round trip every tenth
of a second or so; while Redis is away they go on (each process routes on what it knows itself), and
ten identical warnings a second would bury the one line an operator needs.
"""

from __future__ import annotations

from typing import Any


class Outage:
    """The state of one loop's round trips: :meth:`failed` after each failed one, :meth:`answered`
    after each that worked. Logs ``<name>_unavailable`` (warning, with the error and ``effect``) on the
    first failure of a run, ``<name>_recovered`` (info) on the first success after it."""

    __slots__ = ("_effect", "_log", "_name", "failing")

    def __init__(self, logger: Any, name: str, effect: str | None = None) -> None:
        self._log = logger
        self._name = name
        self._effect = effect
        self.failing = False

    def failed(self, e: BaseException) -> None:
        if self.failing:
            return
        self.failing = True
        extra = {"effect": self._effect} if self._effect is not None else {}
        self._log.warning(f"{self._name}_unavailable", error=f"{type(e).__name__}: {e}", **extra)

    def answered(self) -> None:
        if self.failing:
            self.failing = False
            self._log.info(f"{self._name}_recovered")


__all__ = ["Outage"]
