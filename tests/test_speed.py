"""Learned capacity and speed (routerd.speed), fed synthetic snapshots on a clock the test owns.

Each snapshot is what an engine's ``/metrics`` would show: cumulative counters and finished-request
histogram sums that only grow, except across a restart.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest

from routerd import speed
from routerd.registry import Instance, LoadSnapshot
from routerd.speed import DecayedRatio, Learned, spec_capacity

TAU = speed.TIME_CONSTANT_S


@dataclass
class Engine:
    """An engine's cumulative series; :meth:`tick` advances time, finishing requests of a given shape."""

    t: float = 0.0
    snap: LoadSnapshot = field(
        default_factory=lambda: LoadSnapshot(scraped_at=0.0, prefill_computed_tokens=0.0))

    def tick(self, dt: float = 0.5, *, finished: int = 0, prompt: float = 200.0, cached: float = 0.0,
             prefill_s: float = 0.1, generated: float = 51.0, decode_s: float = 1.0, running: float = 0.0,
             waiting: float = 0.0, kv: float = 0.0) -> LoadSnapshot:
        s, n = self.snap, finished
        self.t += dt
        self.snap = msgspec.structs.replace(
            s, scraped_at=self.t, running=running, waiting=waiting, kv_usage=kv,
            generation_tokens=s.generation_tokens + n * generated,
            prompt_tokens=s.prompt_tokens + n * prompt,
            requests_finished=s.requests_finished + n,
            prefix_cache_queries=s.prefix_cache_queries + n * prompt,
            prefix_cache_hits=s.prefix_cache_hits + n * cached,
            running_seconds_sum=s.running_seconds_sum + n * (prefill_s + decode_s),
            running_seconds_count=s.running_seconds_count + n,
            prefill_seconds_sum=s.prefill_seconds_sum + n * prefill_s,
            prefill_seconds_count=s.prefill_seconds_count + n,
            decode_seconds_sum=s.decode_seconds_sum + n * decode_s,
            decode_seconds_count=s.decode_seconds_count + n,
            finished_generation_tokens=s.finished_generation_tokens + n * generated,
            prefill_computed_tokens=(s.prefill_computed_tokens or 0.0) + n * (prompt - cached))
        return self.snap

    def restart(self) -> LoadSnapshot:
        """A new engine process behind the same URL: every series starts from zero again."""
        self.t += 0.5
        self.snap = LoadSnapshot(scraped_at=self.t, prefill_computed_tokens=0.0)
        return self.snap


def figures(learned: Learned) -> tuple[float | None, ...]:
    return (learned.prefill_tokens_per_s, learned.decode_tokens_per_s, learned.running_s,
            learned.prefill_s, learned.prefix_hit_ratio)


def feed(learned: Learned, snaps: Iterator[LoadSnapshot] | list[LoadSnapshot]) -> None:
    for snap in snaps:
        learned.observe(snap)


def busy(eng: Engine, n: int, **shape: float) -> Iterator[LoadSnapshot]:
    for _ in range(n):
        yield eng.tick(finished=4, running=4, **shape)  # type: ignore[arg-type]  # floats by name


def test_speeds_come_from_the_histogram_deltas() -> None:
    learned, eng = Learned(), Engine()
    assert figures(learned) == (None, None, None, None, None)  # nothing shown yet: routing uses priors
    learned.observe(eng.tick())
    feed(learned, busy(eng, 20, prompt=200, cached=50, prefill_s=0.1, generated=51, decode_s=1.0))
    assert learned.prefill_tokens_per_s == pytest.approx(150 / 0.1)  # computed tokens only
    assert learned.decode_tokens_per_s == pytest.approx(50 / 1.0)  # tokens after the first
    assert learned.running_s == pytest.approx(1.1)
    assert learned.prefill_s == pytest.approx(0.1)
    assert learned.prefix_hit_ratio == pytest.approx(0.25)


def test_prefill_speed_without_the_computed_tokens_histogram() -> None:
    """Engines before vLLM 0.11 have no request_prefill_kv_computed_tokens: prompt tokens minus the
    prefix-cache hits count instead."""
    learned, eng = Learned(), Engine()
    for _ in range(5):
        learned.observe(msgspec.structs.replace(eng.tick(finished=2, prompt=300, cached=100, prefill_s=0.2),
                                                prefill_computed_tokens=None))
    assert learned.prefill_tokens_per_s == pytest.approx(200 / 0.2)


