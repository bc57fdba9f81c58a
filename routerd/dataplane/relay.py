"""Relaying one streamed engine response to its sink, and how the stream ended.

:mod:`routerd.dataplane.upstream` decides — which instance, how many attempts, whether a failed stream is
resumed, what a failure costs the instance. This module only moves the bytes of one response and
says how it ended (:class:`Ending`), in one of two ways:

* :func:`passthrough`, byte for byte: a stream that will not be continued elsewhere (the request
  cannot be, or resume is off) reaches the client exactly as the engine sent it, in the pieces it
  arrived in;
* :func:`by_event`, whole events through a :class:`~routerd.dataplane.resume.ResumableStream` that reads and
  rewrites them: a stream that may be continued on another instance never leaves half an event at
  the client, and a continuation's events join the client's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import quote
from ..surface import EventReader
from .engine_http import Response
from .resume_stream import ResumableStream
from .sinks import ResponseSink

__all__ = ["ERROR_MARK", "EVENT_ERROR_MARK", "NET_ERRORS", "Ending", "InstanceLost", "by_event", "events",
           "first_output",
           "passthrough"]

ERROR_MARK = b'data: {"error"'
EVENT_ERROR_MARK = b"event: error"  # a named-event stream's (the Responses API's, Anthropic's)
_DONE = b"data: [DONE]"
_TAIL = 32  # bytes of the previous chunk kept to find marks split across chunk boundaries
# What a read of the engine's body may fail with (routerd.dataplane.engine_http raises only these).
NET_ERRORS = (TimeoutError, OSError)


class InstanceLost(ConnectionError):
    """The instance was declared failed (``Instance.lose``) while a response from it was being read."""


@dataclass(slots=True)
class Ending:
    """How a relayed stream ended. ``failure``: the engine failed it — ``disconnect``, ``timeout``,
    ``instance_lost``, ``incomplete`` (closed before ``[DONE]``) or, for :func:`by_event`,
    ``error_event`` (an error event with a 5xx code, not passed on) — with ``message``;
    ``engine_error``: the engine ended it with an error event the client got."""

    failure: str = ""
    message: str = ""
    engine_error: bool = False


def _broken(e: BaseException) -> Ending:
    kind = "instance_lost" if isinstance(e, InstanceLost) else \
        "timeout" if isinstance(e, TimeoutError) else "disconnect"
    return Ending(kind, f"the engine failed mid-stream ({type(e).__name__}: {e})")


async def passthrough(resp: Response, sink: ResponseSink, first: bytes, sse: bool) -> Ending:
    """Copy the rest of a stream (``first`` already went to the sink) as raw bytes. An error event the
    engine sent passes on, ended with ``[DONE]`` if the engine did not; the terminal event of a
    failure is the caller's to write."""
    tail = first[-_TAIL:]
    saw_error = ERROR_MARK in first
    read = resp.readany
    while True:
        try:
            chunk = await read()
        except NET_ERRORS as e:
            return _broken(e)
        if not chunk:
            break
        await sink.write(chunk)
        if not saw_error and (ERROR_MARK in chunk or ERROR_MARK in tail + chunk[:_TAIL]):
            saw_error = True
        tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
    if saw_error:
        if _DONE not in tail:
            await sink.write(b"data: [DONE]\n\n")
        return Ending(engine_error=True, message="the engine sent an error event mid-stream")
    if sse and _DONE not in tail:
        return Ending("incomplete", "the engine closed the stream before [DONE]")
    return Ending()


async def events(resp: Response, sink: ResponseSink, first: bytes, reader: EventReader) -> Ending:
    """Copy the rest of a named-event stream (``first`` already went to the sink) byte for byte,
    ``reader`` reading it on the way: an ``event: error`` is the engine's (passed on as it is); a
    stream that closed before its route's terminal event is incomplete."""
    reader.feed(first)
    read = resp.readany
    while True:
        try:
            chunk = await read()
        except NET_ERRORS as e:
            return _broken(e)
        if not chunk:
            break
        reader.feed(chunk)
        await sink.write(chunk)
    if reader.error:
        return Ending(engine_error=True, message="the engine sent an error event mid-stream")
    if not reader.complete:
        return Ending("incomplete", f"the engine closed the stream before its last event (the last was "
                                    f"{quote(reader.last) or 'none'})")
    return Ending()


async def by_event(resp: Response, sink: ResponseSink, first: bytes, rs: ResumableStream,
                   clock: Callable[[], float], gap: Callable[[float], None]) -> Ending:
    """Copy a continuable stream (``first`` included) as :meth:`ResumableStream.feed` makes it.

    An error event with a 5xx code says the engine failed (its engine core died, a generation failed):
    it is not passed on, the caller continues the stream; one with another code blames the request and
    ends the stream. ``gap(seconds)`` is told the pause the client saw across a resume, on the first
    bytes written after it."""
    read = resp.readany
    chunk = first
    while True:
        out = rs.feed(chunk)
        if out:
            await sink.write(out)
            now = clock()
            if rs.gap_from:
                gap(now - rs.gap_from)
                rs.gap_from = 0.0
            rs.wrote_at = now
        if rs.error is not None and rs.error_code >= 500:
            return Ending("error_event", "the engine sent an error event mid-stream: "
                          + quote(rs.error_message()))
        try:
            chunk = await read()
        except NET_ERRORS as e:
            return _broken(e)
        if not chunk:
            break
    if rs.error is not None:
        await sink.write(rs.pass_error())
        return Ending(engine_error=True,
                      message="the engine sent an error event mid-stream: " + quote(rs.error_message()))
    if not rs.done:
        return Ending("incomplete", "the engine closed the stream before [DONE]")
    return Ending()


# The Responses API's two opening events: vLLM sends them at once, before the prefill (its
# ``responses_stream_generator`` yields them before it awaits the engine's first output).
_OPENING = (b"response.created", b"response.in_progress")


def _event_type(event: bytes) -> bytes:
    if event.startswith(b"event: "):
        end = event.find(b"\n")
        return event[7:end] if end >= 0 else event[7:]
    i = event.find(b'"type":"')
    return event[i + 8:event.find(b'"', i + 8)] if i >= 0 else b""


async def first_output(resp: Response, first: bytes) -> tuple[bytes, bytes]:
    """A Responses stream's bytes up to its first event after ``response.created`` and
    ``response.in_progress``, and that event's type (b"" if the stream ended first). Those two say
    nothing of whether the engine can serve the request: until an event after them, nothing reaches the
    client, and a failure is retried on another instance like one before any other stream's first byte
    (issue 29)."""
    buf, start = first, 0
    while True:
        end = buf.find(b"\n\n", start)
        while end >= 0:
            event = buf[start:end].lstrip(b"\r\n")
            if event and _event_type(event) not in _OPENING:
                return buf, _event_type(event)
            start = end + 2
            end = buf.find(b"\n\n", start)
        chunk = await resp.readany()
        if not chunk:
            return buf, b""
        buf += chunk
