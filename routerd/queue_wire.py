"""The queue's messages: jobs in, results, stream chunks and dead-letter entries out.

The wire format is fixed by the interface (``XADD routerd:requests * job <msgpack or JSON>``;
``XADD <reply_to> * result <JSON>``). Encoders and decoders are built once at import: the consumer
decodes every job and encodes every result on the hot path.

A job may be msgpack or JSON; JSON is recognised by its first non-blank byte being ``{`` (a msgpack map
never starts with that byte), so producers need no flag.
"""

from __future__ import annotations

import math
import re
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# Any route routerd serves that takes a JSON body (routerd.surface.ROUTES): checked with the body.
Endpoint = Annotated[str, Meta(min_length=1, max_length=256)]

# A deadline this small cannot be a Unix time in ms (it would be before 1973): it is read as
# "milliseconds after the job was enqueued", measured from the stream entry id's timestamp.
_RELATIVE_DEADLINE_BELOW_MS = 100_000_000_000


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One queued request, as producers write it (unknown extra fields are ignored, not fatal)."""

    id: Annotated[str, Meta(min_length=1, max_length=256)]
    endpoint: Endpoint
    body: dict[str, Any]
    reply_to: Annotated[str, Meta(min_length=1, max_length=512)]
    priority: int = 0
    deadline_ms: int | None = None
    tenant: Annotated[str, Meta(min_length=1, max_length=64)] = "default"  # a [[tenants]] name
    # Keeps a conversation's jobs on one instance while it is not saturated (routing's session key;
    # without it the body's `user`).
    session: Annotated[str, Meta(max_length=256)] | None = None
    # W3C trace context of the producer's span: routerd's spans for the job join that trace. Malformed
    # values are ignored (a new trace starts), as W3C asks of an invalid header: tracing never fails a job.
    traceparent: str | None = None
    tracestate: str | None = None

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def deadline_epoch_s(self, entry_id: str) -> float | None:
        """Absolute deadline in Unix seconds; relative deadlines count from the entry's enqueue time."""
        if self.deadline_ms is None:
            return None
        if self.deadline_ms < _RELATIVE_DEADLINE_BELOW_MS:
            return (entry_time_ms(entry_id) + self.deadline_ms) / 1000.0
        return self.deadline_ms / 1000.0


class Result(msgspec.Struct, kw_only=True, omit_defaults=False):
    """The one result per job id, ``XADD <reply_to> * result <JSON>``."""

    id: str
    status: Literal["ok", "error"]
    response: msgspec.Raw | None = None  # the engine's JSON, embedded byte for byte
    error: dict[str, Any] | None = None  # OpenAI error object: message, type, param, code
    instance: str = ""
    attempts: int = 0


class ResultView(msgspec.Struct, kw_only=True):
    """A result as the client reads it back (``response`` decoded)."""

    id: str
    status: Literal["ok", "error"]
    response: Any = None
    error: dict[str, Any] | None = None
    instance: str = ""
    attempts: int = 0


class Chunk(msgspec.Struct, kw_only=True):
    """One SSE event of a streamed job, ``XADD <reply_to> * chunk <JSON>``, in order before the result.

    ``delivery`` is the job's delivery number: if routerd died mid-stream and ran the job again, the
    new run's chunks restart at ``seq`` 0 with a higher ``delivery`` and the reader drops the old ones.
    """

    id: str
    seq: int
    delivery: int
    data: msgspec.Raw


class ChunkView(msgspec.Struct, kw_only=True):
    id: str
    seq: int
    delivery: int
    data: Any


class Attempt(msgspec.Struct, kw_only=True):
    """One failed try, kept in the job's history list and copied into its dead-letter entry."""

    at_ms: int
    consumer: str
    delivery: int
    instance: str = ""
    error: str = ""


