"""The spans a ``with`` block or a request holds current: :class:`Traced` (the HTTP handler's, a queue
job's, ended by hand after the request's log line), the scope of a span current for a block, the timer
around an admission ticket's wait; each a small class, not a generator — they run per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .. import log
from ._span import Span, SpanKind

if TYPE_CHECKING:
    from types import TracebackType

    from . import Tracing

T = TypeVar("T")

# the span in progress (routerd.log reads it for the log line's ids); set and reset only in tracing
CURRENT = cast("ContextVar[Span | None]", log.current_span)
WAITED_NS = 1_000_000  # an admission wait this long (1 ms) or longer gets a span


def current_context() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of routerd's span in progress (``routerd submit``'s);
    ``{}`` without one."""
    span = CURRENT.get()
    if span is None:
        return {}
    return {"traceparent": span.traceparent, **({"tracestate": span.tracestate} if span.tracestate else {})}


class Scope:
    """A span current for a ``with`` block, ended (and queued for export) when it leaves; an
    exception leaving it marks it an error. A class, not ``@contextmanager``: this is per span."""

    __slots__ = ("span", "token", "tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self.token: Token[Span | None] | None = None

    def __enter__(self) -> Span:
        self.token = CURRENT.set(self.span)
        return self.span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            mark_error(self.span, exc)
        if self.token is not None:
            CURRENT.reset(self.token)
        self.tracing.finish(self.span)


class Waiting(AbstractAsyncContextManager[T]):
    """:meth:`Tracing.waiting`'s wrapper: times ``cm.__aenter__`` and passes everything else through
    (a class, not ``@asynccontextmanager``: an async generator per request costs more than the span)."""

    __slots__ = ("cm", "name", "parent", "tracing")

    def __init__(self, tracing: Tracing, parent: Span, name: str, cm: AbstractAsyncContextManager[T]) -> None:
        self.tracing, self.parent, self.name, self.cm = tracing, parent, name, cm

    async def __aenter__(self) -> T:
        start = time.time_ns()
        try:
            got = await self.cm.__aenter__()
        except BaseException as e:
            self._waited(start, e)
            raise
        self._waited(start, None)
        return got

    def _waited(self, start_ns: int, error: BaseException | None) -> None:
        now = time.time_ns()
        if error is None and now - start_ns < WAITED_NS:
            return
        span = self.tracing.child(self.parent, self.name, SpanKind.INTERNAL, {}, start_ns)
        if error is not None:
            mark_error(span, error)
        self.tracing.finish(span, now)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        return await self.cm.__aexit__(exc_type, exc, tb)


def mark_error(span: Span, e: BaseException) -> None:
    """Mark ``span`` failed by ``e``: cancelled, or an error with the exception as its event."""
    if isinstance(e, asyncio.CancelledError):
        span.attributes["error.type"] = "cancelled"
        span.set_error("cancelled")
    elif span.sampled:
        span.record_exception(e)
        if span.status == 0:  # unless Tracing.failed already said why
            # upstream's _Retry / _Resume say why an attempt failed: the request goes on elsewhere
            span.attributes["error.type"] = type(e).__name__.lstrip("_").lower()
            reason = getattr(e, "reason", None)
            if isinstance(reason, str):
                span.attributes["routerd.failure.reason"] = reason
            span.set_error(str(e))


class Traced:
    """A span made current by hand (the HTTP handler's, a queue job's) and ended by :meth:`end`, in the
    same task, after what should carry its ids (the request's log line)."""

    __slots__ = ("span", "token", "tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self.token = CURRENT.set(span)

    @property
    def trace_id(self) -> str:
        """The trace's id as OpenTelemetry prints it; ``""`` when not sampled (no exemplar then)."""
        return self.span.trace_hex if self.span.sampled else ""

    @property
    def traceparent(self) -> str:
        return self.span.traceparent

    def end(self, fields: Mapping[str, Any] | None = None, *, error: str | None = None) -> None:
        """End the span: ``fields`` is the request's (or job's) log line, whose facts become its
        attributes (handed over: the caller never changes it after); a 5xx status or an ``error``
        with a 2xx (a stream cut) marks it an error."""
        span = self.span
        try:
            if fields is not None and span.sampled:
                span.fields = fields  # the export thread makes them attributes (_export._span)
                status = fields.get("status")
                error = error or fields.get("error")
                if (isinstance(status, int) and status >= 500) or (error and status in (200, None)):
                    span.set_error(str(error or f"HTTP {status}"))
            elif error:
                span.set_error(error)
        finally:
            CURRENT.reset(self.token)
            self.tracing.finish(span)
