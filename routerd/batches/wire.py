"""What the Batch API routes say: OpenAI's file and batch objects, their lists and errors, and ids.

The objects are built from the Redis hashes :mod:`.files` and :mod:`.store` keep (every value a
string there); errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``
with a string ``code``, which the ``openai`` client turns into its ``NotFoundError``,
``BadRequestError``… by status.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

# OpenAI's batch states; the final ones end a batch's run.
STATES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
          "cancelled")
FINAL = frozenset({"failed", "completed", "expired", "cancelled"})
# Timestamps of a batch object, each set when its state is entered.
_STAMPS = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
           "cancelling_at", "cancelled_at")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``status``, ``code`` (a string, or None), ``param``."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def decoded(raw: Mapping[Any, Any]) -> dict[str, str]:
    """A Redis hash as ``str → str``."""
    return {_s(k): _s(v) for k, v in raw.items()}


def _int(h: Mapping[str, str], key: str) -> int | None:
    v = h.get(key, "")
    return int(v) if v else None


def file_object(h: Mapping[str, str]) -> dict[str, Any]:
    """OpenAI's file object from a file hash."""
    return {"id": h["id"], "object": "file", "bytes": int(h.get("bytes", "0")),
            "created_at": int(h["created_at"]), "expires_at": _int(h, "expires_at"),
            "filename": h.get("filename", ""), "purpose": h.get("purpose", "batch"),
            "status": h.get("status", "processed"), "status_details": None}


def batch_object(h: Mapping[str, str]) -> dict[str, Any]:
    """OpenAI's batch object from a batch hash. The output and error files are named once the batch
    is final (OpenAI's way: they are whole then); the error file only if it holds a line."""
    final = h["status"] in FINAL
    failed = int(h.get("failed", "0"))
    out: dict[str, Any] = {
        "id": h["id"], "object": "batch", "endpoint": h["endpoint"],
        "errors": json.loads(h["errors"]) if h.get("errors") else None,
        "input_file_id": h["input_file_id"], "completion_window": h["completion_window"],
        "status": h["status"],
        "output_file_id": h.get("output_file_id") or None if final and h.get("out_lines", "0") != "0"
        else None,
        "error_file_id": h.get("error_file_id") or None if final and h.get("err_lines", "0") != "0"
        else None,
        "created_at": int(h["created_at"]),
        "request_counts": {"total": int(h.get("total", "0")), "completed": int(h.get("completed", "0")),
                           "failed": failed},
        "metadata": json.loads(h["metadata"]) if h.get("metadata") else None,
    }
    for stamp in _STAMPS:
        out[stamp] = _int(h, stamp)
    return out


def listing(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: ``data``, ``first_id``, ``last_id``, ``has_more``."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
