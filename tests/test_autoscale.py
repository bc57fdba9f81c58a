"""The autoscaling policy (routerd/fleet/scaling_policy.py) and its driver's signals, by the clock — no
sleeping.

The policy is fed :class:`Signals` at chosen times; the driver (routerd/fleet/autoscaler.py) is run over a
real registry whose instances carry scrape snapshots, as the scraper leaves them.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable

import pytest

from routerd import config
from routerd.config import AdmissionConfig, AutoscaleConfig
from routerd.dataplane.admission import Admission
from routerd.errors import NoReadyInstance
from routerd.fleet.autoscaler import Autoscaler
from routerd.fleet.scaling_policy import TOLERANCE, ScaleDecision, ScalingPolicy, Signals
from routerd.registry import Instance, InstanceState, LoadSnapshot, Registry

CAP = 8.0


def cfg(**kw: float) -> AutoscaleConfig:
    base: dict[str, float] = {"min_replicas": 0, "max_replicas": 6, "scale_down_delay_s": 30.0,
                              "scale_up_delay_s": 2.0, "target_utilization": 0.5, "target_wait_s": 1.0,
                              "target_kv_usage": 0.8}
    return AutoscaleConfig(**{**base, **kw})  # type: ignore[arg-type]  # numbers by key, checked by msgspec


def sig(ready: int, demand: float, *, waiting: float = 0.0, wait_s: float = 0.0, kv: float = 0.0) -> Signals:
    return Signals(ready=ready, demand=demand, waiting=waiting, capacity=CAP, expected_wait_s=wait_s,
                   kv_usage=kv)


def run(policy: ScalingPolicy, signals: Signals | Callable[[int], Signals], start: float, end: float,
        step: float = 0.5) -> list[ScaleDecision]:
    """Observe ``signals`` every ``step`` from ``start`` to ``end`` (exclusive): the same ones, or drawn
    anew each step from the policy's current replica count."""
    out = []
    t = start
    while t < end:
        d = policy.observe(signals(policy.replicas) if callable(signals) else signals, t)
        if d is not None:
            out.append(d)
        t += step
    return out


def test_scale_up_is_proportional_and_in_one_decision_after_the_up_window() -> None:
    p = ScalingPolicy(cfg(), replicas=1, now=5.0)  # the stable path waits for a window from here
    # 20 requests / (8 slots × 0.5) = 5 replicas, and a request would wait 3 s against 1 s.
    burst = sig(ready=1, demand=20.0, wait_s=3.0)
    assert p.observe(burst, 10.0) is None  # one sample is not a window
    assert p.observe(burst, 11.0) is None
    d = p.observe(burst, 12.0)
    assert d is not None
    assert (d.previous, d.replicas, d.reason, d.direction) == (1, 5, "wait", "up")
    # While the 4 new ones start, the same wait asks for nothing more...
    assert run(p, sig(ready=1, demand=20.0, wait_s=3.0), 12.5, 20.0) == []
    # ...and once all 5 are ready and it still waits, the window starts over and the max caps it.
    assert p.observe(sig(ready=5, demand=50.0, wait_s=2.0), 20.0) is None
    d = p.observe(sig(ready=5, demand=50.0, wait_s=2.0), 22.0)
    assert d is not None
    assert d.replicas == 6


def test_a_spike_shorter_than_the_up_window_adds_nothing() -> None:
    p = ScalingPolicy(cfg(), replicas=2, now=0.0)
    for t in range(20):  # a spike every 2 s, each one sample long
        demand = 30.0 if t % 4 == 0 else 4.0
        assert p.observe(sig(ready=2, demand=demand), t * 0.5) is None
    assert p.replicas == 2


def test_with_no_ready_replica_the_burst_is_answered_at_once() -> None:
    p = ScalingPolicy(cfg(), replicas=0, now=0.0)
    d = p.wake(5.0)
    assert d is not None
    assert (d.previous, d.replicas, d.reason) == (0, 1, "cold_start")
    assert p.wake(5.1) is None  # already starting
    d = p.observe(sig(ready=0, demand=18.0, waiting=18.0), 5.2)  # the rest of the burst waits in admission
    assert d is not None
    assert (d.previous, d.replicas, d.reason) == (1, 5, "queued")


