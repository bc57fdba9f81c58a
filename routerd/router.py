"""Choosing an instance: candidate views over the registry, the policy plugin, and the circuit breaker.

The router only reads the registry (the circuit fields it reads are written by :class:`CircuitBreaker`,
which upstream drives). Rules that hold whatever the policy is:

* only READY instances whose circuit lets a request through are candidates — never a starting,
  draining or unhealthy one;
* instances whose last scrape is stale or failed are left out while a fresh one exists (their load
  figure is a guess); if every instance is stale they are all used, on routerd's own in-flight counts;
* instances this request already tried are left out while an untried one exists (failover goes
  elsewhere first).

Load is the registry's :meth:`Instance.load` — last scrape plus routerd's in-flight delta since it —
so a burst between two scrapes is visible at once, because upstream counts a request in flight
*before* it awaits anything.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection

from . import plugins
from .config import RoutingConfig
from .errors import NoReadyInstance
from .plugins import Candidate, RoutingPolicy
from .registry import CircuitState, Instance, InstanceState, Registry


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


class Router:
    """Builds :class:`Candidate` views for one fleet and asks the policy to choose."""

    def __init__(self, registry: Registry, policy: RoutingPolicy, cfg: RoutingConfig, *,
                 breaker: CircuitBreaker | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.policy = policy
        self.cfg = cfg
        self.clock = clock
        self.breaker = breaker or CircuitBreaker(cfg, clock)
        self.rng = rng or random.Random()

    @classmethod
    def from_config(cls, registry: Registry, cfg: RoutingConfig, **kwargs: object) -> Router:
        policy = plugins.load(plugins.POLICY_GROUP, cfg.policy)
        return cls(registry, policy, cfg, **kwargs)  # type: ignore[arg-type]  # kwargs typed by caller

    def update_config(self, cfg: RoutingConfig) -> None:
        if cfg.policy != self.policy.name:
            self.policy = plugins.load(plugins.POLICY_GROUP, cfg.policy)
        self.cfg = cfg
        self.breaker.cfg = cfg

    def is_stale(self, inst: Instance, now: float) -> bool:
        snap = inst.snapshot
        return snap is None or bool(inst.scrape_error) or now - snap.scraped_at > self.cfg.stale_after_s

    def candidates(self, fleet: str, exclude: Collection[str] = ()) -> list[tuple[Candidate, Instance]]:
        """The instances a request may go to now, each with its policy view (may be empty)."""
        now = self.clock()
        allows = self.breaker.allows
        pool = [i for i in self.registry.instances(fleet)
                if i.state is InstanceState.READY and allows(i, now)]
        if exclude:
            untried = [i for i in pool if i.id not in exclude]
            pool = untried or pool
        views = [(self._view(i, now), i) for i in pool]
        fresh = [v for v in views if not v[0].stale]
        return fresh or views

    def _view(self, inst: Instance, now: float) -> Candidate:
        snap = inst.snapshot
        return Candidate(
            id=inst.id,
            load=inst.load(),
            inflight=inst.inflight,
            queue=inst.estimated_queue(),
            capacity=inst.capacity,
            kv_usage=snap.kv_usage if snap is not None else 0.0,
            stale=self.is_stale(inst, now),
        )

    def pick(self, fleet: str, exclude: Collection[str] = ()) -> Instance:
        """One instance for a request to ``fleet``; raises :class:`NoReadyInstance` when none may take it."""
        views = self.candidates(fleet, exclude)
        if not views:
            raise NoReadyInstance(f"fleet {fleet!r} has no ready instance")
        if len(views) == 1:
            return views[0][1]
        chosen = self.policy.choose([v for v, _ in views], self.rng)
        for view, inst in views:
            if view.id == chosen.id:
                return inst
        raise LookupError(f"policy {self.policy.name!r} returned {chosen.id!r}, not a candidate")
