"""The heartbeat state machine, driven by an injected clock: no sleeping, no servers."""

from __future__ import annotations

import asyncio

import pytest

from routerd.config import HealthConfig
from routerd.fleet.health import (
    ActorProbe,
    HealthMonitor,
    HealthTracker,
    ProbeResult,
    Verdict,
    probe_deadline,
)
from routerd.registry import Instance, InstanceState, LoadSnapshot, Registry

CFG = HealthConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, failure_threshold=3,
                   progress_timeout_s=10.0)
OK = ActorProbe(process_alive=True, http_status=200)
TIMED_OUT = ActorProbe(process_alive=True, http_status=None, error="timeout")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> Clock:
    return Clock()


def snap(clock: Clock, tokens: float, running: float = 4) -> LoadSnapshot:
    return LoadSnapshot(scraped_at=clock(), running=running, generation_tokens=tokens)


def test_deadline_spreads_timeout_over_threshold() -> None:
    assert probe_deadline(CFG) == pytest.approx(1.0)


def test_fails_after_threshold_misses_in_a_row(clock: Clock) -> None:
    t = HealthTracker(CFG, clock)
    verdicts = []
    for _ in range(3):
        clock.advance(1.0)
        verdicts.append(t.record(t.classify(TIMED_OUT)))
    assert verdicts == [Verdict.SUSPECT, Verdict.SUSPECT, Verdict.FAILED]
    assert t.last_result is ProbeResult.TIMEOUT


def test_a_good_answer_resets_the_count(clock: Clock) -> None:
    t = HealthTracker(CFG, clock)
    for _ in range(2):
        t.record(t.classify(TIMED_OUT))
    assert t.record(t.classify(OK)) is Verdict.HEALTHY
    for _ in range(2):
        assert t.record(t.classify(TIMED_OUT)) is Verdict.SUSPECT
    assert t.misses == 2


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"probe": ActorProbe(process_alive=False, http_status=None, returncode=-9)}, ProbeResult.PROCESS_DEAD),
    ({"probe": None, "actor_dead": True}, ProbeResult.ACTOR_DEAD),
])
def test_dead_process_or_actor_fails_at_once(clock: Clock, kwargs: dict[str, object],
                                              expected: ProbeResult) -> None:
    t = HealthTracker(CFG, clock)
    result = t.classify(**kwargs)  # type: ignore[arg-type]  # parametrized keyword bundle
    assert result is expected
    assert t.record(result) is Verdict.FAILED


def test_failed_is_sticky(clock: Clock) -> None:
    """Good probes after FAILED change nothing: only a new engine (a new tracker) is healthy again."""
    t = HealthTracker(CFG, clock)
    t.record(ProbeResult.PROCESS_DEAD)
    assert t.record(t.classify(OK)) is Verdict.FAILED
    assert t.record(t.classify(OK)) is Verdict.FAILED


def test_slow_answer_while_tokens_advance_is_busy_not_a_miss(clock: Clock) -> None:
    t = HealthTracker(CFG, clock)
    tokens = 0.0
    for _ in range(20):  # 20 s of timeouts under load: never a restart
        tokens += 50
        clock.advance(0.2)
        t.observe_snapshot(snap(clock, tokens))
        clock.advance(0.8)
        result = t.classify(TIMED_OUT)
        assert result is ProbeResult.BUSY
        assert t.record(result) is Verdict.HEALTHY
    assert t.classify(None) is ProbeResult.BUSY  # the actor call itself timing out is also excused


def test_hang_with_frozen_tokens_fails_within_timeout_plus_interval(clock: Clock) -> None:
    t = HealthTracker(CFG, clock)
    t.observe_snapshot(snap(clock, 100))
    clock.advance(0.2)
    t.observe_snapshot(snap(clock, 150))
    # SIGSTOP now: scrapes stop updating, each probe takes its full deadline.
    hung_at = clock()
    clock.advance(CFG.heartbeat_interval_s)  # worst case: the stop came right after a probe
    verdict = Verdict.HEALTHY
    while verdict is not Verdict.FAILED:
        clock.advance(probe_deadline(CFG))
        verdict = t.record(t.classify(TIMED_OUT))
    assert clock() - hung_at <= CFG.heartbeat_timeout_s + CFG.heartbeat_interval_s