def test_a_fleet_at_zero_with_waiting_jobs_starts_without_a_wake() -> None:
    p = ScalingPolicy(cfg(), replicas=0, now=0.0)
    d = p.observe(sig(ready=0, demand=1.0, waiting=1.0), 1.0)
    assert d is not None
    assert (d.replicas, d.reason) == (1, "cold_start")


def test_scale_down_goes_one_replica_per_delay_then_to_zero_when_idle() -> None:
    c = cfg(scale_down_delay_s=30.0)
    p = ScalingPolicy(c, replicas=3, now=0.0)
    decisions = run(p, sig(ready=3, demand=0.0), 0.0, 200.0)
    assert [(d.previous, d.replicas, d.reason) for d in decisions] == [(3, 2, "idle"), (2, 1, "idle"),
                                                                       (1, 0, "idle")]
    assert [d.at for d in decisions] == [30.0, 60.0, 90.0]


def test_underused_scale_down_keeps_the_tolerance_and_stops_at_min() -> None:
    p = ScalingPolicy(cfg(min_replicas=1), replicas=4, now=0.0)
    # 6 requests: 2 replicas at 75 % of their target carry them with the tolerance to spare.
    decisions = run(p, sig(ready=4, demand=6.0), 0.0, 300.0)
    assert [(d.replicas, d.reason, d.at) for d in decisions] == [(3, "underused", 30.0),
                                                                 (2, "underused", 60.0)]
    assert p.replicas == 2
    # At 8 requests 2 replicas would be exactly at their target: inside the tolerance, so 3 stay; and
    # at 3.7 one replica would be at 93 %: 2 stay.
    assert 2 * CAP * 0.5 / (1 + TOLERANCE) < 8.0
    assert run(ScalingPolicy(cfg(min_replicas=1), replicas=3, now=0.0), sig(ready=3, demand=8.0),
               0.0, 300.0) == []
    assert run(ScalingPolicy(cfg(min_replicas=1), replicas=2, now=0.0), sig(ready=2, demand=3.7),
               0.0, 300.0) == []


def test_requests_waiting_too_long_block_scale_down_even_while_a_replica_starts() -> None:
    p = ScalingPolicy(cfg(), replicas=3, now=0.0)  # one of the 3 starting: the wait rule cannot scale up
    assert run(p, sig(ready=2, demand=2.0, waiting=2.0, wait_s=1.5), 0.0, 200.0) == []


def test_scale_down_judges_the_mean_demand_so_noise_does_not_hold_a_replica() -> None:
    p = ScalingPolicy(cfg(min_replicas=1), replicas=2, now=0.0)
    decisions = []
    t = 0.0
    while t < 40.0:  # 1.5 and 3.5 in turn: a mean of 2.5 that one replica carries (3.3 at the tolerance)
        d = p.observe(sig(ready=2, demand=3.5 if int(t * 2) % 2 else 1.5), t)
        if d is not None:
            decisions.append(d)
        t += 0.5
    assert [(d.replicas, d.reason, d.at) for d in decisions] == [(1, "underused", 30.0)]


def test_a_shortfall_restarts_the_down_window() -> None:
    p = ScalingPolicy(cfg(), replicas=2, now=0.0)
    assert run(p, sig(ready=2, demand=1.0), 0.0, 29.0) == []
    assert p.observe(sig(ready=2, demand=1.0, wait_s=2.0), 29.0) is None  # a wait (too short to act on)
    assert run(p, sig(ready=2, demand=1.0), 29.5, 59.0) == []  # a fresh 30 s from here
    assert [d.replicas for d in run(p, sig(ready=2, demand=1.0), 59.0, 61.0)] == [1]


def test_wait_and_kv_scale_up_in_proportion_but_not_while_replicas_start() -> None:
    p = ScalingPolicy(cfg(), replicas=2, now=0.0)
    # Demand alone asks for 1, but a request waits 3 s against a 1 s target: 2 × 3 = 6.
    decisions = run(p, sig(ready=2, demand=3.0, wait_s=3.0), 0.0, 3.0)
    assert [(d.replicas, d.reason) for d in decisions] == [(6, "wait")]
    # While 4 of the 6 start, the same wait asks for nothing more.
    assert run(p, sig(ready=2, demand=3.0, wait_s=3.0), 3.0, 10.0) == []
    q = ScalingPolicy(cfg(), replicas=2, now=0.0)
    decisions = run(q, sig(ready=2, demand=3.0, kv=0.96), 0.0, 3.0)
    assert [(d.replicas, d.reason) for d in decisions] == [(3, "kv")]  # ceil(2 × 0.96 / 0.8)


