"""Where the upstream writes a queue job's response: in memory for plain jobs, to the reply stream for
streamed ones (each SSE event becomes one ``chunk`` entry, in order, before the result: its ``data``
as the route's stream has it — OpenAI's chunks, the Responses API's or Anthropic's events, each of
which names its ``type``).

Both implement :class:`routerd.dataplane.sinks.ResponseSink`, the one contract the upstream writes to (the
HTTP ingress's sink is the other implementation)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import redis.exceptions

from ...queue_wire import Chunk, Result, error_result, json_encode
from .results import JobStore

INSTANCE_HEADER = "x-routerd-instance"


class ReplyRefused(Exception):
    """Redis refused a streamed job's chunk (``reply_to`` is not a stream, out of memory…); raised out
    of the sink, so the engine call ends (and the engine aborts) at once."""

    def __init__(self, reply_to: str, error: str) -> None:
        super().__init__(error)
        self.reply_to = reply_to
        self.error = error

    @property
    def permanent(self) -> bool:
        """Another delivery would fail the same way: the key is of another type."""
        return self.error.startswith("WRONGTYPE")


_decode = msgspec.json.Decoder().decode
# What decoding an engine's bytes can raise besides malformed JSON: strings that are not UTF-8, and
# nesting too deep for the decoder. Either way the bytes are passed on as text, never a crash.
_UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class _Sink:
    def __init__(self, on_instance: Callable[[str], None]) -> None:
        self._on_instance = on_instance
        self.status = 0
        self._parts: list[bytes] = []

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        instance = headers.get(INSTANCE_HEADER) or headers.get(INSTANCE_HEADER.title())
        if instance:
            self._on_instance(instance)

    def _error_from_body(self, job_id: str, instance: str, attempts: int, status: int) -> Result:
        body = b"".join(self._parts)
        try:
            obj: Any = _decode(body)
        except _UNREADABLE:
            obj = None
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict):
            return Result(id=job_id, status="error", error=err, instance=instance, attempts=attempts)
        text = body[:500].decode(errors="replace") or f"upstream status {status}"
        return error_result(job_id, text, "UpstreamError", status or 502, instance=instance,
                            attempts=attempts)


class BufferSink(_Sink):
    """Collects a non-streamed response; the result embeds the engine's JSON byte for byte."""

    async def write(self, chunk: bytes) -> None:
        self._parts.append(chunk)

    def result(self, job_id: str, instance: str, attempts: int, status: int) -> Result:
        if not 200 <= status < 300:
            return self._error_from_body(job_id, instance, attempts, status)
        body = b"".join(self._parts)
        try:
            _decode(body)
        except _UNREADABLE:
            return error_result(job_id, "the engine's response is not valid JSON", "UpstreamError", 502,
                                instance=instance, attempts=attempts)
        return Result(id=job_id, status="ok", response=msgspec.Raw(body), instance=instance,
                      attempts=attempts)


class StreamSink(_Sink):
    """Turns SSE events into ``chunk`` entries on ``reply_to``, each written before the next is read."""

    def __init__(self, store: JobStore, job_id: str, reply_to: str, run: int,
                 on_instance: Callable[[str], None]) -> None:
        super().__init__(on_instance)
        self._store = store
        self._job_id = job_id
        self._reply_to = reply_to
        self._run = run
        self._buf = b""
        self.seq = 0
        self.failed = False
        self._usage: Any = None  # the last usage the events carried

    async def write(self, chunk: bytes) -> None:
        if self.status != 200:
            self._parts.append(chunk)
            return
        self._buf += chunk.replace(b"\r\n", b"\n")
        *events, self._buf = self._buf.split(b"\n\n")
        futures: list[asyncio.Future[Any]] = []
        for event in events:
            name = b""
            for line in event.split(b"\n"):
                if line.startswith(b"event:"):
                    name = line[6:].strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]" or not data:
                    continue
                if data.startswith(b'{"error"') or name == b"error":
                    self.failed = True  # a mid-stream failure: this run will be retried
                    continue
                futures.append(self._send(data))
        if futures:
            for outcome in await asyncio.gather(*futures, return_exceptions=True):
                if isinstance(outcome, redis.exceptions.ResponseError):
                    raise ReplyRefused(self._reply_to, str(outcome))
                if isinstance(outcome, BaseException):
                    raise outcome

    def _send(self, data: bytes) -> asyncio.Future[Any]:
        try:
            obj = _decode(data)
        except _UNREADABLE:
            data = json_encode(data.decode(errors="replace"))
        else:
            usage = _usage(obj)
            if usage is not None:
                self._usage = usage
        entry = Chunk(id=self._job_id, seq=self.seq, delivery=self._run, data=msgspec.Raw(data))
        self.seq += 1
        return self._store.chunk(self._reply_to, self._job_id, self._run, entry.seq, json_encode(entry))

    def result(self, job_id: str, instance: str, attempts: int, status: int) -> Result:
        if status != 200:
            return self._error_from_body(job_id, instance, attempts, status)
        summary = {"object": "routerd.stream", "chunks": self.seq, "delivery": self._run,
                   "usage": self._usage}
        return Result(id=job_id, status="ok", response=msgspec.Raw(json_encode(summary)),
                      instance=instance, attempts=attempts)


def _usage(event: Any) -> Any:
    """The usage an event carries: a chunk's ``usage``, a Responses API's terminal event's
    ``response.usage``, Anthropic's ``message_start``'s ``message.usage``; None when it has none."""
    if not isinstance(event, dict):
        return None
    usage = event.get("usage")
    if usage is None:
        inner = event.get("response") or event.get("message")
        usage = inner.get("usage") if isinstance(inner, dict) else None
    return usage
