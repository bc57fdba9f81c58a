"""OpenTelemetry tracing: one trace per request, both ways in, through routerd and into the engine.

Off by default, and then free: :meth:`Tracing.off` has ``on = False``; every hook on the request path
tests it (or gets back what it passed in) before building anything, so an untraced request makes no
span, no context and no header. On, spans are routerd's own records (:mod:`._span`), not the
OpenTelemetry SDK's: the SDK's span costs ≈ 100 µs of CPU on the request path and its encoder ≈ 50 µs
more, so a traced request cost 2.5× an untraced one; a record here is a slotted object with an
attribute dict, and all the OTLP encoding is done by the export thread (:mod:`._export`), which posts
protobuf over OTLP/HTTP with a timeout. The loop only appends a finished span to a bounded queue; when
the collector is down or slow it fills, and spans beyond ``max_queue_spans`` are dropped and counted
(``routerd_trace_spans_dropped_total``), never held without bound; a failed export is counted too.
Sampling is OpenTelemetry's parent-based ratio sampler, computed the same way (a client's
``traceparent`` decides for its request; a new trace is sampled when the low 64 bits of its id are
below ``sample_ratio`` × 2⁶⁴).

Context travels as W3C ``traceparent``/``tracestate``: taken from an HTTP request's headers or a queue
job's fields (:meth:`Tracing.server`, :meth:`Tracing.job`), put on every engine request
(:meth:`Tracing.inject`) so that vLLM's own span joins the trace. The span in progress is
:data:`routerd.log.current_span` (a contextvar of the task), so the log processor in
:mod:`routerd.log` stamps ``trace_id``/``span_id`` on every line logged while it is current.

Spans (README, "Tracing"): ``POST /v1/…`` (server) or ``routerd.queue.job`` (consumer) → per delivery
``routerd.queue.delivery`` → ``routerd.rate_limit``, ``routerd.admission``, ``routerd.attempt``
(client; one per engine attempt, the routing decision as attributes), ``routerd.resume`` (client; one
per continuation) → the engine's span; and ``routerd.queue.finish`` (result write and ``XACK``).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Awaitable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

from .. import _aio, log
from ._export import Collector, Exporter, resource
from ._scopes import CURRENT, Scope, Traced, Waiting, current_context
from ._setup import engine_env, otlp_endpoint, otlp_setting, pairs, unsupported
from ._span import Span, SpanKind, clean_tracestate, parse_traceparent

if TYPE_CHECKING:
    from ..config import TracingConfig

_log = log.get("routerd.tracing")

T = TypeVar("T")

_NULL: nullcontext[None] = nullcontext()
_OPERATION = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
_ID_BITS = (1 << 64) - 1


class Tracing:
    """routerd's tracer: its sampler, ids and exporter (or nothing: :meth:`off`); one per data plane."""

    def __init__(self, exporter: Exporter | None = None, *, sample_ratio: float = 1.0,
                 shutdown_timeout_s: float = 5.0, max_queue: int = 0,
                 rng: random.Random | None = None) -> None:
        self._exporter = exporter
        self.on = exporter is not None
        self.endpoint = exporter.url if exporter is not None else ""
        self._bound = round(sample_ratio * (1 << 64))  # TraceIdRatioBased's: sampled below it
        self._shutdown_timeout_s = shutdown_timeout_s
        self._max_queue = max_queue
        self._bits = (rng or random.Random()).getrandbits

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def from_config(cls, cfg: TracingConfig, environ: Mapping[str, str] | None = None) -> Tracing:
        """Tracing as ``[tracing]`` and the ``OTEL_*`` variables say (:func:`otlp_endpoint`; also
        ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER`` (the parent-based ones) and ``…_SAMPLER_ARG``,
        ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``, ``…_COMPRESSION``
        (gzip), ``…_CERTIFICATE``). What routerd does not implement of them (OTLP/gRPC, another
        sampler, …) is named in one warning, ``tracing_otel_unsupported``: spans still go out, over
        OTLP/HTTP."""
        env = os.environ if environ is None else environ
        endpoint = otlp_endpoint(cfg, env)
        if not endpoint:
            return cls.off()
        if ignored := unsupported(env):
            _log.warning("tracing_otel_unsupported", ignored=ignored, endpoint=endpoint,
                         sends="OTLP/HTTP protobuf, parent-based ratio sampling, W3C traceparent")
        # A key left at its default gives way to its OTEL_* variable (README, "Tracing").
        service = cfg.service_name if cfg.service_name != "routerd" \
            else env.get("OTEL_SERVICE_NAME", "").strip() or "routerd"
        attributes: dict[str, Any] = {**pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", "")),
                                      "service.name": service, "telemetry.sdk.name": "routerd",
                                      "telemetry.sdk.language": "python"}
        exporter = Exporter(endpoint, resource(attributes), max_queue=cfg.max_queue_spans,
                            timeout_s=cfg.export_timeout_s, headers=pairs(otlp_setting(env, "HEADERS")),
                            gzip=otlp_setting(env, "COMPRESSION").lower() == "gzip",
                            cafile=otlp_setting(env, "CERTIFICATE"))
        return cls(exporter, sample_ratio=_ratio(cfg.sample_ratio, env),
                   shutdown_timeout_s=cfg.shutdown_timeout_s, max_queue=cfg.max_queue_spans)

    def collector(self) -> Collector:
        """The ``routerd_trace_spans_*`` metrics for ``/metrics``."""
        assert self._exporter is not None, "tracing is off: no span metrics"
        return Collector(self._exporter.counts, self._max_queue)

    async def aclose(self) -> None:
        """Export what is queued and stop the exporting thread, waiting ``shutdown_timeout_s`` at most.

        Stopping blocks (a thread join, an HTTP request), so it runs in a daemon thread of its own: not
        the loop's default executor, which the interpreter would wait for at exit however long a dead
        collector keeps the export hanging."""
        exporter, self._exporter = self._exporter, None
        if exporter is None:
            return
        self.on = False
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        timeout = self._shutdown_timeout_s

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def stop() -> None:
            try:
                exporter.stop(timeout)
            finally:
                loop.call_soon_threadsafe(settle)

        threading.Thread(target=stop, name="routerd-tracing-shutdown", daemon=True).start()
        try:
            await _aio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            _log.warning("tracing_shutdown_timeout", timeout_s=timeout, waiting=exporter.counts.waiting)

    # ---- making spans ------------------------------------------------------------------------------
    def _root(self, name: str, kind: SpanKind, attributes: dict[str, Any], start_ns: int,
              parent: tuple[int, int, bool] | None, tracestate: str) -> Span:
        """A span starting or continuing a trace from outside (a client's, a producer's context):
        parent-based sampling, else the ratio on the trace id."""
        span_id = self._bits(64) or 1
        if parent is not None:
            trace_id, parent_id, sampled = parent
        else:
            trace_id, parent_id, tracestate = self._bits(128) or 1, 0, ""
            sampled = (trace_id & _ID_BITS) < self._bound
        return Span(trace_id, span_id, parent_id, name, kind, start_ns, attributes if sampled else {},
                    sampled, tracestate)

    def child(self, parent: Span, name: str, kind: SpanKind, attributes: dict[str, Any],
              start_ns: int) -> Span:
        """A span of ``parent``'s trace, its child (not made current: :class:`Scope` does that)."""
        return Span(parent.trace_id, self._bits(64) or 1, parent.span_id, name, kind, start_ns, attributes,
                    parent.sampled, parent.tracestate, parent.trace_hex)

    def finish(self, span: Span, end_ns: int = 0) -> None:
        """End ``span`` (at ``end_ns``, else now) and queue it for export when it is sampled."""
        span.end_ns = end_ns or time.time_ns()
        if span.sampled and self._exporter is not None:
            self._exporter.add(span)

    def start(self, name: str, kind: SpanKind = SpanKind.INTERNAL,
              attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Span | None]:
        """A span current inside the ``with``: a child of the current one, or a new trace's root
        (``routerd submit``'s producer span); the shared no-op when off."""
        if not self.on:
            return _NULL
        parent = CURRENT.get()
        attrs = dict(attributes or {})
        span = self.child(parent, name, kind, attrs, time.time_ns()) if parent is not None \
            else self._root(name, kind, attrs, time.time_ns(), None, "")
        return Scope(self, span)

    # ---- the hooks the request path calls ------------------------------------------------------------
    def server(self, headers: Mapping[str, str], endpoint: str, request_id: str) -> Traced | None:
        """An HTTP request's server span, continuing the client's ``traceparent``; current until
        :meth:`Traced.end` (which the handler calls after its log line, so that line carries the ids)."""
        if not self.on:
            return None
        parent = parse_traceparent(headers.get("traceparent"))
        span = self._root(f"POST {endpoint}", SpanKind.SERVER, {
            "http.request.method": "POST", "url.path": endpoint,
            "gen_ai.operation.name": _OPERATION.get(endpoint, ""), "routerd.request_id": request_id},
            time.time_ns(), parent, clean_tracestate(headers.get("tracestate")) if parent else "")
        return Traced(self, span)

    def job(self, traceparent: str | None, tracestate: str | None, *, entry: str, stream: str,
            read_ns: int) -> Traced | None:
        """A queue job's consumer span, from when its entry was read (``read_ns``) to its ``XACK``,
        continuing the producer's context when the job carries one."""
        if not self.on:
            return None
        parent = parse_traceparent(traceparent)
        span = self._root("routerd.queue.job", SpanKind.CONSUMER, {
            "messaging.system": "redis", "messaging.operation.type": "process",
            "messaging.destination.name": stream, "messaging.message.id": entry},
            read_ns, parent, clean_tracestate(tracestate) if parent else "")
        return Traced(self, span)

    def span(self, name: str, attributes: Mapping[str, Any] | None = None,
             kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span | None]:
        """A child span of the current one, current inside the ``with`` (the shared no-op when off);
        an exception leaving it marks it an error."""
        parent = CURRENT.get() if self.on else None
        if parent is None or not parent.sampled:
            return _NULL
        return Scope(self, self.child(parent, name, kind, dict(attributes or {}), time.time_ns()))

    def _recording(self) -> Span | None:
        """The current span when tracing is on and it is sampled: a request that is not sampled makes
        no child span, only the context it passes on."""
        span = CURRENT.get() if self.on else None
        return span if span is not None and span.sampled else None

    def waiting(self, name: str, cm: AbstractAsyncContextManager[T]) -> AbstractAsyncContextManager[T]:
        """``cm`` (an admission ticket) with a span over its ``__aenter__`` when that waited
        (:data:`._scopes.WAITED_NS`, 1 ms, or more) or failed: a slot taken at once is the server span's
        ``routerd.admission_ms``, not a span of its own."""
        parent = self._recording()
        if parent is None:
            return cm
        return Waiting(self, parent, name, cm)

    def timed(self, name: str, awaitable: Awaitable[T], when: bool = True) -> Awaitable[T]:
        """``awaitable`` (a tenant's charge, a rate-limit wait) inside a span of its own — ``when`` it
        can take time (a tenant without limits is charged at once: no span to pay for)."""
        if not when or self._recording() is None:
            return awaitable
        return self._timed(name, awaitable)

    async def _timed(self, name: str, awaitable: Awaitable[T]) -> T:
        with self.span(name):
            return await awaitable

    def attempt(self, name: str, number: int, instance: str, url: str,
                decision: Mapping[str, Any] | None = None) -> AbstractContextManager[Span | None]:
        """One engine attempt (``routerd.attempt``) or continuation (``routerd.resume``): a client span
        whose context :meth:`inject` hands to the engine; ``decision`` is the routing decision's log
        fields (the same facts as the request's log line)."""
        parent = self._recording()
        if parent is None:
            return _NULL
        span = self.child(parent, name, SpanKind.CLIENT, {
            "routerd.attempt": number, "routerd.instance": instance, "url.full": url}, time.time_ns())
        span.route = decision or None  # named and encoded by the export thread
        return Scope(self, span)

    def inject(self, headers: dict[str, str]) -> None:
        """Put the current span's ``traceparent``/``tracestate`` on an engine request's headers."""
        span = CURRENT.get() if self.on else None
        if span is not None:
            headers["traceparent"] = span.traceparent
            if span.tracestate:
                headers["tracestate"] = span.tracestate

    def trace_id(self) -> str:
        """The current span's sampled trace id (``""``: none, or tracing off): a metric's exemplar."""
        span = self._recording()
        return span.trace_hex if span is not None else ""

    def usage(self, usage: tuple[int, int] | None) -> None:
        """The engine's token usage (``gen_ai.usage.*``) on the current span: :meth:`note` without
        the dicts (this runs for every request)."""
        span = self._recording()
        if span is not None and usage is not None:
            a = span.attributes
            a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"] = usage

    def note(self, **attributes: Any) -> None:
        """Attributes on the current span (a retry's reason, a resume's gap, token usage)."""
        span = self._recording()
        if span is not None:
            span.attributes.update({k: v for k, v in attributes.items() if v is not None})

    def outcome(self, ok: bool, error: str | None, status: int) -> None:
        """How an attempt that reached the client ended: not ok (a 4xx, a cut stream) marks its span."""
        if not ok and self.on:
            self.failed(error or f"HTTP {status}", **{"http.response.status_code": status})

    def failed(self, message: str, **attributes: Any) -> None:
        """Mark the current span an error (an attempt that will be retried, a cut stream)."""
        span = self._recording()
        if span is not None:
            span.set_error(message)
            if attributes:
                span.attributes.update(attributes)


def _ratio(ratio: float, env: Mapping[str, str]) -> float:
    """``[tracing] sample_ratio``, or when left at its default (1.0) what ``OTEL_TRACES_SAMPLER`` and
    ``OTEL_TRACES_SAMPLER_ARG`` say: ``parentbased_always_off`` 0, ``parentbased_always_on`` 1 (its
    argument unread, as the SDK), else the argument."""
    if ratio != 1.0:
        return ratio
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler == "parentbased_always_off":
        return 0.0
    arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if sampler == "parentbased_always_on" or not arg:
        return ratio
    try:
        return min(1.0, max(0.0, float(arg)))
    except ValueError:
        _log.warning("tracing_bad_sampler_arg", value=arg[:50])
        return ratio


__all__ = ["Span", "SpanKind", "Traced", "Tracing", "current_context", "engine_env", "otlp_endpoint"]