def test_kv_use_blocks_scale_down_with_the_tolerance() -> None:
    p = ScalingPolicy(cfg(), replicas=2, now=0.0)
    # One replica left would hold 2 × 0.4 = 0.8 of its cache: over 0.8 / 1.1, so both stay.
    assert run(p, sig(ready=2, demand=1.0, kv=0.4), 0.0, 300.0) == []


def test_steady_noisy_load_near_a_threshold_makes_at_most_one_decision() -> None:
    """Demand wobbling ±1 around 2 replicas' worth (8 = 2 × 8 × 0.5) for ten down-delays."""
    rng = random.Random(7)
    for seed_demand in (7.6, 8.0, 8.4):
        p = ScalingPolicy(cfg(min_replicas=1), replicas=2, now=0.0)
        decisions = run(p, lambda n, d=seed_demand: sig(ready=n, demand=max(0.0, d + rng.uniform(-1.0, 1.0))),
                        0.0, 300.0)
        assert len(decisions) <= 1, (seed_demand, decisions)


def test_a_mean_demand_above_the_band_adds_replicas_on_the_stable_path() -> None:
    p = ScalingPolicy(cfg(min_replicas=1, scale_down_delay_s=60.0), replicas=2, now=0.0)
    # 10 in flight on 2 replicas of 8 slots: nobody waits, but 25 % over their target of 8 — for 10 s.
    decisions = run(p, sig(ready=2, demand=10.0), 0.0, 40.0)
    assert [(d.replicas, d.reason, d.at) for d in decisions] == [(3, "load", 10.0)]
    # 9.4 is within the band (≤ 8 × 1.2): nothing, however long.
    q = ScalingPolicy(cfg(min_replicas=1, scale_down_delay_s=60.0), replicas=2, now=0.0)
    assert run(q, sig(ready=2, demand=9.4), 0.0, 300.0) == []


def test_poisson_load_between_two_thresholds_settles_with_one_decision() -> None:
    """The bench's flap, replayed: 4 slots per replica, target 0.7, a demand of mean 7 wobbling by
    its square root — above 3 replicas' target on many scrapes, near it on average."""
    c = cfg(min_replicas=1, max_replicas=4, scale_down_delay_s=10.0, target_utilization=0.7)
    for seed in range(5):
        rng = random.Random(seed)
        p = ScalingPolicy(c, replicas=4, now=0.0)
        decisions = run(p, lambda n, rng=rng: Signals(
            ready=n, demand=max(0.0, rng.gauss(7.0, math.sqrt(7.0))), waiting=0.0, capacity=4.0,
            expected_wait_s=0.0, kv_usage=0.0), 0.0, 600.0)
        assert len(decisions) <= 1, (seed, decisions)


def test_concurrency_that_grows_as_replicas_go_does_not_flap() -> None:
    """The same load is more requests in flight on fewer replicas (each decode step slows as the batch
    fills): 7.4 on 4 replicas, 9.3 on 3 — as measured in the autoscale bench at 50 % load."""
    c = cfg(min_replicas=1, max_replicas=4, scale_down_delay_s=10.0, target_utilization=0.7)
    in_flight = {4: 7.4, 3: 9.3, 2: 13.0, 1: 20.0}
    for seed in range(5):
        rng = random.Random(seed)
        p = ScalingPolicy(c, replicas=4, now=0.0)
        decisions = run(p, lambda n, rng=rng: Signals(
            ready=n, demand=max(0.0, rng.gauss(in_flight[n], math.sqrt(in_flight[n]))), waiting=0.0,
            capacity=4.0, expected_wait_s=0.0, kv_usage=0.0), 0.0, 600.0)
        assert len(decisions) <= 1, (seed, decisions)


