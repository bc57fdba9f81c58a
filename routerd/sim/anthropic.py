"""Anthropic's Messages API as vLLM 0.32 serves it: ``POST /v1/messages`` (JSON, or SSE events
``message_start``, ``content_block_start``, ``content_block_delta`` …, ``message_stop``) and
``POST /v1/messages/count_tokens``.

vLLM turns a Messages request into a chat request (``system`` first as the system message, text blocks
joined, a tool result as ``Tool result: …``) and answers in Anthropic's shapes, errors included
(``{"type": "error", "error": {type, message}}``); the sim does the same over its own chat: rendered
with ChatML, generated through the batching engine, its metrics and faults.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..sim_tokens import count_prompt_tokens, prompt_words, render_chat
from . import protocol as p
from . import wire
from .config import SimConfig
from .engine import Sequence
from .running import Prompt, Runner

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class MessagesRequest:
    prompt: Prompt
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool


INTERNAL = "The server had an error while processing your request."


def error(status: int, type_: str, message: str = INTERNAL) -> web.Response:
    """Anthropic's error body, as vLLM translates its own errors on these routes."""
    return wire.json_response({"type": "error", "error": {"type": type_, "message": message}}, status)


def translate(e: p.RequestError) -> web.Response:
    """vLLM's own errors in Anthropic's shape; a body its pydantic refuses keeps FastAPI's validation
    answer (OpenAI's shape), as vLLM 0.32 answers it on these routes."""
    inner = e.body["error"]
    if inner["type"] == "Bad Request":
        return wire.json_response(e.body, e.status)
    return error(e.status, inner["type"], inner["message"])


def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return ""
    if block.get("type") == "tool_result":
        content = block.get("content")
        text = content if isinstance(content, str) else "".join(
            str(b.get("text", "")) for b in content or [] if isinstance(b, dict))
        return f"Tool result: {text}"
    value = block.get("text")
    return value if isinstance(value, str) else ""


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(_block_text(b) for b in content or [])


def chat_messages(body: dict[str, Any]) -> Messages:
    """The chat vLLM builds from a Messages request (its ``to_chat_completion_request``)."""
    out: Messages = []
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise p.field_error("string_type", "system", "Input should be a valid string", system)
    if system:
        text = _text(system)
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if messages is None:
        raise p.field_error("missing", "messages", "Field required", body)
    if not isinstance(messages, list):
        raise p.field_error("list_type", "messages", "Input should be a valid list", messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise p.field_error("literal_error", f"messages.{i}.role",
                                "Input should be 'user', 'assistant' or 'system'", m)
        content = m.get("content")
        if not isinstance(content, str | list):
            raise p.field_error("string_type", f"messages.{i}.content", "Input should be a valid string",
                                content)
        out.append({"role": m["role"], "content": _text(content)})
    return out


def _prompt(body: dict[str, Any]) -> Prompt:
    rendered = render_chat(chat_messages(body))
    return Prompt(prompt_words(rendered), count_prompt_tokens(rendered), rendered)


def stop_reason(seq: Sequence) -> tuple[str, str | None]:
    """vLLM's mapping: length → ``max_tokens``, a matched stop string → ``stop_sequence``, else
    ``end_turn``."""
    if seq.finish_reason == "length":
        return "max_tokens", None
    if seq.stop_reason is not None:
        return "stop_sequence", seq.stop_reason
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}


class AnthropicRoutes:
    """``/v1/messages`` and its ``count_tokens``."""

    def __init__(self, config: SimConfig, runner: Runner) -> None:
        self.config = config
        self.runner = runner

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages),
                web.post("/v1/messages/count_tokens", self.count_tokens)]

    def _body(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise p.not_a_dict(body)
        if body.get("model") is None:
            raise p.field_error("missing", "model", "Field required", body)
        p.check_model(body, self.config)
        return body

    def parse(self, raw: Any) -> MessagesRequest:
        body = self._body(raw)
        prompt = _prompt(body)
        max_tokens = p.get_field(body, "max_tokens", int, "int_type", "Input should be a valid integer")
        if max_tokens is None:
            raise p.field_error("missing", "max_tokens", "Field required", body)
        try:
            max_tokens = p.check_max_tokens(max_tokens, self.config, prompt.tokens)
        except p.RequestError as e:  # vLLM checks it as the chat request's max_completion_tokens
            raise p.RequestError(e.status, str(e).replace("max_tokens", "max_completion_tokens"),
                                 "BadRequestError", "max_completion_tokens") from e
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise p.field_error("list_type", "stop_sequences", "Input should be a valid list", stops)
        stream = bool(p.get_field(body, "stream", bool, "bool_type", "Input should be a valid boolean"))
        return MessagesRequest(prompt=prompt, max_tokens=max_tokens, stop=tuple(stops), stream=stream)

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            body = self._body(await wire.read_json(request))
            prompt = _prompt(body)
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return translate(e)
        return wire.json_response({"input_tokens": prompt.tokens,
                                   "context_management": {"original_input_tokens": prompt.tokens}})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            req = self.parse(await wire.read_json(request))
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return translate(e)
        if self.runner.refuses(req.prompt.key):
            return error(500, "InternalServerError")
        seq = self.runner.generation(req.prompt, req.max_tokens, stop=req.stop)
        rid = "chatcmpl-" + secrets.token_hex(8)
        async with self.runner.running(seq):
            if req.stream:
                return await self._stream(request, req, seq, rid)
            if not await self.runner.finish(seq):
                return error(500, "InternalServerError")
        reason, sequence = stop_reason(seq)
        body: dict[str, Any] = {
            "id": rid, "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "".join(seq.pieces)}], "model": self.config.model,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(req.prompt.tokens, seq.generated)}
        # vLLM leaves out what is null (exclude_none): a stop_sequence only when one matched
        return wire.json_response({k: v for k, v in body.items() if v is not None})

    async def _stream(self, request: web.Request, req: MessagesRequest, seq: Sequence,
                      rid: str) -> web.StreamResponse:
        """vLLM's event order: message_start on the first token, then the text block's start, one
        delta per token, its stop, message_delta (stop reason, usage) and message_stop."""
        resp = web.StreamResponse(headers=wire.SSE_HEADERS)
        await resp.prepare(request)
        sent = 0
        async for idx in seq.stream():
            if sent == 0:
                start: dict[str, Any] = {"id": rid, "type": "message", "role": "assistant", "content": [],
                         "model": self.config.model, "stop_reason": None, "stop_sequence": None,
                         "usage": usage(req.prompt.tokens, 0)}
                await resp.write(wire.named_event("message_start", {"type": "message_start",
                                                                    "message": start}))
                await resp.write(wire.named_event("content_block_start", {
                    "type": "content_block_start", "content_block": {"type": "text", "text": ""},
                    "index": 0}))
                sent = 1
            if self.runner.breaks_stream(sent, seq):
                break
            if seq.pieces[idx]:
                await resp.write(wire.named_event("content_block_delta", {
                    "type": "content_block_delta", "delta": {"type": "text_delta", "text": seq.pieces[idx]},
                    "index": 0}))
            sent += 1
        if not self.runner.finished(seq):
            await resp.write(wire.named_event("error", {"type": "error", "error": {
                "type": "InternalServerError", "message": INTERNAL}}))
            await resp.write_eof()
            return resp
        reason, sequence = stop_reason(seq)
        await resp.write(wire.named_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        await resp.write(wire.named_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(req.prompt.tokens, seq.generated)}))
        await resp.write(wire.named_event("message_stop", {"type": "message_stop"}))
        await resp.write_eof()
        return resp
