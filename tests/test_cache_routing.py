"""Cache-aware routing end to end: simulated engines (prefix caching on) as real HTTP servers behind a
running data plane, both ways in — HTTP and the Redis queue."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import structlog

from routerd.client import QueueClient
from routerd.config import parse
from routerd_bench.queue import queue_path, wait_ready
from tests.fixtures.dataplane import PlaneFactory, RunningPlane, SimFactory
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.vllm import parse_metrics

TIMEOUT = aiohttp.ClientTimeout(total=30)
DOC = " ".join(f"paragraph {i} of the shared document explains routing and caching." for i in range(60))


def counter(engine: Any, name: str) -> float:
    return parse_metrics(engine.metrics.exposition().decode())[name].value()


async def chat(session: aiohttp.ClientSession, plane: RunningPlane, messages: list[dict[str, str]],
               headers: dict[str, str] | None = None) -> tuple[str, str]:
    body = {"model": "m", "messages": messages, "max_tokens": 8}
    async with session.post(plane.url + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        assert resp.status == 200, await resp.text()
        doc = await resp.json()
        return resp.headers["X-Routerd-Instance"], doc["choices"][0]["message"]["content"]


async def test_a_conversation_stays_on_the_instance_whose_engine_holds_it(sims: SimFactory,
                                                                          dataplane: PlaneFactory) -> None:
    """Four turns go to one instance — whichever took the first — and its engine's prefix-cache hits
    rise; the log line of each turn says why (matched blocks, estimated wait and TTFT of the best two);
    ``/admin/fleets`` shows the hit ratio routerd predicted beside the engine's."""
    engines = [await sims(max_num_seqs=4, prefill_ms_per_token=0.02) for _ in range(3)]
    plane = await dataplane([e.url for e in engines], routing={"prefix_block_tokens": 16})
    assert plane.dp.serving.router.policy.name == "cache_aware"  # the default
    messages = [{"role": "system", "content": "You answer questions about the document."},
                {"role": "user", "content": DOC + " What does paragraph 3 say?"}]
    served: list[str] = []
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for turn in range(4):
                instance, reply = await chat(http, plane, messages)
                served.append(instance)
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": f"And paragraph {turn + 10}?"}]
            async with http.get(plane.url + "/admin/fleets") as resp:
                status = await resp.json()
    assert len(set(served)) == 1, served
    home = int(served[0].rsplit("static", 1)[1])
    hits = [counter(e, "vllm:prefix_cache_hits_total") for e in engines]
    assert hits[home] > 3 * 200  # each later turn found the conversation so far (~270 words) cached
    assert [h for i, h in enumerate(hits) if i != home] == [0.0, 0.0]

    lines = [e for e in logs if e["event"] == "request"]
    assert len(lines) == 4
    assert lines[0]["matched_blocks"] == 0
    for line in lines[1:]:
        assert line["instance"] == served[0]
        assert line["matched_blocks"] > 0
        assert line["runner_up_matched_blocks"] == 0
        assert line["ttft_est_ms"] < line["runner_up_ttft_est_ms"]
        assert (line["policy"], line["rule"]) == ("cache_aware", "lowest_ttft")
    row = next(i for i in status["fleets"]["f"]["instances"] if i["id"] == served[0])
    # no keyer for these engines: predicted over prompt sizes estimated from bytes, and labelled so
    assert row["predicted_prefix_hit_ratio"] is None
    assert 0.5 < row["estimated_prefix_hit_ratio"] <= 1.0


async def test_x_session_id_keeps_unrelated_prompts_on_one_instance(sims: SimFactory,
                                                                     dataplane: PlaneFactory) -> None:
    engines = [await sims(max_num_seqs=8) for _ in range(3)]
    plane = await dataplane([e.url for e in engines])
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        async def place(session: str, n: int) -> set[str]:
            return {(await chat(http, plane, [{"role": "user", "content": f"unrelated {session} {i}"}],
                                {"X-Session-Id": session}))[0] for i in range(n)}

        placed = [await place(f"sess-{s}", 4) for s in range(6)]
    assert all(len(p) == 1 for p in placed), placed
    assert len(set().union(*placed)) > 1  # different sessions are not all sent to one instance


async def test_a_queue_jobs_session_keeps_it_on_one_instance(redis_server: RedisServer,
                                                             sims: SimFactory) -> None:
    engines = [await sims(max_num_seqs=8) for _ in range(3)]
    cfg = parse({"redis": {"url": redis_server.url, "consumer": "c", "block_ms": 100},
                 "routing": {"scrape_interval_s": 0.05, "stale_after_s": 1.0},
                 "fleets": [{"name": "f", "model": "m", "engine": "static",
                             "urls": [e.url for e in engines]}]}, environ={})
    async with queue_path(cfg, redis_server.url) as routerd:
        ingress = routerd.queue
        assert ingress is not None
        await wait_ready(routerd.registry, ["f"], 15)
        task = asyncio.create_task(ingress.run())
        try:
            with structlog.testing.capture_logs() as logs:
                async with QueueClient.from_url(redis_server.url) as client:
                    by_session: dict[str, set[str]] = {}
                    for s in range(4):
                        jobs = [await client.submit({"model": "m", "max_tokens": 2,
                                                     "prompt": f"job {s}/{i} of nothing shared"},
                                                    session=f"batch-{s}") for i in range(3)]
                        results = (await client.wait_many(jobs, timeout=20)).values()
                        assert all(r.status == "ok" for r in results), results
                        by_session[f"batch-{s}"] = {r.instance for r in results}
        finally:
            ingress.stop_intake()
            await asyncio.wait_for(task, 30)
    assert all(len(v) == 1 for v in by_session.values()), by_session
    # Each job has its log line, like an HTTP request: where it ran, how it ended and why there.
    lines = {e["job_id"]: e for e in logs if e["event"] == "queue_job"}
    assert len(lines) == 12
    for line in lines.values():
        assert (line["status"], line["fleet"], line["attempts"]) == (200, "f", 1)
        assert line["instance"] in {"f:static0", "f:static1", "f:static2"}
        assert (line["policy"], "runner_up" in line) == ("cache_aware", True)
        assert line["ttft_est_ms"] >= 0
    affine = sum(bool(line.get("session_affinity")) for line in lines.values())
    assert affine >= 8  # each session's jobs after its first
    # The line names the rule that chose: a job sent to its session's instance says so.
    assert sum(line["rule"] == "session" for line in lines.values()) >= 8
    assert all(line["rule"] != "session" or line.get("session_affinity") for line in lines.values())


@pytest.mark.parametrize("policy", ["least_load", "power_of_two", "round_robin"])
async def test_every_builtin_policy_serves_through_the_request_view(sims: SimFactory, dataplane: PlaneFactory,
                                                                    policy: str) -> None:
    engines = [await sims() for _ in range(2)]
    plane = await dataplane([e.url for e in engines], routing={"policy": policy})
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        served = {(await chat(http, plane, [{"role": "user", "content": f"hello {i}"}]))[0] for i in range(6)}
    assert served <= {"f:static0", "f:static1"}
