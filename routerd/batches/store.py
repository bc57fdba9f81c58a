"""A batch in Redis: its hash (object, counters, progress), and the atomic steps that change it.

Every step that moves a batch forward is one Lua script, so a routerd killed between any two of them
leaves a batch another routerd simply goes on with:

- ``FEED`` adds lines to the request stream as queue jobs *and* moves the batch's read cursor past
  them (compare-and-set on the cursor: a feed retried, or made by a runner that lost its lease, is
  refused whole — no line is fed twice). Each fed line's ``custom_id`` waits in the in-flight hash.
- ``WRITE`` appends a line to the output (or error) file, sets the line's bit in the ``written``
  bitmap and deletes the result's entry from the batch's result stream, all at once: a result read
  again after a crash, or a second result for the same line, finds the bit set and is only deleted.
  That bit is what makes every line's output exactly once.
- ``FINISH`` ends the batch: its state, the output and error file objects, the active set.

The scripts take key names in ARGV (as the queue's do, routerd/ingress/queue/results.py): one Redis or
Sentinel, not Cluster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from .. import _aio
from ..redis_keys import RedisKeys
from .files import CHUNK_BYTES
from .wire import FINAL, ApiError, decoded, new_batch_id

# Appends ARGV data to the batch's output ('out') or error ('err') file unless its line was written.
_PUT = """
local function put(b, written, line, which, data)
  if redis.call('GETBIT', written, line) == 1 then return 0 end
  redis.call('SETBIT', written, line, 1)
  local c = tonumber(redis.call('HGET', b, which .. '_chunks') or '0')
  local prefix = redis.call('HGET', b, which .. '_prefix')
  if c == 0 then
    c = 1
    redis.call('HSET', b, which .. '_chunks', 1)
  elseif redis.call('STRLEN', prefix .. (c - 1)) + #data > CHUNK_BYTES then
    c = c + 1
    redis.call('HSET', b, which .. '_chunks', c)
  end
  redis.call('APPEND', prefix .. (c - 1), data)
  redis.call('HINCRBY', b, which .. '_bytes', #data)
  redis.call('HINCRBY', b, which .. '_lines', 1)
  redis.call('HINCRBY', b, which == 'out' and 'completed' or 'failed', 1)
  return 1
end
""".replace("CHUNK_BYTES", str(CHUNK_BYTES))

# ARGV: [batch, stream, inflight, written, expected_line, next_line, next_offset, at_end, n, records…]
# records, 4 ARGVs each: kind ('job' | 'err'), line, custom_id JSON (job) or the error line (err), job.
# 0: refused (the cursor moved, or the batch is not in progress); else 1.
FEED = _PUT + """
local b = ARGV[1]
local st = redis.call('HGET', b, 'status')
if st ~= 'in_progress' or redis.call('HGET', b, 'fed_line') ~= ARGV[5] then return 0 end
local n = tonumber(ARGV[9])
for i = 0, n - 1 do
  local k, line, v, job = ARGV[10 + 4 * i], ARGV[11 + 4 * i], ARGV[12 + 4 * i], ARGV[13 + 4 * i]
  if k == 'job' then
    redis.call('XADD', ARGV[2], '*', 'job', job)
    redis.call('HSET', ARGV[3], line, v)
  else
    put(b, ARGV[4], tonumber(line), 'err', v)
  end
end
redis.call('HSET', b, 'fed_line', ARGV[6], 'fed_offset', ARGV[7], 'fed_done', ARGV[8])
return 1
"""

# ARGV: [batch, written, inflight, results, n, records…]; records, 6 ARGVs each: line, result entry
# ('' = none), which ('out' | 'err' | '' = drop), data, the job's done key, its status key.
# Per record 1 when written here, 0 when the line was already written (or dropped).
WRITE = _PUT + """
local b = ARGV[1]
local out = {}
local n = tonumber(ARGV[5])
for i = 0, n - 1 do
  local line, entry, which, data = ARGV[6 + 6 * i], ARGV[7 + 6 * i], ARGV[8 + 6 * i], ARGV[9 + 6 * i]
  out[i + 1] = 0
  if which ~= '' then out[i + 1] = put(b, ARGV[2], tonumber(line), which, data) end
  redis.call('HDEL', ARGV[3], line)
  if entry ~= '' then redis.call('XDEL', ARGV[4], entry) end
  redis.call('DEL', ARGV[10 + 6 * i], ARGV[11 + 6 * i])
end
return out
"""

# ARGV: [batch, states, active, state, stamp, now, files_of, files_bytes, input_file, out_file,
#        err_file, inflight, written, results]
# Ends the batch in ``state`` (unless final already): its stamp, the output and error file objects
# (those with a line), its tenant's stored bytes, the input file's use count. 1 when ended here.
FINISH = """
local b = ARGV[1]
local st = redis.call('HGET', b, 'status')
if st == 'completed' or st == 'failed' or st == 'expired' or st == 'cancelled' then return 0 end
local tenant = redis.call('HGET', b, 'tenant')
redis.call('HSET', b, 'status', ARGV[4], ARGV[5], ARGV[6])
redis.call('HINCRBY', ARGV[2], st, -1)
redis.call('HINCRBY', ARGV[2], ARGV[4], 1)
redis.call('SREM', ARGV[3], redis.call('HGET', b, 'id'))
for _, f in ipairs({{'out', ARGV[10], '_output.jsonl'}, {'err', ARGV[11], '_error.jsonl'}}) do
  local which, key = f[1], f[2]
  local lines = tonumber(redis.call('HGET', b, which .. '_lines') or '0')
  local id = redis.call('HGET', b, which == 'out' and 'output_file_id' or 'error_file_id')
  if lines > 0 and id then
    local bytes = redis.call('HGET', b, which .. '_bytes')
    redis.call('HSET', key, 'id', id, 'tenant', tenant, 'bytes', bytes,
               'chunks', redis.call('HGET', b, which .. '_chunks'), 'created_at', ARGV[6],
               'filename', redis.call('HGET', b, 'id') .. f[3], 'purpose', 'batch_output',
               'status', 'processed', 'batches', '0')
    redis.call('ZADD', ARGV[7], tonumber(ARGV[6]) * 1000, id)
    redis.call('HINCRBY', ARGV[8], tenant, tonumber(bytes))
  end
end
if redis.call('EXISTS', ARGV[9]) == 1 then redis.call('HINCRBY', ARGV[9], 'batches', -1) end
redis.call('DEL', ARGV[12], ARGV[13], ARGV[14])
return 1
"""

# ARGV: [batch, states, state, stamp, now, allowed_from…]: the batch moves to ``state`` if it is in one of
# ``allowed_from``; its state before (moved or not).
MOVE = """
local b = ARGV[1]
local st = redis.call('HGET', b, 'status')
if not st then return false end
for i = 6, #ARGV do
  if st == ARGV[i] then
    redis.call('HSET', b, 'status', ARGV[3], ARGV[4], ARGV[5])
    redis.call('HINCRBY', ARGV[2], st, -1)
    redis.call('HINCRBY', ARGV[2], ARGV[3], 1)
    return st
  end
end
return st
"""


class BatchStore:
    """One deployment's batches: their hashes and the scripts above; every call bounded."""

    def __init__(self, client: Callable[[], Any], keys: RedisKeys, *, op_timeout_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self.keys = keys
        self._timeout = op_timeout_s
        self._clock = clock
        self._scripts: dict[str, Any] = {}

    async def _run(self, fn: Callable[[Any], Any], extra_s: float = 0.0) -> Any:
        async with _aio.timeout(self._timeout + extra_s):
            return await fn(self._client())

    async def _script(self, name: str, src: str, args: list[Any], extra_s: float = 0.0) -> Any:
        async def call(r: Any) -> Any:
            script = self._scripts.get(name)
            if script is None or script.registered_client is not r:
                script = self._scripts[name] = r.register_script(src)
            return await script(keys=[], args=args)

        return await self._run(call, extra_s)

    def now(self) -> int:
        return int(self._clock())

    # the routes' steps ---------------------------------------------------------------------------
    async def create(self, tenant: str, input_file: dict[str, str], endpoint: str, window_s: int,
                     metadata: dict[str, str] | None) -> dict[str, str]:
        batch_id = new_batch_id()
        now = self.now()
        out_id, err_id = "file-" + batch_id[6:] + "o", "file-" + batch_id[6:] + "e"
        h = {"id": batch_id, "tenant": tenant, "status": "validating", "endpoint": endpoint,
             "input_file_id": input_file["id"], "completion_window": "24h", "created_at": str(now),
             "expires_at": str(now + window_s), "total": "0", "completed": "0", "failed": "0",
             "metadata": json.dumps(metadata) if metadata is not None else "",
             "output_file_id": out_id, "error_file_id": err_id,
             "out_prefix": self.keys.file_chunk(out_id, 0)[:-1],
             "err_prefix": self.keys.file_chunk(err_id, 0)[:-1],
             "fed_line": "0", "fed_offset": "0", "fed_done": "0"}

        async def add(r: Any) -> None:
            pipe = r.pipeline(transaction=True)
            pipe.hset(self.keys.batch(batch_id), mapping=h)
            pipe.zadd(self.keys.batches_of(tenant), {batch_id: int(self._clock() * 1000)})
            pipe.sadd(self.keys.batches_active, batch_id)
            pipe.hincrby(self.keys.batch_states, "validating", 1)
            pipe.hincrby(self.keys.file(input_file["id"]), "batches", 1)
            await pipe.execute()

        await self._run(add)
        return h

    async def get(self, batch_id: str) -> dict[str, str] | None:
        raw = await self._run(lambda r: r.hgetall(self.keys.batch(batch_id)))
        return decoded(raw) if raw else None

    async def of_tenant(self, tenant: str, batch_id: str) -> dict[str, str]:
        """The batch, if it is ``tenant``'s (else 404, as for one that never was)."""
        h = await self.get(batch_id)
        if h is None or h.get("tenant") != tenant:
            raise ApiError(404, f"No batch found with id '{batch_id}'", param="batch_id", code="not_found")
        return h

    async def page(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[dict[str, str]], bool]:
        key = self.keys.batches_of(tenant)
        start = 0
        if after:
            rank = await self._run(lambda r: r.zrevrank(key, after))
            start = 0 if rank is None else rank + 1
        ids = await self._run(lambda r: r.zrevrange(key, start, start + limit))

        async def hashes(r: Any) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for i in ids[:limit]:
                pipe.hgetall(self.keys.batch(i.decode()))
            return list(await pipe.execute())

        return [decoded(raw) for raw in await self._run(hashes) if raw], len(ids) > limit

    async def cancel(self, tenant: str, batch_id: str) -> dict[str, str]:
        """``cancelling`` (its runner stops feeding and ends it ``cancelled``); 409 once final."""
        await self.of_tenant(tenant, batch_id)
        before = await self.move(batch_id, "cancelling", "cancelling_at", ("validating", "in_progress"))
        if before in FINAL or before == "finalizing":
            raise ApiError(409, f"Cannot cancel a batch with status '{before}'.", param="batch_id",
                           code="batch_not_cancellable")
        return await self.of_tenant(tenant, batch_id)

    # the runner's steps --------------------------------------------------------------------------
    async def move(self, batch_id: str, state: str, stamp: str, allowed: tuple[str, ...],
                   fields: dict[str, str] | None = None) -> str | None:
        """Move to ``state`` from one of ``allowed`` (setting ``fields`` too); the state before."""
        if fields:
            await self.set_fields(batch_id, fields)
        before = await self._script("move", MOVE, [self.keys.batch(batch_id), self.keys.batch_states,
                                                   state, stamp, str(self.now()), *allowed])
        return before.decode() if isinstance(before, bytes) else before

    async def set_fields(self, batch_id: str, fields: dict[str, str]) -> None:
        await self._run(lambda r: r.hset(self.keys.batch(batch_id), mapping=fields))

    async def feed(self, batch_id: str, expected_line: int, records: list[tuple[str, int, bytes, bytes]],
                   next_line: int, next_offset: int, at_end: bool, stream: str) -> bool:
        """Append ``records`` (kind, line, custom_id JSON or error line, job) and move the cursor;
        False when the cursor had moved (another runner fed these lines)."""
        k = self.keys
        args: list[Any] = [k.batch(batch_id), stream, k.batch_inflight(batch_id), k.batch_written(batch_id),
                           str(expected_line), str(next_line), str(next_offset), "1" if at_end else "0",
                           str(len(records))]
        for kind, line, value, job in records:
            args += [kind, str(line), value, job]
        return bool(await self._script("feed", FEED, args, extra_s=len(records) / 1000))

    async def write(self, batch_id: str, records: list[tuple[int, str, str, bytes, str]]) -> list[int]:
        """Write results: (line, result entry, 'out' | 'err' | '' (drop), data, job id); per record
        1 when written by this call."""
        k = self.keys
        args: list[Any] = [k.batch(batch_id), k.batch_written(batch_id), k.batch_inflight(batch_id),
                           k.batch_results(batch_id), str(len(records))]
        for line, entry, which, data, job_id in records:
            args += [str(line), entry, which, data, k.done(job_id), k.status(job_id)]
        return list(await self._script("write", WRITE, args, extra_s=len(records) / 1000))

    async def finish(self, h: dict[str, str], state: str) -> bool:
        k = self.keys
        batch_id = h["id"]
        stamp = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
                 "cancelled": "cancelled_at"}[state]
        return bool(await self._script("finish", FINISH, [
            k.batch(batch_id), k.batch_states, k.batches_active, state, stamp, str(self.now()),
            k.files_of(h["tenant"]), k.files_bytes, k.file(h["input_file_id"]), k.file(h["output_file_id"]),
            k.file(h["error_file_id"]), k.batch_inflight(batch_id), k.batch_written(batch_id),
            k.batch_results(batch_id)]))

    async def inflight(self, batch_id: str) -> dict[int, str]:
        raw = await self._run(lambda r: r.hgetall(self.keys.batch_inflight(batch_id)))
        return {int(a): b.decode() for a, b in raw.items()}

    async def inflight_count(self, batch_id: str) -> int:
        return int(await self._run(lambda r: r.hlen(self.keys.batch_inflight(batch_id))))

    async def custom_ids(self, batch_id: str, lines: list[int]) -> list[str | None]:
        if not lines:
            return []
        raw = await self._run(lambda r: r.hmget(self.keys.batch_inflight(batch_id), [str(n) for n in lines]))
        return [None if v is None else v.decode() for v in raw]

    async def active(self) -> list[str]:
        return sorted(v.decode() for v in await self._run(lambda r: r.smembers(self.keys.batches_active)))

    async def states(self) -> dict[str, int]:
        raw = await self._run(lambda r: r.hgetall(self.keys.batch_states))
        return {a.decode(): int(b) for a, b in raw.items()}
