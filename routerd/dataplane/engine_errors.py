"""What an engine's error answer says: its message, in whatever shape the engine wrote it, and the
answer in OpenAI's error shape for the client."""

from __future__ import annotations

import msgspec

from ..errors import error_json, error_type, quote

__all__ = ["error_message", "event_message", "openai_error_body"]


def _doc(body: bytes) -> object:
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


def error_message(body: bytes, status: int) -> str:
    """The engine's error message — vLLM's nested shape (≥0.10.1), its flat one (before), FastAPI's
    ``{"detail": …}`` — quoted: engines echo client input in their messages (a model name, a value)."""
    doc = _doc(body)
    if doc is None:
        return quote(body[:1000].decode(errors="replace")) or f"HTTP {status}"
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return quote(err["message"])
        if isinstance(err, str):
            return quote(err)
        if isinstance(doc.get("detail"), str):
            return quote(doc["detail"])
    return f"HTTP {status}"


def openai_error_body(body: bytes, status: int) -> bytes:
    """``body`` when it is already OpenAI's ``{"error": {…}}``, else that shape with its message."""
    doc = _doc(body)
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return body
    return error_json(error_message(body, status), error_type(status), status)


def event_message(chunk: bytes) -> str:
    """The message of an SSE error event (``data: {"error": …}``)."""
    line = chunk.split(b"\n", 1)[0][len(b"data: "):]
    return error_message(line, 500)