class InvalidJob(Exception):
    """A message that cannot become a Job. ``job_id``/``reply_to`` are set when they were readable."""

    def __init__(self, reason: str, job_id: str | None = None, reply_to: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.job_id = job_id
        self.reply_to = reply_to


_json_job = msgspec.json.Decoder(Job)
_msgpack_job = msgspec.msgpack.Decoder(Job)
_json_any = msgspec.json.Decoder()
_msgpack_any = msgspec.msgpack.Decoder()
json_encode = msgspec.json.Encoder().encode
_result_view = msgspec.json.Decoder(ResultView)
_chunk_view = msgspec.json.Decoder(ChunkView)
msgpack_encode = msgspec.msgpack.Encoder().encode


def is_json(raw: bytes) -> bool:
    return raw.lstrip()[:1] == b"{"


_NOT_UTF8 = "not valid {kind}: a string holds bytes that are not UTF-8 ({why})"


def decode_job(raw: bytes) -> Job:
    """Decode and validate one job; raise :class:`InvalidJob` with the reason (and what was readable).

    Whatever the bytes are, the only exception is :class:`InvalidJob`: decoding is deterministic, so a
    message that fails once fails on every delivery and must be dead-lettered at once, never retried.
    """
    as_json = is_json(raw)
    kind = "JSON" if as_json else "msgpack"
    try:
        job = _json_job.decode(raw) if as_json else _msgpack_job.decode(raw)
    except msgspec.ValidationError as e:
        job_id, reply_to = salvage(raw)
        raise InvalidJob(clip(f"invalid job: {e}"), job_id, reply_to) from None
    except msgspec.DecodeError as e:  # a syntax error (``NaN``, say) may come after a readable id
        job_id, reply_to = salvage(raw)
        if "UTF-8" in str(e):  # msgspec 0.23 says so in a DecodeError; earlier ones raise the next
            raise InvalidJob(_NOT_UTF8.format(kind=kind, why=e), job_id, reply_to) from None
        raise InvalidJob(clip(f"not valid {kind}: {e}"), job_id, reply_to) from None
    except UnicodeDecodeError as e:
        job_id, reply_to = salvage(raw)
        raise InvalidJob(_NOT_UTF8.format(kind=kind, why=e.reason), job_id, reply_to) from None
    except RecursionError:
        job_id, reply_to = salvage(raw)
        raise InvalidJob(f"not valid {kind}: nested too deeply", job_id, reply_to) from None
    except Exception as e:  # noqa: BLE001 — producer input: any decoder failure makes the job invalid
        job_id, reply_to = salvage(raw)
        raise InvalidJob(clip(f"not valid {kind}: {type(e).__name__}: {e}"), job_id, reply_to) from None
    return job


def not_json(body: dict[str, Any]) -> str | None:
    """Where a decoded msgpack body holds a value JSON would carry as something else — ``bytes`` (JSON
    would send it base64-encoded, as a string the engine then reads as the prompt), a timestamp (an
    RFC 3339 string), a float that is not finite (``null``), a map key that is not a string — as
    ``body.messages[0].content: bytes``; None when the body goes to the engine as it was sent.
    Iterative: the decoder's own depth bound is the only one."""
    todo: list[tuple[str, Any]] = [("body", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    return f"{path}: a key of type {type(k).__name__} ({clip(repr(k), 50)})"
                todo.append((f"{path}.{k}", v))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                return f"{clip(path, 200)}: {value!r} is not a JSON number"
        elif isinstance(value, bytes | bytearray | memoryview):
            return f"{clip(path, 200)}: msgpack bin (bytes) where text must be a msgpack str"
        elif value is not None and not isinstance(value, str | int):
            return f"{clip(path, 200)}: a {type(value).__name__} is not a JSON value"
    return None


class _Ids(msgspec.Struct):
    id: Any = None
    reply_to: Any = None


_json_ids = msgspec.json.Decoder(_Ids)
_msgpack_ids = msgspec.msgpack.Decoder(_Ids)


def salvage(raw: bytes) -> tuple[str | None, str | None]:
    """The ``id`` and ``reply_to`` of a message that is not a valid job, so that it can still get an
    error result: read by a decoder that skips every other field, or — when that fails too (a body
    nested too deeply for any decoder) — by a flat scan of the top-level object. Never raises."""
    as_json = is_json(raw)
    try:
        ids = _json_ids.decode(raw) if as_json else _msgpack_ids.decode(raw)
        found: tuple[Any, Any] = (ids.id, ids.reply_to)
    except Exception:  # noqa: BLE001 — producer input: fall back to the scan
        try:
            found = _scan_json(raw) if as_json else _scan_msgpack(raw)
        except Exception:  # noqa: BLE001 — producer input: nothing could be read
            return None, None
    job_id, reply_to = found
    ok_id = job_id if isinstance(job_id, str) and 0 < len(job_id) <= 256 else None
    ok_reply = reply_to if isinstance(reply_to, str) and 0 < len(reply_to) <= 512 else None
    return ok_id, ok_reply


_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\],:]')


def _scan_json(raw: bytes) -> tuple[Any, Any]:
    """Top-level ``"id"`` and ``"reply_to"`` string values, found without recursion."""
    found: dict[bytes, Any] = {}
    depth, key, expect_key = 0, b"", False
    for m in _JSON_TOKEN.finditer(raw):
        tok = m.group()
        if tok in (b"{", b"["):
            depth += 1
            expect_key = depth == 1 and tok == b"{"
        elif tok in (b"}", b"]"):
            depth -= 1
        elif depth != 1:
            continue
        elif tok in (b",", b":"):
            expect_key = tok == b","
        elif expect_key:
            key = tok
        else:
            if key in (b'"id"', b'"reply_to"'):
                found.setdefault(key, _json_any.decode(tok))
            key = b""
    return found.get(b'"id"'), found.get(b'"reply_to"')


def _scan_msgpack(raw: bytes) -> tuple[Any, Any]:
    """Top-level ``id`` and ``reply_to`` string values of a msgpack map, found without recursion."""
    pos, n = _mp_container(raw, 0, map_=True)
    found: dict[Any, Any] = {}
    for _ in range(n):
        key_end = _mp_skip(raw, pos)
        value_end = _mp_skip(raw, key_end)
        if key_end - pos <= 9:  # "reply_to" is 9 bytes as msgpack; only short keys are decoded
            key = _msgpack_any.decode(raw[pos:key_end])
            if key in ("id", "reply_to"):
                found.setdefault(key, _msgpack_any.decode(raw[key_end:value_end]))
        pos = value_end
    return found.get("id"), found.get("reply_to")


def _mp_container(raw: bytes, pos: int, *, map_: bool) -> tuple[int, int]:
    """(position after the header, number of entries) of the map (or array) at ``pos``."""
    b = raw[pos]
    fix, size16, size32 = (0x80, 0xDE, 0xDF) if map_ else (0x90, 0xDC, 0xDD)
    if fix <= b <= fix + 0x0F:
        return pos + 1, b & 0x0F
    if b == size16:
        return pos + 3, int.from_bytes(raw[pos + 1:pos + 3], "big")
    if b == size32:
        return pos + 5, int.from_bytes(raw[pos + 1:pos + 5], "big")
    raise ValueError("not a msgpack map")


# msgpack type byte → (bytes of length field, fixed payload bytes) for the non-container types
_MP_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
             0xCA: (0, 4), 0xCB: (0, 8), 0xCC: (0, 1), 0xCD: (0, 2), 0xCE: (0, 4), 0xCF: (0, 8),
             0xD0: (0, 1), 0xD1: (0, 2), 0xD2: (0, 4), 0xD3: (0, 8), 0xD4: (0, 2), 0xD5: (0, 3),
             0xD6: (0, 5), 0xD7: (0, 9), 0xD8: (0, 17), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}