def test_idle_time_neither_decays_nor_forgets() -> None:
    """The same traffic with and without a long idle gap in the middle learns the same figures."""
    plain, gapped = Learned(), Learned()
    eng_a, eng_b = Engine(), Engine()
    feed(plain, busy(eng_a, 10, decode_s=1.0))
    feed(gapped, busy(eng_b, 10, decode_s=1.0))
    before = figures(gapped)
    feed(gapped, (eng_b.tick(running=0.0) for _ in range(2000)))  # 1000 s idle, scraped all along
    assert figures(gapped) == before
    feed(plain, busy(eng_a, 10, decode_s=0.5))
    feed(gapped, busy(eng_b, 10, decode_s=0.5))
    assert figures(gapped) == pytest.approx(figures(plain))
    assert 50.0 < (gapped.decode_tokens_per_s or 0) < 100.0  # between the old and the new speed


def test_a_change_of_speed_is_followed_within_a_few_time_constants() -> None:
    learned, eng = Learned(), Engine()
    feed(learned, busy(eng, int(10 * TAU / 0.5), decode_s=1.0))  # 50 tok/s for a long time
    feed(learned, busy(eng, int(TAU / 0.5), decode_s=0.5))  # then 100 tok/s for one τ of busy time
    after_one_tau = learned.decode_tokens_per_s or 0.0
    # old evidence weighs e^-1 of what it did: the estimate has moved most of the way, not all of it
    old_w = math.exp(-1.0)
    expected = (50 * 1.0 * old_w + 50 * (1 - old_w)) / (1.0 * old_w + 0.5 * (1 - old_w))
    assert after_one_tau == pytest.approx(expected, rel=0.02)
    feed(learned, busy(eng, int(4 * TAU / 0.5), decode_s=0.5))
    assert learned.decode_tokens_per_s == pytest.approx(100.0, rel=0.02)


def test_a_counter_reset_rebaselines_instead_of_learning_garbage() -> None:
    learned, eng = Learned(), Engine()
    feed(learned, busy(eng, 10, decode_s=1.0, prefill_s=0.1))
    before = figures(learned)
    learned.observe(eng.restart())  # every counter drops: a naive delta would be hugely negative
    assert figures(learned) == before
    assert learned.resets == 1
    learned.observe(eng.tick(finished=4, running=4, decode_s=1.0, prefill_s=0.1))
    assert figures(learned) == pytest.approx(before)  # the first deltas after it are exact again


def test_capacity_is_a_running_plateau_while_requests_wait() -> None:
    learned, eng = Learned(), Engine()
    feed(learned, (eng.tick(running=3) for _ in range(5)))
    assert learned.capacity is None  # nothing waits: running 3 says nothing of the limit
    feed(learned, [eng.tick(running=4, waiting=2), eng.tick(running=4, waiting=3)])
    assert learned.capacity is None  # two scrapes can be a request caught between steps
    learned.observe(eng.tick(running=4, waiting=1))
    assert learned.capacity == 4
    learned.observe(eng.tick(running=6))  # it ran more than we thought it could
    assert learned.capacity == 6
    feed(learned, (eng.tick(running=2, waiting=5) for _ in range(5)))  # a lower plateau: other limits
    assert learned.capacity == 6


def test_a_moving_running_count_is_no_plateau() -> None:
    learned, eng = Learned(), Engine()
    feed(learned, (eng.tick(running=5 + i % 2, waiting=2) for i in range(10)))
    assert learned.capacity is None
    feed(learned, (eng.tick(running=6, waiting=2) for _ in range(3)))
    assert learned.capacity == 6


def test_a_kv_bound_plateau_is_not_capacity() -> None:
    learned, eng = Learned(), Engine()
    feed(learned, (eng.tick(running=3, waiting=4, kv=0.97) for _ in range(10)))
    assert learned.capacity is None


def test_waits_between_scrapes_without_a_plateau_teach_nothing() -> None:
    learned, eng = Learned(), Engine()
    for _ in range(5):
        feed(learned, [eng.tick(running=3, waiting=1), eng.tick(running=3), eng.tick(running=3, waiting=1)])
    assert learned.capacity is None


def test_after_a_restart_the_next_plateau_replaces_the_learned_capacity() -> None:
    """The engine behind a static URL may come back with another --max-num-seqs."""
    learned, eng = Learned(), Engine()
    feed(learned, (eng.tick(finished=2, running=8, waiting=2) for _ in range(3)))
    assert learned.capacity == 8
    learned.observe(eng.restart())
    assert learned.resets == 1
    assert learned.capacity == 8  # still the best guess until the engine shows otherwise
    feed(learned, (eng.tick(finished=2, running=4, waiting=2) for _ in range(3)))
    assert learned.capacity == 4


def source(inst: Instance) -> tuple[int, str]:
    assert inst.capacity == inst.capacity_source()[0]  # the fast path routing reads agrees
    return inst.capacity_source()


