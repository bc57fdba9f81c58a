"""Reading a named-event stream (``event: <type>`` + ``data: {...}``: the Responses API's semantic
events, Anthropic's message events) on its way to the client, byte for byte: which event it ended
with (a complete stream ends with a terminal one: ``message_stop``, ``response.completed``…),
whether the engine sent an ``error`` event, and the engine's token counts — so the tenant is billed
what the engine counted, as for chat.

Only the events that carry usage are decoded (``message_start``, ``message_delta``, and the terminal
``response.*`` ones); every other line costs a prefix check."""

from __future__ import annotations

import msgspec

from .routes import Route

__all__ = ["EventReader"]


class _Usage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None


class _Inner(msgspec.Struct):
    usage: _Usage | None = None


class _Event(msgspec.Struct):
    usage: _Usage | None = None
    message: _Inner | None = None  # message_start
    response: _Inner | None = None  # response.completed / incomplete / failed


_decode = msgspec.json.Decoder(_Event).decode
_COUNTED = frozenset({"message_start", "message_delta", "response.completed", "response.incomplete",
                      "response.failed"})


class EventReader:
    """Fed each chunk of one stream (:meth:`feed`); says how it ended and what it counted."""

    __slots__ = ("_buf", "_event", "_route", "error", "input_tokens", "last", "output_tokens")

    def __init__(self, route: Route) -> None:
        self._route = route
        self._buf = b""
        self._event = ""
        self.last = ""  # the last event's name
        self.error = False
        self.input_tokens = 0
        self.output_tokens = 0

    @property
    def complete(self) -> bool:
        """It ended with one of its route's terminal events, and no error event came."""
        return not self.error and self.last in self._route.terminal_events

    def feed(self, chunk: bytes) -> None:
        data = self._buf + chunk if self._buf else chunk
        lines = data.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line.startswith(b"event:"):
                self._event = self.last = line[6:].strip().decode("utf-8", "replace")
                if self._event == "error":
                    self.error = True
            elif self._event in _COUNTED and line.startswith(b"data:"):
                self._count(line[5:])

    def _count(self, data: bytes) -> None:
        try:
            event = _decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return
        usage = event.usage or (event.message.usage if event.message is not None else None) or \
            (event.response.usage if event.response is not None else None)
        if usage is None:
            return
        if usage.input_tokens:
            self.input_tokens = usage.input_tokens
        if usage.output_tokens is not None:
            self.output_tokens = max(self.output_tokens, usage.output_tokens)

    def usage(self) -> tuple[int, int] | None:
        """The engine's count so far (prompt, completion tokens), or None when it counted nothing."""
        if not self.input_tokens and not self.output_tokens:
            return None
        return self.input_tokens, self.output_tokens
