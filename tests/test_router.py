"""Router + circuit breaker over a real Registry, with an injected clock (no sleeping)."""

from __future__ import annotations

import asyncio
import collections
import random

import aiohttp
import pytest
from aiohttp import web

from routerd.config import RoutingConfig
from routerd.errors import NoReadyInstance
from routerd.registry import Instance, InstanceState, LoadSnapshot, Registry
from routerd.routing import CircuitBreaker, Router, Scraper
from routerd.status import render
from routerd.telemetry import Metrics, Telemetry, registry_collector


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, n: int, policy: str = "least_load", **routing: float) -> tuple[Registry, Router]:
    reg = Registry(clock=clock)
    for i in range(n):
        inst = reg.add(Instance(id=f"f:{i}", fleet="f", url=f"http://127.0.0.1:{9000 + i}", capacity_hint=4))
        inst.state = InstanceState.READY
        inst.snapshot = LoadSnapshot(scraped_at=clock.t)
    cfg = RoutingConfig(policy=policy, **routing)  # type: ignore[arg-type]
    return reg, Router.from_config(reg, cfg, rng=random.Random(0), clock=clock)


def test_burst_between_scrapes_spreads(clock: Clock) -> None:
    """The scrape said all idle; routerd's own in-flight deltas must spread 8 picks 2/2/2/2."""
    _reg, router = make(clock, 4)
    picks = []
    for _ in range(8):
        inst = router.pick("f")
        inst.inflight += 1  # what upstream does before it awaits anything
        picks.append(inst.id)
    assert collections.Counter(picks) == {"f:0": 2, "f:1": 2, "f:2": 2, "f:3": 2}


def test_scraped_load_counts_with_inflight_delta(clock: Clock) -> None:
    reg, router = make(clock, 2)
    a, b = reg.instances("f")
    a.snapshot = LoadSnapshot(scraped_at=clock.t, running=3)  # engine busy with others' work
    assert router.pick("f") is b
    b.inflight = 4  # routerd sent 4 to b since the scrape
    assert router.pick("f") is a


def test_never_a_non_ready_instance(clock: Clock) -> None:
    reg, router = make(clock, 3)
    states = [InstanceState.STARTING, InstanceState.DRAINING, InstanceState.UNHEALTHY]
    for inst, st in zip(reg.instances("f"), states, strict=True):
        inst.state = st
    with pytest.raises(NoReadyInstance):
        router.pick("f")
    reg.instances("f")[1].state = InstanceState.READY
    assert {router.pick("f").id for _ in range(20)} == {"f:1"}


def test_unknown_fleet_has_no_instance(clock: Clock) -> None:
    _, router = make(clock, 1)
    with pytest.raises(NoReadyInstance):
        router.pick("other")


def test_stale_and_failed_scrapes_excluded_while_fresh_exist(clock: Clock) -> None:
    reg, router = make(clock, 3, stale_after_s=2.0)
    a, b, c = reg.instances("f")
    a.snapshot = LoadSnapshot(scraped_at=clock.t - 5)  # stale (and looks idle)
    b.scrape_error = "timed out"  # last scrape failed
    c.inflight = 50  # fresh but busy: still preferred over guesses
    assert {router.pick("f").id for _ in range(10)} == {"f:2"}
    c.scrape_error = "timed out"  # nothing fresh left: fall back to all of them
    assert {router.pick("f").id for _ in range(30)} <= {"f:0", "f:1", "f:2"}
    assert router.pick("f") is not c


def test_tried_instances_excluded_while_others_exist(clock: Clock) -> None:
    _reg, router = make(clock, 2)
    assert router.pick("f", exclude={"f:0"}).id == "f:1"
    assert router.pick("f", exclude={"f:0", "f:1"}).id in {"f:0", "f:1"}


def test_circuit_opens_after_threshold_and_half_opens_after_cooldown(clock: Clock) -> None:
    reg, router = make(clock, 2, circuit_failure_threshold=3, circuit_cooldown_s=5.0)
    br: CircuitBreaker = router.breaker
    bad, good = reg.instances("f")
    assert not br.failure(bad)
    assert not br.failure(bad)
    assert br.failure(bad)  # third in a row opens it
    assert bad.circuit(clock.t) == "open"
    good.inflight = 100  # even far busier, the open one is not chosen
    assert {router.pick("f").id for _ in range(10)} == {"f:1"}
    clock.t += 5.1
    assert bad.circuit(clock.t) == "half_open"
    good.inflight = 100
    assert router.pick("f") is bad  # the one trial
    assert br.begin(bad)
    assert router.pick("f") is good  # no second trial while the first is out
    br.end(bad)
    br.failure(bad)  # trial failed: open again for a whole cool-down
    assert bad.circuit(clock.t) == "open"
    clock.t += 5.1
    br.begin(bad)
    br.success(bad)
    br.end(bad)
    assert bad.circuit(clock.t) == "closed"
    assert bad.consecutive_failures == 0


