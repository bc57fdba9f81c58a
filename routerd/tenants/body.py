"""What the tenant path needs to know of an OpenAI request body before it is sent.

An estimate of its prompt tokens, charged against ``tokens_per_minute`` at admission and corrected by
the engine's own count at the end. It is the request view's (:class:`routerd.plugins.RequestView`,
built where the body was parsed for routing): the same figure routing uses, at the fleet's learned
tokens per byte, and the body decoded once. The body goes to upstream as the client sent it: a stream's usage,
which vLLM sends only when ``stream_options.include_usage`` is asked, is asked for by upstream's one
reader of streams (:func:`routerd.dataplane.resume.meter`), which also hides it from a client that did
not ask.

Without a view (an upstream that is not routerd's, in tests) the estimate is the JSON length of the
prompt (or the messages) over four: about one token per four
characters of English text, the messages' JSON keys standing in for the chat template's own tokens.
It is off by tens of percent for other languages and for code; the correction at the end makes the
bucket right, so the error only shifts *when* a tenant near its limit is told to wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ..plugins import RequestView

__all__ = ["RequestFacts", "inspect"]

_CHARS_PER_TOKEN = 4


_ABSENT = msgspec.Raw()  # msgspec cannot decode ``Raw | None``: an empty Raw says "not there"


class _Head(msgspec.Struct):
    prompt: msgspec.Raw = _ABSENT
    messages: msgspec.Raw = _ABSENT


_head = msgspec.json.Decoder(_Head).decode


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """``body`` is what to send the engine: the client's own."""

    prompt_tokens: int
    body: bytes


def inspect(body: bytes, view: RequestView | None = None) -> RequestFacts:
    """The facts of a body that :func:`routerd.ingress.validate.read_head` accepted, ``view`` its
    request view."""
    if view is not None and view.prompt_tokens:
        return RequestFacts(view.prompt_tokens, body)
    try:
        head = _head(body)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return RequestFacts(max(1, len(body) // _CHARS_PER_TOKEN), body)
    raw = bytes(head.prompt or head.messages)
    tokens = max(1, len(raw) // _CHARS_PER_TOKEN)
    if raw[:1] == b"[" and _token_ids(raw):
        tokens = raw.count(b",") + 1  # a prompt given as token ids
    return RequestFacts(tokens, body)


def _token_ids(raw: bytes) -> bool:
    """Whether a JSON array is a flat list of integers (a prompt of token ids)."""
    inner = raw[1:-1].strip()
    return bool(inner) and inner[:1] not in (b'"', b"[", b"{")