def test_capacity_sources_in_order_of_authority() -> None:
    inst = Instance(id="f:0", fleet="f", url="http://x", capacity_hint=16)
    assert source(inst) == (16, "config")
    eng = Engine()
    inst.learned.observe(eng.tick(running=20))
    assert source(inst) == (20, "learned")  # runs more than the config says it can
    feed(inst.learned, (eng.tick(running=6, waiting=2) for _ in range(3)))
    assert source(inst) == (20, "learned")  # running 20 was seen: a plateau of 6 is lower
    fresh = Instance(id="f:1", fleet="f", url="http://y", capacity_hint=256)
    feed(fresh.learned, (eng.tick(running=6, waiting=2) for _ in range(3)))
    assert source(fresh) == (6, "learned")  # the engine beats the config's prior
    fresh.snapshot = msgspec.structs.replace(eng.snap, capacity=10)
    assert source(fresh) == (10, "engine")
    fresh.launch_capacity = 12
    assert source(fresh) == (12, "launch")


def loaded(capacity: int, running_s: float, prefill_s: float = 0.1) -> Instance:
    """An instance that has learned ``capacity`` and its request times."""
    inst = Instance(id="f:0", fleet="f", url="http://x", capacity_hint=256)
    eng = Engine()
    feed(inst.learned, (eng.tick(finished=2, running=capacity, waiting=1, prefill_s=prefill_s,
                                 decode_s=running_s - prefill_s) for _ in range(4)))
    assert inst.capacity_source() == (capacity, "learned")
    return inst


def scraped(inst: Instance, running: float, waiting: float = 0.0, kv: float = 0.0) -> Instance:
    inst.snapshot = LoadSnapshot(scraped_at=1.0, running=running, waiting=waiting, kv_usage=kv)
    inst.inflight_at_scrape = inst.inflight
    return inst


def test_expected_wait_is_work_ahead_over_what_the_instance_gets_through() -> None:
    inst = loaded(capacity=4, running_s=2.0, prefill_s=0.1)
    assert scraped(inst, running=2).expected_wait_s() == 0.0  # a slot is free, nothing queued ahead
    inst.inflight += 1  # routerd sent one since the scrape: its prefill comes first
    assert inst.expected_wait_s() == pytest.approx(0.1)
    inst.inflight -= 1
    # 4 running, 3 waiting: the new request is 4th in line; a slot frees every 2.0 / 4 s
    assert scraped(inst, running=4, waiting=3).expected_wait_s() == pytest.approx(4 * 2.0 / 4)
    # waiting with the KV cache full: saturated at the 2 it runs, whatever its slot count
    assert scraped(inst, running=2, waiting=1, kv=0.97).expected_wait_s() == pytest.approx(2 * 2.0 / 2)


def test_a_small_slow_instance_waits_longer_than_a_busy_fast_one() -> None:
    """What "queue ÷ capacity" got wrong: 2 of 2 on a slow instance is worse than 7 of 8 on a fast one."""
    slow = scraped(loaded(capacity=2, running_s=5.0), running=2)
    fast = scraped(loaded(capacity=8, running_s=1.25), running=7)
    assert slow.expected_wait_s() == pytest.approx(1 * 5.0 / 2)
    assert fast.expected_wait_s() == 0.0
    scraped(fast, running=8, waiting=2)  # even full with two waiting, it starts the request sooner
    assert fast.expected_wait_s() == pytest.approx(3 * 1.25 / 8)
    assert fast.expected_wait_s() < slow.expected_wait_s()


def test_priors_before_anything_is_learned() -> None:
    inst = Instance(id="f:0", fleet="f", url="http://x", capacity_hint=4)
    assert inst.learned.prefill_tokens_per_s is None  # the router prices a prefill at the prior then
    inst.inflight = 5  # no scrape yet: routerd's own count is the queue
    assert inst.expected_wait_s() == pytest.approx(2 * speed.PRIOR_RUNNING_S / 4)
    assert inst.status(0.0)["decode_tokens_per_s"] is None  # shown as not known, not as the prior


def test_decayed_ratio_weights_by_evidence_and_decays_only_with_it() -> None:
    r = DecayedRatio(time_constant_s=10.0)
    assert r.value is None
    r.add(1.0, 10.0, dt=1.0)
    r.add(99.0, 100.0, dt=1.0)  # ten times the evidence: it dominates
    assert r.value == pytest.approx((1.0 * math.exp(-0.1) + 99.0) / (10.0 * math.exp(-0.1) + 100.0))
    before = r.value
    r.add(5.0, 0.0, dt=1000.0)  # no evidence: no change (not even the decay)
    assert r.value == before


@pytest.mark.parametrize(("args", "expected"), [
    ({"max-num-seqs": 64}, 64), ({"max_num_seqs": "32"}, 32), ({"enforce-eager": True}, None),
    ({"max-num-seqs": 0}, None), ({"max-num-seqs": "lots"}, None), ({"max-num-seqs": True}, None),
])
def test_launch_spec_capacity(args: dict[str, object], expected: int | None) -> None:
    assert spec_capacity(args) == expected
