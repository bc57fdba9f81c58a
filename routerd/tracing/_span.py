"""routerd's own span record and W3C trace context, written by hand for what they cost.

The OpenTelemetry SDK's span costs ≈ 100 µs of CPU on the request path (sampler, attribute cleaning,
locks, context objects, the batch processor); a request here is ≈ 1 ms. A :class:`Span` is a slotted
record the request path fills (ids, name, kind, times, an attribute dict, status, events) and the
export thread alone turns into OTLP protobuf (:mod:`._export`); the request's log line and the routing
decision ride on it as the dicts they are, named and encoded as attributes by that thread only.
``traceparent`` is a fixed format (W3C Trace Context, version ``00``), parsed and printed here without
the propagator's regex and context objects. The span in progress is :data:`routerd.log.current_span`
(a contextvar), so a log line carries its ids and a child finds its parent.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from typing import Any


class SpanKind(enum.IntEnum):
    """A span's kind, numbered as OTLP's ``Span.SpanKind`` (opentelemetry/proto/trace/v1/trace.proto):
    the number the export thread writes, so nothing translates it (OpenTelemetry's API counts from 0)."""

    INTERNAL = 1
    SERVER = 2
    CLIENT = 3
    PRODUCER = 4
    CONSUMER = 5


# OTLP's Status.StatusCode numbers
UNSET, ERROR = 0, 2
_HEX = frozenset("0123456789abcdef")
_MAX_TRACESTATE = 512  # W3C: 32 list members; longer is cut by propagators, here dropped whole


class Span:
    """One span: filled on the loop, read by the export thread only after :meth:`end` queued it.

    ``sampled`` False is a span that is not recorded (its trace not sampled): it only carries the
    context on (to the engine, with the flag unset), never gets attributes and is never exported.
    ``fields`` (a request's log line) and ``route`` (the routing decision's log fields) are handed
    over as they are, never changed after, and become attributes only in the export thread: mapping
    them on the loop cost as much as encoding them."""

    __slots__ = ("attributes", "end_ns", "events", "fields", "kind", "message", "name", "parent_id",
                 "route", "sampled", "span_id", "start_ns", "status", "trace_hex", "trace_id", "tracestate")

    def __init__(self, trace_id: int, span_id: int, parent_id: int, name: str, kind: SpanKind, start_ns: int,
                 attributes: dict[str, Any], sampled: bool, tracestate: str = "",
                 trace_hex: str = "") -> None:
        self.trace_id = trace_id
        # the trace id as OpenTelemetry prints it (log lines, exemplars, traceparent): formatted once
        # per trace, a child gets its parent's
        self.trace_hex = trace_hex or format(trace_id, "032x")
        self.span_id = span_id
        self.parent_id = parent_id
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        self.status = UNSET
        self.message = ""
        self.events: list[tuple[str, int, dict[str, Any]]] | None = None
        self.sampled = sampled
        self.tracestate = tracestate
        self.fields: Mapping[str, Any] | None = None
        self.route: Mapping[str, Any] | None = None

    def set_error(self, message: str) -> None:
        if self.sampled:
            self.status, self.message = ERROR, message[:500]

    def record_exception(self, e: BaseException) -> None:
        """The ``exception`` event OpenTelemetry's semantic conventions name (type and message; the
        stack trace is left out: formatting it would cost more than the request)."""
        if self.sampled:
            if self.events is None:
                self.events = []
            self.events.append(("exception", time.time_ns(), {
                "exception.type": type(e).__qualname__, "exception.message": str(e)[:500]}))

    @property
    def traceparent(self) -> str:
        """W3C ``traceparent`` naming this span as the parent (``01``: sampled)."""
        return f"00-{self.trace_hex}-{self.span_id:016x}-{'01' if self.sampled else '00'}"


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """``(trace_id, parent_id, sampled)`` of a W3C ``traceparent``, or None where it is not one (a
    new trace starts then, as W3C asks): version ``00`` is exactly 55 characters; a later version may
    append fields after the flags; ``ff`` and all-zero ids are invalid."""
    if not value:
        return None
    value = value.strip()
    if len(value) < 55 or value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    version, trace_hex, parent_hex, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if version == "ff" or (version == "00" and len(value) != 55) or (len(value) > 55 and value[55] != "-"):
        return None
    if not _HEX.issuperset(value[:2] + trace_hex + parent_hex + flags):
        return None
    trace_id, parent_id = int(trace_hex, 16), int(parent_hex, 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, bool(int(flags, 16) & 1)


def clean_tracestate(value: str | None) -> str:
    """A ``tracestate`` to pass on as it came (vendors' entries are theirs), or ``""`` when too long."""
    if not value or len(value) > _MAX_TRACESTATE:
        return ""
    return value.strip()


__all__ = ["ERROR", "UNSET", "Span", "SpanKind", "clean_tracestate", "parse_traceparent"]
