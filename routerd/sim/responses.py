"""The Responses API as vLLM 0.32 serves it: ``POST /v1/responses`` (JSON, or SSE semantic events),
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

A request becomes chat messages as vLLM builds them (``instructions`` as the system message; the
previous response's messages without their system message, then its output as the assistant's turn;
then ``input``), rendered with the sim's ChatML and generated like a chat — through the batching engine,
its metrics and its faults. So turn n+1's rendered prompt starts with turn n's, and its output is the
same whether the turn came with ``previous_response_id`` or with the whole conversation as ``input``
(what routerd sends to an engine that does not hold the chain).

``store`` (default true) keeps the response and its messages in this server's memory, as vLLM's store
does with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` — lost with the process, unknown to other replicas;
``--no-responses-store`` is vLLM without it (``store`` ignored, every ``previous_response_id`` 404).
Unlike vLLM's, the store is bounded (``responses_store_max``, oldest first out). ``background`` mode is
not simulated (400).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from routerd.errors import error_body

from ..sim_tokens import count_prompt_tokens, prompt_words, render_chat
from . import protocol as p
from . import wire
from .config import SimConfig
from .engine import Sequence
from .running import Prompt, Runner

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated ``/v1/responses`` request: the messages it renders and what the answer echoes."""

    body: dict[str, Any]
    messages: Messages
    prompt: Prompt
    max_tokens: int
    stream: bool
    store: bool


@dataclass
class Stored:
    response: dict[str, Any]
    messages: Messages  # the input messages; the output is in ``response``


def not_found(response_id: str) -> p.RequestError:
    """vLLM's answer to an id its store does not hold (continued, retrieved or cancelled)."""
    return p.RequestError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                          "response_id")


def _input_messages(value: Any) -> Messages:
    """``input``: a string (one user message) or message items (content a string or text parts)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise p.field_error("string_type", "input", "Input should be a valid string", value)
    out: Messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message" \
                or not isinstance(item.get("role"), str):
            raise p.semantic_error("The simulated engine takes message items only.", f"input.{i}",
                                   item)
        if not p.valid_content(item.get("content")):
            raise p.field_error("string_type", f"input.{i}.content", "Input should be a valid string",
                                item.get("content"))
        out.append({"role": item["role"], "content": _text(item.get("content"))})
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def _float(value: Any, default: float) -> float:
    """A sampling setting as vLLM echoes it (a float, whatever number the client sent)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def output_text(response: dict[str, Any]) -> str:
    return "".join(c.get("text", "") for item in response["output"] if item.get("type") == "message"
                   for c in item["content"])


