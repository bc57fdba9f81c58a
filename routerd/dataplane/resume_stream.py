"""A resumable stream's events as its client sees them: read, rewritten, and continued.

:class:`ResumableStream` reads each event on its way to the client — the text and the token count so
far, the stream's ``id``/``created``/``model`` — cuts usage the client did not ask for, and after a
failure builds the request that continues the generation and rewrites the continuation's events into
the first stream's. Whether a request gets one at all is decided before it is sent
(:mod:`routerd.dataplane.resume`, whose docstring tells the whole of it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import sse_error_event

__all__ = ["CHAT", "BodyFields", "ResumableStream", "StreamOptions", "decode_body",
           "prompt_text"]

CHAT = "/v1/chat/completions"

_USAGE_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_NULL = msgspec.Raw(b"null")
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens when the client sends none
_MAX_EVENT_BYTES = 1 << 20  # bytes without an event's end after which they are passed on unread
_encode = msgspec.json.Encoder().encode
_decode_any = msgspec.json.Decoder().decode
_UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class BodyFields(msgspec.Struct):
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
    stream_options: StreamOptions | msgspec.UnsetType | None = msgspec.UNSET


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


decode_body = msgspec.json.Decoder(BodyFields).decode
_decode_event = msgspec.json.Decoder(_Event).decode
_decode_ident = msgspec.json.Decoder(_Ident).decode


def prompt_text(raw: msgspec.Raw | Any) -> str | None:
    """The completion prompt when it is one string (or a batch of exactly one string), else None."""
    prompt = _decode_any(raw) if isinstance(raw, msgspec.Raw) else raw
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None




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

    def __init__(self, endpoint: str, body: bytes, req: BodyFields, engine_body: bytes) -> None:
        self.chat = endpoint == CHAT
        self.body = body  # the client's own: continuations are built from it
        opts = req.stream_options
        self.client_usage = isinstance(opts, StreamOptions) and bool(opts.include_usage)
        self.client_continuous = self.client_usage and isinstance(opts, StreamOptions) \
            and bool(opts.continuous_usage_stats)
        self.engine_body = engine_body
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
        """The ``resume.NOT_CONTINUABLE`` key of why this stream cannot be continued now, or ``""``."""
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
            doc["prompt"] = (prompt_text(doc["prompt"]) or "") + text
            doc["max_tokens"] = (self._limit or _COMPLETIONS_DEFAULT_MAX_TOKENS) - sent
        if isinstance(doc.get("min_tokens"), int):
            doc["min_tokens"] = max(0, doc["min_tokens"] - sent)
        doc["stream_options"] = dict(_USAGE_OPTIONS)
        self._base = sent
        self._rewrite = True
        return _encode(doc)
