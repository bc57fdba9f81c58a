"""The queue's messages: jobs in, results, stream chunks and dead-letter entries out.

The wire format is fixed by the interface (``XADD routerd:requests * job <msgpack or JSON>``;
``XADD <reply_to> * result <JSON>``). Encoders and decoders are built once at import: the consumer
decodes every job and encodes every result on the hot path.

A job may be msgpack or JSON; JSON is recognised by its first non-blank byte being ``{`` (a msgpack map
never starts with that byte), so producers need no flag.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")

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
_attempt = msgspec.json.Decoder(Attempt)
msgpack_encode = msgspec.msgpack.Encoder().encode


def is_json(raw: bytes) -> bool:
    return raw.lstrip()[:1] == b"{"


def decode_job(raw: bytes) -> Job:
    """Decode and validate one job; raise :class:`InvalidJob` with the reason (and what was readable)."""
    as_json = is_json(raw)
    try:
        job = _json_job.decode(raw) if as_json else _msgpack_job.decode(raw)
    except msgspec.ValidationError as e:
        job_id, reply_to = _salvage(raw, as_json)
        raise InvalidJob(f"invalid job: {e}", job_id, reply_to) from None
    except msgspec.DecodeError as e:
        kind = "JSON" if as_json else "msgpack"
        raise InvalidJob(f"not valid {kind}: {e}") from None
    return job


def _salvage(raw: bytes, as_json: bool) -> tuple[str | None, str | None]:
    """The id and reply_to of a message that decodes but does not validate, so it can get a result."""
    try:
        obj = _json_any.decode(raw) if as_json else _msgpack_any.decode(raw)
    except msgspec.DecodeError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    job_id, reply_to = obj.get("id"), obj.get("reply_to")
    ok_id = job_id if isinstance(job_id, str) and 0 < len(job_id) <= 256 else None
    ok_reply = reply_to if isinstance(reply_to, str) and 0 < len(reply_to) <= 512 else None
    return ok_id, ok_reply


def body_problem(job: Job) -> str | None:
    """What is wrong with an OpenAI body routerd would otherwise send to an engine (None if fine)."""
    body = job.body
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "body.model: a non-empty string is required"
    if job.endpoint == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            return "body.messages: a non-empty list of message objects is required"
    elif not isinstance(body.get("prompt"), str | list) or not body["prompt"]:
        return "body.prompt: a non-empty string or list is required"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "body.stream: must be a boolean"
    return None


def entry_time_ms(entry_id: str) -> int:
    """The ms timestamp part of a stream entry id (``1700000000000-0``)."""
    return int(entry_id.split("-", 1)[0])


def now_ms() -> int:
    return int(time.time() * 1000)


def encode_result(result: Result) -> bytes:
    return json_encode(result)


def decode_result(raw: bytes) -> ResultView:
    return _result_view.decode(raw)


def decode_chunk(raw: bytes) -> ChunkView:
    return _chunk_view.decode(raw)


def decode_attempt(raw: bytes) -> Attempt:
    return _attempt.decode(raw)


def error_result(job_id: str, message: str, type_: str, code: int, *, instance: str = "",
                 attempts: int = 0) -> Result:
    """An error result in the OpenAI error shape routerd's HTTP side uses too."""
    return Result(id=job_id, status="error", instance=instance, attempts=attempts,
                  error={"message": message, "type": type_, "param": None, "code": code})
