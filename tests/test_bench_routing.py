"""``routerd bench routing`` and how every benchmark times a request.

Why: the benchmark's figures are what docs/benchmarks.md reports and what routing changes are judged
by. Time to first token must be the first event carrying generated text — not chat's role chunk,
which an engine or a router may send early — and every workload must give every figure for every
router it ran, on the same traffic.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from routerd_bench import workloads as wl
from routerd_bench._common import timed_request

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
EMPTY = b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n'
TEXT = b'data: {"choices":[{"index":0,"delta":{"content":" hello"},"finish_reason":null}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
ERROR = b'data: {"error":{"message":"engine died","type":"InternalServerError","code":500}}\n\n'
DONE = b"data: [DONE]\n\n"
DELAY_S = 0.2


@pytest.fixture
async def early_role_engine() -> AsyncIterator[str]:
    """An engine that sends the role chunk and an empty delta at once and its first text DELAY_S later
    (what the sim did before it was fixed, and what a router that answers early would look like);
    ``/cut`` ends with an error event instead of text."""

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ROLE + EMPTY)
        await asyncio.sleep(DELAY_S)
        await resp.write(ERROR + DONE if request.path == "/cut" else TEXT + USAGE + DONE)
        return resp

    app = web.Application()
    app.router.add_post("/ok", stream)
    app.router.add_post("/cut", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_ttft_is_the_first_event_with_generated_text(early_role_engine: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        ok = await timed_request(http, early_role_engine + "/ok", b"{}", True)
        cut = await timed_request(http, early_role_engine + "/cut", b"{}", True)
    assert ok.ok
    assert ok.ttft >= DELAY_S - 0.005, f"TTFT {ok.ttft * 1000:.0f} ms counted an event without text"
    # A stream that ends with an error event and no text failed; it has no time to first token.
    assert not cut.ok
    assert math.isnan(cut.ttft)


@pytest.mark.parametrize("name", wl.WORKLOADS)
def test_plans_are_seeded(name: str) -> None:
    """Every router meets the same traffic only if the plan is a function of the seed alone."""
    work = wl.build(name, scale=0.05)
    a, b = work.plan(20.0, 3.0, 7), work.plan(20.0, 3.0, 7)
    assert a
    assert a == b
    assert work.plan(20.0, 3.0, 8) != a
    if name == "multiturn":
        assert max(r.turn for r in a) >= 2  # conversations, whose later turns wait for an answer
        assert any(r.think_s > 0 for r in a if r.turn)


@pytest.mark.slow
@pytest.mark.subprocess  # `routerd bench routing`, its sims and routerd
@pytest.mark.timeout(420)
def test_every_workload_gives_every_figure_for_every_router(tmp_path: Path) -> None:
    """Every workload but ``cache-pressure`` (the next test's) at a tiny size: real sim processes,
    routerd (by the engines' KV events where they publish; one policy: a second one ran the same code
    for ~25 s of CI), vLLM Router when
    installed; the JSON must hold each figure for each router, and TTFT must be at least the engines'
    own prefill step (a time to the role chunk would be far less).

    The sizes are the least that still give every figure (this checks that they are produced, not
    their values): half a second of arrivals is still 58–121 requests per run here, and the decision
    and keying costs are timed at 1,024-token prompts, a sixth of the time 8,192 take."""
    out = tmp_path / "routing.json"
    works = [w for w in wl.WORKLOADS if w != "cache-pressure"]
    argv = [sys.executable, "-m", "routerd", "bench", "routing", "--json", str(out), "--duration", "0.5",
            "--calibrate-s", "0.2", "--scale", "0.05", "--load", "0.5", "--workload", *works, "--policies",
            "cache_aware", "--views", "events", "--peers", "vllm-router:cache_aware",
            "--decision-prompt-tokens", "1024", "--keying-requests", "20"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.read_text())
    labels = results["routers"]
    assert labels[:1] == ["routerd cache_aware"]
    assert labels[1:] == (["vllm-router cache_aware"] if results["note"] is None else [])
    assert set(results["workloads"]) == set(works)
    for name, work in results["workloads"].items():
        assert [r["label"] for r in work["runs"]] == labels, name
        assert work["kv_events"] == (name != "heterogeneous"), name
        min_ttft_ms = min(k["ttft_ms"] for k in work["fleet"].values())
        for run in work["runs"]:
            where = f"{name}/{run['label']}"
            assert run["requests"] == work["requests"] > 0, where  # the same plan for every router
            assert run["failed"] == 0, where
            for metric in ("ttft_ms", "e2e_ms"):
                assert all(math.isfinite(run[metric][s]) for s in ("mean", "p99")), where
            assert run["ttft_ms"]["p50"] >= min_ttft_ms, where
            assert run["e2e_ms"]["mean"] >= run["ttft_ms"]["mean"], where
            assert set(run["share"]) == set(work["fleet"]), where
            assert sum(run["share"].values()) == pytest.approx(1.0, abs=0.01), where
            assert 0.0 <= run["prefix_hit_ratio"] <= 1.0, where
            if name in ("multiturn", "shared-prefix"):
                assert run["prefix_hit_ratio"] > 0, where  # shared system prompts hit on any router
            if name == "multiturn":
                assert 0.0 < run["later_turn_hit_ratio"] <= 1.0, where
            if name == "random":
                assert run["prefix_hit_ratio"] == 0, where  # nothing shared, nothing hit
            if run["router"] == "routerd":
                assert set(run["routerd_view"]) == set(work["fleet"]), where
                if work["kv_events"]:  # each request's predicted hit against the engine's own count
                    pred = run["prediction"]["events"]
                    assert pred["requests"] == run["requests"], where
                    assert 0.0 <= pred["exact"] <= 1.0, where
    cost = results["decision_cost_us"]
    assert cost["prompt_tokens"] == 1024
    assert all(cost["parts"][p]["p99"] > 0 for p in ("view", "choose", "total"))
    keying = results["keying_cost"]["keyers"]["sim"]
    for way in ("process", "thread", "inline"):
        assert keying[way]["blocks"] == (keying["prompt_tokens"] - 1) // 16
        assert keying[way]["loop_us"]["p99"] > 0
        assert keying[way]["wait_ms"]["p99"] > 0
    assert isinstance(results["targets"], list)


@pytest.mark.slow
@pytest.mark.subprocess  # `routerd bench routing`, its sims and routerd
@pytest.mark.timeout(300)
def test_cache_pressure_by_events_and_by_the_model_with_two_routerd(tmp_path: Path) -> None:
    """``cache-pressure`` with ``--replicas 2``: two routerd processes on the same engines, the client
    alternating between them, once by the engines' events and once by the request-side model; every
    request is answered, each found in one routerd's log with its prediction, and the KV is sized to
    the plan."""
    out = tmp_path / "routing.json"
    argv = [sys.executable, "-m", "routerd", "bench", "routing", "--json", str(out), "--workload",
            "cache-pressure", "--duration", "0.5", "--capacity-rps", "20", "--scale", "0.05", "--load", "0.5",
            "--policies", "cache_aware", "--replicas", "2", "--peers", "--no-decision-cost"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=250, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    work = json.loads(out.read_text())["workloads"]["cache-pressure"]
    assert 0.0 < work["kv_fill"] <= 0.75
    assert {k["num_gpu_blocks"] for k in work["fleet"].values()} == {work["fleet"]["i0"]["num_gpu_blocks"]}
    assert [r["label"] for r in work["runs"]] == ["routerd cache_aware ×2", "routerd cache_aware model ×2"]
    for run, view in zip(work["runs"], ("events", "model"), strict=True):
        assert run["replicas"] == 2
        assert run["failed"] == 0
        assert run["prediction"][view]["requests"] == run["requests"]  # both routerd's logs were read
        assert 0.0 < run["later_turn_hit_ratio"] <= 1.0