def test_bounds_clamp_on_reconfigure_and_reset_resumes() -> None:
    p = ScalingPolicy(cfg(max_replicas=6), replicas=5, now=0.0)
    d = p.reconfigure(cfg(max_replicas=3), 1.0)
    assert d is not None
    assert (d.previous, d.replicas, d.reason) == (5, 3, "bounds")
    assert p.reconfigure(cfg(max_replicas=3, target_wait_s=2.0), 2.0) is None
    p.reset(10, 3.0)
    assert p.replicas == 3
    assert ScalingPolicy(cfg(min_replicas=2), replicas=0, now=0.0).replicas == 2


# the driver -------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fleet_config(**autoscale: float) -> config.Config:
    return config.parse({"fleets": [{"name": "f", "model": "m", "engine": "sim", "replicas": 0,
                                     "engine_args": {"max-num-seqs": 8},
                                     "autoscale": {"max_replicas": 4, "scale_up_delay_s": 0,
                                                   **autoscale}}]}, environ={})


def ready_instance(registry: Registry, n: int, *, running: float, waiting: float, kv: float,
                   at: float) -> Instance:
    inst = registry.add(Instance(id=f"f:{n}", fleet="f", url=f"http://127.0.0.1:{9000 + n}",
                                 capacity_hint=8, launch_capacity=8))
    inst.snapshot = LoadSnapshot(scraped_at=at, running=running, waiting=waiting, kv_usage=kv, capacity=8)
    registry.set_state(inst, InstanceState.READY)
    return inst


def test_driver_signals_count_engines_and_admission_and_decisions_are_recorded() -> None:
    clock = Clock()
    registry = Registry(clock=clock)
    woken: list[int] = []
    pins: dict[str, int] = {}
    scaler = Autoscaler(fleet_config(), registry, None, on_change=lambda: woken.append(1), pin=pins.get,
                        clock=clock)
    registry.queued["f"] = 3 + 2  # waiting in admission: 3 HTTP requests, 2 queue jobs
    scaler.begin({})
    assert scaler.replicas("f") == 0
    assert scaler.standby("f")
    # A request finds no ready instance: one starts at once, and the manager is woken.
    eta = scaler.wake("f")
    assert eta == pytest.approx(30.0)  # nothing learnt yet: the guess
    assert scaler.replicas("f") == 1
    assert woken
    inst = ready_instance(registry, 0, running=8, waiting=12, kv=0.5, at=clock.t)
    inst.inflight = 20  # as many as the scrape saw: no delta
    inst.inflight_at_scrape = 20
    s = scaler._signals(scaler.cfg.fleets[0])
    assert s.ready == 1
    assert s.demand == pytest.approx(20 + 5)  # engine's running + waiting, and admission's 5
    assert s.waiting == pytest.approx(12 + 5)
    assert s.capacity == 8
    assert s.kv_usage == pytest.approx(0.5)
    assert s.expected_wait_s == pytest.approx(inst.expected_wait_s())
    assert s.expected_wait_s > 1.0  # 13 in line for 8 slots, past the 1 s target
    clock.t += 0.5
    scaler.tick(clock.t)
    assert scaler.replicas("f") == min(4, math.ceil(25 / (8 * 0.7)))  # the max
    status = scaler.status("f")
    assert status is not None
    assert [(r["from"], r["to"], r["reason"]) for r in status["recent"]] == [(0, 1, "cold_start"),
                                                                            (1, 4, "wait")]
    assert status["recent"][-1]["demand"] == 25  # the inputs are kept with the decision
    assert status["decisions_total"] == {"up:cold_start": 1, "up:wait": 1}
    assert scaler.wake("f") == 0.0  # a ready instance: no wait
    # A pin holds the count: the policy only watches; standby is off (a pin at zero does not wake).
    pins["f"] = 2
    registry.queued["f"] = 0  # nothing waits in admission any more
    inst.snapshot = LoadSnapshot(scraped_at=clock.t, running=0, waiting=0, capacity=8)
    inst.inflight = inst.inflight_at_scrape = 0
    for _ in range(200):
        clock.t += 0.5
        scaler.tick(clock.t)
    assert scaler.replicas("f") == 4
    assert scaler.wake("f") is None
    assert not scaler.standby("f")


