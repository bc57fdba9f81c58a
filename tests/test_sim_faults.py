"""Fault injection: each way a vLLM server fails, as a router observes it over HTTP.

routerd's health checks, retries and failover are tested against these, so each test checks what is
visible from outside: a dead port, a port that accepts but never answers, a 503 ``/health``, 500s,
a stream that breaks with vLLM's ``data: {"error": ...}`` + ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from routerd.sim import expected_text
from tests.fixtures.sim import SimEngineFactory, SimProcessFactory

BODY = {"model": "m", "prompt": "p q", "max_tokens": 4}


async def status_of(url: str, path: str = "/health", timeout_s: float = 2.0) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
            s.get(url + path) as r:
        await r.read()
        return r.status


async def port_accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def test_unhealthy_health_503_from_python_and_http(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m")
    eng.faults.set(unhealthy=True)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{eng.url}/health") as r:
            assert (r.status, await r.read()) == (503, b"")
        async with s.delete(f"{eng.url}/sim/faults") as r:
            assert (await r.json())["unhealthy"] is False
        assert await status_of(eng.url) == 200
        async with s.post(f"{eng.url}/sim/faults", json={"unhealthy": True}) as r:
            assert (await r.json())["unhealthy"] is True
        assert await status_of(eng.url) == 503
        async with s.post(f"{eng.url}/sim/faults", json={"bogus": 1}) as r:
            assert r.status == 400


async def test_hang_stops_every_route_and_progress_but_keeps_port(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m", ttft_ms=1, itl_ms=10)
    chunks: list[float] = []
    three = asyncio.Event()
    body = {**BODY, "max_tokens": 30, "stream": True}
    async with aiohttp.ClientSession() as s:
        async def consume() -> None:
            async with s.post(f"{eng.url}/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        chunks.append(time.monotonic())
                        if len(chunks) == 3:
                            three.set()

        stream = asyncio.create_task(consume())
        await asyncio.wait_for(three.wait(), 5)
        eng.faults.set(hang=True)
        hung_at, seen = time.monotonic(), len(chunks)
        for path in ("/health", "/metrics", "/v1/models"):
            with pytest.raises(TimeoutError):
                await status_of(eng.url, path, timeout_s=0.2)
        assert await port_accepts(eng.port)
        pending_health = asyncio.create_task(status_of(eng.url, timeout_s=5))
        await asyncio.sleep(0.1)
        assert len([t for t in chunks if t > hung_at + 0.05]) == 0  # no progress while hung
        assert not pending_health.done()
        async with s.get(f"{eng.url}/sim/faults") as r:  # the admin route stays live
            assert (await r.json())["hang"] is True
        async with s.delete(f"{eng.url}/sim/faults") as r:
            assert r.status == 200
        assert await pending_health == 200
        await asyncio.wait_for(stream, 5)
    assert len(chunks) == 31
    assert seen < 30


async def test_sigusr1_hangs_and_sigusr2_clears_the_process(sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m")
    sim.signal(signal.SIGUSR1)
    await asyncio.sleep(0.2)
    with pytest.raises(TimeoutError):
        await status_of(sim.url, timeout_s=0.3)
    assert await port_accepts(sim.port)
    sim.signal(signal.SIGUSR2)
    assert await status_of(sim.url) == 200


async def test_crash_exits_the_process_at_once(sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m", ttft_ms=1, itl_ms=1)
    assert await status_of(sim.url) == 200
    await sim.set_faults(crash=True)
    rc = await asyncio.to_thread(sim.proc.wait, 5)
    assert rc == 1
    assert not await port_accepts(sim.port)


async def test_in_process_crash_drops_port_and_connections(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m", ttft_ms=1, itl_ms=20)
    body = {**BODY, "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{eng.url}/v1/completions", json=body) as r:
        await r.content.readline()
        eng.faults.crash()
        assert eng.crashed.is_set()
        assert not await port_accepts(eng.port)  # refused at once, not after a graceful stop
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()


async def test_slow_multiplies_latency(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m", ttft_ms=10, itl_ms=10)

    async def timed() -> float:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s, s.post(f"{eng.url}/v1/completions", json=BODY) as r:
            assert r.status == 200
            await r.read()
        return time.monotonic() - t0

    normal = await timed()
    eng.faults.set(slow_factor=4.0)
    slow = await timed()
    assert slow > normal * 2.5, (normal, slow)


async def test_error_rate_answers_vllm_500(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m", ttft_ms=0, itl_ms=0, seed=1)
    eng.faults.set(error_rate=1.0)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{eng.url}/v1/completions", json=BODY) as r:
            assert r.status == 500
            assert await r.json() == {"error": {
                "message": "The server had an error while processing your request.",
                "type": "InternalServerError", "param": None, "code": 500}}
        eng.faults.set(error_rate=0.5)
        statuses = []
        for _ in range(40):
            async with s.post(f"{eng.url}/v1/completions", json=BODY) as r:
                statuses.append(r.status)
                await r.read()
    assert set(statuses) == {200, 500}
    assert 8 <= statuses.count(500) <= 32


async def test_fail_mid_stream_sends_error_event_then_done(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m", ttft_ms=1, itl_ms=1)
    eng.faults.set(fail_after_chunks=2)
    async with aiohttp.ClientSession() as s, \
            s.post(f"{eng.url}/v1/completions", json={**BODY, "max_tokens": 8, "stream": True}) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    events = [b.removeprefix("data: ") for b in raw.split("\n\n") if b]
    assert len(events) == 4, events
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:2])
    assert text == expected_text(0, "p q", 8)[: len(text)]
    assert text
    assert json.loads(events[2])["error"]["type"] == "InternalServerError"
    assert (eng.stats.running, eng.stats.failed) == (0, 1)
    eng.faults.set(fail_after_chunks=None)
    async with aiohttp.ClientSession() as s, \
            s.post(f"{eng.url}/v1/completions", json={**BODY, "stream": True}) as r:
        assert b'"error"' not in await r.read()


async def test_poison_answers_500_to_the_requests_that_carry_it(sim_engine: SimEngineFactory) -> None:
    """A request-triggered engine bug: every replica with the fault fails the same requests, and only
    those (the fault routerd's circuit breaker must not blame on the instances)."""
    eng = await sim_engine(model="m", ttft_ms=0, itl_ms=0)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{eng.url}/sim/faults", json={"poison": "BAD"}) as r:
            assert (await r.json())["poison"] == "BAD"
        chat = {"model": "m", "messages": [{"role": "user", "content": "so BAD"}]}
        for path, body, status in [("/v1/completions", {**BODY, "prompt": "a BAD one"}, 500),
                                   ("/v1/chat/completions", chat, 500),
                                   ("/v1/completions", BODY, 200)]:
            async with s.post(eng.url + path, json=body) as r:
                assert r.status == status
                if status == 500:
                    assert (await r.json())["error"]["type"] == "InternalServerError"
        async with s.delete(f"{eng.url}/sim/faults") as r:
            assert (await r.json())["poison"] == ""
        async with s.post(f"{eng.url}/v1/completions", json={**BODY, "prompt": "a BAD one"}) as r:
            assert r.status == 200


@pytest.mark.parametrize("raw", [b'{"po\xffison": "x"}', b'{"hang": 1}', b"not json"])
async def test_a_bad_fault_update_is_400_and_changes_nothing(sim_engine: SimEngineFactory,
                                                             raw: bytes) -> None:
    eng = await sim_engine(model="m")
    async with aiohttp.ClientSession() as s, s.post(f"{eng.url}/sim/faults", data=raw) as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == 400
    assert eng.faults.snapshot() == {"hang": False, "slow_factor": 1.0, "error_rate": 0.0,
                                     "fail_after_chunks": None, "unhealthy": False, "poison": "",
                                     "kv_events_drop_rate": 0.0, "kv_events_reorder": False}
