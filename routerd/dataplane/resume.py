"""Mid-stream resume: a stream whose engine fails goes on from another instance as the same stream.

:mod:`routerd.dataplane.upstream` moves bytes; this module knows what they mean. For one streamed request it

1. decides before the first attempt whether the request can be continued faithfully at all
   (:func:`plan`; what cannot is :data:`NOT_CONTINUABLE`) and, if so, asks the engine for
   ``stream_options.include_usage`` + ``continuous_usage_stats``: every chunk then carries the number of
   completion tokens generated so far. That is how routerd knows exactly how many tokens the client was
   sent — counting events would not: an event may carry several tokens, or none while text is held back;
2. reads each event on its way to the client (msgspec, only the fields it needs): the text and the token
   count so far and the stream's ``id``/``created``/``model``. Usage the client did not ask for is cut
   out of the bytes, and chat's ``system_fingerprint`` moved back onto the finishing event where vLLM
   puts it without ``include_usage``, so the client gets the bytes it would have got without it. Only
   whole events are forwarded, so a failure never leaves half an event at the client;
3. after a failure builds the request that continues the generation (:meth:`ResumableStream.
   continuation`): ``/v1/completions`` gets the prompt plus the text already sent, chat the messages
   plus the partial assistant message with vLLM's ``continue_final_message: true,
   add_generation_prompt: false``; ``max_tokens`` (``max_completion_tokens``) and ``min_tokens`` shrink
   by the tokens already sent;
4. rewrites the continuation's events into the first stream's: its ``id``, ``created`` and ``model``,
   chat's second role chunk dropped, usage counted over the whole generation (the first request's
   prompt, the completion tokens of every part) — so ``finish_reason`` and usage describe it all.

The same reading serves a stream that is never continued but whose usage routerd bills (:func:`meter`):
there is one notion of what the client asked for, its own body, and one reader of the engine's events.

Only a stream that is continued pays for a re-encoded event; the per-event cost of the others is one
msgspec decode of a few fields and, when usage must be hidden, a byte slice.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import sse_error_event

__all__ = ["NOT_CONTINUABLE", "ResumableStream", "meter", "plan", "reader"]

CHAT = "/v1/chat/completions"

# Why a request cannot be continued faithfully on another instance (README, "Resume"): its stream ends
# as before, with the terminal error event. Checked on the request before it is sent, and — for what
# only the output shows — on the events that reached the client.
NOT_CONTINUABLE: dict[str, str] = {
    "n": "n > 1 (several choices streamed interleaved)",
    "best_of": "best_of > 1 or beam search (the output is chosen at the end)",
    "echo": "echo (the prompt is part of the output)",
    "logprobs": "logprobs on /v1/completions (text_offset counts from the start of the output)",
    "prompt_logprobs": "prompt_logprobs (they describe a prompt the continuation changes)",
    "tools": "tools (a tool call's arguments follow a grammar that cannot start over mid-way)",
    "structured": "structured output: response_format json, structured_outputs, guided_* (a grammar "
                  "that cannot start over mid-way)",
    "kv_transfer": "kv_transfer_params (disaggregated prefill)",
    "prompt": "a /v1/completions prompt that is not one string (token ids or a batch)",
    "fields": "a field routerd cannot read (the engine will say what is wrong with it)",
    "reasoning": "reasoning or tool-call output already sent (a parser's state cannot be rebuilt)",
    "unreadable": "an event routerd could not read",
    "uncounted": "no token counts from the engine (it ignored stream_options.continuous_usage_stats)",
    "content": "continue_final_message on a final message whose content is not a string",
    "budget": "the token budget is spent but the engine never said the generation finished",
}

_USAGE_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_USAGE_OPTIONS_JSON = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
_NULL = msgspec.Raw(b"null")
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens when the client sends none
_MAX_EVENT_BYTES = 1 << 20  # bytes without an event's end after which they are passed on unread
_encode = msgspec.json.Encoder().encode
_decode_any = msgspec.json.Decoder().decode
_UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Request(msgspec.Struct):
    """The fields of an OpenAI request body that decide whether its stream can be continued."""

    prompt: msgspec.Raw = _NULL
    n: int | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None
    echo: bool | None = None
    logprobs: msgspec.Raw = _NULL
    prompt_logprobs: msgspec.Raw = _NULL
    tools: msgspec.Raw = _NULL
    tool_choice: msgspec.Raw = _NULL
    response_format: msgspec.Raw = _NULL
    structured_outputs: msgspec.Raw = _NULL
    guided_json: msgspec.Raw = _NULL
    guided_regex: msgspec.Raw = _NULL
    guided_choice: msgspec.Raw = _NULL
    guided_grammar: msgspec.Raw = _NULL
    kv_transfer_params: msgspec.Raw = _NULL
    continue_final_message: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream_options: _StreamOptions | msgspec.UnsetType | None = msgspec.UNSET


class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int | None = None


class _Ident(msgspec.Struct):
    """What makes the client's stream one stream, read from its first event only."""

    id: str | None = None
    created: int | None = None
    model: str | None = None


