"""``POST /v1/responses`` around routerd's one dispatch: prepare → dispatch → record.

1. **prepare** (:func:`~routerd.conversations.chain.prepare`): the conversation so far read from the
   store and sent whole, with routerd's response id and the chain's session key;
2. **dispatch**: the way in runs the prepared request through :class:`~routerd.dataplane.dispatch.Dispatch`
   like any other (tenant limits, admission, routing, retries, breaker), into a :class:`RecordingSink`
   around its own sink;
3. **record**: the sink reads the answer on its way to the client, without holding a stream back. The
   response object the client gets says what the client asked (its ``previous_response_id``,
   ``conversation``, ``store``; routerd's id) rather than what the engine was sent; a stream's output
   items are gathered from ``response.output_item.done`` as they pass, and the response is recorded
   when its last event (``response.completed``, ``.incomplete`` or ``.failed``) arrives — *before* that
   event, or a non-streamed answer's body, goes to the client: a client that continues the chain as
   soon as it has the answer finds it recorded, on any routerd.

What a stream does when its engine fails (the engine call's: :mod:`routerd.dataplane.attempt`): vLLM
sends ``response.created`` and ``response.in_progress`` at once, before the prefill; those two are not
the stream's first byte — until an event after them arrives nothing reaches the client, and a failure is
retried on another instance. Once an output event went out, a failure ends the stream with the Responses
API's ``error`` event: routerd does not continue a Responses stream mid-way (its events are not
completion chunks it can rebuild), and nothing is recorded — the client sends the turn again, on the
same ``previous_response_id``.

A record that cannot be written (Redis down past ``op_timeout_s``; the conversation deleted meanwhile, or
full) does not fail the answer: it is logged (``response_not_recorded``), and that id cannot be
continued.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from .. import log
from ..dataplane.dispatch import Request
from ..dataplane.sinks import ForwardResult, ResponseSink
from ..errors import RouterdError
from .chain import Turn, prepare
from .store import ResponseRecord, Store

__all__ = ["RecordingSink", "Responses"]

_log = log.get("routerd.conversations")

_decode = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.Encoder().encode
_LIFECYCLE = (b"response.created", b"response.in_progress")  # events that carry the response object
_LAST = (b"response.completed", b"response.incomplete", b"response.failed")
_ITEM_DONE = b"response.output_item.done"


class Responses:
    """The ``/v1/responses`` flow of one data plane (see the module's docstring): the route's hook
    (:class:`~routerd.dataplane.dispatch.RouteHook`, in ``Dispatch.hooks``), both ways in."""

    def __init__(self, store: Store, *, generation_of: Callable[[str], int],
                 served: Callable[[str, str, int], None] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        """``generation_of(instance id)``: the instance's generation now (recorded with the response);
        ``served(session, instance id, generation)``: tells routing where a chain's last turn was served
        (``Router.served``)."""
        self.store = store
        self.generation_of = generation_of
        self.served = served
        self.wall = wall

    async def prepare(self, req: Request) -> None:
        """The request made whole (:func:`~routerd.conversations.chain.prepare`): its body, routing's head
        and session replaced, the turn kept in ``req.context``."""
        turn = await prepare(self.store, req.tenant.name, req.body, session=req.session)
        if turn.served is not None and self.served is not None:
            self.served(turn.session, *turn.served)
        req.body, req.head, req.session, req.context = turn.body, turn.head, turn.session, turn

    def observe(self, req: Request, sink: ResponseSink) -> ResponseSink:
        return RecordingSink(self, req.context, sink)

    async def finished(self, req: Request, result: ForwardResult) -> None:
        return None  # recorded as the answer passed (before its last event reached the client)


class RecordingSink:
    """:class:`~routerd.dataplane.sinks.ResponseSink` that records the answer it passes on to ``inner``."""

    __slots__ = ("_buf", "_flow", "_held", "_items", "_length", "_mode", "inner", "instance",
                 "recorded", "turn")

    def __init__(self, flow: Responses, turn: Turn, inner: ResponseSink) -> None:
        self._flow = flow
        self.turn = turn
        self.inner = inner
        self.instance = ""
        self.recorded = False
        self._mode = ""  # "sse": events read as they pass; "json": a body held until whole; "": passed
        self._held: dict[str, str] = {}
        self._length = 0
        self._buf = b""
        self._items: list[Any] = []

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.instance = headers.get("X-Routerd-Instance", "")
        ctype = headers.get("Content-Type", "")
        if 200 <= status < 300 and ctype.startswith("text/event-stream"):
            self._mode = "sse"
        elif 200 <= status < 300 and "Content-Length" in headers:
            self._mode, self._held, self._length = "json", dict(headers), int(headers["Content-Length"])
            return  # started with its body, once the body is whole (its length changes)
        await self.inner.start(status, headers)

    async def write(self, chunk: bytes) -> None:
        if self._mode == "sse":
            await self._events(chunk)
        elif self._mode == "json":
            self._buf += chunk
            if len(self._buf) >= self._length:
                await self._answer()
        else:
            await self.inner.write(chunk)

    async def _answer(self) -> None:
        body, self._buf, self._mode = self._buf, b"", ""
        try:
            obj = _decode(body)
        except msgspec.DecodeError:
            obj = None
        if obj is not None and isinstance(obj.get("output"), list):
            await self._record(self._patched(obj))
            body = _encode(obj)
        self._held["Content-Length"] = str(len(body))
        await self.inner.start(200, self._held)
        await self.inner.write(body)

    async def _events(self, chunk: bytes) -> None:
        if chunk.startswith(b"event: error\n") and self._buf:
            self._buf = b""  # routerd's terminal event after an engine that failed mid-event: drop the half
        buf = self._buf + chunk
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._buf = buf
            return
        self._buf = buf[cut + 2:]
        out: list[bytes] = []
        for event in buf[:cut].split(b"\n\n"):
            out.append(await self._event(event) + b"\n\n")
        await self.inner.write(b"".join(out))

    async def _event(self, event: bytes) -> bytes:
        head, sep, data = event.partition(b"\ndata: ")
        if not sep or not head.startswith(b"event: "):
            return event
        kind = head[7:]
        if kind != _ITEM_DONE and kind not in _LIFECYCLE and kind not in _LAST:
            return event
        try:
            doc = _decode(data)
        except msgspec.DecodeError:
            return event  # passed on as the engine sent it
        if kind == _ITEM_DONE:
            if isinstance(item := doc.get("item"), dict):
                self._items.append(item)
            return event
        obj = doc.get("response")
        if not isinstance(obj, dict):
            return event
        doc["response"] = self._patched(obj)
        if kind in _LAST:
            if not obj.get("output"):
                obj["output"] = self._items
            await self._record(obj)
        return head + sep + _encode(doc)

    def _patched(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The response object as the client asked for it, not as the engine was sent it."""
        turn = self.turn
        obj["id"] = turn.id
        obj["previous_response_id"] = turn.previous_response_id
        obj["store"] = turn.store
        if turn.conversation is not None:
            obj["conversation"] = {"id": turn.conversation}
        return obj

    async def _record(self, obj: dict[str, Any]) -> None:
        turn, store = self.turn, self._flow.store
        output: list[Any] = obj.get("output") or []
        try:
            if turn.store:
                await store.put_response(ResponseRecord(
                    id=turn.id, tenant=turn.tenant, model=str(obj.get("model") or turn.model),
                    created_at=int(obj.get("created_at") or self._flow.wall()), status=str(obj.get("status")),
                    input=turn.input, output=output, previous_response_id=turn.previous_response_id,
                    chain=turn.chain, conversation=turn.conversation, instance=self.instance,
                    generation=self._flow.generation_of(self.instance), response=obj))
            if turn.conversation is not None:
                await store.add_items(turn.tenant, turn.conversation, [*turn.input, *output])
        except RouterdError as e:
            _log.warning("response_not_recorded", response_id=turn.id, error=e.message)
            return
        self.recorded = True