def test_idle_engine_that_times_out_is_not_excused(clock: Clock) -> None:
    t = HealthTracker(CFG, clock)
    t.observe_snapshot(snap(clock, 100, running=0))
    assert t.classify(TIMED_OUT) is ProbeResult.TIMEOUT


def test_health_200_but_no_progress_while_running_is_stalled(clock: Clock) -> None:
    t = HealthTracker(CFG, clock)
    t.observe_snapshot(snap(clock, 100))
    for _ in range(12):  # scrapes keep coming, counters frozen
        clock.advance(1.0)
        t.observe_snapshot(snap(clock, 100))
    assert t.classify(OK) is ProbeResult.STALLED
    verdicts = [t.record(ProbeResult.STALLED) for _ in range(3)]
    assert verdicts[-1] is Verdict.FAILED


def test_counter_reset_is_not_read_as_progress_loss(clock: Clock) -> None:
    t = HealthTracker(CFG, clock)
    t.observe_snapshot(snap(clock, 5000))
    clock.advance(0.3)
    t.observe_snapshot(snap(clock, 10))  # engine restarted behind the same URL
    assert t.classify(OK) is ProbeResult.OK
    assert t.progressing()


@pytest.mark.parametrize(("probe", "expected"), [
    (ActorProbe(process_alive=True, http_status=503), ProbeResult.UNHEALTHY_HTTP),
    (ActorProbe(process_alive=True, http_status=None, error="connect"), ProbeResult.CONNECT_ERROR),
])
def test_http_failures_count_as_misses(clock: Clock, probe: ActorProbe, expected: ProbeResult) -> None:
    t = HealthTracker(CFG, clock)
    assert t.classify(probe) is expected
    assert t.record(expected) is Verdict.SUSPECT


async def test_monitor_check_once_updates_registry_and_reports(clock: Clock) -> None:
    reg = Registry(clock=clock)
    inst = reg.add(Instance(id="f:0", fleet="f", url="http://127.0.0.1:1", state=InstanceState.READY))
    answers: list[tuple[ActorProbe | None, bool, bool]] = [(OK, False, False), (None, True, False)]
    seen_deadlines: list[float] = []

    async def probe(_: Instance, deadline: float) -> tuple[ActorProbe | None, bool, bool]:
        seen_deadlines.append(deadline)
        return answers.pop(0)

    failed: list[tuple[str, ProbeResult]] = []

    async def on_failed(i: Instance, r: ProbeResult) -> None:
        failed.append((i.id, r))

    mon = HealthMonitor(reg, CFG, probe, on_failed, clock=clock, wall=lambda: 42.0)
    tracker = HealthTracker(CFG, clock)
    assert await mon.check_once(inst, tracker) is Verdict.HEALTHY
    assert inst.health == "ok"
    assert inst.last_heartbeat == 42.0
    assert await mon.check_once(inst, tracker) is Verdict.FAILED
    assert inst.health == "actor_dead"
    assert seen_deadlines == [1.0, 1.0]


async def test_a_probe_that_raises_counts_as_a_miss_and_fails_the_instance() -> None:
    # A crashing probe loop used to be restarted with a fresh tracker, so its misses never added up.
    reg = Registry()
    reg.add(Instance(id="f:0", fleet="f", url="http://127.0.0.1:1", state=InstanceState.READY))
    calls = 0

    async def probe(_: Instance, deadline: float) -> tuple[ActorProbe | None, bool, bool]:
        nonlocal calls
        calls += 1
        raise RuntimeError("ray said something unexpected")

    failed: list[tuple[str, ProbeResult]] = []
    failed_event = asyncio.Event()

    async def on_failed(i: Instance, r: ProbeResult) -> None:
        failed.append((i.id, r))
        reg.set_state(i, InstanceState.UNHEALTHY, "failed")
        failed_event.set()

    cfg = HealthConfig(heartbeat_interval_s=0.01, heartbeat_timeout_s=0.3, failure_threshold=3)
    mon = HealthMonitor(reg, cfg, probe, on_failed)
    task = asyncio.create_task(mon.run())
    try:
        async with asyncio.timeout(5):
            await failed_event.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert failed == [("f:0", ProbeResult.TIMEOUT)]
    assert calls == 3
