"""structlog setup: JSON lines for journald, a console renderer on a TTY, one format for every logger.

aiohttp, redis and ray log through the stdlib; a ``ProcessorFormatter`` sends their records through the
same processors so journald sees one format. The request id rides in a contextvar
(``structlog.contextvars``) so every line logged while serving a request carries it. Every line, ours
and the stdlib's, passes a :class:`~routerd.redact.Redactor` last, so no secret reaches the log.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, MutableMapping
from contextvars import ContextVar
from typing import Any, Protocol, TextIO

import msgspec
import structlog

from .redact import Redactor

_json = msgspec.json.Encoder()


def _dumps(obj: Any, **_: Any) -> str:
    # JSONRenderer passes default= and other json.dumps kwargs; msgspec takes none of them.
    try:
        return _json.encode(obj).decode()
    except TypeError:
        return _json.encode({k: repr(v) if not isinstance(v, str | int | float | bool | None) else v
                             for k, v in obj.items()}).decode()


class _UtcTimestamp:
    """The ``timestamp`` field as ``TimeStamper(fmt="iso", utc=True)`` writes it
    (``2026-11-23T11:21:04.741981Z``), with the date and time of day formatted once a second: a
    ``datetime`` built and formatted per line was a sixth of the cost of the request's log line."""

    __slots__ = ("_cached",)

    def __init__(self) -> None:
        self._cached = (-1, "")  # (second, its text), replaced whole: threads log too

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        now = time.time()
        second = int(now)
        cached_second, prefix = self._cached
        if second != cached_second:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._cached = (second, prefix)
        micro = int((now - second) * 1_000_000)
        event["timestamp"] = f"{prefix}.{micro:06d}Z" if micro else f"{prefix}Z"
        return event


class LineWriter:
    """structlog's output: each line and its newline in one ``write``.

    structlog's ``PrintLogger`` prints them as two, and stdout is unbuffered under systemd
    (``PYTHONUNBUFFERED=1`` in the unit), so that was two syscalls for every line — one more per
    request. One writer (and one lock) per stream serves every logger: threads (``to_thread``) log too.
    """

    __slots__ = ("_file", "_lock")

    def __init__(self, file: TextIO) -> None:
        self._file = file
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            self._file.write(message + "\n")
            self._file.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg

    def __call__(self, *_: Any) -> LineWriter:
        """As structlog's logger factory: every logger writes through this one."""
        return self


def setup(level: str = "info", *, json: bool | None = None, secrets: Iterable[str] = (),
          trace_ids: bool = False) -> Redactor:
    """Configure structlog and the stdlib root logger. ``json=None`` picks JSON unless stdout is a TTY.

    Returns the redactor every line passes, knowing ``secrets``; ``learn`` tells it new ones (reload).
    ``trace_ids``: routerd traces, so each line logged under a span carries its ids
    (:func:`add_trace_ids`).
    """
    redactor = Redactor()
    redactor.learn(secrets)
    if json is None:
        json = not sys.stdout.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _UtcTimestamp(),
        *([add_trace_ids] if trace_ids else []),
    ]
    renderer: Any = redactor.render(
        structlog.processors.JSONRenderer(serializer=_dumps)
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, redactor, renderer] if json
        else [*shared, redactor, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=LineWriter(sys.stdout),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, _stdlib_component],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *([structlog.processors.format_exc_info] if json else []),
                redactor,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp.access would log every request twice (we write one canonical line per request).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return redactor


def get(name: str) -> Any:
    """The one way to make a logger: module level, ``_log = log.get("routerd.<component>")``; ``name``
    is the ``component`` field of every line it writes."""
    # get_logger(**initial_values) stays lazy: a module-level logger made before setup() still
    # renders with the processors setup() installs.
    return structlog.get_logger(component=name)


class SpanIds(Protocol):
    """What a log line needs of the span in progress (routerd.tracing's span record)."""

    trace_id: int
    span_id: int
    trace_hex: str  # trace_id as 32 hex digits


# The span in progress in this task: set and reset by routerd.tracing (which sits above this module),
# read here for the log line's ids.
current_span: ContextVar[SpanIds | None] = ContextVar("routerd_current_span", default=None)


def add_trace_ids(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """``trace_id``/``span_id`` of the span current where the line is logged (routerd/tracing), as
    OpenTelemetry prints them: a log line and its trace join on them. Installed only when tracing is
    on: looking for a span costs a little on every line."""
    span = current_span.get()
    if span is not None:
        event_dict["trace_id"] = span.trace_hex
        event_dict["span_id"] = format(span.span_id, "016x")
    return event_dict


def _stdlib_component(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A stdlib record (aiohttp, redis, ray) carries its logger's name as ``component``, as ours do."""
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("component", record.name)
    return event_dict


bind_request_id = structlog.contextvars.bind_contextvars