class _Event(msgspec.Struct):
    """What routerd reads of every streamed chunk (everything else is skipped by the decoder)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    system_fingerprint: str | None = None
    error: msgspec.Raw = _NULL


_decode_request = msgspec.json.Decoder(_Request).decode
_decode_event = msgspec.json.Decoder(_Event).decode
_decode_ident = msgspec.json.Decoder(_Ident).decode


def reader(endpoint: str, body: bytes, *, resumable: bool) -> ResumableStream | str:
    """How upstream reads this streamed request, its body decoded once: a stream it may continue
    (:func:`plan`), one read only for its usage (:func:`meter`), or — the string — why it is passed
    through untouched (``"disabled"`` when resume is off)."""
    try:
        req = _decode_request(body)
    except (msgspec.ValidationError, *_UNREADABLE):
        return "fields" if resumable else "disabled"
    planned = _plan(endpoint, body, req) if resumable else "disabled"
    if not isinstance(planned, str):
        return planned
    return _meter(endpoint, body, req, planned) or planned


def plan(endpoint: str, body: bytes) -> ResumableStream | str:
    """A :class:`ResumableStream` for this streamed request, or the key in :data:`NOT_CONTINUABLE`
    of why it cannot be continued (its stream is then passed through untouched, as before)."""
    try:
        req = _decode_request(body)
    except (msgspec.ValidationError, *_UNREADABLE):
        return "fields"
    return _plan(endpoint, body, req)


def _plan(endpoint: str, body: bytes, req: _Request) -> ResumableStream | str:
    why = _obstacle(endpoint, req)
    if why:
        return why
    if req.continue_final_message and endpoint == CHAT and not _final_content_is_text(body):
        return "content"
    return ResumableStream(endpoint, body, req)


def meter(endpoint: str, body: bytes, why: str) -> ResumableStream | None:
    """A :class:`ResumableStream` that is never continued (``why``: the :data:`NOT_CONTINUABLE` key, or
    ``"disabled"``) but reads the stream for its usage, the way a continuable one is read: the engine is
    asked for the counts, the client gets the bytes of its own request. None when that could not be
    faithful — a body routerd cannot read, or several choices the client did not ask usage for (vLLM
    puts ``system_fingerprint`` on each choice's finishing event: holding them all until the usage
    chunk would hold the other choices' text) — and the stream is passed through untouched."""
    try:
        req = _decode_request(body)
    except (msgspec.ValidationError, *_UNREADABLE):
        return None
    return _meter(endpoint, body, req, why)


def _meter(endpoint: str, body: bytes, req: _Request, why: str) -> ResumableStream | None:
    opts = req.stream_options
    asked = isinstance(opts, _StreamOptions) and bool(opts.include_usage)
    if not asked and (req.n not in (None, 1) or req.best_of not in (None, 1) or req.use_beam_search):
        return None
    rs = ResumableStream(endpoint, body, req)
    rs.fixed = why
    return rs


def _given(raw: msgspec.Raw) -> bool:
    return bytes(raw) not in (b"null", b"false", b"[]", b"{}")


def _obstacle(endpoint: str, req: _Request) -> str:
    chat = endpoint == CHAT
    if req.n not in (None, 1):
        return "n"
    if req.best_of not in (None, 1) or req.use_beam_search:
        return "best_of"
    if req.echo:
        return "echo"
    if (not chat and _given(req.logprobs)) or _given(req.prompt_logprobs):
        return "logprobs" if not chat and _given(req.logprobs) else "prompt_logprobs"
    if _given(req.tools) and bytes(req.tool_choice) != b'"none"':
        return "tools"
    if any(_given(r) for r in (req.structured_outputs, req.guided_json, req.guided_regex,
                               req.guided_choice, req.guided_grammar)) or _structured(req.response_format):
        return "structured"
    if _given(req.kv_transfer_params):
        return "kv_transfer"
    if not chat and _prompt_text(req.prompt) is None:
        return "prompt"
    return ""


def _final_content_is_text(body: bytes) -> bool:
    """For a chat request that continues its own final message: that message's content is a string
    (the text sent is appended to it). Read only for such requests: it decodes the whole body."""
    messages = _decode_any(body).get("messages")
    return bool(messages) and isinstance(messages[-1], dict) and isinstance(messages[-1].get("content"), str)


def _structured(raw: msgspec.Raw) -> bool:
    if not _given(raw):
        return False
    try:
        doc = _decode_any(raw)
    except _UNREADABLE:
        return True
    return not (isinstance(doc, dict) and doc.get("type") == "text")


def _prompt_text(raw: msgspec.Raw | Any) -> str | None:
    """The completion prompt when it is one string (or a batch of exactly one string), else None."""
    prompt = _decode_any(raw) if isinstance(raw, msgspec.Raw) else raw
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _with_usage_options(body: bytes, req: _Request) -> bytes:
    """The body asking for per-chunk token counts, spliced in — a body may hold a long prompt, and is
    never re-encoded here. Without ``stream_options`` ours go first; with the client's own (or a null,
    or another component's), ours go last: of two members of one name a JSON parser keeps the last
    (Python's json under FastAPI, pydantic, msgspec), and ours only ever turn counting on."""
    opts = req.stream_options
    if isinstance(opts, _StreamOptions) and opts.include_usage and opts.continuous_usage_stats:
        return body
    if opts is msgspec.UNSET:
        i = body.find(b"{") + 1
        sep = b"" if body[i:].lstrip().startswith(b"}") else b","
        return body[:i] + _USAGE_OPTIONS_JSON + sep + body[i:]
    j = body.rfind(b"}")
    return body[:j] + b"," + _USAGE_OPTIONS_JSON + body[j:]


def _cut_usage(event: bytes) -> bytes:
    """``event`` without its top-level ``"usage":{…}`` member. JSON strings escape their quotes, so
    ``,"usage":{`` cannot occur inside one, and a usage object holds only numbers, nulls and objects."""
    i = event.rfind(b',"usage":{')  # it follows the choices: near the end
    if i < 0:
        return event
    j = i + len(b',"usage":{')
    depth = 1
    while True:
        close = event.find(b"}", j)
        if close < 0:
            return event  # malformed: leave it as the engine sent it
        opening = event.find(b"{", j, close)
        if opening >= 0:
            depth += 1
            j = opening + 1
            continue
        depth -= 1
        j = close + 1
        if depth == 0:
            return event[:i] + event[j:]


def _error_code(raw: msgspec.Raw) -> int:
    try:
        err = _decode_any(raw)
    except _UNREADABLE:
        return 500
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) else 500


