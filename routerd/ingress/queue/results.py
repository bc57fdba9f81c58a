"""The queue consumer's Redis writes: Lua scripts for the atomic steps, and one batching writer.

Every per-job write (the pre-dispatch check, stream chunks, the final result + acknowledgement) goes
through :class:`ResultWriter`. Whatever is waiting goes out as one pipeline, and consecutive steps of the
same kind go as *one* script call that loops over their records (msgpack, unpacked by Redis' built-in
``cmsgpack``): the per-job cost is a few bytes of msgpack rather than a command to pack and parse. Order
is kept — a job's chunks are always sent before its result because they sit earlier in the same FIFO.
When Redis is unreachable the writer keeps the batch and resends it with backoff, so work finished
during an outage is stored when Redis is back instead of being run again; every step is written to be
safe to run twice (a resent batch whose first reply was lost).

The result step is what makes "exactly one result per job id" true: the idempotency record
(``SET done:<id> <result> NX``), the ``XADD`` to ``reply_to``, the status hash and the ``XACK`` happen
inside one script, so Redis never holds a result without its record or an acknowledgement without its
result. Key names come from :mod:`routerd.redis_keys` inside each record; scripts touch keys they are not
given in KEYS, so Redis Cluster is not supported (one Redis, or Sentinel).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from ... import _aio, log
from ...config import RedisConfig
from ...queue_wire import Attempt, Result, json_encode, now_ms
from ...redis_keys import RedisKeys
from ...redis_server import REDIS_DOWN as REDIS_DOWN  # Redis did not answer; re-exported for the queue

_log = log.get("routerd.queue")
_pack = msgspec.msgpack.Encoder().encode


# Keys a producer can name or create (reply_to, and the per-job keys derived from its id) are written
# with redis.pcall: a key of the wrong type fails that one record, never the script — a raised error
# would abort the script half way and fail every other job of the batch with it.

# ARGV[1]: [consumer, now_ms, ttl_s]; ARGV[2]: records [done_key, cancel_key, status_key, entry, reply_to].
# Per record: 1 already done (a duplicate, or reclaimed after its result was stored), 2 cancelled,
# the type of the key reply_to names when that is not a stream (it could never take a result, so the
# engine is not called), "refused: <error>" when routerd's Redis user may not use that key (an ACL's
# NOPERM: this job only, not the batch), or 0 go (and the job is marked running here).
BEGIN = """
local c = cmsgpack.unpack(ARGV[1])
local out = {}
for i, r in ipairs(cmsgpack.unpack(ARGV[2])) do
  local kind = redis.pcall('TYPE', r[5])
  if kind.err then kind = 'refused: ' .. kind.err else kind = kind['ok'] end
  if redis.call('EXISTS', r[1]) == 1 then out[i] = 1
  elseif redis.call('EXISTS', r[2]) == 1 then out[i] = 2
  elseif kind ~= 'none' and kind ~= 'stream' then out[i] = kind
  else
    redis.pcall('HSET', r[3], 'state', 'running', 'consumer', c[1], 'entry', r[4], 'updated_ms', c[2])
    redis.pcall('EXPIRE', r[3], c[3])
    out[i] = 0
  end
