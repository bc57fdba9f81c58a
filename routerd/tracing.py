"""OpenTelemetry tracing: one trace per request, both ways in, through routerd and into the engine.

Off by default, and then free: :meth:`Tracing.off` has ``on = False``; every hook on the request path
tests it (or gets back what it passed in) before building anything, so an untraced request makes no
span, no context and no header. On, it is the OpenTelemetry SDK with a provider of routerd's own (not
the process-global one: two data planes in one process trace apart, and a producer's own tracing is
left alone), a parent-based ratio sampler (a client's ``traceparent`` decides for its request), and a
batch processor whose thread does the exporting over OTLP/HTTP — the event loop only appends a finished
span to a bounded deque. When the collector is down or slow that deque fills; spans beyond
``max_queue_spans`` are dropped and counted (``routerd_trace_spans_dropped_total``), never held
without bound, and a failed export is counted the same way.

Context travels as W3C ``traceparent``/``tracestate``: taken from an HTTP request's headers or a queue
job's fields (:meth:`Tracing.server`, :meth:`Tracing.job`), put on every engine request
(:meth:`Tracing.inject`) so that vLLM's own span joins the trace. The span in progress is the
OpenTelemetry context of the task (a contextvar), so the log processor in :mod:`routerd.log` stamps
``trace_id``/``span_id`` on every line logged while it is current.

Spans (README, "Tracing"): ``POST /v1/…`` (server) or ``routerd.queue.job`` (consumer) → per delivery
``routerd.queue.delivery`` → ``routerd.rate_limit``, ``routerd.admission``, ``routerd.attempt``
(client; one per engine attempt, the routing decision as attributes), ``routerd.resume`` (client; one
per continuation) → the engine's span; and ``routerd.queue.finish`` (result write and ``XACK``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from typing import TYPE_CHECKING, Any, TypeVar, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import log

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter

    from .config import TracingConfig

_log = log.get("routerd.tracing")

T = TypeVar("T")

_W3C = TraceContextTextMapPropagator()
_NULL: nullcontext[None] = nullcontext()
_OPERATION = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
_TRACES_PATH = "/v1/traces"
WAITED_NS = 1_000_000  # an admission wait this long (1 ms) or longer gets a span


def otlp_endpoint(cfg: TracingConfig, environ: Mapping[str, str]) -> str:
    """Where spans go (the full OTLP/HTTP traces URL), or ``""`` when tracing is off.

    ``[tracing] endpoint`` first; else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as it is), else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base: ``/v1/traces`` is added), as every OpenTelemetry SDK reads
    them. ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off whatever is set."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" \
            or environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return ""
    if cfg.endpoint:
        return _traces_url(cfg.endpoint)
    if url := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return url
    if url := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return _traces_url(url)
    return ""


def engine_env(cfg: TracingConfig, fleet: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a launched engine is told when routerd traces (``{}`` when not): routerd's collector,
    over OTLP/HTTP, as service ``vllm-<fleet>``; the vLLM launcher adds ``--otlp-traces-endpoint``."""
    endpoint = otlp_endpoint(cfg, os.environ if environ is None else environ)
    if not endpoint:
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": f"vllm-{fleet}"}


def _traces_url(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(_TRACES_PATH) else base + _TRACES_PATH


class _Counts:
    """Spans waiting for export, exported, dropped: written by the loop (on span end) and by the
    exporting thread, so under a lock."""

    __slots__ = ("dropped_full", "exported", "failed", "lock", "waiting")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting = 0
        self.exported = 0
        self.dropped_full = 0
        self.failed = 0


def _processor(exporter: SpanExporter, counts: _Counts, max_queue: int) -> Any:
    """The SDK's ``BatchSpanProcessor`` bounded by routerd's own count, so that every dropped span is
    counted (the SDK drops its oldest silently) and the newest, not the oldest, is the one dropped."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class Bounded(BatchSpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            if span.context is None or not span.context.trace_flags.sampled:
                return
            with counts.lock:
                if counts.waiting >= max_queue:
                    counts.dropped_full += 1
                    return
                counts.waiting += 1
            super().on_end(span)

    return Bounded(cast("SpanExporter", _Exporter(exporter, counts)), max_queue_size=max_queue,
                   max_export_batch_size=min(512, max_queue), schedule_delay_millis=5000)


class _Exporter:
    """The OTLP exporter, counting what leaves and what fails (runs in the processor's thread)."""

    def __init__(self, inner: SpanExporter, counts: _Counts) -> None:
        self._inner = inner
        self._counts = counts

    def export(self, spans: Sequence[ReadableSpan]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        n = len(spans)
        with self._counts.lock:
            self._counts.waiting = max(0, self._counts.waiting - n)
        result = self._inner.export(spans)
        with self._counts.lock:
            if result is SpanExportResult.SUCCESS:
                self._counts.exported += n
            else:
                self._counts.failed += n
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))


