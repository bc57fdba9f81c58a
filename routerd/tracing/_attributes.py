"""What a span says: a log line's fields as OpenTelemetry attributes (``gen_ai.*`` where the semantic
conventions have a name, ``routerd.*`` otherwise), and the routing decision's.

The request path does not map them: it hands the log line's dict (:attr:`Span.fields`) and the routing
decision's (:attr:`Span.route`) to the span as they are, and the export thread's encoder
(:mod:`._export`) names each field once, with :func:`field_name` and :func:`route_name`, and encodes it
straight to its OTLP attribute."""

from __future__ import annotations

_FIELDS = {"status": "http.response.status_code", "model": "gen_ai.request.model",
           "fleet": "routerd.fleet", "tenant": "routerd.tenant", "instance": "routerd.instance",
           "attempts": "routerd.attempts", "resumes": "routerd.resumes", "stream": "routerd.stream",
           "admission_ms": "routerd.admission_ms", "ttfb_ms": "routerd.ttfb_ms", "error": "routerd.error",
           "delivery": "routerd.queue.delivery", "job_id": "routerd.queue.job_id",
           "endpoint": "routerd.endpoint"}


_ROUTE = {"policy", "rule", "prompt_tokens", "prompt_tokens_est", "block_tokens", "prompt_blocks",
          "matched_blocks", "cached_tokens_est", "cache_view", "wait_est_ms", "ttft_est_ms",
          "session_affinity"}

TTFB = "ttfb_ms"  # a log field that is also gen_ai's time to first token (in seconds)
TTFT = "gen_ai.latency.time_to_first_token"


_ON_SPAN = {"request_id"}  # set on the server span as it starts (Tracing.server)


def field_name(key: str) -> str:
    """A log line's field as a span attribute's name; ``""``: the routing decision's, which is on each
    attempt's span (:func:`route_name`), not the request's, or one the span has already."""
    if key in _ROUTE or key in _ON_SPAN or key.startswith("runner_up"):
        return ""
    return _FIELDS.get(key) or f"routerd.{key}"


def route_name(key: str) -> str:
    """A routing decision's field (:meth:`RouteDecision.log_fields`) as an attempt span's attribute."""
    return "routerd.route." + key
