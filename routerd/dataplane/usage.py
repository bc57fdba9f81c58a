"""The usage tap: a response sink in front of the way in's that notes how the engine answered, so the
tenant is billed what the engine counted, never routerd's guess.

It passes every byte on; what it notes is the answer's status and, from upstream, the count:

- a non-streamed answer is one JSON document: upstream holds it whole and reads its ``usage``
  (:func:`usage_of`) into ``ForwardResult.usage``;
- a stream is read by upstream, event by event, the way a resumable stream is
  (:func:`routerd.dataplane.resume.meter`): it asks the engine for the counts on the client's behalf
  and hides what the client did not ask for; upstream returns the count (a resumed stream's whole
  generation) and also hands that reader's count to :meth:`UsageTap.meter` before the first byte, so a
  stream that never returns a result — its client went away, a deadline or a drain cancelled it — is
  billed what the engine generated up to the last event read, not nothing; a non-streamed request
  cancelled while its engine worked gets upstream's estimate the same way.

``headers`` are added to the response's own (the tenant's ``x-ratelimit-*``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from ..tenants.usage import Usage
from .sinks import ResponseSink

__all__ = ["UsageTap", "usage_of"]

Counts = Callable[[], tuple[int, int] | None]


class _Counts(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0  # the Responses API's and Anthropic's names
    output_tokens: int = 0


class _Doc(msgspec.Struct):
    usage: _Counts | None = None


_decode = msgspec.json.Decoder(_Doc).decode


def usage_of(doc: bytes) -> tuple[int, int] | None:
    """The ``usage`` (prompt, completion tokens) of a non-streamed answer's body, or None: OpenAI's
    ``prompt_tokens``/``completion_tokens`` (an embedding's: prompt tokens alone), or the Responses
    API's and Anthropic's ``input_tokens``/``output_tokens``."""
    try:
        usage = _decode(doc).usage
    except (msgspec.DecodeError, RecursionError):
        return None
    if usage is None:
        return None
    return (usage.prompt_tokens or usage.input_tokens, usage.completion_tokens or usage.output_tokens)


class UsageTap:
    """:class:`~routerd.dataplane.sinks.ResponseSink` wrapping ``inner``; :meth:`usage` once the call
    ended."""

    __slots__ = ("_counts", "headers", "inner", "status")

    def __init__(self, inner: ResponseSink, *, headers: Mapping[str, str] | None = None) -> None:
        self.inner = inner
        self.headers = headers
        self.status = 0
        self._counts: Counts | None = None

    def meter(self, counts: Counts) -> None:
        """``counts()``: the engine's count of a stream so far, read when the call ends however it ends
        (``ResumableStream.usage``); for a non-streamed request cancelled while its engine worked,
        upstream's estimate of what it generated."""
        self._counts = counts

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        if self.headers:
            headers = {**headers, **self.headers}
        await self.inner.start(status, headers)

    async def write(self, chunk: bytes) -> None:
        await self.inner.write(chunk)

    def usage(self, reported: tuple[int, int] | None = None) -> Usage | None:
        """What the engine reported for a 2xx answer; None when it reported nothing. ``reported``: the
        count upstream read (``ForwardResult.usage``); without one — the call was cancelled — what the
        meter read, and for a request abandoned before its answer began, upstream's estimate."""
        if self.status == 0 and self._counts is not None:
            counts = self._counts()
            return None if counts is None else Usage(*counts)
        if not 200 <= self.status < 300:
            return None
        if reported is None and self._counts is not None:
            reported = self._counts()
        return None if reported is None else Usage(*reported)
