"""Two routerd in front of the same engines, a conversation's turns alternating between them (what a
load balancer in front of several routerd does): each routerd knows only what it sent itself, so its
request-side model misses the turns the other one placed — the engines' own events are the same truth
for both. Measured as the engines' prefix-cache hit ratio on the later turns, with and without events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.fixtures.dataplane import PlaneFactory, RunningPlane, SimFactory, kv_events_args
from tests.fixtures.vllm import parse_metrics

KV = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                 "replay_endpoint": "tcp://127.0.0.1:0"})
CONVERSATIONS, TURNS = 8, 5


def _counter(engine: Any, name: str) -> float:
    return parse_metrics(engine.metrics.exposition().decode())[name].value()


async def _alternate(planes: list[RunningPlane], engines: list[Any]) -> float:
    """Every conversation's turn t goes through routerd t % len(planes); the engines' hit ratio on turns
    2 and later."""
    convs: list[list[dict[str, str]]] = [[{"role": "system", "content": f"conversation {c} " * 30}]
                                         for c in range(CONVERSATIONS)]
    hits = queries = 0.0
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def one(plane: RunningPlane, conv: list[dict[str, str]], text: str) -> None:
            conv.append({"role": "user", "content": text})
            body = {"model": "m", "messages": conv, "max_tokens": 4}
            async with http.post(plane.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                reply = (await r.json())["choices"][0]["message"]["content"]
            conv.append({"role": "assistant", "content": reply})

        for turn in range(TURNS):
            plane = planes[turn % len(planes)]
            before = [[_counter(e, n) for n in names] for e in engines]
            await asyncio.gather(*(one(plane, conv, " ".join(f"c{c}t{turn}w{i}" for i in range(40)))
                                   for c, conv in enumerate(convs)))
            if turn >= 1:
                for e, (h, q) in zip(engines, before, strict=True):
                    hits += _counter(e, names[0]) - h
                    queries += _counter(e, names[1]) - q
    return hits / queries


async def _run(sims: SimFactory, dataplane: PlaneFactory, routerds: int, events: bool) -> float:
    engines = [await sims(kv_events_config=KV, max_num_seqs=8, prefill_ms_per_token=0.05) for _ in range(3)]
    args = kv_events_args() if events else None  # routing by the engines' events, or the request-side model
    planes = [await dataplane([e.url for e in engines], engine_args=args) for _ in range(routerds)]
    for p in planes if events else []:
        await p.wait_for(lambda p=p: all(i.cache_view.get("cache_view") == "events" for i in p.registry),
                         timeout=30, what="subscribed")
    return await _alternate(planes, engines)


async def test_two_routerd_alternating_turns_hit_as_one_does_with_events(sims: SimFactory,
                                                                        dataplane: PlaneFactory) -> None:
    one = await _run(sims, dataplane, 1, events=False)
    two_model = await _run(sims, dataplane, 2, events=False)
    two_events = await _run(sims, dataplane, 2, events=True)
    print(f"engines' hit ratio on turns 2-{TURNS}: one routerd {one:.3f}; two alternating: "
          f"request-side model {two_model:.3f}, engines' events {two_events:.3f}")
    # 8 conversations of 5 turns: one request's luck moves the ratio by ~0.03 (a fresh-clone CI run
    # measured 0.946 × one's); the behaviour is "about as one routerd, far above the model's"
    assert two_events >= 0.9 * one
    assert two_events > two_model