class ResumableStream:
    """One streamed request's progress as its client saw it, and how to continue it elsewhere.

    Upstream sends :attr:`engine_body` first, passes each engine read through :meth:`feed` and writes
    what it returns; after a failure it asks :meth:`why_not`, then sends :meth:`continuation` to another
    instance and goes on feeding. ``wrote_at`` and ``gap_from`` are upstream's timing of the stream.
    """

    __slots__ = ("_base", "_buf", "_held", "_limit", "_rewrite", "body", "chat", "client_continuous",
                 "client_usage", "counted", "done", "engine_body", "error", "error_code", "finished", "fixed",
                 "gap_from", "ident", "obstacle", "parts", "prompt_tokens", "started", "tokens", "wrote_at")

    def __init__(self, endpoint: str, body: bytes, req: _Request) -> None:
        self.chat = endpoint == CHAT
        self.body = body  # the client's own: continuations are built from it
        opts = req.stream_options
        self.client_usage = isinstance(opts, _StreamOptions) and bool(opts.include_usage)
        self.client_continuous = self.client_usage and isinstance(opts, _StreamOptions) \
            and bool(opts.continuous_usage_stats)
        self.engine_body = _with_usage_options(body, req)
        self.fixed = ""  # read for its usage only, never continued: why (see :func:`meter`)
        self.started = False  # the client has the response headers (set by upstream)
        self.parts: list[str] = []  # the generated text the client has
        self.tokens = 0  # completion tokens the client has
        self.prompt_tokens = 0  # of the first request: usage describes the client's prompt
        self.counted = False  # an event carried a token count
        self.ident: tuple[str, int, str] | None = None  # id, created, model of the client's stream
        self.finished = False  # an event with a finish_reason was read
        self.done = False  # ``[DONE]`` was read
        self.error: bytes | None = None  # the engine's error event (not forwarded)
        self.error_code = 0
        self.obstacle = ""  # a NOT_CONTINUABLE key the output revealed
        self.wrote_at = 0.0
        self.gap_from = 0.0
        self._base = 0  # tokens the client had when the current continuation began
        self._buf = b""
        self._held: bytes | None = None  # the finishing event, until the fingerprint after it is known
        self._rewrite = False  # the events come from a continuation
        # The completion-token limit of the whole generation; None: chat without one (the context).
        self._limit: int | None
        if self.chat:
            self._limit = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
        else:
            self._limit = req.max_tokens if req.max_tokens is not None else _COMPLETIONS_DEFAULT_MAX_TOKENS

    # ---- events ---------------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> bytes:
        """The bytes the client gets for this read of the engine's stream (whole events only)."""
        if self._buf:
            chunk = self._buf + chunk
        if b"\r" in chunk:  # vLLM frames with \n only; another server may not
            chunk = chunk.replace(b"\r\n", b"\n")
        end = chunk.rfind(b"\n\n")
        if end < 0:
            if len(chunk) > _MAX_EVENT_BYTES:  # not SSE as vLLM frames it: pass it on, continue nothing
                self._buf = b""
                self.obstacle = self.obstacle or "unreadable"
                return chunk
            self._buf = chunk
            return b""
        self._buf = chunk[end + 2:]
        if self.error is not None or self.done:
            return b""
        if chunk.find(b"\n") == end:  # one event, the usual read (JSON escapes its own newlines)
            return self._event(chunk[:end])
        events = chunk[:end].split(b"\n\n")
        out = []
        for event in events:
            out.append(self._event(event))
            if self.error is not None or self.done:
                break
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event + b"\n\n"  # a comment or keep-alive
        payload = event[6:]
        if payload == b"[DONE]":
            self.done = True
            return self._release() + b"data: [DONE]\n\n"
        try:
            e = _decode_event(payload)
        except (msgspec.ValidationError, *_UNREADABLE):
            self.obstacle = self.obstacle or "unreadable"
            return self._release() + event + b"\n\n"
        if e.error is not _NULL and bytes(e.error) != b"null":  # absent: the default object itself
            self.error, self.error_code = event + b"\n\n", _error_code(e.error)
            return b""
        if self.ident is None:
            head = _decode_ident(payload)
            if head.id is not None:
                self.ident = (head.id, head.created or 0, head.model or "")
        choice = e.choices[0] if e.choices else None
        if choice is not None:
            if self._rewrite and self.chat and choice.delta is not None and choice.delta.role \
                    and not choice.delta.content:
                return b""  # the continuation's role chunk: the client had one
            self._note(choice, len(e.choices or ()))
        usage = e.usage
        if usage is not None and usage.completion_tokens is not None:
            self.counted = True
            self.tokens = self._base + usage.completion_tokens
            if not self._rewrite:
                self.prompt_tokens = usage.prompt_tokens
        if self._rewrite:
            return self._output_rewritten(payload, choice is not None, e.system_fingerprint)
        return self._output(event, choice is not None, usage is not None, e.system_fingerprint)

    def _note(self, choice: _Choice, n: int) -> None:
        if n > 1 or choice.index != 0:
            self.obstacle = self.obstacle or "n"
        if self.chat:
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    self.parts.append(delta.content)
                if delta.tool_calls or delta.reasoning or delta.reasoning_content:
                    self.obstacle = self.obstacle or "reasoning"
        elif choice.text:
            self.parts.append(choice.text)
        if choice.finish_reason is not None:
            self.finished = True

    def _output(self, event: bytes, has_choice: bool, has_usage: bool, fingerprint: str | None) -> bytes:
        """A first attempt's event as the client asked for it: sliced, never re-encoded."""
        if self.client_continuous or not has_usage:
            return self._hold_if_final(event + b"\n\n", has_choice)
        if not has_choice:  # the final usage chunk
            if self.client_usage:
                return self._release() + event + b"\n\n"
            return self._release(fingerprint)
        return self._hold_if_final(_cut_usage(event) + b"\n\n", has_choice)

    def _output_rewritten(self, payload: bytes, has_choice: bool, fingerprint: str | None) -> bytes:
        """A continuation's event, re-encoded as part of the client's stream."""
        doc = _decode_any(payload)
        if not isinstance(doc, dict):
            return b""
        assert self.ident is not None
        for key, value in zip(("id", "created", "model"), self.ident, strict=True):
            if key in doc:
                doc[key] = value
        usage = doc.get("usage")
        if isinstance(usage, dict):
            usage["prompt_tokens"] = self.prompt_tokens
            usage["completion_tokens"] = self.tokens
            usage["total_tokens"] = self.prompt_tokens + self.tokens
            if not has_choice:
                if not self.client_usage:
                    return self._release(fingerprint)
            elif not self.client_continuous:
                del doc["usage"]
        return self._hold_if_final(b"data: " + _encode(doc) + b"\n\n", has_choice)

    def _hold_if_final(self, out: bytes, has_choice: bool) -> bytes:
        """Without ``include_usage`` vLLM puts ``system_fingerprint`` on the finishing event; asked for
        usage, it puts it on the usage chunk that follows. Hold the finishing event until then."""
        if self._held is not None:
            return self._release() + out
        if has_choice and self.finished and not self.client_usage:
            self._held = out
            return b""
        return out

    def _release(self, fingerprint: str | None = None) -> bytes:
        held, self._held = self._held, None
        if held is None:
            return b""
        if fingerprint is not None and held.endswith(b"}\n\n"):
            held = held[:-3] + b',"system_fingerprint":' + _encode(fingerprint) + b"}\n\n"
        return held

    def usage(self) -> tuple[int, int] | None:
        """The engine's count, prompt and completion tokens, over the whole generation (every part of
        a continued stream) as far as the client got it; None when no event carried one."""
        return (self.prompt_tokens, self.tokens) if self.counted else None

    # ---- endings ----------------------------------------------------------------------------------

    def why_not(self) -> str:
        """The :data:`NOT_CONTINUABLE` key of why this stream cannot be continued now, or ``""``."""
        if self.obstacle:
            return self.obstacle
        if self.ident is not None and not self.counted:
            return "uncounted"
        if not self.finished and self._limit is not None and self._limit <= self.tokens:
            return "budget"
        return ""

    def complete(self) -> bytes:
        """The end of a stream whose generation had finished when its engine failed (only the usage
        chunk and ``[DONE]`` were lost): no engine is needed to end it."""
        out = self._release()
        if self.client_usage and self.ident is not None:
            rid, created, model = self.ident
            usage = {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + self.tokens,
                     "completion_tokens": self.tokens}
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            chunk: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model,
                                     "choices": [], "usage": usage}
            out += b"data: " + _encode(chunk) + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def cut(self, message: str) -> bytes:
        """routerd's terminal error event for a stream that is not continued."""
        return self._release() + sse_error_event(message, "UpstreamError", 502)

    def pass_error(self) -> bytes:
        """The engine's own error event (one that blames the request), then ``[DONE]``."""
        return self._release() + (self.error or b"") + b"data: [DONE]\n\n"

    def error_message(self) -> str:
        if self.error is None:
            return ""
        try:
            doc = _decode_any(self.error[6:].strip())
            return str(doc["error"]["message"])
        except (*_UNREADABLE, KeyError, TypeError):
            return "error event"

    def continuation(self) -> bytes:
        """The request that continues the generation from what the client has (call after
        :meth:`why_not` said it can); later events are rewritten into the client's stream."""
        self._buf = b""
        self.error = None
        self.done = False
        if self.ident is None:  # no event reached the client: the first request, once more
            return self.engine_body
        doc = _decode_any(self.body)
        sent, text = self.tokens, "".join(self.parts)
        if self.chat:
            if text:
                messages = doc["messages"]
                if doc.get("continue_final_message"):  # its content is a string: checked by plan()
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
                else:
                    messages.append({"role": "assistant", "content": text})
                doc["continue_final_message"] = True
                doc["add_generation_prompt"] = False
            for key in ("max_completion_tokens", "max_tokens"):
                if isinstance(doc.get(key), int):
                    doc[key] -= sent
        else:
            doc["prompt"] = (_prompt_text(doc["prompt"]) or "") + text
            doc["max_tokens"] = (self._limit or _COMPLETIONS_DEFAULT_MAX_TOKENS) - sent
        if isinstance(doc.get("min_tokens"), int):
            doc["min_tokens"] = max(0, doc["min_tokens"] - sent)
        doc["stream_options"] = dict(_USAGE_OPTIONS)
        self._base = sent
        self._rewrite = True
        return _encode(doc)
