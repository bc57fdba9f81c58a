"""Static fleets get hang detection too: a SIGSTOPped engine process at a configured URL leaves rotation
within the heartbeat bounds, what runs on it ends there (a stream goes on from another instance, a
request with no byte sent yet is sent there), and it comes back when it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog

from routerd.assembly import build, running
from routerd.config import HealthConfig
from routerd.registry import Instance, InstanceState, Registry
from routerd.sim_tokens import expected_text
from routerd.tracing import Tracing
from tests.fixtures.dataplane import RunningPlane, plane_config
from tests.fixtures.sim import SimProcess, SimProcessFactory

HEALTH = HealthConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5, failure_threshold=3,
                      progress_timeout_s=2.0)
# heartbeat_timeout_s plus one jittered interval (the detection bound, routerd/health.py), plus slack
# for a loaded test machine
BOUND_S = HEALTH.heartbeat_timeout_s + 1.2 * HEALTH.heartbeat_interval_s + 1.5


@contextlib.asynccontextmanager
async def static_plane(urls: list[str], **routing: Any) -> AsyncIterator[RunningPlane]:
    cfg = msgspec.structs.replace(plane_config(urls, routing=routing), health=HEALTH)
    registry = Registry()
    async with running(cfg, registry) as dp:
        plane = RunningPlane(url=dp.url, dp=dp, registry=registry, listener=dp.serving.listener)
        await plane.wait_ready(len(urls))
        yield plane


MAX_TOKENS = 300  # 6 s at 20 ms a token: the stream runs through the fault and its detection


async def _stream(session: aiohttp.ClientSession, url: str, events: list[tuple[float, bytes]],
                  first: asyncio.Event) -> str:
    body = {"model": "m", "prompt": "hello", "max_tokens": MAX_TOKENS, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        instance = r.headers["X-Routerd-Instance"]
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append((time.monotonic(), line.strip()))
                first.set()
        return instance


def _resumed_whole(events: list[tuple[float, bytes]], fault_at: float) -> float:
    """The stream went on after the fault as the whole generation, no error event; returns the pause
    the client saw across the fault."""
    data = [e for _, e in events]
    assert data[-1] == b"data: [DONE]"
    assert not any(e.startswith(b'data: {"error"') for e in data)
    text = "".join(msgspec.json.decode(e[6:])["choices"][0]["text"] for e in data[:-1])
    assert text == expected_text(0, "hello", MAX_TOKENS)
    before = max(t for t, _ in events if t < fault_at)
    return min(t for t, _ in events if t > fault_at) - before


@pytest.fixture
async def two_sims(sim_process: SimProcessFactory) -> list[SimProcess]:
    return [await sim_process(model="m", itl_ms=20, max_num_seqs=8) for _ in range(2)]


async def test_sigstopped_static_engine_ends_its_stream_and_leaves_rotation(
        two_sims: list[SimProcess]) -> None:
    async with static_plane([s.url for s in two_sims]) as plane, aiohttp.ClientSession() as session:
        events: list[tuple[float, bytes]] = []
        first = asyncio.Event()
        reader = asyncio.create_task(_stream(session, plane.url, events, first))
        await asyncio.wait_for(first.wait(), 10)
        victim_id = next(i.id for i in plane.registry if i.inflight > 0)
        victim = two_sims[int(victim_id[-1])]
        victim_inst = plane.registry.get(victim_id)
        assert victim_inst is not None

        victim.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            # A non-streamed request sent to it now, before anything tells routerd, is not lost either:
            # it is ended with the instance and retried on the other one.
            plain = asyncio.create_task(session.post(plane.url + "/v1/completions",
                                                     json={"model": "m", "prompt": "x", "max_tokens": 3}))
            await plane.wait_for(lambda: victim_inst.state is InstanceState.UNHEALTHY, BOUND_S, "out")
            assert await asyncio.wait_for(reader, MAX_TOKENS * 0.02 + 10) == victim_id
            # what ran on it went on from the other instance within the bound, as the whole stream
            assert _resumed_whole(events, stopped) <= BOUND_S
            assert victim_inst.state is InstanceState.UNHEALTHY
            assert victim_inst.state_reason.startswith("heartbeat: ")
            assert victim_inst.inflight == 0
            failed_tracker = plane.dp.watch.static_health.monitor.tracker(victim_id)
            assert failed_tracker is not None
            resp = await asyncio.wait_for(plain, BOUND_S)
            assert resp.status == 200
            other = resp.headers["X-Routerd-Instance"]
            resp.release()
            assert other != victim_id
            # meanwhile every new request goes to the other instance
            for _ in range(3):
                async with session.post(plane.url + "/v1/completions",
                                        json={"model": "m", "prompt": "x", "max_tokens": 2}) as r:
                    assert r.status == 200
                    assert r.headers["X-Routerd-Instance"] == other
        finally:
            victim.signal(signal.SIGCONT)
        # it answers again: back into rotation, and heartbeaten again
        await plane.wait_for(lambda: victim_inst.state is InstanceState.READY, timeout=10, what="back")
        monitor = plane.dp.watch.static_health.monitor
        await plane.wait_for(lambda: failed_tracker is not monitor.tracker(victim_id)
                             and victim_inst.health == "ok", timeout=5, what="heartbeats again")
        # a burst the other instance cannot hold alone (8 slots each) is shared with it again
        async def one() -> str:
            async with session.post(plane.url + "/v1/completions",
                                    json={"model": "m", "prompt": "x", "max_tokens": 20}) as r:
                assert r.status == 200
                return r.headers["X-Routerd-Instance"]

        seen = set(await asyncio.gather(*(one() for _ in range(16))))
        assert victim_id in seen


async def test_a_stall_of_routerd_itself_takes_no_instance_out_of_rotation(
        two_sims: list[SimProcess]) -> None:
    """routerd's own loop held up longer than ``stale_after_s`` (a starved machine, a long pause) held
    its scrapes up too: their age then says nothing of the engines, which stay in rotation. An engine
    that does stop answering afterwards still leaves rotation on its stale scrapes."""
    async with static_plane([s.url for s in two_sims], stale_after_s=1.0) as plane:
        with structlog.testing.capture_logs() as logs:
            time.sleep(2.5)  # noqa: ASYNC251  # the stall itself: routerd's loop does not run
            await asyncio.sleep(2.5)  # the rotation, the scrapes and the heartbeats run again
        assert [e for e in logs if e["event"] == "instance_out_of_rotation"] == []
        assert [i.state for i in plane.registry] == [InstanceState.READY] * 2
        victim = plane.registry.get("f:static0")
        assert victim is not None
        two_sims[0].signal(signal.SIGSTOP)
        try:
            await plane.wait_for(lambda: victim.state is InstanceState.UNHEALTHY, 5, "out on stale scrapes")
            assert victim.state_reason.startswith("no successful /metrics scrape")
        finally:
            two_sims[0].signal(signal.SIGCONT)


async def test_static_engine_that_answers_but_makes_no_progress_is_failed(
        sim_process: SimProcessFactory) -> None:
    """/health answers 200 and /metrics stays fresh, but a running request's tokens stop: a stall."""
    sims = [await sim_process(model="m", itl_ms=20, max_num_seqs=8) for _ in range(2)]
    async with static_plane([s.url for s in sims]) as plane, aiohttp.ClientSession() as session:
        events: list[tuple[float, bytes]] = []
        first = asyncio.Event()
        reader = asyncio.create_task(_stream(session, plane.url, events, first))
        await asyncio.wait_for(first.wait(), 10)
        victim_id = next(i.id for i in plane.registry if i.inflight > 0)
        victim = sims[int(victim_id[-1])]
        # generation all but stops (a token per ~30 min); /health and /metrics still answer at once
        await victim.set_faults(slow_factor=100_000.0)
        stalled = time.monotonic()
        await asyncio.wait_for(reader, HEALTH.progress_timeout_s + BOUND_S + MAX_TOKENS * 0.02 + 10)
        # the stall was caught (it answers /health, so it is back in rotation at once: the heartbeats
        # declaring it lost are what ended the engine call) and the stream went on from the other
        # instance, as the whole stream
        metrics = plane.dp.core.metrics.render().decode()
        assert 'routerd_resumes_total{fleet="f",reason="instance_lost"} 1.0' in metrics
        assert _resumed_whole(events, stalled) <= HEALTH.progress_timeout_s + BOUND_S


async def test_static_is_the_instance_field_not_its_id() -> None:
    """A reload syncs the instances marked static and no other: one whose id merely looks static (a
    fleet manager's, say) stays, and it is never heartbeaten as a static instance."""
    cfg = plane_config(["http://127.0.0.1:9/"])
    registry = Registry()
    lookalike = registry.add(Instance(id="f:static7", fleet="f", url="http://127.0.0.1:8"))
    async with aiohttp.ClientSession() as session:
        plane = build(cfg, registry, session, tracing=Tracing.off())
        await plane.apply(cfg)
    static = registry.get("f:static0")
    assert static is not None
    assert static.static
    assert static.url == "http://127.0.0.1:9"
    assert registry.get("f:static7") is lookalike
    assert [i.id for i in plane.watch.static_health.instances()] == ["f:static0"]
