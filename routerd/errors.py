"""routerd's exception tree. Each error knows its HTTP status and OpenAI-style ``type``.

Errors are raised deep (admission, router, upstream) and turned into an HTTP response or a queue
result only at the edges, with :func:`error_body`, so both ways in report the same failure the same way.
"""

from __future__ import annotations

from typing import Any

import msgspec


class RouterdError(Exception):
    """Base class: ``status`` and ``type`` map onto vLLM/OpenAI's error JSON."""

    status: int = 500
    type: str = "InternalServerError"
    retryable: bool = False

    def __init__(self, message: str, *, param: str | None = None, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.data = data

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.status, self.param)


class BadRequest(RouterdError):
    status, type = 400, "BadRequestError"


class Unauthorized(RouterdError):
    status, type = 401, "AuthenticationError"


class PermissionDenied(RouterdError):
    """The caller is known but may not do this (a tenant asking for a fleet it is not allowed)."""

    status, type = 403, "PermissionDeniedError"


class NotFound(RouterdError):
    status, type = 404, "NotFoundError"


class BodyTooLarge(RouterdError):
    status, type = 413, "RequestTooLargeError"


class UnsupportedMediaType(RouterdError):
    """A body in a format the route does not take (JSON sent as a form, a form where JSON is due)."""

    status, type = 415, "UnsupportedMediaTypeError"


class Overloaded(RouterdError):
    """The fleet's admission bound is reached: come back after ``retry_after_s``."""

    status, type = 429, "RateLimitError"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimited(Overloaded):
    """A tenant is over its rate limit: 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*``."""

    def __init__(self, message: str, *, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.headers = headers


class NoReadyInstance(RouterdError):
    """No instance can take the request; ``retry_after_s`` when one is expected (a fleet starting)."""

    status, type = 503, "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(RouterdError):
    status, type = 504, "DeadlineExceededError"


class UpstreamError(RouterdError):
    """The engine failed (connect error, timeout, 5xx). ``retryable`` when no byte reached the client."""

    status, type = 502, "UpstreamError"

    def __init__(self, message: str, *, retryable: bool = True, upstream_status: int | None = None,
                 instance: str = "") -> None:
        super().__init__(message)
        self.retryable = retryable
        self.upstream_status = upstream_status
        self.instance = instance


class ShuttingDown(RouterdError):
    """routerd is draining: another routerd (or this one restarted) takes the request after
    ``retry_after_s``."""

    status, type = 503, "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimitFailed(RouterdError):
    """A request's rate-limit check failed inside routerd (not over the limit, not Redis away): that
    request fails, logged with the cause; the checks of every other request go on."""


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM ≥ 0.10.1's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_enc = msgspec.json.Encoder()

_QUOTE_CHARS = 200
# OpenAI's error ``type`` for a status routerd did not raise itself (aiohttp's, or an engine's answer
# that is not in OpenAI's shape).
_STATUS_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                 404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError", 417: "ExpectationFailedError",
                 422: "UnprocessableEntityError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


def quote(text: str) -> str:
    """Client input (or an engine message that may echo it) for an error message or a log line: one
    line, cut to a bounded length with a marker saying how long it was."""
    head = " ".join(text[:2 * _QUOTE_CHARS].split())  # never walks a megabyte to log 200 characters
    if len(head) <= _QUOTE_CHARS and len(text) <= 2 * _QUOTE_CHARS:
        return head
    return head[:_QUOTE_CHARS] + f"… ({len(text)} characters)"


def error_type(status: int) -> str:
    """The OpenAI-style ``type`` for an HTTP error status."""
    return _STATUS_TYPES.get(status, "InternalServerError" if status >= 500 else "InvalidRequestError")


def error_json(message: str, type_: str, code: int, param: str | None = None) -> bytes:
    return _enc.encode(error_body(message, type_, code, param))


def sse_error_event(message: str, type_: str = "InternalServerError", code: int = 500) -> bytes:
    """The terminal event vLLM sends when a stream fails after it started, followed by ``[DONE]``."""
    return b"data: " + error_json(message, type_, code) + b"\n\ndata: [DONE]\n\n"
