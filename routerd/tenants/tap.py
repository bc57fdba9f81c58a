"""A response sink in front of another that notes the usage the engine reported.

It sits between upstream and the client's sink (an HTTP response, a queue job's result or reply
stream) and passes every byte on, so routerd bills what the engine counted, never its own guess:

- a non-streamed answer is one JSON document: its ``usage`` is read when the request ends;
- a stream is read by upstream, event by event, the way a resumable stream is
  (:func:`routerd.dataplane.resume.meter`): it asks the engine for the counts on the client's behalf and hides
  what the client did not ask for, so the client gets the bytes of its own request; upstream returns
  the count (``ForwardResult.usage``, a resumed stream's whole generation) and :meth:`UsageTap.usage`
  is given it. One reader of the engine's events, one notion of what the client asked for. Upstream
  also hands that reader's count to :meth:`UsageTap.meter` before the first byte, so a stream that
  never returns a result — its client went away, a deadline or a drain cancelled it — is billed
  what the engine generated up to the last event read, not nothing.

``headers`` are added to the response's own (the tenant's ``x-ratelimit-*``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import msgspec

if TYPE_CHECKING:
    from ..dataplane.sinks import ResponseSink

__all__ = ["Usage", "UsageTap"]

class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _Counts(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Doc(msgspec.Struct):
    usage: _Counts | None = None


_decode = msgspec.json.Decoder(_Doc).decode


def _usage_of(doc: bytes) -> Usage | None:
    try:
        usage = _decode(doc).usage
    except (msgspec.DecodeError, RecursionError):
        return None
    return None if usage is None else Usage(usage.prompt_tokens, usage.completion_tokens)


class UsageTap:
    """:class:`routerd.dataplane.sinks.ResponseSink` wrapping ``inner``; :meth:`usage` once the call ended."""

    __slots__ = ("_chunks", "_counts", "_stream", "headers", "inner", "status")

    def __init__(self, inner: ResponseSink, *, stream: bool,
                 headers: Mapping[str, str] | None = None) -> None:
        self.inner = inner
        self.headers = headers
        self.status = 0
        self._stream = stream
        self._chunks: list[bytes] = []  # a non-streamed answer's body
        self._counts: Callable[[], tuple[int, int] | None] | None = None  # a stream's reader's count

    def meter(self, counts: Callable[[], tuple[int, int] | None]) -> None:
        """``counts()``: the engine's count of a stream so far, read when the call ends however it ends
        (upstream's ``ResumableStream.usage``); for a non-streamed request cancelled
        while its engine worked, upstream's estimate of what it generated."""
        self._counts = counts

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        if self.headers:
            headers = {**headers, **self.headers}
        await self.inner.start(status, headers)

    async def write(self, chunk: bytes) -> None:
        if not self._stream:
            self._chunks.append(chunk)
        await self.inner.write(chunk)

    def usage(self, streamed: tuple[int, int] | None = None) -> Usage | None:
        """What the engine reported for a 2xx answer; None when it reported nothing. ``streamed``: a
        stream's count as upstream read it (``ForwardResult.usage``). A request abandoned before its
        answer began (no status) has upstream's estimate, when it gave one."""
        if self.status == 0 and self._counts is not None:
            counts = self._counts()
            return None if counts is None else Usage(*counts)
        if not 200 <= self.status < 300:
            return None
        if self._stream:
            if streamed is None and self._counts is not None:  # the call was cancelled: what was read
                streamed = self._counts()
            return None if streamed is None else Usage(*streamed)
        return _usage_of(b"".join(self._chunks))