end
return out
"""

# ARGV[1]: [stream, group, ttl_s, reply_maxlen, now_ms, consumer, dead_stream]
# ARGV[2]: records [entry, done_key ('' = no result), reply_to ('' = store the result only), status_key,
#          history_key, result, instance, status, dead_reason ('' = not dead), raw job, deliveries];
#          result and raw job are bytes, so they travel as ARGV[n] and the record holds n (0 = empty:
#          Redis' cmsgpack has no bin type)
# Per record: 1 when this call stored the job's result, 0 when there was none or one existed already.
# A reply_to that refuses the XADD dead-letters the entry (the result stays in the done record).
# Run twice (a resent batch), the XACK count (0 the second time) keeps the dead-letter entry single,
# as SET NX keeps the result single.
ACKNOWLEDGE = """
local c = cmsgpack.unpack(ARGV[1])
local out = {}
for i, r in ipairs(cmsgpack.unpack(ARGV[2])) do
  r[6] = r[6] == 0 and '' or ARGV[r[6]]
  r[10] = r[10] == 0 and '' or ARGV[r[10]]
  local acked = redis.call('XACK', c[1], c[2], r[1])
  out[i] = 0
  if r[2] ~= '' and redis.call('SET', r[2], r[6], 'NX', 'EX', c[3]) then
    if r[3] ~= '' then
      local sent = redis.pcall('XADD', r[3], 'MAXLEN', '~', c[4], '*', 'result', r[6])
      if type(sent) == 'table' and sent.err then
        if r[9] == '' then r[9] = 'reply_to ' .. r[3] .. ' cannot take the result: ' .. sent.err end
      else
        redis.call('EXPIRE', r[3], c[3])
      end
    end
    redis.pcall('HSET', r[4], 'state', 'done', 'status', r[8], 'instance', r[7], 'updated_ms', c[5])
    redis.pcall('EXPIRE', r[4], c[3])
    out[i] = 1
  end
  if r[9] ~= '' and acked == 1 then
    local hist = {}
    if r[5] ~= '' then
      local h = redis.pcall('LRANGE', r[5], 0, -1)
      if type(h) == 'table' and not h.err then hist = h end
    end
    redis.call('XADD', c[7], 'MAXLEN', '~', '100000', '*', 'entry', r[1], 'reason', r[9], 'job', r[10],
               'deliveries', r[11], 'consumer', c[6], 'at_ms', c[5],
               'history', '[' .. table.concat(hist, ',') .. ']')
  end
  if r[5] ~= '' then redis.call('DEL', r[5]) end
  redis.call('XDEL', c[1], r[1])
end
return out
"""

# ARGV[1]: [reply_maxlen, ttl_s]; ARGV[2]: records [reply_to, cursor_key, run, seq, chunk (ARGV n)].
# A streamed job's chunk, once: the cursor holds the last (run, seq) written, so a resent batch does
# not repeat chunks. Per record: 1 written, 0 already there, an error reply if reply_to refused it.
CHUNK = """
local c = cmsgpack.unpack(ARGV[1])
local out = {}
for i, r in ipairs(cmsgpack.unpack(ARGV[2])) do
  out[i] = 0
  local run, seq = tonumber(r[3]), tonumber(r[4])
  local cur = redis.pcall('GET', r[2])
  if type(cur) == 'table' and cur.err and string.find(cur.err, 'non local key', 1, true) then
    return redis.error_reply(cur.err)  -- a cluster node that lost the slot: the whole call, elsewhere
  end
  local fresh = true
  if type(cur) == 'string' then
    local cr, cs = string.match(cur, '^(%d+):(%d+)$')
    cr, cs = tonumber(cr), tonumber(cs)
    if cr and cs then fresh = cr < run or (cr == run and cs < seq) end
  end
  if fresh then
    local sent = redis.pcall('XADD', r[1], 'MAXLEN', '~', c[1], '*', 'chunk', ARGV[r[5]])
    if type(sent) == 'table' and sent.err then
      out[i] = sent  -- this record's error only
    else
      redis.call('SET', r[2], r[3] .. ':' .. r[4], 'EX', c[2])
      out[i] = 1
    end
  end
