"""The sim's routes beyond completions and chat (issue 29), over real HTTP: what routerd and its
tests rely on — deterministic answers, the Responses API's store, the engine's accounting, faults.

Shapes are held to real vLLM's captures in ``test_sim_routes_fidelity.py``; here is behaviour.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import aiohttp
import pytest

from routerd.sim import expected_text
from routerd.sim.server import SimEngine
from routerd.sim_tokens import render_chat, token_ids
from tests.fixtures.sim import SimEngineFactory
from tests.fixtures.vllm import parse_metrics
from tests.fixtures.vllm_routes import named_events

FAST = {"ttft_ms": 1.0, "itl_ms": 0.5}
TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest.fixture
async def eng(sim_engine: SimEngineFactory) -> SimEngine:
    return await sim_engine(model="m", max_model_len=512, seed=7, **FAST)


async def call(url: str, body: Any = None, *, method: str = "POST", data: Any = None) -> tuple[int, Any]:
    """Status and body: JSON when it is, else the raw bytes (SSE)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.request(
            method, url, json=body if data is None else None, data=data) as r:
        raw = await r.read()
        return r.status, json.loads(raw) if r.content_type == "application/json" else raw


async def metric(eng: SimEngine, family: str, **labels: str) -> float:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(eng.url + "/metrics") as r:
        return parse_metrics(await r.text())[family].value(**labels)


# ---- the Responses API ----------------------------------------------------------------------------


