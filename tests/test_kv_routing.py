"""Routing by the engines' own cache: with KV events, ``cache_aware`` scores each instance by the blocks
its engine says it holds — predicted hit tokens equal the engine's own, request by request, under
eviction — says so in the request's log line, ``/admin/fleets`` and ``/metrics``, and falls back to
the request-side model for an engine whose events went stale."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import structlog

from routerd.routing.engine_cache.subscriptions import EngineEvents
from tests.fixtures.dataplane import PlaneFactory, RunningPlane, SimFactory, kv_events_args
from tests.fixtures.vllm import parse_metrics

KV = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                 "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"})
TIMEOUT = aiohttp.ClientTimeout(total=30)


def hits(engine: Any) -> float:
    return parse_metrics(engine.metrics.exposition().decode())["vllm:prefix_cache_hits_total"].value()


def queries(engine: Any) -> float:
    return parse_metrics(engine.metrics.exposition().decode())["vllm:prefix_cache_queries_total"].value()


@pytest.fixture
async def subscribed(sims: SimFactory, dataplane: PlaneFactory
                     ) -> tuple[RunningPlane, list[Any], EngineEvents]:
    # 32 blocks of 16 tokens each: six conversations of four turns do not fit in two engines (evictions).
    # A step that admits requests takes 50 ms: a burst is routed before any engine announces its blocks.
    engines = [await sims(kv_events_config=KV, num_gpu_blocks=32, max_model_len=512, max_num_seqs=8,
                          ttft_ms=50)
               for _ in range(2)]
    # The in-process sims seed their block hashes from this process's PYTHONHASHSEED (as vLLM does).
    plane = await dataplane([e.url for e in engines], engine_args=kv_events_args())
    assert plane.dp.kv is not None, "the fleet publishes KV events: routing by them is assembled"
    await plane.wait_for(lambda: all(i.cache_view.get("cache_view") == "events" for i in plane.registry),
                         timeout=30, what="both engines subscribed")
    return plane, engines, plane.dp.kv.events


def _words(conv: int, turn: int) -> str:
    return " ".join(f"c{conv}w{turn}x{i}" for i in range(60))


async def test_predicted_hits_are_the_engines_own_request_by_request(
        subscribed: tuple[RunningPlane, list[Any], EngineEvents]) -> None:
    """Each request's predicted hit tokens are the engine's own; so is each instance's predicted hit
    ratio (``vllm:prefix_cache_hits`` over ``queries``: the prompt's tokens as the engine counts them,
    not an estimate from bytes); and each log line counts in the engine's tokens and blocks."""
    plane, engines, events = subscribed
    # The predicted ratio is windowed in routing's time (~30 s, as the engine's reported one): frozen
    # here, so that it is the plain sum over this test's requests, as the engine's counters are.
    frozen = plane.dp.serving.router.clock()
    plane.dp.serving.router.clock = lambda: frozen
    by_id = {i.id: next(e for e in engines if e.url == i.url) for i in plane.registry}
    start = {iid: (hits(e), queries(e)) for iid, e in by_id.items()}
    conversations: list[list[dict[str, str]]] = [[{"role": "system", "content": f"conversation {c}"}]
                                                 for c in range(6)]
    predicted_total = 0
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for turn in range(4):
                for conv in conversations:
                    conv.append({"role": "user", "content": _words(conversations.index(conv), turn)})
                    before = {iid: (hits(e), queries(e)) for iid, e in by_id.items()}
                    body = {"model": "m", "messages": conv, "max_tokens": 4}
                    async with http.post(plane.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        instance = r.headers["X-Routerd-Instance"]
                        reply = (await r.json())["choices"][0]["message"]["content"]
                    conv.append({"role": "assistant", "content": reply})
                    line = [e for e in logs if e["event"] == "request"][-1]
                    assert line["cache_view"] == "events"
                    actual = hits(by_id[instance]) - before[instance][0]
                    assert line["cached_tokens_est"] == actual, (turn, line)  # to the token
                    # one unit: the engine's tokens, and its blocks of 16 of them
                    assert line["prompt_tokens"] == queries(by_id[instance]) - before[instance][1], line
                    assert "prompt_tokens_est" not in line
                    assert line["block_tokens"] == 16
                    assert line["prompt_blocks"] == (line["prompt_tokens"] - 1) // 16  # what a hit can cover
                    assert line["matched_blocks"] * 16 == line["cached_tokens_est"]
                    assert "runner_up_matched_blocks" in line  # the other engine's, in its blocks too
                    predicted_total += actual
            async with http.get(plane.url + "/admin/fleets") as r:
                status = await r.json()
            async with http.get(plane.url + "/metrics") as r:
                metrics = parse_metrics(await r.text())
    assert predicted_total > 0
    for iid, engine in by_id.items():
        engine_ratio = (hits(engine) - start[iid][0]) / (queries(engine) - start[iid][1])
        inst = plane.registry.get(iid)
        assert inst is not None
        assert inst.predicted_prefix_hit_ratio == pytest.approx(engine_ratio, abs=1e-9), iid
        assert metrics["routerd_instance_prefix_cache_hit_ratio"].value(instance=iid, source="predicted") \
            == pytest.approx(engine_ratio, abs=1e-9)
        assert inst.estimated_prefix_hit_ratio is None  # every prompt was counted, none estimated
    views = [v for i in plane.registry for _, v in events.views(i.id)]
    assert sum(v.removed for v in views) > 0  # the engines evicted, and said so
    assert all(len(v) <= 32 for v in views)
    assert all(v.capacity_blocks == 32 for v in views)  # bounded by the engines' own KV, as scraped
    assert all(v.overflow == 0 for v in views)
    rows = status["fleets"]["f"]["instances"]
    assert all(row["cache_view"]["cache_view"] == "events" for row in rows)
    assert all(row["cache_view"]["event_ranks"][0]["health"] == "complete" for row in rows)
    for row in rows:
        assert metrics["routerd_kv_events_events_total"].value(instance=row["id"]) > 0
        assert metrics["routerd_kv_events_gaps_total"].value(instance=row["id"]) == 0
        assert metrics["routerd_kv_events_view"].value(instance=row["id"], health="complete") == 1


async def test_a_burst_sharing_a_new_prefix_sees_it_held_where_the_first_went(
        subscribed: tuple[RunningPlane, list[Any], EngineEvents]) -> None:
    """Three requests sharing a prefix no engine holds, sent at once — all routed before any engine
    announces a block (a step takes 50 ms): the first one's blocks count as held where it went
    (speculatively, until the engine's BlockStored), so the others are scored with that prefix there —
    and go there unless its wait outweighs the prefill saved (cache_aware's trade-off)."""
    plane, _, _ = subscribed
    shared = " ".join(_words(99, t) for t in range(5))  # 300 words: most of the prompt
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:

            async def send(n: int) -> None:
                body = {"model": "m", "max_tokens": 2, "messages": [
                    {"role": "system", "content": shared}, {"role": "user", "content": str(n)}]}
                async with http.post(plane.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200

            await asyncio.gather(*(send(n) for n in range(3)))
    first, *later = [e for e in logs if e["event"] == "request"]
    assert first["matched_blocks"] == 0
    assert first["runner_up_matched_blocks"] == 0
    assert len(later) == 2
    for line in later:
        assert line["cache_view"] == "events"
        same = line["instance"] == first["instance"]
        there = line["matched_blocks"] if same else line["runner_up_matched_blocks"]
        assert there == 300 // 16  # the shared system prompt's blocks, before the engine stored them


async def test_a_stale_view_falls_back_to_the_model(
        subscribed: tuple[RunningPlane, list[Any], EngineEvents]) -> None:
    plane, engines, events = subscribed
    victim = engines[0]
    iid = next(i.id for i in plane.registry if i.url == victim.url)
    assert victim.kv_events is not None
    await victim.kv_events.stop()  # the engine serves on, its publisher is gone: the probe goes unanswered
    await plane.wait_for(lambda: events.match(iid, [1]) is None, timeout=15, what="stale")
    await plane.wait_for(lambda: plane.registry.get(iid).cache_view.get("cache_view") == "model",  # type: ignore[union-attr]
                         timeout=5, what="status says model")
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for n in range(6):
                body = {"model": "m", "messages": [{"role": "user", "content": _words(n, 9)}],
                        "max_tokens": 2}
                async with http.post(plane.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
    lines = [e for e in logs if e["event"] == "request"]
    views = {(e["instance"], e["cache_view"]) for e in lines}
    assert all(view == "model" for inst, view in views if inst == iid)
    assert all(view == "events" for inst, view in views if inst != iid)