end
return out
"""

_SCRIPTS = {"begin": BEGIN, "acknowledge": ACKNOWLEDGE, "chunk": CHUNK}


@dataclass
class _Item:
    name: str  # a script name (``args`` is one record), or "" for a raw command
    args: tuple[Any, ...]
    future: asyncio.Future[Any] = field(
        repr=False, default_factory=lambda: asyncio.get_running_loop().create_future())


class ResultWriter:
    """Pipelines queued steps; each caller awaits its own reply. One instance per consumer.

    ``common`` gives, per script, the arguments shared by every record of a call (evaluated at send
    time, so a reloaded config or the current time is picked up).
    """

    def __init__(self, client: Callable[[], aioredis.Redis], *, op_timeout_s: float,
                 common: dict[str, Callable[[], list[Any]]], max_batch: int = 1024,
                 rng: random.Random | None = None) -> None:
        self._client = client
        self._timeout = op_timeout_s
        self._common = common
        self._max_batch = max_batch
        self._items: list[_Item] = []
        self._wake = asyncio.Event()
        self._shas: dict[str, str] = {}
        self._rng = rng or random.Random()
        self.batches = 0

    def step(self, name: str, record: list[Any]) -> asyncio.Future[Any]:
        """Queue one record for script ``name`` now (order is fixed at this call)."""
        return self._submit(_Item(name, tuple(record)))

    async def command(self, *args: Any) -> Any:
        return await self.enqueue(*args)

    def enqueue(self, *args: Any) -> asyncio.Future[Any]:
        """Queue a raw command now (order is fixed at this call); await the future for its reply."""
        return self._submit(_Item("", args))

    def send(self, *args: Any) -> None:
        """Fire and forget: a failure is logged, never raised."""
        self.enqueue(*args).add_done_callback(_log_failure)

    def _submit(self, item: _Item) -> asyncio.Future[Any]:
        self._items.append(item)
        self._wake.set()
        return item.future

    def pending(self) -> int:
        return len(self._items)

    async def run(self) -> None:
        """Flush forever: each wake sends everything queued, in order, as one pipeline."""
        backoff = 0.05
        while True:
            if not self._items:
                self._wake.clear()
                await self._wake.wait()
            batch = self._items[: self._max_batch]
            try:
                await self._flush(batch)
                backoff = 0.05
            except REDIS_DOWN as e:
                self._shas.clear()  # a restarted Redis has lost its script cache
                _log.warning("queue_writer_redis_unavailable", error=repr(e), pending=len(self._items),
                             retry_in_s=round(backoff, 3))
                await asyncio.sleep(backoff * (0.5 + self._rng.random()))
                backoff = min(backoff * 2, 2.0)
            except Exception as e:  # noqa: BLE001 — loop boundary: fail this batch, keep writing
                _log.exception("queue_writer_batch_failed", size=len(batch))
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                del self._items[: len(batch)]

    @staticmethod
    def _runs(batch: list[_Item]) -> list[list[_Item]]:
        """Consecutive records of one script become one call; raw commands stay alone."""
        runs: list[list[_Item]] = []
        for item in batch:
            if item.name and runs and runs[-1][0].name == item.name:
                runs[-1].append(item)
            else:
                runs.append([item])
        return runs

    async def _flush(self, batch: list[_Item]) -> None:
        client = self._client()
        if not self._shas:
            async with _aio.timeout(self._timeout):
                for name, src in _SCRIPTS.items():
                    self._shas[name] = await client.script_load(src)
        runs = self._runs(batch)
        pipe = client.pipeline(transaction=False)
        for run in runs:
            name = run[0].name
            if name:
                blobs: list[bytes] = []
                records = [[_blob(v, blobs) for v in item.args] for item in run]
                pipe.execute_command("EVALSHA", self._shas[name], 0, _pack(self._common[name]()),
                                     _pack(records), *blobs)
            else:
                pipe.execute_command(*run[0].args)
        async with _aio.timeout(self._timeout):  # redis-py can swallow a cancel: see routerd._aio
            replies = await pipe.execute(raise_on_error=False)
        self.batches += 1
        retry: list[_Item] = []
        for run, reply in zip(runs, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                retry += run
                continue
            results = reply if run[0].name and isinstance(reply, list) else [reply] * len(run)
            for item, res in zip(run, results, strict=True):
                if item.future.done():
                    continue  # the caller went away (cancelled); the write still happened
                if isinstance(res, Exception):
                    item.future.set_exception(res)
                else:
                    item.future.set_result(res)
        if retry:
            self._shas.clear()
        # The batch leaves the queue only once sent; NOSCRIPT items go back to the front, in order.
        self._items[: len(batch)] = retry


def _blob(value: Any, blobs: list[bytes]) -> Any:
    """Bytes go as extra ARGVs (Redis' cmsgpack cannot read msgpack's bin type); the record keeps the
    ARGV index (the first two ARGVs are the common arguments and the records), 0 for empty."""
    if not isinstance(value, bytes):
        return value
    if not value:
        return 0
    blobs.append(value)
    return len(blobs) + 2


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        _log.warning("queue_write_failed", error=repr(fut.exception()))


class JobStore:
    """The per-job steps of one consumer, each atomic, all through one :class:`ResultWriter`."""

    def __init__(self, client: Callable[[], aioredis.Redis], keys: RedisKeys, consumer: str,
                 cfg: Callable[[], RedisConfig], *, rng: random.Random | None = None) -> None:
        self.keys = keys
        self.consumer = consumer
        self._cfg = cfg
        self._client = client
        self.writer = ResultWriter(client, op_timeout_s=cfg().op_timeout_s, rng=rng, common={
            "begin": lambda: [consumer, str(now_ms()), str(cfg().result_ttl_s)],
            "acknowledge": self._acknowledge_common,
            "chunk": lambda: [str(cfg().reply_maxlen), str(cfg().result_ttl_s)],
        })

    def _acknowledge_common(self) -> list[Any]:
        r = self._cfg()
        return [r.stream, r.group, str(r.result_ttl_s), str(r.reply_maxlen), str(now_ms()),
                self.consumer, r.dead_stream]

    async def begin(self, job_id: str, entry_id: str, reply_to: str) -> int | str:
        """0 go (and mark the job running here), 1 it already has its result, 2 it was cancelled, or
        the type of the key ``reply_to`` names (``"string"``, ``"hash"``…) when that is not a stream, or
        ``"refused: <error>"`` when Redis does not let routerd's user use it (its ACL)."""
        k = self.keys
        state: int | bytes = await self.writer.step(
            "begin", [k.done(job_id), k.cancel(job_id), k.status(job_id), entry_id, reply_to])
        return state.decode(errors="replace") if isinstance(state, bytes) else state

    def chunk(self, reply_to: str, job_id: str, run: int, seq: int, chunk: bytes) -> asyncio.Future[Any]:
        """Queue one stream chunk (written once even if its batch is resent)."""
        return self.writer.step("chunk", [reply_to, self.keys.chunks(job_id), run, seq, chunk])

    async def set_aside(self, entry_id: str, job_id: str, delivery: int, *, give_back: bool = True) -> None:
        """The job is set aside, not run (see :mod:`.held`): its delivery is given back in Redis
        (``XCLAIM … RETRYCOUNT``, the count before it was read), so the claim that brings it back — or a
        restart's recovery, or another consumer's takeover — counts this delivery again, once: a
        backlog waiting for quota across restarts is never dead-lettered for ``max_deliveries``. Not
        ``give_back``: a failed delivery waiting for its retry, which stays counted."""
        r = self._cfg()
        self.writer.send("HSET", self.keys.status(job_id), "state", "queued")
        if not give_back:
            return
        # Redis away (or the group deleted): the delivery stays counted, the job is set aside all the same.
        with contextlib.suppress(*REDIS_DOWN, redis.exceptions.ResponseError):
            async with _aio.timeout(r.op_timeout_s):
                await self._client().xclaim(r.stream, r.group, self.consumer, 0, [entry_id],
                                            retrycount=max(0, delivery - 1), justid=True)

    async def record_failure(self, job_id: str, attempt: Attempt) -> None:
        """Append a failed attempt to the job's history (copied into a dead-letter entry later)."""
        key = self.keys.history(job_id)
        self.writer.enqueue("RPUSH", key, json_encode(attempt)).add_done_callback(_log_failure)
        await self.writer.command("EXPIRE", key, self._cfg().result_ttl_s)

    async def acknowledge(self, entry_id: str, job_id: str, reply_to: str, result: Result | None, *,
                     delivery: int, dead_reason: str = "", raw: bytes = b"") -> bool:
        """Where a job is acknowledged: its stream entry is ``XACK``ed in the one script that also
        stores ``result`` (unless the job has one already), sends it to ``reply_to`` (``""``: the done
        record only) and dead-letters it if ``dead_reason`` — one atomic step, so Redis never holds an
        acknowledgement without a result. True when this call stored the result."""
        k = self.keys
        stored = bool(job_id and result is not None)
        payload = json_encode(result) if result is not None and stored else b""
        written: int = await self.writer.step("acknowledge", [
            entry_id, k.done(job_id) if stored else "", reply_to if stored else "",
            k.status(job_id) if stored else "", k.history(job_id) if job_id else "", payload,
            result.instance if result else "", result.status if result else "", dead_reason, raw,
            str(delivery)])
        return written == 1
