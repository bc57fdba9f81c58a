"""The HTTP pieces every route family of the sim shares: reading a JSON body as vLLM (FastAPI) reads
it, answering JSON, and framing server-sent events."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from routerd.errors import error_json, sse_error_event

from . import protocol as p

_json = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder()

INTERNAL_ERROR = error_json("The server had an error while processing your request.",
                            "InternalServerError", 500)
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}


class Unparsable(Exception):
    """A body FastAPI cannot read as JSON text at all (not UTF-8, nested too deep): its own 400."""


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


def internal_error() -> web.Response:
    return web.Response(body=INTERNAL_ERROR, status=500, content_type="application/json")


def unparsable() -> web.Response:
    return json_response(p.UNPARSABLE_BODY, 400)


def stream_error() -> bytes:
    """What vLLM writes when a stream fails after it started: an error event (then the stream ends)."""
    return sse_error_event("The server had an error while processing your request.")


def encode(obj: Any) -> bytes:
    return _json.encode(obj)


def data_event(obj: Any) -> bytes:
    """An OpenAI-style SSE event: ``data: <json>`` and a blank line."""
    return b"data: " + _json.encode(obj) + b"\n\n"


def named_event(kind: str, obj: Any) -> bytes:
    """An SSE event with its type (the Responses API's and Anthropic's): ``event:`` then ``data:``."""
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(obj) + b"\n\n"


async def read_json(request: web.Request) -> Any:
    """The body as JSON; :class:`Unparsable` or ``protocol.RequestError`` (malformed JSON) as vLLM."""
    raw = await request.read()
    try:
        if not raw.isascii():
            raw.decode()  # vLLM reads the whole body as text first; msgspec checks only strings
        return _json_dec.decode(raw)
    except (UnicodeDecodeError, RecursionError) as e:
        raise Unparsable() from e
    except msgspec.DecodeError as e:
        raise p.invalid_json(str(e)) from e
