"""Mid-stream resume: a stream whose engine fails goes on from another instance as the same stream.

:mod:`routerd.dataplane.upstream` moves bytes; this module knows what they mean. For one streamed request
it

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

This module decides (step 1); reading and rewriting (steps 2–4) are
:class:`~routerd.dataplane.resume_stream.ResumableStream`'s. Only a stream that is continued pays for
a re-encoded event; the per-event cost of the others is one msgspec decode of a few fields and, when
usage must be hidden, a byte slice.
"""

from __future__ import annotations

import msgspec

from .resume_stream import (
    CHAT,
    BodyFields,
    ResumableStream,
    StreamOptions,
    decode_body,
    prompt_text,
)

__all__ = ["NOT_CONTINUABLE", "ResumableStream", "meter", "plan", "reader"]

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
    "route": "a route other than /v1/completions and /v1/chat/completions (only those are continued)",
}

_USAGE_OPTIONS_JSON = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
_decode_any = msgspec.json.Decoder().decode
_UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def reader(endpoint: str, body: bytes, *, resumable: bool) -> ResumableStream | str:
    """How upstream reads this streamed request, its body decoded once: a stream it may continue
    (:func:`plan`), one read only for its usage (:func:`meter`), or — the string — why it is passed
    through untouched (``"disabled"`` when resume is off)."""
    try:
        req = decode_body(body)
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
        req = decode_body(body)
    except (msgspec.ValidationError, *_UNREADABLE):
        return "fields"
    return _plan(endpoint, body, req)


def _plan(endpoint: str, body: bytes, req: BodyFields) -> ResumableStream | str:
    why = _obstacle(endpoint, req)
    if why:
        return why
    if req.continue_final_message and endpoint == CHAT and not _final_content_is_text(body):
        return "content"
    return ResumableStream(endpoint, body, req, _with_usage_options(body, req))


def meter(endpoint: str, body: bytes, why: str) -> ResumableStream | None:
    """A :class:`ResumableStream` that is never continued (``why``: the :data:`NOT_CONTINUABLE` key, or
    ``"disabled"``) but reads the stream for its usage, the way a continuable one is read: the engine is
    asked for the counts, the client gets the bytes of its own request. None when that could not be
    faithful — a body routerd cannot read, or several choices the client did not ask usage for (vLLM
    puts ``system_fingerprint`` on each choice's finishing event: holding them all until the usage
    chunk would hold the other choices' text) — and the stream is passed through untouched."""
    try:
        req = decode_body(body)
    except (msgspec.ValidationError, *_UNREADABLE):
        return None
    return _meter(endpoint, body, req, why)


def _meter(endpoint: str, body: bytes, req: BodyFields, why: str) -> ResumableStream | None:
    opts = req.stream_options
    asked = isinstance(opts, StreamOptions) and bool(opts.include_usage)
    if not asked and (req.n not in (None, 1) or req.best_of not in (None, 1) or req.use_beam_search):
        return None
    rs = ResumableStream(endpoint, body, req, _with_usage_options(body, req))
    rs.fixed = why
    return rs


def _given(raw: msgspec.Raw) -> bool:
    return bytes(raw) not in (b"null", b"false", b"[]", b"{}")


def _obstacle(endpoint: str, req: BodyFields) -> str:
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
    if not chat and prompt_text(req.prompt) is None:
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


def _with_usage_options(body: bytes, req: BodyFields) -> bytes:
    """The body asking for per-chunk token counts, spliced in — a body may hold a long prompt, and is
    never re-encoded here. Without ``stream_options`` ours go first; with the client's own (or a null,
    or another component's), ours go last: of two members of one name a JSON parser keeps the last
    (Python's json under FastAPI, pydantic, msgspec), and ours only ever turn counting on."""
    opts = req.stream_options
    if isinstance(opts, StreamOptions) and opts.include_usage and opts.continuous_usage_stats:
        return body
    if opts is msgspec.UNSET:
        i = body.find(b"{") + 1
        sep = b"" if body[i:].lstrip().startswith(b"}") else b","
        return body[:i] + _USAGE_OPTIONS_JSON + sep + body[i:]
    j = body.rfind(b"}")
    return body[:j] + b"," + _USAGE_OPTIONS_JSON + body[j:]
