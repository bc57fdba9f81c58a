"""Failover, stream integrity, cancellation and counters, through routerd's HTTP over scripted engines."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd.registry import InstanceState
from tests.fixtures.dataplane import EngineFactory, PlaneFactory, RunningPlane, SimFactory

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**BODY, "stream": True}


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def settle(plane: RunningPlane) -> None:
    """Every kind of ending must give the counters back: in-flight per instance and admission slots."""
    await plane.wait_for(lambda: plane.inflight() == 0, timeout=3, what="in-flight back to 0")
    assert plane.dp.admission.stats("f")["active"] == 0
    assert plane.dp.serving.upstream.active == 0


async def test_503_and_500_are_retried_on_another_instance(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    bad = await scripted_engine(default="status:503")
    bad2 = await scripted_engine(default="status:500")
    good = await scripted_engine()
    plane = await dataplane([bad.url, bad2.url, good.url], routing={"max_attempts": 3,
                                                                    "circuit_failure_threshold": 100})
    for _ in range(6):
        async with client.post(plane.url + CHAT, json=BODY) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == "hello"
            assert r.headers["X-Routerd-Instance"] == "f:static2"
    assert good.requests == 6
    assert bad.requests + bad2.requests >= 1
    metrics = await (await client.get(plane.url + "/metrics")).text()
    assert 'routerd_retries_total{fleet="f"}' in metrics
    assert 'routerd_requests_total{code="200",fleet="f",instance="f:static2",' \
        'route="/v1/chat/completions"} 6.0' in metrics
    await settle(plane)


async def test_connect_error_is_retried(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                        client: aiohttp.ClientSession) -> None:
    dead = await scripted_engine()
    good = await scripted_engine()
    plane = await dataplane([dead.url, good.url], routing={"stale_after_s": 30})
    await dead.stop()  # killed after it was ready; routing still believes in it for a while
    for _ in range(5):
        async with client.post(plane.url + CHAT, json=STREAM) as r:
            assert r.status == 200
            text = await r.text()
            assert text.endswith("data: [DONE]\n\n")
            assert "error" not in text
    assert good.requests == 5
    await settle(plane)


async def test_client_errors_pass_through_unretried(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                                    client: aiohttp.ClientSession) -> None:
    a = await scripted_engine(default="status:400")
    b = await scripted_engine(default="status:400")
    plane = await dataplane([a.url, b.url])
    for _ in range(4):
        async with client.post(plane.url + CHAT, json=BODY) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == "scripted 400"
    assert a.requests + b.requests == 4
    await settle(plane)


async def test_all_attempts_fail_gives_502_json(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                                client: aiohttp.ClientSession) -> None:
    a = await scripted_engine(default="status:500")
    b = await scripted_engine(default="status:500")
    plane = await dataplane([a.url, b.url], routing={"max_attempts": 2, "circuit_failure_threshold": 100})
    async with client.post(plane.url + CHAT, json=STREAM) as r:
        assert r.status == 502
        err = (await r.json())["error"]
        assert err["code"] == 502
        assert "scripted 500" in err["message"]
    assert a.requests == 1
    assert b.requests == 1
    await settle(plane)


async def test_every_engine_queue_full_gives_503(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                                 client: aiohttp.ClientSession) -> None:
    a = await scripted_engine(default="status:503")
    b = await scripted_engine(default="status:503")
    plane = await dataplane([a.url, b.url], routing={"max_attempts": 2, "circuit_failure_threshold": 100})
    async with client.post(plane.url + CHAT, json=STREAM) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == 503
    await settle(plane)


async def test_every_engine_timing_out_gives_504(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                                 client: aiohttp.ClientSession) -> None:
    a = await scripted_engine(default="hang")
    b = await scripted_engine(default="hang")
    plane = await dataplane([a.url, b.url], routing={"first_byte_timeout_s": 0.2, "max_attempts": 2,
                                                     "circuit_failure_threshold": 100})
    async with client.post(plane.url + CHAT, json=STREAM) as r:
        assert r.status == 504
        assert (await r.json())["error"]["code"] == 504
    await settle(plane)


async def test_hung_instance_first_byte_timeout_retries_and_aborts(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    hung = await scripted_engine(default="hang")
    good = await scripted_engine(running=5)  # looks busier, so the hung one is tried first
    plane = await dataplane([hung.url, good.url], routing={"first_byte_timeout_s": 0.3,
                                                           "circuit_failure_threshold": 1,
                                                           "circuit_cooldown_s": 30})
    for _ in range(4):
        async with client.post(plane.url + CHAT, json=STREAM) as r:
            assert r.status == 200
            assert (await r.text()).endswith("data: [DONE]\n\n")
    # One request went to the hung engine; its circuit opened on that timeout and it got no more.
    assert hung.requests == 1
    assert good.requests == 4
    await plane.wait_for(lambda: hung.cancelled == 1, timeout=3, what="hung request aborted")
    status = plane.dp.status()["fleets"]["f"]["instances"][0]
    assert status["circuit"] == "open"
    await settle(plane)


async def test_error_event_before_any_token_is_retried(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    a = await scripted_engine(default="error_first")
    b = await scripted_engine(running=5)  # looks busier, so the failing one is tried first
    plane = await dataplane([a.url, b.url], routing={"circuit_failure_threshold": 100})
    for _ in range(4):
        async with client.post(plane.url + CHAT, json=STREAM) as r:
            text = await r.text()
            assert r.status == 200
            assert "error" not in text
            assert text.endswith("data: [DONE]\n\n")
            assert text.count("data: ") == 6  # 5 chunks + [DONE]
    assert a.requests == 4
    assert b.requests == 4
    await settle(plane)


@pytest.mark.parametrize(("behaviour", "engine_error"), [("error_after:2", True), ("drop_after:2", False),
                                                        ("no_done", False)])
async def test_failure_after_first_byte_ends_the_stream_with_an_error_event(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession,
        behaviour: str, engine_error: bool) -> None:
    a = await scripted_engine(default=behaviour)
    plane = await dataplane([a.url])
    async with client.post(plane.url + CHAT, json=STREAM) as r:
        assert r.status == 200
        text = await r.text()
    events = [e for e in text.split("\n\n") if e]
    assert events[0].startswith('data: {"choices"')
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith('data: {"error"')
    assert ("engine died" in events[-2]) is engine_error  # the engine's own event passes through as is
    assert a.requests == 1  # nothing is retried once bytes went out
    await settle(plane)


async def test_client_disconnect_cancels_upstream(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                                  client: aiohttp.ClientSession) -> None:
    slow = await scripted_engine(chunks=100, chunk_delay_s=0.05)
    plane = await dataplane([slow.url])
    # Streaming: disconnect after the first chunk.
    async with client.post(plane.url + CHAT, json=STREAM) as r:
        assert r.status == 200
        await r.content.readline()
    await plane.wait_for(lambda: slow.cancelled == 1, timeout=3, what="stream aborted upstream")
    # Non-streaming: disconnect while routerd waits for the engine.
    task = asyncio.create_task(client.post(plane.url + CHAT, json=BODY))
    await plane.wait_for(lambda: slow.active == 1, timeout=3, what="request reached the engine")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await plane.wait_for(lambda: slow.cancelled == 2, timeout=3, what="non-stream aborted upstream")
    assert slow.completed == 0
    await settle(plane)


async def test_circuit_breaker_takes_failing_instance_out_then_back(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    flaky = await scripted_engine(default="status:500")
    good = await scripted_engine()
    # a cool-down longer than a starved test process's pause: all 20 requests fall within it
    plane = await dataplane([flaky.url, good.url], routing={"circuit_failure_threshold": 2,
                                                            "circuit_cooldown_s": 3.0})
    for _ in range(20):
        async with client.post(plane.url + CHAT, json=BODY) as r:
            assert r.status == 200
    assert flaky.requests == 2  # two failures in a row, then out of rotation
    flaky.default = "ok"
    await asyncio.sleep(3.1)  # cool-down over: half-open, one trial, which succeeds
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(20):
        async with client.post(plane.url + CHAT, json=BODY) as r:
            seen[r.headers["X-Routerd-Instance"]] += 1
    assert seen["f:static0"] > 0  # back in rotation
    await settle(plane)


async def test_static_instance_leaves_rotation_when_scrapes_fail(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    a = await scripted_engine()
    b = await scripted_engine()
    plane = await dataplane([a.url, b.url], routing={"stale_after_s": 0.3})
    a.metrics_ok = False  # /metrics hangs from now on
    inst = plane.registry.get("f:static0")
    assert inst is not None
    await plane.wait_for(lambda: inst.state is InstanceState.UNHEALTHY, timeout=5, what="out of rotation")
    for _ in range(5):
        async with client.post(plane.url + CHAT, json=BODY) as r:
            assert r.headers["X-Routerd-Instance"] == "f:static1"
    a.metrics_ok = True
    await plane.wait_ready(2, timeout=5)
    await settle(plane)


@pytest.mark.parametrize(("capture", "stream"), [
    ("chat_stream.sse", True), ("completion_stream_usage.sse", True), ("chat.json", False)])
async def test_real_vllm_responses_pass_through_byte_for_byte(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession,
        capture: str, stream: bool) -> None:
    """Bytes a real vLLM sent (tests/data/vllm) for the request it answered, re-sent in odd-sized pieces,
    reach the client unchanged."""
    data = Path(__file__).parent / "data" / "vllm"
    raw = (data / capture).read_bytes()
    asked = json.loads((data / "manifest.json").read_text())["files"][capture]
    eng = await scripted_engine(replay=raw, replay_piece=7)
    plane = await dataplane([eng.url], model="tiny")
    async with client.post(plane.url + asked["path"], data=asked["request"],
                           headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200
        assert await r.read() == raw
        assert r.headers["Content-Type"].startswith("text/event-stream" if stream else "application/json")
    await settle(plane)


# ---- what the circuit breaker is charged with (simulated engines) --------------------------------

COMP = "/v1/completions"


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of routerd's /metrics (0.0 when the series does not exist)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


async def test_a_request_every_engine_fails_opens_no_circuit(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """A body that makes every engine answer 500 is the request's fault: retried on each instance, it
    must not count against any of them — else a few such requests open every circuit and every
    client gets 503 for the cool-down."""
    engines = [await sims(max_num_seqs=64, ttft_ms=1, itl_ms=1) for _ in range(3)]
    for eng in engines:
        eng.faults.set(poison="POISON")  # an engine bug this input triggers on every replica
    plane = await dataplane([e.url for e in engines], routing={"circuit_failure_threshold": 3,
                                                               "circuit_cooldown_s": 30})

    async def send(prompt: str) -> tuple[int, dict[str, Any]]:
        async with client.post(plane.url + COMP, json={"model": "m", "prompt": prompt, "max_tokens": 4}) as r:
            return r.status, await r.json()

    for _ in range(4):  # more than circuit_failure_threshold in a row
        status, body = await send("POISON please")
        assert status == 502, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["message"].startswith("3 attempt(s) failed")  # each instance answered 500
    # Poison and ordinary requests at once: the others keep being served.
    results = await asyncio.gather(*(send("POISON" if i % 2 else f"hello {i}") for i in range(30)))
    assert [s for s, _ in results] == [502 if i % 2 else 200 for i in range(30)]
    metrics = await (await client.get(plane.url + "/metrics")).text()
    for inst in plane.dp.status()["fleets"]["f"]["instances"]:
        assert (inst["circuit"], inst["consecutive_failures"]) == ("closed", 0), inst
        assert metric(metrics, "routerd_circuit_opened_total", fleet="f", instance=inst["id"]) == 0
        # Still visible as failed engine calls, just not held against the instance.
        assert metric(metrics, "routerd_upstream_failures_total", fleet="f", instance=inst["id"],
                      reason="status_500") > 0
    await settle(plane)


async def test_an_instance_failing_what_its_peers_serve_still_opens_its_circuit(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    broken = await sims(ttft_ms=1, itl_ms=1)
    peers = [await sims(ttft_ms=1, itl_ms=1) for _ in range(2)]
    broken.faults.set(error_rate=1.0)  # answers every request 500
    plane = await dataplane([broken.url] + [p.url for p in peers],
                            routing={"policy": "round_robin", "circuit_failure_threshold": 2,
                                     "circuit_cooldown_s": 30})
    for i in range(12):
        body = {"model": "m", "prompt": f"p{i}", "max_tokens": 2}
        async with client.post(plane.url + COMP, json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Routerd-Instance"] != "f:static0"
    circuits = {i["id"]: i["circuit"] for i in plane.dp.status()["fleets"]["f"]["instances"]}
    assert circuits == {"f:static0": "open", "f:static1": "closed", "f:static2": "closed"}
    metrics = await (await client.get(plane.url + "/metrics")).text()
    assert metric(metrics, "routerd_circuit_opened_total", fleet="f", instance="f:static0") == 1
    await settle(plane)


async def test_one_engine_death_is_one_circuit_opening(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """Every stream the dead engine held fails, and each failure used to count as another opening."""
    victim = await sims(max_num_seqs=64, ttft_ms=1, itl_ms=20)
    other = await sims(max_num_seqs=64, ttft_ms=1, itl_ms=20)
    plane = await dataplane([victim.url, other.url],
                            routing={"policy": "round_robin", "circuit_failure_threshold": 2,
                                     "circuit_cooldown_s": 0.1, "stale_after_s": 30})

    flowing: list[str] = []

    async def stream(i: int) -> str:
        body = {"model": "m", "prompt": f"s{i}", "max_tokens": 60, "stream": True}
        async with client.post(plane.url + COMP, json=body) as r:
            assert r.status == 200
            first = await r.content.readline()
            flowing.append(r.headers["X-Routerd-Instance"])
            return first.decode() + await r.text()

    streams = [asyncio.create_task(stream(i)) for i in range(12)]
    await plane.wait_for(lambda: len(flowing) == 12, timeout=5, what="12 streams flowing")
    assert flowing.count("f:static0") == 6
    victim.faults.crash()  # the process dies: every connection dropped, the port closed
    texts = await asyncio.gather(*streams)
    assert not any('data: {"error"' in t for t in texts)  # its six streams went on on the other one
    assert all(t.endswith("data: [DONE]\n\n") for t in texts)
    for i in range(10):  # several cool-downs, each ending in a failed trial while the instance is in rotation
        async with client.post(plane.url + COMP, json={"model": "m", "prompt": f"after {i}",
                                                       "max_tokens": 2}) as r:
            assert r.status == 200
        await asyncio.sleep(0.05)
    metrics = await (await client.get(plane.url + "/metrics")).text()
    assert metric(metrics, "routerd_circuit_opened_total", fleet="f", instance="f:static0") == 1
    assert metric(metrics, "routerd_circuit_opened_total", fleet="f", instance="f:static1") == 0
    await settle(plane)


class Collected:
    """A ResponseSink keeping what upstream sends it (what a queue job's result is made from)."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.status, self.headers = status, dict(headers)

    async def write(self, chunk: bytes) -> None:
        self.body += chunk


async def test_an_engine_error_not_in_openai_shape_is_rewrapped(sims: SimFactory,
                                                                dataplane: PlaneFactory) -> None:
    """vLLM answers a body it cannot parse with FastAPI's ``{"detail": …}``; clients (and queue results)
    get OpenAI's shape with the engine's message. The HTTP ingress refuses such bodies itself, so the
    engine is called directly, as the queue path does."""
    plane = await dataplane([(await sims()).url])
    sink = Collected()
    result = await plane.dp.serving.upstream.forward("f", COMP, b'{"model": "m", "prompt": "\xff"}', sink,
                                             stream=False, request_id="r1")
    assert (result.status, result.ok, result.error) == (400, False, "There was an error parsing the body")
    assert json.loads(sink.body) == {"error": {"message": "There was an error parsing the body",
                                               "type": "BadRequestError", "param": None, "code": 400}}
    assert sink.headers["Content-Type"] == "application/json"
    assert sink.headers["Content-Length"] == str(len(sink.body))
    assert plane.registry.instances("f")[0].consecutive_failures == 0
    await settle(plane)


async def test_a_request_id_no_header_may_hold_is_forwarded(sims: SimFactory,
                                                            dataplane: PlaneFactory) -> None:
    """A queue job's id is the request id sent to the engine; one with a newline or non-ASCII
    characters made aiohttp refuse to send the request (a ValueError out of forward)."""
    plane = await dataplane([(await sims()).url])
    for request_id in ("job\nX-Injected: 1", "jöb ☃", "x" * 256 + "é"):
        sink = Collected()
        result = await plane.dp.serving.upstream.forward("f", COMP, b'{"model": "m", "prompt": "hi"}', sink,
                                                 stream=False, request_id=request_id)
        assert (result.status, sink.status) == (200, 200)
    await settle(plane)


async def test_error_events_an_engine_sends_mid_stream_open_no_circuit(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """The engine is alive and says this stream failed — possibly the request's doing, and nothing can
    be retried after the first byte to tell. The client learns of it; the instance is not charged."""
    eng = await sims(ttft_ms=1, itl_ms=1)
    eng.faults.set(fail_after_chunks=2)
    plane = await dataplane([eng.url], routing={"circuit_failure_threshold": 2, "circuit_cooldown_s": 30})
    for i in range(5):
        body = {"model": "m", "prompt": f"p{i}", "max_tokens": 8, "stream": True}
        async with client.post(plane.url + COMP, json=body) as r:
            assert r.status == 200  # not 503: the circuit stayed closed
            text = await r.text()
        assert 'data: {"error"' in text
        assert text.endswith("data: [DONE]\n\n")
    (inst,) = plane.dp.status()["fleets"]["f"]["instances"]
    assert (inst["circuit"], inst["consecutive_failures"]) == ("closed", 0)
    metrics = await (await client.get(plane.url + "/metrics")).text()
    assert metric(metrics, "routerd_upstream_failures_total", fleet="f", instance="f:static0",
                  reason="error_event") == 5
    await settle(plane)
