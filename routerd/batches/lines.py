"""One line of a batch: how it is checked, how it becomes a queue job, how its result is written.

A line is OpenAI's ``{"custom_id", "method": "POST", "url", "body"}``. Its body is carried as the very
bytes the file holds (``msgspec.Raw``): validation reads only its head (``model``, ``stream``), and
the queue job embeds it unparsed. Output lines have OpenAI's shape,
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``; a line that never
ran (the window ended) has ``response: null`` and an ``error`` with OpenAI's code ``batch_expired``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from ..queue_wire import clip


class Line(msgspec.Struct):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class _Head(msgspec.Struct):
    model: Any = None
    stream: Any = None


class JobOut(msgspec.Struct, omit_defaults=True):
    """A queue job as routerd's wire has it (routerd/queue_wire.py's Job), its body embedded byte for byte."""

    id: str
    endpoint: str
    body: msgspec.Raw
    reply_to: str
    priority: int
    tenant: str
    deadline_ms: int | None = None


class Outcome(msgspec.Struct, kw_only=True):
    """A queue job's result (routerd/queue_wire.py's Result) with the engine's answer left as bytes."""

    id: str
    status: str
    response: msgspec.Raw = msgspec.Raw(b"null")  # any JSON, null included, left as its bytes
    error: dict[str, Any] | None = None


class _Response(msgspec.Struct):
    status_code: int
    request_id: str
    body: msgspec.Raw


class _OutLine(msgspec.Struct):
    id: str
    custom_id: msgspec.Raw  # its JSON, as kept while the line runs
    response: _Response | None
    error: dict[str, Any] | None


_line = msgspec.json.Decoder(Line)
_head = msgspec.json.Decoder(_Head)
_outcome = msgspec.json.Decoder(Outcome)
encode = msgspec.json.Encoder().encode


class LineError(Exception):
    """A line that cannot run: OpenAI's per-line error ``code`` and ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def parse(raw: bytes) -> Line:
    try:
        return _line.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        # msgspec's ValidationError is a DecodeError: a missing or mistyped field
        text = str(e)
        if isinstance(e, msgspec.ValidationError):
            raise LineError("invalid_request", f"not a batch request line: {clip(text, 200)}") from None
        raise LineError("invalid_json_line", f"This line is not parseable as valid JSON: {clip(text, 200)}") \
            from None


def check(raw: bytes, endpoint: str, max_body_bytes: int, model_error: Callable[[str], str | None]) -> Line:
    """The line, or :class:`LineError`: JSON, ``method`` POST, ``url`` the batch's endpoint, a body that
    is an object within ``max_body_bytes`` naming a model the tenant may use, not streamed."""
    line = parse(raw)
    if line.method.upper() != "POST":
        raise LineError("invalid_method", f"method must be POST, not {clip(line.method, 50)!r}")
    if line.url != endpoint:
        raise LineError("mismatched_endpoint",
                        f"url {clip(line.url, 100)!r} is not the batch's endpoint {endpoint!r}")
    if len(line.body) > max_body_bytes:
        raise LineError("request_too_large",
                        f"the body is {len(line.body)} bytes, over the limit of {max_body_bytes} "
                        "(http.max_body_bytes)")
    if bytes(memoryview(line.body)[:1]) != b"{":
        raise LineError("invalid_body", "body must be a JSON object")
    try:
        head = _head.decode(line.body)
    except msgspec.DecodeError as e:
        raise LineError("invalid_body", f"body is not a JSON object: {clip(str(e), 200)}") from None
    if not isinstance(head.model, str) or not head.model:
        raise LineError("missing_required_parameter", "body.model is required (a string)")
    why = model_error(head.model)
    if why is not None:
        raise LineError("model_not_found", why)
    if head.stream is True:
        raise LineError("invalid_body", "body.stream must not be true in a batch (each line's answer is "
                                        "written whole)")
    return line


def job(line: Line, job_id: str, endpoint: str, reply_to: str, priority: int, tenant: str,
        deadline_ms: int) -> bytes:
    return encode(JobOut(id=job_id, endpoint=endpoint, body=line.body, reply_to=reply_to,
                         priority=priority, tenant=tenant, deadline_ms=deadline_ms))


def outcome(raw: bytes) -> Outcome | None:
    try:
        return _outcome.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


def result_line(req_id: str, custom_id_json: str, job_id: str, out: Outcome) -> tuple[str, bytes]:
    """(``'out'`` or ``'err'``, the output line) for a job's result."""
    if out.status == "ok" and bytes(out.response) != b"null":
        resp = _Response(status_code=200, request_id=job_id, body=out.response)
        return "out", encode(_OutLine(req_id, msgspec.Raw(custom_id_json.encode()), resp, None)) + b"\n"
    err = out.error or {"message": "no answer", "type": "InternalServerError", "param": None, "code": 500}
    code = err.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    resp = _Response(status_code=status, request_id=job_id, body=msgspec.Raw(encode({"error": err})))
    return "err", encode(_OutLine(req_id, msgspec.Raw(custom_id_json.encode()), resp, None)) + b"\n"


def expired_line(req_id: str, custom_id_json: str) -> bytes:
    return encode(_OutLine(req_id, msgspec.Raw(custom_id_json.encode()), None, {
        "code": "batch_expired",
        "message": "This request could not be executed before the completion window expired."})) + b"\n"
