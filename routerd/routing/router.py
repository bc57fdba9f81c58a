"""Choosing an instance: candidate views over the registry and the policy plugin.

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

from .. import plugins
from ..config import RoutingConfig
from ..errors import NoReadyInstance
from ..plugins import Candidate, RoutingPolicy
from ..registry import Instance, InstanceState, Registry
from .breaker import CircuitBreaker


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
