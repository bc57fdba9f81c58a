"""structlog setup: JSON lines for journald, a console renderer on a TTY, one format for every logger.

aiohttp, redis and ray log through the stdlib; a ``ProcessorFormatter`` sends their records through the
same processors so journald sees one format. The request id rides in a contextvar
(``structlog.contextvars``) so every line logged while serving a request carries it. Every line, ours
and the stdlib's, passes a :class:`~routerd.redact.Redactor` last, so no secret reaches the log.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

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


def setup(level: str = "info", *, json: bool | None = None, secrets: Iterable[str] = ()) -> Redactor:
    """Configure structlog and the stdlib root logger. ``json=None`` picks JSON unless stdout is a TTY.

    Returns the redactor every line passes, knowing ``secrets``; ``learn`` tells it new ones (reload).
    """
    redactor = Redactor()
    redactor.learn(secrets)
    if json is None:
        json = not sys.stdout.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
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
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
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


def get(name: str | None = None) -> Any:
    """A bound structlog logger; ``name`` becomes the ``component`` field."""
    # get_logger(**initial_values) stays lazy: a module-level logger made before setup() still
    # renders with the processors setup() installs.
    return structlog.get_logger() if name is None else structlog.get_logger(component=name)


bind_request_id = structlog.contextvars.bind_contextvars
