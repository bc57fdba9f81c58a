"""The autoscaler: runs each autoscaled fleet's :class:`~routerd.fleet.scaling_policy.ScalingPolicy`.

It gathers the policy's signals from what routerd already knows — the registry (engines' running and
waiting counts, KV use, expected wait, readiness, and the requests and queue jobs admission has
waiting for the fleet, ``Registry.queued``, and the requests waiting for a LoRA adapter to load,
``Registry.adapter_waiting``, this process's and the other routerd's on its Redis) — every
:data:`TICK_S`, logs every decision with those inputs, and wakes the fleet manager, which reconciles
to the new count (launching at once; draining, then stopping, one replica going).

It is also the data plane's :class:`routerd.elastic.Elastic`: a request for a fleet scaled to zero
calls :meth:`Autoscaler.wake`, which decides at once (no tick to wait for) and returns when an engine
is expected ready — learned from this fleet's own start-ups — for the ``Retry-After`` of a request whose
waiting room runs out first.

And it tells Ray's autoscaler what the autoscaled fleets want: one bundle per desired replica, through
``ray.autoscaler.sdk.request_resources``, re-sent whenever that changes (so a scale-down withdraws it).
On a cluster without an autoscaler the request is recorded and ignored; replicas that cannot be placed
stay pending with what is missing, as any launch does.

An admin pin (``POST /admin/fleets/{fleet}/replicas``) suspends the fleet's policy until lifted
(``DELETE``); the fleet manager holds the pin, the autoscaler only asks whether there is one.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import log
from ..config import Config, FleetConfig
from ..registry import Instance, InstanceState, Registry
from ..speed import spec_capacity
from .naming import bundle_for, spec_for
from .ray_cluster import RayCluster
from .scaling_policy import ScaleDecision, ScalingPolicy, Signals

_logger = log.get("routerd.autoscale")

TICK_S = 0.5  # how often the policies look at their signals (scrapes come every 0.2 s by default)
STARTUP_GUESS_S = 30.0  # expected start-up of a fleet never seen starting (only feeds Retry-After)
_RECENT = 10  # decisions kept per fleet for status


def configured_capacity(fleet: FleetConfig) -> int:
    """Requests one replica runs at once before any is running: the spec's max-num-seqs, else the
    fleet's ``max_num_seqs``."""
    return spec_capacity(fleet.engine_args) or fleet.max_num_seqs