def test_one_opening_per_transition_from_closed(clock: Clock) -> None:
    """``failure()`` says True (and routerd_circuit_opened_total rises) once per closed → open: not for
    the failures of requests that were in flight when it opened, nor for a failed half-open trial."""
    reg, router = make(clock, 1, circuit_failure_threshold=2, circuit_cooldown_s=5.0)
    br: CircuitBreaker = router.breaker
    inst = reg.instances("f")[0]
    assert [br.failure(inst) for _ in range(6)] == [False, True, False, False, False, False]
    assert inst.circuit_open_until == clock.t + 5.0  # stragglers do not stretch the cool-down
    for _ in range(3):  # the engine stays down: each trial fails and re-opens it, quietly
        clock.t += 5.1
        assert br.begin(inst)
        assert not br.failure(inst)
        br.end(inst)
        assert inst.circuit(clock.t) == "open"
    clock.t += 5.1
    br.success(inst)
    assert [br.failure(inst) for _ in range(2)] == [False, True]  # closed again: a new opening counts


def test_every_view_shows_the_breakers_three_states(clock: Clock) -> None:
    """Status (the admin replies and ``/admin/fleets``), ``/metrics`` and ``routerd status`` read the one
    circuit state: a cooled-down circuit is ``half_open`` everywhere — not ``closed`` in some replies."""
    reg, router = make(clock, 1, circuit_failure_threshold=1, circuit_cooldown_s=5.0)
    inst = reg.instances("f")[0]
    metrics = Metrics(Telemetry(), [registry_collector(reg, clock=clock)])

    def views() -> tuple[str, str, float, str]:
        st = inst.status(clock.t)
        metric = next(line for line in metrics.render().decode().splitlines()
                      if line.startswith("routerd_circuit_state{"))
        row = next(line for line in render({"fleets": {"f": {"instances": [st]}}}).splitlines()
                   if line.startswith("f:0"))
        return st["circuit"], row.split()[2], float(metric.rsplit(" ", 1)[1]), str(inst.circuit(clock.t))

    assert views() == ("closed", "closed", 0.0, "closed")
    router.breaker.failure(inst)
    assert views() == ("open", "open", 2.0, "open")
    assert inst.status(clock.t)["consecutive_failures"] == 1
    clock.t += 5.1
    assert views() == ("half_open", "half_open", 1.0, "half_open")
    assert reg.routable("f") == [inst]  # half-open: the trial may go there


def test_success_resets_the_failure_run(clock: Clock) -> None:
    reg, router = make(clock, 1, circuit_failure_threshold=3)
    inst = reg.instances("f")[0]
    br = router.breaker
    br.failure(inst)
    br.failure(inst)
    br.success(inst)
    assert not br.failure(inst)
    assert inst.circuit(clock.t) == "closed"


def test_policy_swap_on_config_update(clock: Clock) -> None:
    _, router = make(clock, 3)
    router.update_config(RoutingConfig(policy="round_robin"))
    assert router.policy.name == "round_robin"
    assert [router.pick("f").id for _ in range(3)] == ["f:0", "f:1", "f:2"]


async def test_scrape_reads_a_page_sent_in_several_chunks() -> None:
    """A /metrics page that arrives in pieces (a real vLLM page is ~100 KiB) is read to its end:
    the queue figures sit near the bottom and must not be read as 0 from a truncated page."""
    filler = "".join(f'vllm:time_to_first_token_seconds_bucket{{le="{i}"}} 0\n' for i in range(2000))

    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(filler.encode())
        await asyncio.sleep(0.05)
        await resp.write(b"vllm:num_requests_running 5\nvllm:num_requests_waiting 7\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as session:
            inst = Instance(id="f:0", fleet="f", url=f"http://{host}:{port}")
            assert await Scraper(Registry(), session, RoutingConfig()).scrape(inst)
    finally:
        await runner.cleanup()
    assert inst.snapshot is not None
    assert (inst.snapshot.running, inst.snapshot.waiting) == (5, 7)
