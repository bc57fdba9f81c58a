"""Routing and failover end to end: routerd's HTTP in front of simulated vLLM engines (real HTTP)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from routerd.registry import Instance, InstanceState
from tests.fixtures.dataplane import PlaneFactory, RunningPlane, SimFactory

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def settle(plane: RunningPlane, *engines: Any) -> None:
    """Counters return to zero: routerd's in-flight and admission, and the engines' own batches."""
    await plane.wait_for(lambda: plane.inflight() == 0, timeout=5, what="routerd in-flight 0")
    assert plane.dp.admission.stats("f")["active"] == 0
    for eng in engines:
        await plane.wait_for(lambda e=eng: e.stats.running + e.stats.waiting == 0, timeout=5,
                             what="engine idle")


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    async with client.post(url, json=body) as r:
        return r.status, r.headers.get("X-Routerd-Instance", ""), await r.text()


async def test_burst_spreads_over_idle_instances(sims: SimFactory, dataplane: PlaneFactory,
                                                 client: aiohttp.ClientSession) -> None:
    engines = [await sims(itl_ms=10) for _ in range(4)]
    plane = await dataplane([e.url for e in engines], routing={"scrape_interval_s": 0.5})
    body = {"model": "m", "prompt": "hello there", "max_tokens": 10}
    results = await asyncio.gather(*(post(client, plane.url + COMP, body) for _ in range(16)))
    assert all(status == 200 for status, _, _ in results)
    per_instance = collections.Counter(inst for _, inst, _ in results)
    assert sorted(per_instance.values()) == [4, 4, 4, 4], per_instance  # no herding between scrapes
    assert sum(e.stats.preemptions for e in engines) == 0
    await settle(plane, *engines)


async def test_hung_instance_stops_receiving_traffic(sims: SimFactory, dataplane: PlaneFactory,
                                                     client: aiohttp.ClientSession) -> None:
    engines = [await sims() for _ in range(3)]
    plane = await dataplane([e.url for e in engines],
                            routing={"first_byte_timeout_s": 0.5, "stale_after_s": 0.5,
                                     "scrape_timeout_s": 0.2})
    engines[0].faults.set(hang=True)
    body = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": True}
    for _ in range(6):  # while routerd may still believe in it: retried after the first-byte timeout
        status, inst, text = await post(client, plane.url + COMP, body)
        assert status == 200
        assert text.endswith("data: [DONE]\n\n")
        assert inst != "f:static0"
    hung = plane.registry.get("f:static0")
    assert hung is not None
    await plane.wait_for(lambda: hung.state is InstanceState.UNHEALTHY, timeout=5, what="out of rotation")
    results = await asyncio.gather(*(post(client, plane.url + COMP, body) for _ in range(12)))
    assert {inst for _, inst, _ in results} == {"f:static1", "f:static2"}
    assert hung.inflight == 0
    engines[0].faults.set(hang=False)
    await plane.wait_ready(3, timeout=5)  # it answers again: back in rotation
    await settle(plane, *engines)


async def test_killed_instance_requests_retried_before_first_byte(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    victim = await sims(itl_ms=50, max_num_seqs=16)
    other = await sims(itl_ms=5, max_num_seqs=16)
    plane = await dataplane([victim.url, other.url], routing={"circuit_failure_threshold": 1})
    body = {"model": "m", "prompt": "x", "max_tokens": 10}  # non-streaming: no byte until it is done
    tasks = [asyncio.create_task(post(client, plane.url + COMP, body)) for _ in range(8)]
    await plane.wait_for(lambda: victim.stats.running >= 2, timeout=5, what="work on the victim")
    victim.faults.crash()  # connections reset, port closed
    results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _, _ in results), results
    assert {inst for _, inst, _ in results} == {"f:static1"}  # every answer came from the survivor
    metrics = await (await client.get(plane.url + "/metrics")).text()
    assert 'routerd_retries_total{fleet="f"}' in metrics
    await settle(plane, other)


async def test_mid_stream_failure_reaches_the_client(sims: SimFactory, dataplane: PlaneFactory,
                                                     client: aiohttp.ClientSession) -> None:
    eng = await sims()
    plane = await dataplane([eng.url])
    eng.faults.set(fail_after_chunks=3)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    status, _, text = await post(client, plane.url + CHAT, body)
    events = [e for e in text.split("\n\n") if e]
    assert status == 200
    assert len(events) == 5
    assert events[-2].startswith('data: {"error"')
    assert events[-1] == "data: [DONE]"
    await settle(plane, eng)


async def test_client_disconnect_aborts_engine_request(sims: SimFactory, dataplane: PlaneFactory,
                                                       client: aiohttp.ClientSession) -> None:
    eng = await sims(itl_ms=20)
    plane = await dataplane([eng.url])
    body = {"model": "m", "prompt": "x", "max_tokens": 500, "stream": True}
    async with client.post(plane.url + COMP, json=body) as r:
        await r.content.readline()  # the stream started
    await plane.wait_for(lambda: eng.stats.aborted == 1, timeout=3, what="engine aborted the stream")
    task = asyncio.create_task(post(client, plane.url + COMP, {**body, "stream": False}))
    await plane.wait_for(lambda: eng.stats.running == 1, timeout=3, what="non-stream running")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await plane.wait_for(lambda: eng.stats.aborted == 2, timeout=3, what="engine aborted the request")
    assert eng.stats.completed == 0
    await settle(plane, eng)


async def test_engine_500s_are_retried_and_counters_settle(sims: SimFactory, dataplane: PlaneFactory,
                                                           client: aiohttp.ClientSession) -> None:
    flaky = await sims(seed=3)
    good = await sims()
    plane = await dataplane([flaky.url, good.url], routing={"circuit_failure_threshold": 1000})
    flaky.faults.set(error_rate=1.0)
    body = {"model": "m", "prompt": "x", "max_tokens": 3}
    results = await asyncio.gather(*(post(client, plane.url + COMP, body) for _ in range(10)))
    assert [s for s, _, _ in results] == [200] * 10
    await settle(plane, flaky, good)


async def test_instances_added_by_anyone_are_scraped_and_routed_once_ready(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    static = await sims()
    launched = await sims()
    plane = await dataplane([static.url])
    # What the fleet manager does for a launched engine: add it, then mark it ready when healthy.
    inst = plane.registry.add(Instance(id="f:0", fleet="f", url=launched.url, capacity_hint=4))
    await plane.wait_for(lambda: inst.snapshot is not None, timeout=3, what="first scrape")
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    results = await asyncio.gather(*(post(client, plane.url + COMP, body) for _ in range(6)))
    assert {i for _, i, _ in results} == {"f:static0"}  # scraped but starting: never chosen
    plane.registry.set_state(inst, InstanceState.READY)
    results = await asyncio.gather(*(post(client, plane.url + COMP, body) for _ in range(8)))
    assert {i for _, i, _ in results} == {"f:static0", "f:0"}
    await launched.stop()
    await plane.wait_for(lambda: bool(inst.scrape_error), timeout=3, what="failed scrape recorded")
    assert inst.scrape_errors_total >= 1
    status = {i["id"]: i for i in plane.dp.status()["fleets"]["f"]["instances"]}
    assert status["f:0"]["scrape_error"]
    results = await asyncio.gather(*(post(client, plane.url + COMP, body) for _ in range(6)))
    assert {i for _, i, _ in results} == {"f:static0"}  # a failed scrape leaves rotation while others exist
    await settle(plane, static)