class Autoscaler:
    """Every autoscaled fleet's policy, its inputs and its record; the fleet manager owns ``run()``."""

    def __init__(self, cfg: Config, registry: Registry, cluster: RayCluster | None, *,
                 on_change: Callable[[], None], pin: Callable[[str], int | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``on_change`` wakes the fleet manager; ``pin(fleet)`` is the count an admin pinned it at."""
        self.cfg = cfg
        self.registry = registry
        self.cluster = cluster
        self.clock = clock
        self._on_change = on_change
        self._pin = pin
        self.policies: dict[str, ScalingPolicy] = {}
        self.signals: dict[str, Signals] = {}
        self.decisions: Counter[tuple[str, str, str]] = Counter()  # (fleet, direction, reason)
        self.recent: dict[str, deque[dict[str, Any]]] = {}
        self.startup_s: dict[str, float] = {}  # learned seconds from launch to ready, per fleet
        self._starting: dict[str, float] = {}  # instance id → when it was first seen starting
        self._requested: list[dict[str, float]] | None = None  # what Ray's autoscaler was last asked

    # the fleet manager's side ----------------------------------------------------------------
    def begin(self, adopted: dict[str, int], published: dict[str, int] | None = None) -> None:
        """Policies for the autoscaled fleets, each starting from the count the last fleet state
        ``published`` (the previous controller's decision: a change of controller neither wakes a fleet
        at zero nor drops what it scaled up to), else from the engines adopted for it (a restart keeps
        what runs), else from its ``replicas``."""
        now = self.clock()
        for fleet in self._autoscaled(self.cfg):
            assert fleet.autoscale is not None
            start = published.get(fleet.name) if published is not None else None
            if start is None:
                start = adopted.get(fleet.name) or fleet.replicas
            self.policies[fleet.name] = ScalingPolicy(fleet.autoscale, start, now)

    def replicas(self, fleet: str) -> int | None:
        """The autoscaled count of ``fleet``; None when it is not autoscaled (or not begun)."""
        policy = self.policies.get(fleet)
        return None if policy is None else policy.replicas

    def update_config(self, cfg: Config, running: dict[str, int]) -> None:
        """A reload: a fleet newly autoscaled starts from the replicas it ``running`` has, changed
        bounds are applied (clamping the count at once), dropped sections end their policy."""
        self.cfg = cfg
        now = self.clock()
        wanted = {f.name: f for f in self._autoscaled(cfg)}
        for name in list(self.policies):
            if name not in wanted:
                del self.policies[name]
                self.signals.pop(name, None)
        for name, fleet in wanted.items():
            assert fleet.autoscale is not None
            policy = self.policies.get(name)
            if policy is None:
                self.policies[name] = ScalingPolicy(fleet.autoscale, running.get(name, fleet.replicas), now)
            elif policy.cfg != fleet.autoscale:
                decision = policy.reconfigure(fleet.autoscale, now)
                if decision is not None:
                    self._record(name, decision, self._signals(fleet))
        self._on_change()

    def unpinned(self, fleet: str, replicas: int) -> None:
        """The admin pin was lifted: the policy resumes from the pinned count."""
        policy = self.policies.get(fleet)
        if policy is not None:
            policy.reset(replicas, self.clock())
            _logger.info("autoscale_resumed", fleet=fleet, replicas=policy.replicas)

    # Elastic: the data plane's side ----------------------------------------------------------
    def wake(self, fleet: str) -> float | None:
        policy = self.policies.get(fleet)
        if policy is None or self._pin(fleet) is not None:
            return None
        now = self.clock()
        decision = policy.wake(now)
        if decision is not None:
            fcfg = self.cfg.fleet(fleet)
            self._record(fleet, decision, self._signals(fcfg) if fcfg is not None else None)
            self._on_change()
        return self.eta(fleet, now)

    def standby(self, fleet: str) -> bool:
        policy = self.policies.get(fleet)
        if policy is None or policy.cfg.min_replicas > 0 or self._pin(fleet) is not None:
            return False
        return not any(i.state is InstanceState.UNHEALTHY for i in self.registry.instances(fleet))

    def eta(self, fleet: str, now: float) -> float:
        """Seconds until ``fleet`` is expected to have a ready instance (0 when it has one): the
        earliest launch under way plus the fleet's learned start-up (a launch not begun yet: now)."""
        instances = self.registry.instances(fleet)
        if any(i.state is InstanceState.READY for i in instances):
            return 0.0
        begun = min((self._starting[i.id] for i in instances if i.id in self._starting), default=now)
        return max(0.0, begun + self.startup_s.get(fleet, STARTUP_GUESS_S) - now)

    def status(self, fleet: str) -> dict[str, Any] | None:
        policy = self.policies.get(fleet)
        if policy is None:
            return None
        c = policy.cfg
        s = self.signals.get(fleet)
        counts: Counter[str] = Counter()
        for (f, direction, reason), n in self.decisions.items():
            if f == fleet:
                counts[f"{direction}:{reason}"] += n
        return {
            "min_replicas": c.min_replicas, "max_replicas": c.max_replicas,
            "desired": policy.replicas, "recommended": policy.last_recommendation,
            "pinned": self._pin(fleet) is not None,
            "targets": {"utilization": c.target_utilization, "wait_s": c.target_wait_s,
                        "kv_usage": c.target_kv_usage},
            "signals": _signal_fields(s) if s is not None else None,
            "startup_s": round(self.startup_s[fleet], 3) if fleet in self.startup_s else None,
            "ray_requested_bundles": sum(1 for _ in self._fleet_bundles(fleet)),
            "decisions_total": dict(counts),
            "recent": list(self.recent.get(fleet, ())),
        }

    # the loop --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick every :data:`TICK_S`; learn start-up times as soon as the registry changes."""
        version = self.registry.version
        next_tick = self.clock()
        while True:
            now = self.clock()
            try:
                self._learn_startups(now)
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self.tick(now)
                    await self._sync_ray_request()
            except Exception:  # a loop boundary: log and go on
                _logger.exception("autoscale_step_failed")
            version = await self.registry.wait_changed(version, timeout=max(0.01, next_tick - self.clock()))

    def tick(self, now: float) -> None:
        """Observe every autoscaled fleet once (pinned ones are only watched)."""
        changed = False
        for fleet in self._autoscaled(self.cfg):
            policy = self.policies.get(fleet.name)
            if policy is None:
                continue
            signals = self._signals(fleet)
            self.signals[fleet.name] = signals
            if self._pin(fleet.name) is not None:
                continue
            decision = policy.observe(signals, now)
            if decision is not None:
                self._record(fleet.name, decision, signals)
                changed = True
        if changed:
            self._on_change()

    def _signals(self, fleet: FleetConfig) -> Signals:
        ready = [i for i in self.registry.instances(fleet.name) if i.state is InstanceState.READY]
        queued = float(self.registry.queued.get(fleet.name, 0))  # waiting in admission
        # and waiting for a LoRA adapter to load (routing.adapters): demand no engine counts yet
        queued += self.registry.adapter_waiting.get(fleet.name, 0)
        queued += self.registry.adapter_waiting_elsewhere.get(fleet.name, 0)  # a worker's, a replica's
        demand = queued
        waiting = queued
        kv = 0.0
        for inst in ready:
            queue = inst.estimated_queue()
            demand += queue
            waiting += _engine_waiting(inst, queue)
            kv += inst.snapshot.kv_usage if inst.snapshot is not None else 0.0
        capacity = (sum(i.capacity for i in ready) / len(ready)) if ready else configured_capacity(fleet)
        wait = min((i.expected_wait_s() for i in ready), default=0.0)
        return Signals(ready=len(ready), demand=demand, waiting=waiting, capacity=float(capacity),
                       expected_wait_s=wait, kv_usage=kv / len(ready) if ready else 0.0)

    def _record(self, fleet: str, decision: ScaleDecision, signals: Signals | None) -> None:
        self.decisions[(fleet, decision.direction, decision.reason)] += 1
        inputs = _signal_fields(signals) if signals is not None else {}
        entry = {"at": time.time(), "from": decision.previous, "to": decision.replicas,
                 "reason": decision.reason, "recommended": decision.recommendation, **inputs}
        self.recent.setdefault(fleet, deque(maxlen=_RECENT)).append(entry)
        _logger.info("autoscale_decision", fleet=fleet, replicas=decision.replicas,
                     previous=decision.previous, direction=decision.direction, reason=decision.reason,
                     recommended=decision.recommendation, **inputs)

    def _learn_startups(self, now: float) -> None:
        """Seconds from a replica's launch (its registry entry appearing, generation 0) to ready: the
        fleet's expected start-up, placement included — an exponential average, so a changed model or
        node shows within a few starts. Restarts (a later generation) and adoptions are not launches."""
        seen: set[str] = set()
        for fleet in self._autoscaled(self.cfg):
            for inst in self.registry.instances(fleet.name):
                seen.add(inst.id)
                if inst.state is InstanceState.STARTING:
                    if inst.generation == 0:
                        self._starting.setdefault(inst.id, now)
                elif inst.state is InstanceState.READY and inst.id in self._starting:
                    took = now - self._starting.pop(inst.id)
                    before = self.startup_s.get(fleet.name)
                    self.startup_s[fleet.name] = took if before is None else 0.5 * before + 0.5 * took
                    _logger.info("autoscale_startup_learned", fleet=fleet.name, instance=inst.id,
                                 startup_s=round(took, 3), expected_s=round(self.startup_s[fleet.name], 3))
                else:
                    self._starting.pop(inst.id, None)
        for iid in [i for i in self._starting if i not in seen]:
            del self._starting[iid]

    # Ray's autoscaler ------------------------------------------------------------------------
    def _fleet_bundles(self, fleet: str) -> Iterator[dict[str, float]]:
        fcfg, policy = self.cfg.fleet(fleet), self.policies.get(fleet)
        if fcfg is None or policy is None:
            return
        bundle = bundle_for(spec_for(fcfg, 0))
        pinned = self._pin(fleet)
        for _ in range(policy.replicas if pinned is None else pinned):
            yield dict(bundle)

    async def _sync_ray_request(self) -> None:
        """Ask Ray's autoscaler for one bundle per desired replica of every autoscaled fleet, when
        that changed since the last request (each request replaces the previous one)."""
        if self.cluster is None or not self.cfg.ray.request_resources:
            return
        bundles = [b for name in sorted(self.policies) for b in self._fleet_bundles(name)]
        if bundles == self._requested:
            return
        await self.cluster.request_resources(bundles)
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        _logger.info("ray_resources_requested", bundles=len(bundles), total=total)
        self._requested = bundles

    async def withdraw(self) -> None:
        """Withdraw the request (routerd stops its engines on exit)."""
        if self.cluster is not None and self._requested:
            await self.cluster.request_resources([])
            self._requested = []

    @staticmethod
    def _autoscaled(cfg: Config) -> list[FleetConfig]:
        return [f for f in cfg.fleets if f.autoscale is not None and f.engine != "static"]


def _engine_waiting(inst: Instance, queue: float) -> float:
    """Requests waiting for a slot at this engine: its own count, or what routerd sent beyond its slots."""
    snap = inst.snapshot
    return max(snap.waiting if snap is not None else 0.0, queue - inst.capacity)


def _signal_fields(s: Signals) -> dict[str, Any]:
    return {"ready": s.ready, "demand": round(s.demand, 2), "waiting": round(s.waiting, 2),
            "capacity": round(s.capacity, 2), "expected_wait_s": round(s.expected_wait_s, 3),
            "kv_usage": round(s.kv_usage, 3)}


class FleetCollector:
    """``/metrics`` of launched fleets: desired, actual and ready replicas, autoscaling decisions."""

    def __init__(self, figures: Callable[[], list[tuple[str, int, int, int]]],
                 autoscaler: Autoscaler) -> None:
        """``figures()`` gives (fleet, desired, actual, ready) for every launched fleet."""
        self._figures = figures
        self._autoscaler = autoscaler

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are built per collect

    def collect(self) -> Iterator[Any]:
        desired = GaugeMetricFamily("routerd_fleet_desired_replicas", "Replicas the fleet is kept at "
                                    "(autoscaled, pinned by the admin route, or configured)",
                                    labels=["fleet"])
        actual = GaugeMetricFamily("routerd_fleet_replicas", "Replicas launched and not being retired "
                                   "(starting, ready or restarting)", labels=["fleet"])
        ready = GaugeMetricFamily("routerd_fleet_ready_replicas", "Replicas in rotation", labels=["fleet"])
        for fleet, d, a, r in self._figures():
            desired.add_metric([fleet], d)
            actual.add_metric([fleet], a)
            ready.add_metric([fleet], r)
        yield from (desired, actual, ready)
        decisions = CounterMetricFamily("routerd_autoscale_decisions", "Autoscaling decisions by direction "
                                        "(up, down) and reason (cold_start, full, wait, kv, load, underused, "
                                        "idle, bounds)", labels=["fleet", "direction", "reason"])
        for (fleet, direction, reason), n in sorted(self._autoscaler.decisions.items()):
            decisions.add_metric([fleet, direction, reason], n)
        yield decisions
        startup = GaugeMetricFamily("routerd_autoscale_startup_seconds", "Learned seconds from launching a "
                                    "replica to it being ready (what a request to a fleet at zero waits)",
                                    labels=["fleet"])
        for fleet, s in sorted(self._autoscaler.startup_s.items()):
            startup.add_metric([fleet], s)
        yield startup
