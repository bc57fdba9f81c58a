"""routerd's span records on the wire: the hand-written OTLP protobuf read back with
``opentelemetry-proto`` (what every collector decodes with), and W3C ``traceparent`` parsed as the
spec says — the two formats routerd now writes itself instead of the OpenTelemetry SDK."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from routerd.tracing._export import encode, resource
from routerd.tracing._span import CLIENT, SERVER, Span, parse_traceparent
from tests.fixtures.otlp import _value

TRACE, PARENT = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


def test_spans_encode_to_what_opentelemetry_proto_decodes() -> None:
    """Every field routerd sets, every attribute type (negative and 64-bit ints, floats, bools,
    arrays, non-ASCII text), an event, an error status, a trace state — read back as written."""
    attrs = {"s": "tëxt", "t": True, "f": False, "zero": 0, "neg": -3, "big": 2**63 - 1, "x": 0.25,
             "list": ["a", "b"], "empty": ""}
    server = Span(TRACE, 0xABCDEF0123456789, PARENT, "POST /v1/completions", SERVER,
                  1_700_000_000_000_000_001, attrs, sampled=True, tracestate="vendor=1")
    server.end_ns = 1_700_000_000_500_000_000
    server.record_exception(ValueError("bad"))
    server.set_error("HTTP 502")
    # the same keys with values equal in Python but not on the wire (True == 1 == 1.0, "1"): each as it is
    child = Span(TRACE, 7, server.span_id, "routerd.attempt", CLIENT, 5,
                 {"t": 1, "f": 0.0, "zero": "0", "s": "tëxt"}, sampled=True)
    child.end_ns = 6
    body = encode(resource({"service.name": "routerd", "pid": 12}), [server, child])

    (rs,) = ExportTraceServiceRequest.FromString(body).resource_spans
    assert {a.key: _value(a.value) for a in rs.resource.attributes} == {"service.name": "routerd", "pid": 12}
    (ss,) = rs.scope_spans
    assert ss.scope.name == "routerd"
    s, c = ss.spans
    assert (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex()) == (
        f"{TRACE:032x}", "abcdef0123456789", f"{PARENT:016x}")
    assert (s.name, s.kind, s.trace_state) == ("POST /v1/completions", 2, "vendor=1")
    assert (s.start_time_unix_nano, s.end_time_unix_nano) == (
        1_700_000_000_000_000_001, 1_700_000_000_500_000_000)
    assert {a.key: _value(a.value) for a in s.attributes} == attrs
    assert (s.status.code, s.status.message) == (2, "HTTP 502")
    (event,) = s.events
    assert event.name == "exception"
    assert {a.key: _value(a.value) for a in event.attributes} == {"exception.type": "ValueError",
                                                                   "exception.message": "bad"}
    assert (c.parent_span_id.hex(), c.kind, c.status.code, c.trace_state) == ("abcdef0123456789", 3, 0, "")
    assert [(a.key, a.value.WhichOneof("value"), _value(a.value)) for a in c.attributes] == [
        ("t", "int_value", 1), ("f", "double_value", 0.0), ("zero", "string_value", "0"),
        ("s", "string_value", "tëxt")]
    assert (c.start_time_unix_nano, c.end_time_unix_nano) == (5, 6)


@pytest.mark.parametrize(("header", "parsed"), [
    (f"00-{TRACE:032x}-{PARENT:016x}-01", (TRACE, PARENT, True)),
    (f"00-{TRACE:032x}-{PARENT:016x}-00", (TRACE, PARENT, False)),
    (f"00-{TRACE:032x}-{PARENT:016x}-03", (TRACE, PARENT, True)),  # other flags: only bit 0 is ours
    (f" 00-{TRACE:032x}-{PARENT:016x}-01 ", (TRACE, PARENT, True)),
    (f"cc-{TRACE:032x}-{PARENT:016x}-01-later-fields", (TRACE, PARENT, True)),  # a later version
    (f"00-{TRACE:032x}-{PARENT:016x}-01-x", None),  # version 00 is exactly 55 characters
    (f"ff-{TRACE:032x}-{PARENT:016x}-01", None),  # version ff is invalid
    (f"00-{0:032x}-{PARENT:016x}-01", None),  # all-zero trace id
    (f"00-{TRACE:032x}-{0:016x}-01", None),  # all-zero parent id
    (f"00-{TRACE:032X}-{PARENT:016x}-01", None),  # upper case
    (f"00-{TRACE:032x}-{PARENT:016x}-0g", None),
    (f"00_{TRACE:032x}-{PARENT:016x}-01", None),
    (f"00-{TRACE:032x}"[:-1] + f"-{PARENT:016x}-01", None),  # a digit short
    ("", None), (None, None),
])
def test_traceparent_is_parsed_as_w3c_says(header: str | None, parsed: tuple[int, int, bool] | None) -> None:
    """An invalid ``traceparent`` is ignored (a new trace starts), never an error for the request."""
    assert parse_traceparent(header) == parsed
    if parsed is not None and parsed[2]:
        span = Span(parsed[0], parsed[1], 0, "x", SERVER, 0, {}, sampled=True)
        assert span.traceparent == f"00-{TRACE:032x}-{PARENT:016x}-01"