class _Collector:
    """``routerd_trace_spans_*``: read at scrape time from the counts the exporter keeps."""

    def __init__(self, counts: _Counts, max_queue: int) -> None:
        self._counts = counts
        self._max = max_queue

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        c = self._counts
        with c.lock:
            waiting, exported, full, failed = c.waiting, c.exported, c.dropped_full, c.failed
        yield CounterMetricFamily("routerd_trace_spans_exported", "Spans the collector accepted",
                                  value=exported)
        dropped = CounterMetricFamily("routerd_trace_spans_dropped", "Spans lost: queue_full (more "
                                      "than tracing.max_queue_spans waiting), export_failed (the "
                                      "collector down or refusing)", labels=["reason"])
        dropped.add_metric(["queue_full"], full)
        dropped.add_metric(["export_failed"], failed)
        yield dropped
        yield GaugeMetricFamily("routerd_trace_spans_waiting", f"Spans waiting for export (at most "
                                f"{self._max})", value=waiting)


class Tracing:
    """routerd's tracer, its provider and exporter (or nothing: :meth:`off`); one per data plane."""

    def __init__(self, provider: Any = None, *, counts: _Counts | None = None, max_queue: int = 0,
                 shutdown_timeout_s: float = 5.0, endpoint: str = "") -> None:
        self._provider = provider
        self.on = provider is not None
        self.tracer: trace.Tracer = provider.get_tracer("routerd") if provider is not None \
            else trace.NoOpTracer()
        self.endpoint = endpoint
        self._counts = counts or _Counts()
        self._max_queue = max_queue
        self._shutdown_timeout_s = shutdown_timeout_s

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def from_config(cls, cfg: TracingConfig, environ: Mapping[str, str] | None = None, *,
                    exporter: SpanExporter | None = None) -> Tracing:
        """Tracing as ``[tracing]`` and the ``OTEL_*`` variables say (:func:`otlp_endpoint`); ``exporter``
        replaces the OTLP one (benchmarks: spans built and batched, sent nowhere)."""
        env = os.environ if environ is None else environ
        endpoint = otlp_endpoint(cfg, env)
        if not endpoint and exporter is None:
            return cls.off()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, timeout=cfg.export_timeout_s)
        # A key left at its default gives way to its OTEL_* variable (README, "Tracing").
        service = cfg.service_name if cfg.service_name != "routerd" \
            else env.get("OTEL_SERVICE_NAME", "").strip() or "routerd"
        ratio = cfg.sample_ratio
        if ratio == 1.0 and env.get("OTEL_TRACES_SAMPLER_ARG", "").strip():
            try:
                ratio = min(1.0, max(0.0, float(env["OTEL_TRACES_SAMPLER_ARG"])))
            except ValueError:
                _log.warning("tracing_bad_sampler_arg", value=env["OTEL_TRACES_SAMPLER_ARG"][:50])
        counts = _Counts()
        provider = TracerProvider(resource=Resource.create({"service.name": service}),
                                  sampler=ParentBased(TraceIdRatioBased(ratio)))
        provider.add_span_processor(_processor(exporter, counts, cfg.max_queue_spans))
        return cls(provider, counts=counts, max_queue=cfg.max_queue_spans,
                   shutdown_timeout_s=cfg.shutdown_timeout_s, endpoint=endpoint)

    def collector(self) -> _Collector:
        """The ``routerd_trace_spans_*`` metrics for ``/metrics``."""
        return _Collector(self._counts, self._max_queue)

    async def aclose(self) -> None:
        """Export what is queued and stop the exporting thread, waiting ``shutdown_timeout_s`` at most.

        The SDK's shutdown blocks (a thread join, an HTTP request), so it runs in a daemon thread of its
        own: not the loop's default executor, which the interpreter would wait for at exit however long
        a dead collector keeps the export hanging."""
        provider, self._provider = self._provider, None
        if provider is None:
            return
        self.on = False
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def stop() -> None:
            try:
                provider.shutdown()
            finally:
                loop.call_soon_threadsafe(settle)

        threading.Thread(target=stop, name="routerd-tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), self._shutdown_timeout_s)
        except TimeoutError:
            _log.warning("tracing_shutdown_timeout", timeout_s=self._shutdown_timeout_s,
                         waiting=self._counts.waiting)

    # ---- the hooks the request path calls ------------------------------------------------------------
    def server(self, headers: Mapping[str, str], endpoint: str, request_id: str) -> Traced | None:
        """An HTTP request's server span, continuing the client's ``traceparent``; current until
        :meth:`Traced.end` (which the handler calls after its log line, so that line carries the ids)."""
        if not self.on:
            return None
        parent = _W3C.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(f"POST {endpoint}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": "POST", "url.path": endpoint,
                                                  "gen_ai.operation.name": _OPERATION.get(endpoint, ""),
                                                  "routerd.request_id": request_id})
        return Traced(span)

    def job(self, traceparent: str | None, tracestate: str | None, *, entry: str, stream: str,
            read_ns: int) -> Traced | None:
        """A queue job's consumer span, from when its entry was read (``read_ns``) to its ``XACK``,
        continuing the producer's context when the job carries one."""
        if not self.on:
            return None
        carrier = {"traceparent": traceparent} if traceparent else {}
        if traceparent and tracestate:
            carrier["tracestate"] = tracestate
        parent = _W3C.extract(carrier) if carrier else None
        span = self.tracer.start_span("routerd.queue.job", context=parent, kind=SpanKind.CONSUMER,
                                      start_time=read_ns,
                                      attributes={"messaging.system": "redis",
                                                  "messaging.operation.type": "process",
                                                  "messaging.destination.name": stream,
                                                  "messaging.message.id": entry})
        return Traced(span)

    def span(self, name: str, attributes: Mapping[str, Any] | None = None,
             kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span | None]:
        """A child span of the current one, current inside the ``with`` (the shared no-op when off);
        an exception leaving it marks it an error."""
        if not self._recording():
            return _NULL
        return self._span(name, kind, attributes or {})

    def _recording(self) -> bool:
        """Tracing is on and the current span is sampled: a request that is not sampled makes no child
        span (each would cost the SDK's work for nothing), only the context it passes on."""
        return self.on and trace.get_current_span().is_recording()

    @contextmanager
    def _span(self, name: str, kind: SpanKind, attributes: Mapping[str, Any]) -> Iterator[Span | None]:
        with self.tracer.start_as_current_span(name, kind=kind, attributes=attributes,
                                               record_exception=True, set_status_on_exception=False) as s:
            try:
                yield s
            except BaseException as e:
                _error(s, e)
                raise

    def waiting(self, name: str, cm: AbstractAsyncContextManager[T]) -> AbstractAsyncContextManager[T]:
        """``cm`` (an admission ticket) with a span over its ``__aenter__`` when that waited
        (:data:`WAITED_NS` or more) or failed: a slot taken at once is the server span's
        ``routerd.admission_ms``, not a span of its own (each span costs the request more than the
        admission did)."""
        if not self._recording():
            return cm
        return self._waiting(name, cm)

    def _waited(self, name: str, start_ns: int, error: BaseException | None) -> None:
        now = time.time_ns()
        if error is None and now - start_ns < WAITED_NS:
            return
        span = self.tracer.start_span(name, start_time=start_ns)
        if error is not None:
            _error(span, error)
        span.end(end_time=now)

    @asynccontextmanager
    async def _waiting(self, name: str, cm: AbstractAsyncContextManager[T]) -> AsyncIterator[T]:
        start = time.time_ns()
        try:
            got = await cm.__aenter__()
        except BaseException as e:
            self._waited(name, start, e)
            raise
        self._waited(name, start, None)
        exc: BaseException | None = None
        try:
            yield got
        except BaseException as e:
            exc = e
            if not await cm.__aexit__(type(e), e, e.__traceback__):
                raise
        finally:
            if exc is None:
                await cm.__aexit__(None, None, None)

    def timed(self, name: str, awaitable: Awaitable[T], when: bool = True) -> Awaitable[T]:
        """``awaitable`` (a tenant's charge, a rate-limit wait) inside a span of its own — ``when`` it
        can take time (a tenant without limits is charged at once: no span to pay for)."""
        if not when or not self._recording():
            return awaitable
        return self._timed(name, awaitable)

    async def _timed(self, name: str, awaitable: Awaitable[T]) -> T:
        with self._span(name, SpanKind.INTERNAL, {}):
            return await awaitable

    def attempt(self, name: str, number: int, instance: str, url: str,
                decision: Mapping[str, Any] | None = None) -> AbstractContextManager[Span | None]:
        """One engine attempt (``routerd.attempt``) or continuation (``routerd.resume``): a client span
        whose context :meth:`inject` hands to the engine; ``decision`` is the routing decision's log
        fields (the same facts as the request's log line)."""
        if not self._recording():
            return _NULL
        attrs: dict[str, Any] = {"routerd.attempt": number, "routerd.instance": instance, "url.full": url}
        if decision:
            attrs.update({f"routerd.route.{k}": v for k, v in decision.items()})
        return self._span(name, SpanKind.CLIENT, attrs)

    def inject(self, headers: dict[str, str]) -> None:
        """Put the current span's ``traceparent``/``tracestate`` on an engine request's headers."""
        if self.on:
            _W3C.inject(headers)

    def trace_id(self) -> str:
        """The current span's sampled trace id (``""``: none, or tracing off): a metric's exemplar."""
        if not self.on:
            return ""
        ctx = trace.get_current_span().get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid and ctx.trace_flags.sampled else ""

    def note(self, **attributes: Any) -> None:
        """Attributes on the current span (a retry's reason, a resume's gap, token usage)."""
        if self.on:
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def outcome(self, ok: bool, error: str | None, status: int) -> None:
        """How an attempt that reached the client ended: not ok (a 4xx, a cut stream) marks its span."""
        if not ok and self.on:
            self.failed(error or f"HTTP {status}", **{"http.response.status_code": status})

    def failed(self, message: str, **attributes: Any) -> None:
        """Mark the current span an error (an attempt that will be retried, a cut stream)."""
        if self.on:
            span = trace.get_current_span()
            if span.is_recording():
                span.set_status(Status(StatusCode.ERROR, message[:500]))
                if attributes:
                    span.set_attributes(attributes)