class ResponsesRoutes:
    """The handlers and the in-memory store."""

    def __init__(self, config: SimConfig, runner: Runner) -> None:
        self.config = config
        self.runner = runner
        self.store: OrderedDict[str, Stored] = OrderedDict()

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.create), web.get("/v1/responses/{response_id}", self.retrieve),
                web.post("/v1/responses/{response_id}/cancel", self.cancel)]

    def _keep(self, rid: str, stored: Stored) -> None:
        self.store[rid] = stored
        while len(self.store) > self.config.responses_store_max:
            self.store.popitem(last=False)

    # ---- the request ------------------------------------------------------------------------------

    def parse(self, body: Any) -> ResponsesRequest:
        if not isinstance(body, dict):
            raise p.not_a_dict(body)
        p.check_model(body, self.config)
        if body.get("input") is None:
            raise p.field_error("missing", "input", "Field required", body)
        bool_msg = "Input should be a valid boolean"
        stream = bool(p.get_field(body, "stream", bool, "bool_type", bool_msg))
        store = p.get_field(body, "store", bool, "bool_type", bool_msg) is not False
        if p.get_field(body, "background", bool, "bool_type", bool_msg):
            raise p.semantic_error("The simulated engine does not run background responses.", "background",
                                   True)
        instructions = p.get_field(body, "instructions", str, "string_type", "Input should be a valid string")
        messages: Messages = [{"role": "system", "content": instructions}] if instructions else []
        prev_id = p.get_field(body, "previous_response_id", str, "string_type",
                              "Input should be a valid string")
        if prev_id is not None:
            prev = self.store.get(prev_id) if self.config.responses_store else None
            if prev is None:
                raise not_found(prev_id)
            messages += [m for m in prev.messages if m.get("role") != "system"]
            messages.append({"role": "assistant", "content": output_text(prev.response)})
        messages += _input_messages(body["input"])
        rendered = render_chat(messages)
        prompt = Prompt(prompt_words(rendered), count_prompt_tokens(rendered), rendered)
        max_tokens = self._max_tokens(body, prompt.tokens)
        return ResponsesRequest(body=body, messages=messages, prompt=prompt, max_tokens=max_tokens,
                                stream=stream, store=store and self.config.responses_store)

    def _max_tokens(self, body: dict[str, Any], n_prompt: int) -> int:
        value = p.get_field(body, "max_output_tokens", int, "int_type", "Input should be a valid integer")
        return p.check_max_tokens(value if value is not None else self.config.default_max_tokens,
                                  self.config, n_prompt)

    # ---- the answer -------------------------------------------------------------------------------

    def body(self, req: ResponsesRequest, rid: str, created: int, output: list[dict[str, Any]], status: str,
             usage: dict[str, Any] | None) -> dict[str, Any]:
        """vLLM's ``ResponsesResponse.model_dump()``: every field, the request's settings echoed."""
        b = req.body
        return {
            "id": rid, "created_at": created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata"), "model": self.config.model,
            "object": "response", "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "temperature": _float(b.get("temperature"), 1.0),
            # vLLM answers "none" when the request has no tools
            "tool_choice": b.get("tool_choice", "auto" if b.get("tools") else "none"),
            "tools": b.get("tools", []),
            "top_p": _float(b.get("top_p"), 1.0),
            "background": False, "max_output_tokens": req.max_tokens,
            "max_tool_calls": b.get("max_tool_calls"), "previous_response_id": b.get("previous_response_id"),
            "prompt": b.get("prompt"), "reasoning": b.get("reasoning"),
            "service_tier": b.get("service_tier", "auto"), "status": status, "text": b.get("text"),
            "top_logprobs": b.get("top_logprobs"), "truncation": b.get("truncation", "disabled"),
            "usage": usage, "user": b.get("user"),
            "presence_penalty": _float(b.get("presence_penalty"), 0.0),
            "frequency_penalty": _float(b.get("frequency_penalty"), 0.0),
            "kv_transfer_params": None, "ec_transfer_params": None,
            "input_messages": None, "output_messages": None,
        }

    @staticmethod
    def message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
        """An output message item; ``text`` None: the item as added, before its text part."""
        content: list[dict[str, Any]] = [] if text is None else [
            {"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
        return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message",
                "phase": None}

    @staticmethod
    def usage(prompt_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, Any]:
        return {"input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                         "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                "total_tokens": prompt_tokens + output_tokens}

    def finished(self, req: ResponsesRequest, rid: str, created: int, seq: Sequence,
                 item_id: str = "") -> dict[str, Any]:
        """The finished response (stored when asked): its one message, status and usage."""
        status = "incomplete" if seq.finish_reason == "length" else "completed"
        output = [self.message(item_id or "msg_" + secrets.token_hex(8), "".join(seq.pieces), "completed")]
        response = self.body(req, rid, created, output, status,
                             self.usage(req.prompt.tokens, seq.generated, seq.cached_tokens))
        if req.store:
            self._keep(rid, Stored(response, req.messages))
        return response

    # ---- the routes -------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            req = self.parse(await wire.read_json(request))
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return wire.json_response(e.body, e.status)
        if self.runner.refuses(req.prompt.key):
            return wire.internal_error()
        seq = self.runner.generation(req.prompt, req.max_tokens)
        rid, created = "resp_" + secrets.token_hex(8), int(time.time())
        async with self.runner.running(seq):
            if req.stream:
                return await self._stream(request, req, seq, rid, created)
            if not await self.runner.finish(seq):
                return wire.internal_error()
            return wire.json_response(self.finished(req, rid, created, seq))

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            e = not_found(rid)
            return wire.json_response(e.body, e.status)
        return wire.json_response(stored.response)

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            e = not_found(rid)
            return wire.json_response(e.body, e.status)
        # Every response the sim stores has finished (no background mode): vLLM's answer then.
        return wire.json_response(error_body("Cannot cancel a synchronous response.", "invalid_request_error",
                                             400, "response_id"), 400)

    async def _stream(self, request: web.Request, req: ResponsesRequest, seq: Sequence, rid: str,
                      created: int) -> web.StreamResponse:
        """vLLM's semantic events: created, in_progress, the message item and its text part added, one
        ``response.output_text.delta`` per token, then the text, part and item done, and completed.
        Nothing is sent before the first token (as vLLM, which starts on the engine's first output)."""
        resp = web.StreamResponse(headers=wire.SSE_HEADERS)
        await resp.prepare(request)
        events = _Events(resp)
        item_id = "msg_" + secrets.token_hex(8)
        pieces: list[str] = []
        async for idx in seq.stream():
            if not pieces and events.n == 0:
                await self._opening(events, req, rid, created, item_id)
            if self.runner.breaks_stream(events.n, seq):
                break
            pieces.append(seq.pieces[idx])
            await events.send("response.output_text.delta", {
                "content_index": 0, "delta": seq.pieces[idx], "item_id": item_id, "logprobs": [],
                "output_index": 0})
        if not self.runner.finished(seq):
            await events.send("error", {"code": None, "message": "The server had an error while processing "
                                        "your request.", "param": None})
            await resp.write_eof()
            return resp
        text = "".join(pieces)
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        await events.send("response.output_text.done", {"content_index": 0, "item_id": item_id,
                                                         "logprobs": [], "output_index": 0, "text": text})
        await events.send("response.content_part.done", {"content_index": 0, "item_id": item_id,
                                                          "output_index": 0, "part": part})
        await events.send("response.output_item.done", {"item": self.message(item_id, text, "completed"),
                                                         "output_index": 0})
        response = self.finished(req, rid, created, seq, item_id=item_id)
        await events.send("response.completed", {"response": response})
        await resp.write_eof()
        return resp

    async def _opening(self, events: _Events, req: ResponsesRequest, rid: str, created: int,
                       item_id: str) -> None:
        started = self.body(req, rid, created, [], "in_progress", None)
        await events.send("response.created", {"response": started})
        await events.send("response.in_progress", {"response": started})
        await events.send("response.output_item.added", {"item": self.message(item_id, None, "in_progress"),
                                                          "output_index": 0})
        await events.send("response.content_part.added", {
            "content_index": 0, "item_id": item_id, "output_index": 0,
            "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}})


class _Events:
    """Writes ``event:``/``data:`` pairs, numbering them (``sequence_number``) from 0 as vLLM does."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.n = 0

    async def send(self, kind: str, fields: dict[str, Any]) -> None:
        await self.resp.write(wire.named_event(kind, {**fields, "sequence_number": self.n, "type": kind}))
        self.n += 1