def test_driver_learns_start_up_from_launch_to_ready_and_answers_eta() -> None:
    clock = Clock()
    registry = Registry(clock=clock)
    scaler = Autoscaler(fleet_config(), registry, None, on_change=lambda: None, pin=lambda f: None,
                        clock=clock)
    scaler.begin({})
    scaler.wake("f")
    inst = registry.add(Instance(id="f:0", fleet="f", url=""))  # the supervisor's entry: generation 0
    scaler._learn_startups(clock.t)
    clock.t += 4.0
    assert scaler.eta("f", clock.t) == pytest.approx(26.0)  # the 30 s guess, 4 s of it gone
    clock.t += 2.0
    inst.generation = 1
    registry.set_state(inst, InstanceState.READY)
    scaler._learn_startups(clock.t)
    assert scaler.startup_s["f"] == pytest.approx(6.0)
    assert scaler.eta("f", clock.t) == 0.0
    registry.remove("f:0")
    assert scaler.eta("f", clock.t) == pytest.approx(6.0)
    # A failing instance takes the fleet out of standby: /readyz then says so.
    bad = registry.add(Instance(id="f:0", fleet="f", url=""))
    registry.set_state(bad, InstanceState.UNHEALTHY, "crash loop")
    assert not scaler.standby("f")


# admission's side: a fake of the Elastic protocol -----------------------------------------------
class FakeElastic:
    """Implements :class:`routerd.elastic.Elastic` for one fleet: counts wakes, answers an ETA."""

    def __init__(self, eta: float | None, standby: bool) -> None:
        self.eta = eta
        self.on_standby = standby
        self.wakes = 0

    def wake(self, fleet: str) -> float | None:
        self.wakes += 1
        return self.eta

    def standby(self, fleet: str) -> bool:
        return self.on_standby

    def status(self, fleet: str) -> dict[str, object] | None:
        return None


def admission(elastic: FakeElastic) -> tuple[Admission, Registry, Clock]:
    registry = Registry()
    registry.ensure_fleet("f")
    clock = Clock()
    cfg = AdmissionConfig(max_inflight_per_instance=4, max_queued=10, waiting_room_s=5.0, aging_s=10.0)
    return Admission(registry, cfg, clock=clock, elastic=elastic), registry, clock


async def test_a_request_for_a_fleet_at_zero_wakes_it_and_is_admitted_once_ready() -> None:
    elastic = FakeElastic(eta=12.0, standby=True)
    adm, registry, clock = admission(elastic)
    assert adm.limit("f") == 0
    assert adm.intake_limit("f") == 4  # the queue reads one instance's worth for a fleet at zero
    assert adm.free_slots("f") == 4
    got: list[str] = []

    async def request() -> None:
        async with adm.ticket("f", source="queue"):
            got.append("admitted")

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    assert elastic.wakes == 1  # at arrival, not at the next tick
    assert got == []
    assert adm.free_slots("f") == 3
    clock.t += 60.0  # a queue job has no waiting room: it waits for the instance
    adm.sweep()
    registry.add(Instance(id="f:0", fleet="f", url="http://x", state=InstanceState.READY))
    adm.dispatch_all()
    await asyncio.wait_for(task, 1.0)
    assert got == ["admitted"]


async def test_the_waiting_room_ends_in_503_with_retry_after_from_the_expected_start_up() -> None:
    elastic = FakeElastic(eta=12.4, standby=True)
    adm, _, clock = admission(elastic)
    task = asyncio.create_task(_ticket(adm))
    await asyncio.sleep(0)
    clock.t += 5.0
    adm.sweep()
    with pytest.raises(NoReadyInstance) as info:
        await asyncio.wait_for(task, 1.0)
    assert info.value.retry_after_s == pytest.approx(12.4)
    assert info.value.status == 503
    # A fleet that does not start on demand: no Retry-After, and the queue reads nothing for it.
    fixed = FakeElastic(eta=None, standby=False)
    adm2, _, clock2 = admission(fixed)
    assert adm2.intake_limit("f") == 0
    task = asyncio.create_task(_ticket(adm2))
    await asyncio.sleep(0)
    clock2.t += 5.0
    adm2.sweep()
    with pytest.raises(NoReadyInstance) as info:
        await asyncio.wait_for(task, 1.0)
    assert info.value.retry_after_s is None


async def _ticket(adm: Admission) -> None:
    async with adm.ticket("f", source="http"):
        pass
