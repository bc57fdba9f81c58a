"""What a span says: a log line's fields as OpenTelemetry attributes (``gen_ai.*`` where the semantic
conventions have a name, ``routerd.*`` otherwise), the routing decision's, and the engine's usage —
names learnt once per field, since this runs for every traced request."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

_FIELDS = {"status": "http.response.status_code", "model": "gen_ai.request.model",
           "fleet": "routerd.fleet", "tenant": "routerd.tenant", "instance": "routerd.instance",
           "attempts": "routerd.attempts", "resumes": "routerd.resumes", "stream": "routerd.stream",
           "admission_ms": "routerd.admission_ms", "ttfb_ms": "routerd.ttfb_ms", "error": "routerd.error",
           "delivery": "routerd.queue.delivery", "job_id": "routerd.queue.job_id",
           "endpoint": "routerd.endpoint"}


_ROUTE = {"policy", "prompt_tokens_est", "prompt_blocks", "matched_blocks", "cached_tokens_est",
          "wait_est_ms", "ttft_est_ms", "session_affinity"}


_SCALARS = frozenset({str, int, float, bool})  # what an attribute may be
_NAMES: dict[str, str] = {}  # a log field's attribute name ("": none), learnt once per field
_MAX_NAMES = 1024


def _learn(keys: Iterable[str]) -> None:
    if len(_NAMES) >= _MAX_NAMES:
        _NAMES.clear()  # bounded whatever fields a log line grows (they are a fixed few in practice)
    for key in keys:
        _NAMES[key] = _FIELDS.get(key) or (
            # the routing decision: on each attempt's span, where it applies
            "" if key in _ROUTE or key.startswith("runner_up") else f"routerd.{key}")


def _attributes(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A log line's fields as attributes: one comprehension over a learnt name table (this runs for
    every traced request)."""
    if new := fields.keys() - _NAMES.keys():
        _learn(new)
    names = _NAMES
    out = {names[k]: v for k, v in fields.items() if type(v) in _SCALARS and names[k]}
    if isinstance(ttfb := fields.get("ttfb_ms"), int | float):
        out["gen_ai.latency.time_to_first_token"] = ttfb / 1000
    return out


_ROUTE_NAMES: dict[str, str] = {}


def _route(key: str) -> str:
    if (name := _ROUTE_NAMES.get(key)) is None:
        name = "routerd.route." + key
        if len(_ROUTE_NAMES) < _MAX_NAMES:
            _ROUTE_NAMES[key] = name
    return name


def usage_attributes(usage: tuple[int, int] | None) -> dict[str, Any]:
    """``gen_ai.usage.*`` of what the engine reported."""
    if usage is None:
        return {}
    return {"gen_ai.usage.input_tokens": usage[0], "gen_ai.usage.output_tokens": usage[1]}
