"""The queue consumer's Redis writes: Lua scripts for the atomic steps, and one batching writer.

Every per-job write (the pre-dispatch check, stream chunks, the final result + acknowledgement) goes
through :class:`BatchWriter`, which sends whatever is waiting as one pipeline. That keeps the per-job
cost near one command instead of one round trip, and it keeps order: a job's chunks are always sent
before its result because they sit earlier in the same FIFO. When Redis is unreachable the writer keeps
the batch and retries with backoff, so work that finished during an outage is stored when Redis is back
instead of being run again.

The result script is what makes "exactly one result per job id" true: the idempotency record
(``SET done:<id> <result> NX``), the ``XADD`` to ``reply_to``, the status hash and the ``XACK`` happen in
one script, so Redis never holds a result without its record or an acknowledgement without its result.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from .. import log
from ..config import RedisConfig
from ..jobs import Attempt, Result, json_encode, now_ms
from ..keys import Keys

_log = log.get("routerd.queue")

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, TimeoutError)

# KEYS: done, cancel, status. ARGV: consumer, entry, now_ms, ttl_s.
# → 1 already done (duplicate or reclaimed after its result was stored), 2 cancelled, 0 go.
BEGIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
redis.call('HSET', KEYS[3], 'state', 'running', 'consumer', ARGV[1], 'entry', ARGV[2],
           'updated_ms', ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[4])
return 0
"""

# KEYS: stream, done, reply, status, history, dead.
# ARGV: group, entry, result ('' = none), ttl_s, reply_maxlen, instance, now_ms, status,
#       dead_reason ('' = not dead), raw job, deliveries, consumer.
# → 1 when this call stored the job's result, 0 when there was none to store or one existed already.
# A batch resent after a lost reply runs this twice: the XACK count (0 the second time) keeps the
# dead-letter entry single, as SET NX keeps the result single.
FINISH = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
local written = 0
if ARGV[3] ~= '' then
  if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'EX', ARGV[4]) then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'result', ARGV[3])
    redis.call('EXPIRE', KEYS[3], ARGV[4])
    redis.call('HSET', KEYS[4], 'state', 'done', 'status', ARGV[8], 'instance', ARGV[6],
               'updated_ms', ARGV[7])
    redis.call('EXPIRE', KEYS[4], ARGV[4])
    written = 1
  end
end
if ARGV[9] ~= '' and acked == 1 then
  local hist = redis.call('LRANGE', KEYS[5], 0, -1)
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', '100000', '*', 'entry', ARGV[2], 'reason', ARGV[9],
             'job', ARGV[10], 'deliveries', ARGV[11], 'consumer', ARGV[12], 'at_ms', ARGV[7],
             'history', '[' .. table.concat(hist, ',') .. ']')
