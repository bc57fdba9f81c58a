"""The per-instance circuit breaker: consecutive failures take an instance out of rotation for a while.

Upstream drives it (``begin``/``success``/``failure``/``end`` around each attempt); the router asks
``allows`` when it builds candidates. Its state lives on the :class:`~routerd.registry.Instance` so
routing, status and metrics all read the same three states.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config import RoutingConfig
from ..registry import CircuitState, Instance


class CircuitBreaker:
    """Per-instance breaker: ``threshold`` failures in a row → out of rotation for ``cooldown_s``.

    After the cool-down the circuit is half-open: exactly one request may try the instance; success
    closes the circuit, failure opens it for another cool-down. State lives on the Instance
    (``consecutive_failures``, ``circuit_open_until``, read as a :class:`CircuitState` through
    :meth:`Instance.circuit`) so routing, status and metrics all see the same three states; the set of
    instances with a half-open trial in flight lives here.
    """

    def __init__(self, cfg: RoutingConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self._trials: set[str] = set()

    def allows(self, inst: Instance, now: float) -> bool:
        state = inst.circuit(now)
        if state is CircuitState.HALF_OPEN:
            return inst.id not in self._trials  # one trial at a time
        return state is CircuitState.CLOSED

    def begin(self, inst: Instance) -> bool:
        """Called when a request is sent; returns True when it is the half-open trial."""
        if inst.circuit(self.clock()) is CircuitState.HALF_OPEN:
            self._trials.add(inst.id)
            return True
        return False

    def end(self, inst: Instance) -> None:
        self._trials.discard(inst.id)

    def success(self, inst: Instance) -> None:
        inst.consecutive_failures = 0
        inst.circuit_open_until = 0.0

    def failure(self, inst: Instance) -> bool:
        """Count one failure; returns True only when it moves the circuit from closed to open.

        One opening per transition: the failures of requests that were already in flight when the
        circuit opened change nothing (the cool-down is not stretched by them), and a failure once the
        cool-down is over (the half-open trial) re-opens it for another cool-down without counting as a
        new opening — so one dead engine shows as one opening, however many requests it dropped and
        however many cool-downs it stays down."""
        inst.consecutive_failures += 1
        now = self.clock()
        if inst.circuit_open_until == 0.0:
            if inst.consecutive_failures >= self.cfg.circuit_failure_threshold:
                inst.circuit_open_until = now + self.cfg.circuit_cooldown_s
                return True
            return False
        if now >= inst.circuit_open_until:
            inst.circuit_open_until = now + self.cfg.circuit_cooldown_s
        return False
