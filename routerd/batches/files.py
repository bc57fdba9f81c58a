"""Files in Redis: a hash of the file object, the bytes in pieces of at most :data:`CHUNK_BYTES`.

An upload is read as a stream and written a piece at a time, so routerd never holds more than a piece
of it; it is refused while it is read once it passes ``[batches] max_file_bytes`` or its tenant's
``tenant_quota_bytes`` (every file of the tenant counts, batch outputs too). Its pieces are written with
a TTL and made durable only with the file object, in one ``MULTI``: an upload cut short (a client gone,
a routerd killed) leaves nothing that lasts. Content is streamed out a piece at a time, too.

Input pieces are all exactly :data:`CHUNK_BYTES` but the last, so a byte offset names its piece
(:class:`LineReader`). A batch's output and error files grow by appended lines (the write script in
:mod:`.store`), their pieces filled up to :data:`CHUNK_BYTES` each.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from .. import _aio
from ..config import BatchesConfig
from ..redis_keys import RedisKeys
from .wire import ApiError, decoded, new_file_id

CHUNK_BYTES = 256 * 1024
_UPLOAD_TTL_S = 3600  # an upload's pieces, until its file object makes them durable


class FileStore:
    """One deployment's files; every Redis call bounded by ``op_timeout_s``."""

    def __init__(self, client: Callable[[], Any], keys: RedisKeys, cfg: Callable[[], BatchesConfig],
                 *, op_timeout_s: float, clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self.keys = keys
        self._cfg = cfg
        self._timeout = op_timeout_s
        self._clock = clock

    async def _do(self, command: str, *args: Any) -> Any:
        """One redis-py command by name, bounded."""
        async with _aio.timeout(self._timeout):
            return await getattr(self._client(), command)(*args)

    async def _run(self, fn: Callable[[Any], Any]) -> Any:
        async with _aio.timeout(self._timeout):
            return await fn(self._client())

    # upload --------------------------------------------------------------------------------------
    async def upload(self, tenant: str, filename: str, purpose: str, parts: AsyncIterator[bytes], *,
                     expires_after_s: int | None = None) -> dict[str, str]:
        """Store a file read from ``parts``; its hash. Refused (413) past the size limit or the quota."""
        if purpose not in ("batch",):
            raise ApiError(400, f"purpose must be 'batch' (routerd keeps batch input files), not {purpose!r}",
                           param="purpose", code="invalid_purpose")
        cfg = self._cfg()
        file_id = new_file_id()
        used = int(await self._run(lambda r: r.hget(self.keys.files_bytes, tenant)) or 0)
        buf = bytearray()
        size = chunks = 0
        try:
            async for piece in parts:
                size += len(piece)
                if size > cfg.max_file_bytes:
                    raise ApiError(413, f"the file is larger than the limit of {cfg.max_file_bytes} bytes "
                                        "([batches] max_file_bytes)", param="file", code="file_too_large")
                if used + size > cfg.tenant_quota_bytes:
                    raise ApiError(413, f"the file would take tenant {tenant!r} past its storage quota of "
                                        f"{cfg.tenant_quota_bytes} bytes ({used} used; "
                                        "[batches] tenant_quota_bytes): delete files first",
                                   param="file", code="quota_exceeded")
                buf += piece
                while len(buf) >= CHUNK_BYTES:
                    await self._put_piece(file_id, chunks, bytes(buf[:CHUNK_BYTES]))
                    del buf[:CHUNK_BYTES]
                    chunks += 1
            if buf:
                await self._put_piece(file_id, chunks, bytes(buf))
                chunks += 1
            now = int(self._clock())
            meta = {"id": file_id, "tenant": tenant, "bytes": str(size), "chunks": str(chunks),
                    "created_at": str(now), "filename": filename, "purpose": purpose,
                    "status": "processed", "batches": "0"}
            if expires_after_s:
                meta["expires_at"] = str(now + expires_after_s)

            async def commit(r: Any) -> None:
                pipe = r.pipeline(transaction=True)
                pipe.hset(self.keys.file(file_id), mapping=meta)
                for n in range(chunks):
                    pipe.persist(self.keys.file_chunk(file_id, n))
                pipe.zadd(self.keys.files_of(tenant), {file_id: int(now * 1000)})
                pipe.hincrby(self.keys.files_bytes, tenant, size)
                await pipe.execute()

            async with _aio.timeout(self._timeout + chunks / 1000):
                await commit(self._client())
            return meta
        except Exception:
            with contextlib.suppress(Exception):  # best effort: the pieces' TTL ends them anyway
                await self._drop_pieces(file_id, chunks + 1)
            raise

    async def _put_piece(self, file_id: str, n: int, data: bytes) -> None:
        await self._run(lambda r: r.set(self.keys.file_chunk(file_id, n), data, ex=_UPLOAD_TTL_S))

    async def _drop_pieces(self, file_id: str, chunks: int) -> None:
        for start in range(0, chunks, 512):
            names = [self.keys.file_chunk(file_id, n) for n in range(start, min(chunks, start + 512))]
            await self._do("unlink", *names)

    # read ----------------------------------------------------------------------------------------
    async def meta(self, tenant: str, file_id: str) -> dict[str, str]:
        """The file's hash, if it is ``tenant``'s and there (else 404, as for one that never was)."""
        raw = await self._run(lambda r: r.hgetall(self.keys.file(file_id)))
        h = decoded(raw) if raw else {}
        if not h or h.get("tenant") != tenant:
            raise ApiError(404, f"No such File object: {file_id}", param="id", code="file_not_found")
        return h

    def expired(self, h: dict[str, str]) -> bool:
        return bool(h.get("expires_at")) and int(h["expires_at"]) <= self._clock()

    async def page(self, tenant: str, *, after: str | None, limit: int, purpose: str | None,
                   ) -> tuple[list[dict[str, str]], bool]:
        """A tenant's files, newest first, after the id ``after``; and whether there are more."""
        key = self.keys.files_of(tenant)
        start = 0
        if after:
            rank = await self._run(lambda r: r.zrevrank(key, after))
            start = 0 if rank is None else rank + 1
        out: list[dict[str, str]] = []
        while len(out) <= limit:
            ids = await self._do("zrevrange", key, start, start + limit)
            if not ids:
                break
            start += len(ids)

            async def hashes(r: Any, ids: list[Any] = ids) -> list[Any]:
                pipe = r.pipeline(transaction=False)
                for i in ids:
                    pipe.hgetall(self.keys.file(i.decode()))
                return list(await pipe.execute())

            for raw in await self._run(hashes):
                h = decoded(raw)
                if h and (purpose is None or h.get("purpose") == purpose):
                    out.append(h)
        return out[:limit], len(out) > limit

    async def content(self, h: dict[str, str]) -> AsyncIterator[bytes]:
        """The file's bytes, a piece at a time (never whole in memory)."""
        for n in range(int(h.get("chunks", "0"))):
            data = await self._do("get", self.keys.file_chunk(h["id"], n))
            if data is None:  # deleted while read
                return
            yield data

    async def piece(self, file_id: str, n: int) -> bytes | None:
        data: bytes | None = await self._run(lambda r: r.get(self.keys.file_chunk(file_id, n)))
        return data

    # delete --------------------------------------------------------------------------------------
    async def delete(self, tenant: str, file_id: str, *, check_use: bool = True) -> None:
        """Delete a file of ``tenant`` (404 if it has none such; 409 while a batch not final reads it)."""
        h = await self.meta(tenant, file_id)
        if check_use and int(h.get("batches", "0")) > 0:
            raise ApiError(409, f"File {file_id} is the input of a batch still running: cancel it, or "
                                "delete the file once it is done", param="file_id", code="file_in_use")

        async def forget(r: Any) -> list[Any]:
            pipe = r.pipeline(transaction=True)
            pipe.delete(self.keys.file(file_id))
            pipe.zrem(self.keys.files_of(tenant), file_id)
            pipe.hincrby(self.keys.files_bytes, tenant, -int(h.get("bytes", "0")))
            return list(await pipe.execute())

        deleted = await self._run(forget)
        if deleted[0]:
            await self._drop_pieces(file_id, int(h.get("chunks", "0")))


class LineReader:
    """The lines of an input file from a byte offset: ``(line number, bytes without the newline,
    offset after it)``, reading one piece at a time. Line numbers count from 0 and include blank lines
    (OpenAI's error ``line`` is this + 1)."""

    def __init__(self, files: FileStore, h: dict[str, str], *, line: int = 0, offset: int = 0) -> None:
        self._files = files
        self._id = h["id"]
        self._size = int(h.get("bytes", "0"))
        self.line, self.offset = line, offset
        self._piece_no = -1
        self._piece = b""

    @property
    def at_end(self) -> bool:
        return self.offset >= self._size

    async def _byte_range(self, start: int, end: int) -> bytes:
        out = bytearray()
        while start < end:
            n = start // CHUNK_BYTES
            if n != self._piece_no:
                data = await self._files.piece(self._id, n)
                if data is None:
                    raise ApiError(400, f"the input file {self._id} was deleted", code="file_not_found")
                self._piece_no, self._piece = n, data
            lo = start - n * CHUNK_BYTES
            hi = min(end - n * CHUNK_BYTES, len(self._piece))
            if hi <= lo:
                raise ApiError(400, f"the input file {self._id} is shorter than its size", code="file_broken")
            out += self._piece[lo:hi]
            start += hi - lo
        return bytes(out)

    async def next_line(self, max_bytes: int) -> tuple[int, bytes | None, int] | None:
        """The next line (None at the end of the file); its bytes are None when it is longer than
        ``max_bytes`` (it is skipped whole, never held)."""
        if self.at_end:
            return None
        start, pos, too_long = self.offset, self.offset, False
        found = -1
        while pos < self._size:
            n = pos // CHUNK_BYTES
            await self._byte_range(pos, min(self._size, (n + 1) * CHUNK_BYTES))
            lo = pos - n * CHUNK_BYTES
            i = self._piece.find(b"\n", lo)
            if i >= 0:
                found = n * CHUNK_BYTES + i
                break
            pos = (n + 1) * CHUNK_BYTES
            if pos - start > max_bytes:
                too_long = True
        end = found if found >= 0 else self._size
        too_long = too_long or end - start > max_bytes
        line = None if too_long else await self._byte_range(start, end)
        number = self.line
        self.line += 1
        self.offset = end + 1 if found >= 0 else self._size
        return number, line, self.offset