def _mp_skip(raw: bytes, pos: int) -> int:
    """The position after the msgpack value at ``pos``; iterative, so any nesting depth is fine."""
    todo = 1
    while todo:
        todo -= 1
        b = raw[pos]
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            pos += 1
        elif 0xA0 <= b <= 0xBF:
            pos += 1 + (b & 0x1F)
        elif 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
            pos, n = _mp_container(raw, pos, map_=True)
            todo += 2 * n
        elif 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
            pos, n = _mp_container(raw, pos, map_=False)
            todo += n
        elif b in _MP_SIZED:
            len_bytes, fixed = _MP_SIZED[b]
            size = int.from_bytes(raw[pos + 1:pos + 1 + len_bytes], "big")
            pos += 1 + len_bytes + fixed + size
        else:
            raise ValueError(f"msgpack byte 0x{b:02x} is never used")
        if pos > len(raw):
            raise ValueError("truncated msgpack")
    return pos


def clip(text: str, limit: int = 500) -> str:
    """Producer input quoted in a reason or log line, cut to ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def entry_time_ms(entry_id: str) -> int:
    """The ms timestamp part of a stream entry id (``1700000000000-0``)."""
    return int(entry_id.split("-", 1)[0])


def now_ms() -> int:
    return int(time.time() * 1000)


def decode_result(raw: bytes) -> ResultView:
    return _result_view.decode(raw)


def decode_chunk(raw: bytes) -> ChunkView:
    return _chunk_view.decode(raw)


def error_result(job_id: str, message: str, type_: str, code: int, *, instance: str = "",
                 attempts: int = 0) -> Result:
    """An error result in the OpenAI error shape routerd's HTTP side uses too."""
    return Result(id=job_id, status="error", instance=instance, attempts=attempts,
                  error={"message": message, "type": type_, "param": None, "code": code})
