"""Errors in a route's own shape: OpenAI's (``{"error": {"message", "type", "param", "code"}}``) on
every route but Anthropic's ``/v1/messages*``, where routerd answers as vLLM does there:
``{"type": "error", "error": {"type", "message"}}`` with Anthropic's error types. A stream that fails
after it started ends with that route's terminal error event."""

from __future__ import annotations

import msgspec

from ..errors import error_json, error_type, quote
from .routes import ErrorShape, Route, StreamShape

__all__ = ["anthropic_type", "engine_error_body", "error_body_json", "is_route_error", "stream_error"]

_enc = msgspec.json.Encoder()
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body_json(shape: ErrorShape, message: str, type_: str, status: int,
                    param: str | None = None) -> bytes:
    """routerd's own error answer in ``shape`` (``type_``: OpenAI's type, for the OpenAI shape)."""
    if shape is ErrorShape.ANTHROPIC:
        return _enc.encode({"type": "error", "error": {"type": anthropic_type(status), "message": message}})
    return error_json(message, type_, status, param)


def is_route_error(doc: object) -> bool:
    """Whether a decoded engine answer is an error document in either shape."""
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict)


def engine_error_body(shape: ErrorShape, body: bytes, status: int, message: str) -> bytes:
    """An engine's error answer for the client: as it is when it is in an error shape already (vLLM
    answers /v1/messages in Anthropic's), else ``message`` (what the engine said) in the route's."""
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        doc = None
    if is_route_error(doc):
        return body
    return error_body_json(shape, message, error_type(status), status)


def stream_error(route: Route | None, message: str, type_: str = "UpstreamError", status: int = 502) -> bytes:
    """The terminal event of a stream routerd ends after it started: vLLM's ``data: {"error"…}`` +
    ``[DONE]`` on OpenAI's SSE routes; an ``event: error`` on named-event routes (Anthropic's error
    shape on /v1/messages, the Responses API's error event on /v1/responses)."""
    message = quote(message)
    if route is None or route.stream is not StreamShape.EVENTS:
        return b"data: " + error_json(message, type_, status) + b"\n\ndata: [DONE]\n\n"
    if route.errors is ErrorShape.ANTHROPIC:
        data = _enc.encode({"type": "error", "error": {"type": anthropic_type(status), "message": message}})
    else:
        data = _enc.encode({"type": "error", "code": type_, "message": message, "param": None})
    return b"event: error\ndata: " + data + b"\n\n"
