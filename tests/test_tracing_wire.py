"""routerd's span records on the wire: the hand-written OTLP protobuf read back with
``opentelemetry-proto`` (what every collector decodes with), and W3C ``traceparent`` parsed as the
spec says — the two formats routerd now writes itself instead of the OpenTelemetry SDK."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from routerd.tracing import Span, SpanKind
from routerd.tracing._export import encode, resource
from routerd.tracing._span import parse_traceparent
from tests.fixtures.otlp import _value

TRACE, PARENT = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


def test_spans_encode_to_what_opentelemetry_proto_decodes() -> None:
    """Every field routerd sets, every attribute type (negative and 64-bit ints, floats, bools,
    arrays, non-ASCII text), an event, an error status, a trace state — read back as written."""
    attrs = {"s": "tëxt", "t": True, "f": False, "zero": 0, "neg": -3, "big": 2**63 - 1, "x": 0.25,
             "list": ["a", "b"], "empty": ""}
    server = Span(TRACE, 0xABCDEF0123456789, PARENT, "POST /v1/completions", SpanKind.SERVER,
                  1_700_000_000_000_000_001, attrs, sampled=True, tracestate="vendor=1")
    server.end_ns = 1_700_000_000_500_000_000
    server.record_exception(ValueError("bad"))
    server.set_error("HTTP 502")
    # the same keys with values equal in Python but not on the wire (True == 1 == 1.0, "1"): each as it is
    child = Span(TRACE, 7, server.span_id, "routerd.attempt", SpanKind.CLIENT, 5,
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
        span = Span(parsed[0], parsed[1], 0, "x", SpanKind.SERVER, 0, {}, sampled=True)
        assert span.traceparent == f"00-{TRACE:032x}-{PARENT:016x}-01"


def test_a_log_line_and_a_routing_decision_become_attributes_in_the_export_thread() -> None:
    """The request path hands a request's log line and its routing decision's fields to the spans as
    they are; the encoder names them (``gen_ai.*``, ``routerd.*``), adds gen_ai's time to first token,
    leaves out of the server span the routing facts (they are its attempts') and the request id it
    already has, and leaves lists out of a log line's — the same the second time, from its caches."""
    server = Span(TRACE, 1, 0, "POST /v1/completions", SpanKind.SERVER, 1, {"routerd.request_id": "r1"}, True)
    server.fields = {"request_id": "r1", "model": "m", "status": 200, "stream": False, "ttfb_ms": 12.5,
                     "admission_ms": 0.25, "policy": "least_load", "rule": "least_wait",
                     "cache_view": "model", "wait_est_ms": 1.0, "runner_up": "f:static1",
                     "runner_up_wait_est_ms": 2.0, "tenant": "t", "resumes": 0, "custom": "x",
                     "tags": ["a"], "gone": None}
    attempt = Span(TRACE, 2, 1, "routerd.attempt", SpanKind.CLIENT, 2, {"routerd.attempt": 1}, True)
    attempt.route = {"policy": "least_load", "matched_blocks": 3, "wait_est_ms": 1.0,
                     "session_affinity": True, "runner_up": "f:static1"}
    server.end_ns = attempt.end_ns = 3
    for _ in range(2):
        (rs,) = ExportTraceServiceRequest.FromString(encode(resource({}), [server, attempt])).resource_spans
        s, a = rs.scope_spans[0].spans
        assert [(x.key, _value(x.value)) for x in s.attributes] == [
            ("routerd.request_id", "r1"), ("gen_ai.request.model", "m"), ("http.response.status_code", 200),
            ("routerd.stream", False), ("routerd.ttfb_ms", 12.5), ("routerd.admission_ms", 0.25),
            ("routerd.tenant", "t"), ("routerd.resumes", 0), ("routerd.custom", "x"),
            ("gen_ai.latency.time_to_first_token", 0.0125)]
        assert [(x.key, _value(x.value)) for x in a.attributes] == [
            ("routerd.attempt", 1), ("routerd.route.policy", "least_load"),
            ("routerd.route.matched_blocks", 3), ("routerd.route.wait_est_ms", 1.0),
            ("routerd.route.session_affinity", True), ("routerd.route.runner_up", "f:static1")]