async def test_a_stored_response_continues_as_the_whole_conversation_would(eng: SimEngine) -> None:
    """`previous_response_id` and the conversation sent whole render the same prompt, so the turn's
    output is the same — what lets routerd rehydrate a chain on an engine that never saw it."""
    first_body = {"model": "m", "input": "hello world", "instructions": "Be brief.", "max_output_tokens": 6}
    status, first = await call(eng.url + "/v1/responses", first_body)
    assert status == 200, first
    said = first["output"][0]["content"][0]["text"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    assert said == expected_text(7, render_chat(chat), 6)
    assert first["status"] == "incomplete"  # max_output_tokens ran out, as vLLM reports it
    assert first["usage"]["output_tokens"] == 6

    status, chained = await call(eng.url + "/v1/responses", {
        "model": "m", "input": "and then", "previous_response_id": first["id"], "max_output_tokens": 5})
    assert status == 200, chained
    assert chained["previous_response_id"] == first["id"]
    status, whole = await call(eng.url + "/v1/responses", {"model": "m", "max_output_tokens": 5, "input": [
        {"role": "user", "content": "hello world"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": said}]},
        {"role": "user", "content": [{"type": "input_text", "text": "and then"}]}]})
    assert status == 200, whole
    # instructions do not carry over (OpenAI's rule, vLLM's too): the chain's turn 2 has no system message
    assert chained["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"]

    status, got = await call(eng.url + f"/v1/responses/{chained['id']}", method="GET")
    assert (status, got) == (200, chained)
    status, err = await call(eng.url + "/v1/responses", {"model": "m", "input": "x",
                                                          "previous_response_id": "resp_gone"})
    assert status == 404
    assert err["error"] == {"message": "Response with id 'resp_gone' not found.",
                            "type": "invalid_request_error", "param": "response_id", "code": 404}


async def test_an_unstored_response_cannot_be_continued(eng: SimEngine,
                                                        sim_engine: SimEngineFactory) -> None:
    status, body = await call(eng.url + "/v1/responses", {"model": "m", "input": "hi", "store": False})
    assert status == 200
    assert (await call(eng.url + f"/v1/responses/{body['id']}", method="GET"))[0] == 404
    # a server without the store (vLLM without VLLM_ENABLE_RESPONSES_API_STORE) keeps nothing
    bare = await sim_engine(model="m", responses_store=False, **FAST)
    status, body = await call(bare.url + "/v1/responses", {"model": "m", "input": "hi"})
    assert status == 200
    status, _ = await call(bare.url + "/v1/responses", {"model": "m", "input": "more",
                                                         "previous_response_id": body["id"]})
    assert status == 404


async def test_a_streamed_response_says_what_the_plain_one_does(eng: SimEngine) -> None:
    body = {"model": "m", "input": "stream me", "max_output_tokens": 7}
    status, raw = await call(eng.url + "/v1/responses", {**body, "stream": True})
    assert status == 200
    events = named_events(raw)
    kinds = [k for k, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    text = "".join(e["delta"] for k, e in events if k == "response.output_text.delta")
    assert text == expected_text(7, render_chat([{"role": "user", "content": "stream me"}]), 7)
    done = events[-1][1]["response"]
    assert done["output"][0]["content"][0]["text"] == text
    assert done["usage"]["output_tokens"] == 7
    status, got = await call(eng.url + f"/v1/responses/{done['id']}", method="GET")
    assert (status, got["output"]) == (200, done["output"])


async def test_generating_routes_count_as_generation_and_break_under_faults(eng: SimEngine) -> None:
    before = await metric(eng, "vllm:generation_tokens_total")
    assert (await call(eng.url + "/v1/responses", {"model": "m", "input": "a", "max_output_tokens": 3}))[0] \
        == 200
    assert (await call(eng.url + "/v1/messages", {"model": "m", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "b"}]}))[0] == 200
    assert await metric(eng, "vllm:generation_tokens_total") == before + 7
    eng.faults.set(fail_after_chunks=3)
    _, raw = await call(eng.url + "/v1/responses", {"model": "m", "input": "a", "stream": True})
    kinds = [k for k, _ in named_events(raw)]
    assert kinds[-1] == "error"
    assert "response.completed" not in kinds
    _, raw = await call(eng.url + "/v1/messages", {"model": "m", "max_tokens": 8, "stream": True,
                                                   "messages": [{"role": "user", "content": "b"}]})
    kinds = [k for k, _ in named_events(raw)]
    assert kinds[-1] == "error"
    assert "message_stop" not in kinds
    eng.faults.set(fail_after_chunks=None, error_rate=1.0)
    status, err = await call(eng.url + "/v1/messages", {"model": "m", "max_tokens": 8,
                                                        "messages": [{"role": "user", "content": "b"}]})
    assert status == 500
    assert err["type"] == "error"
    assert eng.stats.failed == 2


# ---- Anthropic's messages -------------------------------------------------------------------------


async def test_messages_streamed_and_not_and_their_token_count(eng: SimEngine) -> None:
    body = {"model": "m", "max_tokens": 6, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    status, msg = await call(eng.url + "/v1/messages", body)
    assert status == 200, msg
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert msg["content"] == [{"type": "text", "text": expected_text(7, render_chat(chat), 6)}]
    assert (msg["stop_reason"], msg["usage"]["output_tokens"]) == ("max_tokens", 6)
    status, counted = await call(eng.url + "/v1/messages/count_tokens",
                                 {k: v for k, v in body.items() if k != "max_tokens"})
    assert (status, counted["input_tokens"]) == (200, msg["usage"]["input_tokens"])

    status, raw = await call(eng.url + "/v1/messages", {**body, "stream": True})
    events = named_events(raw)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta")
    assert text == msg["content"][0]["text"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"

    stop = expected_text(7, render_chat(chat), 6).split()[2]
    status, cut = await call(eng.url + "/v1/messages", {**body, "stop_sequences": [stop]})
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", stop)


async def test_messages_errors_are_in_anthropics_shape(eng: SimEngine) -> None:
    status, err = await call(eng.url + "/v1/messages", {"model": "nope", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "x"}]})
    assert status == 404
    assert err["type"] == "error"
    assert err["error"]["type"] == "NotFoundError"
    status, err = await call(eng.url + "/v1/messages", {"model": "m", "max_tokens": 9999,
                                                        "messages": [{"role": "user", "content": "x"}]})
    assert (status, err["type"], err["error"]["type"]) == (400, "error", "BadRequestError"), err
    # a body pydantic refuses keeps FastAPI's validation answer, as vLLM 0.32 gives it here
    status, err = await call(eng.url + "/v1/messages", {"model": "m", "messages": []})
    assert (status, err["error"]["param"]) == (400, "body.max_tokens"), err


# ---- pooling --------------------------------------------------------------------------------------


async def test_embeddings_are_deterministic_unit_vectors_and_take_a_slot(
        eng: SimEngine, sim_engine: SimEngineFactory) -> None:
    other = await sim_engine(model="m", seed=7, **FAST)
    body = {"model": "m", "input": ["hello world", "the router sends"]}
    before = await metric(eng, "vllm:generation_tokens_total")
    stops = await metric(eng, "vllm:request_success_total", finished_reason="stop")
    status, a = await call(eng.url + "/v1/embeddings", body)
    assert status == 200, a
    _, b = await call(other.url + "/v1/embeddings", body)
    assert [d["embedding"] for d in a["data"]] == [d["embedding"] for d in b["data"]]
    for d in a["data"]:
        assert len(d["embedding"]) == 128
        assert math.isclose(sum(x * x for x in d["embedding"]), 1.0, rel_tol=1e-9)
    assert a["usage"]["prompt_tokens"] == 2 + 3
    # two engine requests of one prefill step each, nothing generated
    assert await metric(eng, "vllm:request_success_total", finished_reason="stop") == stops + 2
    assert await metric(eng, "vllm:generation_tokens_total") == before


async def test_rerank_and_score_put_the_closer_text_first(eng: SimEngine) -> None:
    docs = ["blue sky over the sea", "cache blocks in the engine", "the engine cache holds blocks"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, body = await call(eng.url + path, {"model": "m", "query": "engine cache blocks",
                                                   "documents": docs, "top_n": 2})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] in ([1, 2], [2, 1])
        assert body["results"][0]["document"]["text"] == docs[body["results"][0]["index"]]
    for path in ("/score", "/v1/score"):
        status, body = await call(eng.url + path, {"model": "m", "queries": "engine cache blocks",
                                                   "documents": docs})
        assert status == 200, body
        scores = [d["score"] for d in body["data"]]
        assert scores[0] < min(scores[1:])
        assert all(-1.0 <= s <= 1.0 for s in scores)
    status, body = await call(eng.url + "/classify", {"model": "m", "input": ["a b", "c"]})
    assert status == 200
    assert [math.fsum(d["probs"]) for d in body["data"]] == pytest.approx([1.0, 1.0])
    status, body = await call(eng.url + "/pooling", {"model": "m", "input": "a b"})
    assert status == 200
    assert len(body["data"][0]["data"]) == 128


# ---- tokenize -------------------------------------------------------------------------------------


async def test_tokenize_gives_the_sims_token_ids_and_detokenize_reads_them_back(eng: SimEngine) -> None:
    status, tok = await call(eng.url + "/tokenize", {"model": "m", "prompt": "hello big world",
                                                     "return_token_strs": True})
    assert status == 200
    assert tok == {"count": 3, "max_model_len": 512, "tokens": token_ids(["hello", "big", "world"]),
                   "token_strs": ["hello", "big", "world"]}
    status, chat = await call(eng.url + "/tokenize", {"model": "m", "messages": [{"role": "user",
                                                                                   "content": "hi"}]})
    assert chat["count"] == len(render_chat([{"role": "user", "content": "hi"}]).split())
    status, detok = await call(eng.url + "/detokenize", {"model": "m", "tokens": tok["tokens"]})
    assert (status, detok) == (200, {"prompt": "hello big world"})
    said = expected_text(7, "x", 4)  # generated words are known to every replica
    assert (await call(eng.url + "/detokenize", {"tokens": token_ids(said.split())}))[1] == \
        {"prompt": said.strip()}
    # an id it never met is left out, as vLLM leaves out one outside its vocabulary
    assert (await call(eng.url + "/detokenize", {"tokens": [12345, tok["tokens"][0]]})) == \
        (200, {"prompt": "hello"})
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(eng.url + "/load") as r:
        assert (await r.json()) == {"server_load": 0}


# ---- audio ----------------------------------------------------------------------------------------


def _form(audio: bytes, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for k, v in fields.items():
        form.add_field(k, v)
    form.add_field("file", io.BytesIO(audio), filename="a.wav", content_type="audio/wav")
    return form


async def test_audio_transcripts_are_deterministic_and_oversized_files_refused(
        sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(model="m", max_model_len=512, seed=7, max_audio_filesize_mb=1, **FAST)
    other = await sim_engine(model="m", seed=7, **FAST)
    audio = bytes(range(256)) * 250  # 64,000 bytes: 2 s at 16 kHz 16-bit
    status, a = await call(eng.url + "/v1/audio/transcriptions", data=_form(audio, model="m"))
    assert status == 200, a
    _, b = await call(other.url + "/v1/audio/transcriptions", data=_form(audio, model="m"))
    assert a == b
    assert a["usage"] == {"type": "duration", "seconds": 2}
    assert len(a["text"].split()) == 5
    status, t = await call(eng.url + "/v1/audio/translations", data=_form(audio))
    assert status == 200
    assert set(t) == {"text"}
    assert t["text"] != a["text"]
    status, raw = await call(eng.url + "/v1/audio/transcriptions",
                             data=_form(audio, stream="true", stream_include_usage="true"))
    chunks = [json.loads(x[len("data: "):]) for x in raw.decode().split("\n\n") if x and x != "data: [DONE]"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]).strip() == a["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    status, err = await call(eng.url + "/v1/audio/transcriptions", data=_form(b"\0" * (2**20 + 1)))
    assert status == 400
    assert err["error"]["param"] == "audio_filesize_mb"
    garbled = aiohttp.payload.BytesPayload(b"--xx\r\nno end", content_type="multipart/form-data; boundary=xx")
    assert await call(eng.url + "/v1/audio/transcriptions", data=garbled) == \
        (400, {"detail": "There was an error parsing the body"})
    status, err = await call(eng.url + "/v1/audio/transcriptions", {"model": "m"})
    assert status == 400
    assert err["error"]["param"] == "body.file"