end
redis.call('DEL', KEYS[5])
redis.call('XDEL', KEYS[1], ARGV[2])
return written
"""

# KEYS: reply, cursor. ARGV: run, seq, chunk, reply_maxlen, ttl_s.
# A streamed job's chunk, once: the cursor remembers the last (run, seq) written, so a batch resent
# after a lost reply does not repeat chunks. → 1 written, 0 already there.
CHUNK = """
local cur = redis.call('GET', KEYS[2])
local run, seq = tonumber(ARGV[1]), tonumber(ARGV[2])
if cur then
  local r, s = string.match(cur, '^(%d+):(%d+)$')
  r, s = tonumber(r), tonumber(s)
  if r > run or (r == run and s >= seq) then return 0 end
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'chunk', ARGV[3])
redis.call('SET', KEYS[2], ARGV[1] .. ':' .. ARGV[2], 'EX', ARGV[5])
return 1
"""

_SCRIPTS = {"begin": BEGIN, "finish": FINISH, "chunk": CHUNK}


@dataclass
class _Item:
    name: str  # a script name, or "" for a raw command
    args: tuple[Any, ...]
    future: asyncio.Future[Any] = field(
        repr=False, default_factory=lambda: asyncio.get_running_loop().create_future())


class BatchWriter:
    """Pipelines queued commands; each caller awaits its own reply. One instance per consumer."""

    def __init__(self, client: Callable[[], aioredis.Redis], *, op_timeout_s: float,
                 max_batch: int = 512, rng: random.Random | None = None) -> None:
        self._client = client
        self._timeout = op_timeout_s
        self._max_batch = max_batch
        self._items: list[_Item] = []
        self._wake = asyncio.Event()
        self._shas: dict[str, str] = {}
        self._rng = rng or random.Random()
        self.healthy = asyncio.Event()
        self.batches = 0

    async def script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self.enqueue_script(name, keys, args)

    async def command(self, *args: Any) -> Any:
        return await self.enqueue(*args)

    def enqueue_script(self, name: str, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        return self._submit(_Item(name, (len(keys), *keys, *args)))

    def enqueue(self, *args: Any) -> asyncio.Future[Any]:
        """Queue a command now (order is fixed at this call); await the future for its reply."""
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
                self.healthy.set()
            except REDIS_DOWN as e:
                self.healthy.clear()
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

    async def _flush(self, batch: list[_Item]) -> None:
        client = self._client()
        if not self._shas:
            async with asyncio.timeout(self._timeout):
                for name, src in _SCRIPTS.items():
                    self._shas[name] = await client.script_load(src)
        pipe = client.pipeline(transaction=False)
        for item in batch:
            if item.name:
                pipe.execute_command("EVALSHA", self._shas[item.name], *item.args)
            else:
                pipe.execute_command(*item.args)
        async with asyncio.timeout(self._timeout):
            replies = await pipe.execute(raise_on_error=False)
        self.batches += 1
        retry: list[_Item] = []
        for item, reply in zip(batch, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                retry.append(item)
            elif item.future.done():
                continue  # the caller went away (cancelled); the write still happened
            elif isinstance(reply, Exception):
                item.future.set_exception(reply)
            else:
                item.future.set_result(reply)
        if retry:
            self._shas.clear()
        # The batch leaves the queue only once sent; NOSCRIPT items go back to the front, in order.
        self._items[: len(batch)] = retry


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        _log.warning("queue_write_failed", error=repr(fut.exception()))


class JobStore:
    """The per-job writes of one consumer, each one atomic step through the :class:`BatchWriter`."""

    def __init__(self, writer: BatchWriter, keys: Keys, consumer: str,
                 cfg: Callable[[], RedisConfig]) -> None:
        self.writer = writer
        self.keys = keys
        self.consumer = consumer
        self._cfg = cfg

    async def begin(self, job_id: str, entry_id: str) -> int:
        """0 go (and mark the job running here), 1 it already has its result, 2 it was cancelled."""
        k = self.keys
        state: int = await self.writer.script(
            "begin", [k.done(job_id), k.cancel(job_id), k.status(job_id)],
            [self.consumer, entry_id, now_ms(), self._cfg().result_ttl_s])
        return state

    async def record_failure(self, job_id: str, attempt: Attempt) -> None:
        """Append a failed attempt to the job's history (copied into a dead-letter entry later)."""
        key = self.keys.history(job_id)
        self.writer.enqueue("RPUSH", key, json_encode(attempt)).add_done_callback(_log_failure)
        await self.writer.command("EXPIRE", key, self._cfg().result_ttl_s)

    async def finish(self, entry_id: str, job_id: str, reply_to: str, result: Result | None, *,
                     delivery: int, dead_reason: str = "", raw: bytes = b"") -> bool:
        """Store ``result`` (unless the job has one already), dead-letter if ``dead_reason``, and
        acknowledge — all in one script. True when this call stored the result."""
        r, k = self._cfg(), self.keys
        has_id = bool(job_id and reply_to and result is not None)
        payload = json_encode(result) if result is not None and has_id else b""
        written: int = await self.writer.script(
            "finish",
            [r.stream, k.done(job_id) if has_id else "", reply_to, k.status(job_id) if has_id else "",
             k.history(job_id) if job_id else "", r.dead_stream],
            [r.group, entry_id, payload, r.result_ttl_s, r.reply_maxlen,
             result.instance if result else "", now_ms(), result.status if result else "",
             dead_reason, raw, delivery, self.consumer])
        return written == 1