def _error(span: Span, e: BaseException) -> None:
    if isinstance(e, asyncio.CancelledError):
        span.set_attribute("error.type", "cancelled")
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
    elif span.is_recording() and _unset(span):
        # upstream's _Retry / _Resume say why an attempt failed: the request goes on elsewhere
        span.set_attribute("error.type", type(e).__name__.lstrip("_").lower())
        reason = getattr(e, "reason", None)
        if isinstance(reason, str):
            span.set_attribute("routerd.failure.reason", reason)
        span.set_status(Status(StatusCode.ERROR, str(e)[:500]))


def _unset(span: Span) -> bool:
    """True unless :meth:`Tracing.failed` already said why the span failed (the SDK's span has a
    ``status``; the API's does not say)."""
    status: Any = getattr(span, "status", None)
    return status is None or status.status_code is StatusCode.UNSET


class Traced:
    """A span made current by hand (the HTTP handler's, a queue job's) and ended by :meth:`end`, in the
    same task, after what should carry its ids (the request's log line)."""

    __slots__ = ("span", "token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.token = otel_context.attach(trace.set_span_in_context(span))

    @property
    def trace_id(self) -> str:
        """The trace's id as OpenTelemetry prints it; ``""`` when not sampled (no exemplar then)."""
        ctx = self.span.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.trace_flags.sampled else ""

    @property
    def traceparent(self) -> str:
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier.get("traceparent", "")

    def end(self, fields: Mapping[str, Any] | None = None, *, error: str | None = None) -> None:
        """End the span: ``fields`` is the request's (or job's) log line, whose facts become its
        attributes; a 5xx status or an ``error`` with a 2xx (a stream cut) marks it an error."""
        span = self.span
        try:
            if fields is not None and span.is_recording():
                span.set_attributes(_attributes(fields))
                status = fields.get("status")
                error = error or fields.get("error")
                if (isinstance(status, int) and status >= 500) or (error and status in (200, None)):
                    span.set_status(Status(StatusCode.ERROR, str(error or f"HTTP {status}")[:500]))
            elif error:
                span.set_status(Status(StatusCode.ERROR, error[:500]))
        finally:
            otel_context.detach(self.token)
            span.end()


_FIELDS = {"status": "http.response.status_code", "model": "gen_ai.request.model",
           "fleet": "routerd.fleet", "tenant": "routerd.tenant", "instance": "routerd.instance",
           "attempts": "routerd.attempts", "resumes": "routerd.resumes", "stream": "routerd.stream",
           "admission_ms": "routerd.admission_ms", "ttfb_ms": "routerd.ttfb_ms", "error": "routerd.error",
           "delivery": "routerd.queue.delivery", "job_id": "routerd.queue.job_id",
           "endpoint": "routerd.endpoint"}


_ROUTE = {"policy", "prompt_tokens_est", "prompt_blocks", "matched_blocks", "cached_tokens_est",
          "wait_est_ms", "ttft_est_ms", "session_affinity"}


def _attributes(fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None or not isinstance(value, str | bool | int | float):
            continue
        name = _FIELDS.get(key)
        if name is None:
            if key in _ROUTE or key.startswith("runner_up"):
                continue  # the routing decision: on each attempt's span, where it applies
            name = f"routerd.{key}"
        out[name] = value
    if isinstance(ttfb := fields.get("ttfb_ms"), int | float):
        out["gen_ai.latency.time_to_first_token"] = ttfb / 1000
    return out


def usage_attributes(usage: tuple[int, int] | None) -> dict[str, Any]:
    """``gen_ai.usage.*`` of what the engine reported."""
    if usage is None:
        return {}
    return {"gen_ai.usage.input_tokens": usage[0], "gen_ai.usage.output_tokens": usage[1]}


def now_ns() -> int:
    return time.time_ns()


__all__ = ["Traced", "Tracing", "now_ns", "otlp_endpoint", "usage_attributes"]
