"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: vLLM 0.32's speech-to-text
routes (multipart forms), as a Whisper-like model answers them.

The transcript is deterministic: words the sim generates from a digest of the audio bytes (and the
task), one generated token per word, as many as the clip's length suggests (≈2.5 words a second,
``max_completion_tokens`` at most). The clip's duration is read from a WAV header, else counted at
16 kHz 16-bit mono. It is generation: it goes through the batching engine, its metrics and faults.
Files over vLLM's 25 MB (``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``; ``--max-audio-filesize-mb``) are refused,
read no further than the limit.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from . import protocol as p
from . import wire
from .config import SimConfig
from .running import Prompt, Runner

_FORMATS = ("json", "text", "verbose_json", "diarized_json", "srt", "vtt")


@dataclass(frozen=True)
class AudioRequest:
    audio: bytes
    fields: dict[str, str]
    stream: bool
    include_usage: bool


def duration_s(audio: bytes) -> float:
    """A WAV's duration from its header (byte rate, data size); anything else at 32,000 bytes a second."""
    if len(audio) >= 44 and audio[:4] == b"RIFF" and audio[8:12] == b"WAVE":
        byte_rate = int(struct.unpack_from("<I", audio, 28)[0])
        if byte_rate > 0:
            return max(0.0, (len(audio) - 44) / byte_rate)
    return len(audio) / 32000


def _flag(fields: dict[str, str], name: str) -> bool:
    value = fields.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise p.field_error("bool_parsing", name, "Input should be a valid boolean", value)
    return value in ("true", "1")


class AudioRoutes:
    """The two routes: the same engine work, transcription's answer carrying the clip's duration."""

    def __init__(self, config: SimConfig, runner: Runner) -> None:
        self.config = config
        self.runner = runner

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/audio/transcriptions", self.transcriptions),
                web.post("/v1/audio/translations", self.translations)]

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "transcribe")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "translate")

    async def read(self, request: web.Request) -> AudioRequest:
        """The form, the file read no further than the size limit; vLLM's errors for what is wrong."""
        fields: dict[str, str] = {}
        audio: bytes | None = None
        if request.content_type == "multipart/form-data":
            try:
                audio = await self._read_form(request, fields)
            except (ValueError, HttpProcessingError) as e:  # no boundary, cut or garbled: Starlette's 400
                raise wire.Unparsable() from e
        if audio is None:
            raise p.field_error("missing", "file", "Field required", None)
        model = fields.get("model")
        if model:
            p.check_model({"model": model}, self.config)
        fmt = fields.get("response_format", "json")
        if fmt not in _FORMATS:
            raise p.field_error("literal_error", "response_format",
                                "Input should be 'json', 'text', 'srt', 'verbose_json' or 'vtt'", fmt)
        if fmt not in ("json", "text"):
            raise p.RequestError(400, f"Currently do not support {fmt} for {self.config.model}",
                                 "BadRequestError", None)
        stream = _flag(fields, "stream")
        return AudioRequest(audio=audio, fields=fields, stream=stream,
                            include_usage=stream and _flag(fields, "stream_include_usage"))

    async def _read_form(self, request: web.Request, fields: dict[str, str]) -> bytes | None:
        """The form's fields into ``fields``; the file's bytes (None: no file part)."""
        audio = None
        async for part in await request.multipart():
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "file":
                audio = await _read_limited(part, self.config.max_audio_filesize_mb * 2**20)
            elif part.name:
                fields[part.name] = (await part.read(decode=True)).decode("utf-8", "replace")
        return audio

    def _words(self, req: AudioRequest, task: str) -> tuple[Prompt, int]:
        seconds = duration_s(req.audio)
        digest = hashlib.blake2b(req.audio, digest_size=16).hexdigest()
        words = [f"<|{task}|>", digest]
        budget = max(1, math.ceil(seconds * 2.5))
        limit = req.fields.get("max_completion_tokens")
        if limit is not None and limit.isdigit() and int(limit) > 0:
            budget = min(budget, int(limit))
        # Whisper's encoder sees the clip in 20 ms frames: the prefill grows with the clip.
        tokens = len(words) + math.ceil(seconds * 50)
        budget = min(budget, max(1, self.config.max_model_len - tokens))
        return Prompt(words, tokens, " ".join(words)), budget

    async def _answer(self, request: web.Request, task: str) -> web.StreamResponse:
        try:
            req = await self.read(request)
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return wire.json_response(e.body, e.status)
        prompt, budget = self._words(req, task)
        if self.runner.refuses(prompt.key):
            return wire.internal_error()
        seq = self.runner.generation(prompt, budget)
        async with self.runner.running(seq):
            if req.stream:
                return await self._stream(request, req, task, prompt, seq)
            if not await self.runner.finish(seq):
                return wire.internal_error()
        text = "".join(seq.pieces).strip()
        if task == "translate":
            return wire.json_response({"text": text})
        seconds = math.ceil(duration_s(req.audio))
        return wire.json_response({"text": text, "usage": {"type": "duration", "seconds": seconds}})

    async def _stream(self, request: web.Request, req: AudioRequest, task: str, prompt: Prompt,
                      seq: Any) -> web.StreamResponse:
        """vLLM's stream: one ``transcription.chunk`` (``translation.chunk``) per token, the last with its
        finish reason, then the usage chunk if asked, then ``[DONE]``."""
        rid = ("trsc-" if task == "transcribe" else "trsl-") + secrets.token_hex(16)
        kind = "transcription.chunk" if task == "transcribe" else "translation.chunk"
        created = int(time.time())
        resp = web.StreamResponse(headers=wire.SSE_HEADERS)
        await resp.prepare(request)
        sent = 0
        async for idx in seq.stream():
            if self.runner.breaks_stream(sent, seq):
                break
            last = idx == seq.num_tokens - 1
            choice: dict[str, Any] = {"delta": {"content": seq.pieces[idx]}}
            if last:
                choice |= {"finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
            await resp.write(wire.data_event({"id": rid, "object": kind, "created": created,
                                              "model": self.config.model, "choices": [choice]}))
            sent += 1
        if not self.runner.finished(seq):
            await resp.write(wire.stream_error())
            await resp.write_eof()
            return resp
        if req.include_usage:
            usage = {"prompt_tokens": prompt.tokens, "total_tokens": prompt.tokens + seq.generated,
                     "completion_tokens": seq.generated}
            await resp.write(wire.data_event({"id": rid, "object": kind, "created": created,
                                              "model": self.config.model, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _read_limited(part: BodyPartReader, limit: int) -> bytes:
    """The file part, refused as soon as it passes the limit (nothing more of it is read)."""
    chunks: list[bytes] = []
    total = 0
    while chunk := await part.read_chunk(64 * 1024):
        total += len(chunk)
        if total > limit:
            raise p.semantic_error("Maximum file size exceeded", "audio_filesize_mb", total / 2**20)
        chunks.append(chunk)
    return b"".join(chunks)
