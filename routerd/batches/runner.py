"""Running batches: any routerd runs any batch, one at a time each (:mod:`.lease`).

Every ``[batches] poll_s`` a routerd looks at the active batches and takes the lease of those nobody
holds; for each it holds, one task steps the batch until it is final or the lease is lost:

1. ``validating``: the input file is read as a stream, line by line (:mod:`.lines`); a bad line fails
   the batch with OpenAI's per-line ``errors``, a good file moves it to ``in_progress``.
2. ``in_progress``: the *feeder* keeps at most ``lines_in_flight`` of its lines on the queue as jobs
   (its tenant's, at the batch priority, with the window's end as their deadline, replying to the
   batch's result stream); the *collector* reads that stream and writes each line's result to the
   output or error file, deleting the result only in the same atomic step (:mod:`.store`). Its
   progress is all in Redis: a runner taking over goes on where the last one stopped.
3. At the window's end the lines in flight are cancelled and written as ``batch_expired``, then so is
   every line not yet fed; the batch ends ``expired``.
4. ``cancelling``: no line is fed any more; lines queued but not started are cancelled, running ones
   finish and are written; the batch ends ``cancelled`` with what was done.
5. With every line fed and written the batch passes ``finalizing`` and ends ``completed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from .. import _aio, log
from ..config import Config
from ..errors import DeadlineExceeded
from ..redis_conn import RedisConn
from ..redis_keys import RedisKeys
from ..redis_server import REDIS_DOWN
from ..tenants.service import Tenancy
from . import lines
from .files import FileStore, LineReader
from .lease import BatchLease
from .store import BatchStore
from .wire import FINAL, ApiError

_log = log.get("routerd.batches")
_MAX_ERRORS = 100  # a failed validation names this many bad lines at most
_FEED_STEP = 256  # lines fed in one script call
_COLLECT_COUNT = 512
_COLLECT_BLOCK_MS = 200
_SWEEP_S = 10.0  # results found in their idempotency records (a trimmed result stream)
_RETRY_S = 10.0  # a batch whose run failed here is left to others (or retried here) for this long


class _LeaseLost(Exception):
    """This runner's lease on the batch lapsed (another routerd may run it now): stop stepping it."""


@dataclass
class BatchStats:
    """This process's figures for ``/metrics`` and ``routerd status`` (sampled, never awaited there)."""

    states: dict[str, int] = field(default_factory=dict)
    active: list[dict[str, Any]] = field(default_factory=list)  # id, status, total, completed, failed, runner
    written: dict[str, int] = field(default_factory=lambda: {"completed": 0, "failed": 0})
    running: int = 0
    rate: float = 0.0  # lines written per second here, over the last sample period
    _last: tuple[float, int] = (0.0, 0)


class BatchRunner:
    """Finds the batches nobody runs and runs them; the daemon runs :meth:`run` in its TaskGroup."""

    def __init__(self, cfg: Config, redis: RedisConn, tenancy: Tenancy, holder: str, *,
                 clock: Callable[[], float] = time.time) -> None:
        """``redis``: the process's Redis (the queue's, routerd/redis_conn.py); ``tenancy``: which
        models each tenant may use; ``holder``: this process's name in the batches' leases."""
        self._current = cfg
        self._conn = redis
        self._redis: aioredis.Redis | None = None
        self._tenancy = tenancy
        client = self._client
        keys = RedisKeys.from_config(cfg.redis)
        self.keys = keys
        t = cfg.redis.op_timeout_s
        self.files = FileStore(client, keys, lambda: self._current.batches, op_timeout_s=t, clock=clock)
        self.store = BatchStore(client, keys, op_timeout_s=t, clock=clock)
        self.lease = BatchLease(client, keys, holder, op_timeout_s=t)
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, float] = {}  # batch → when its run here failed (retaken after a while)
        self.stats = BatchStats()

    def _cfg(self) -> Config:
        return self._current

    @property
    def config(self) -> Config:
        return self._current

    def update_config(self, cfg: Config) -> None:
        self._current = cfg

    def _client(self) -> Any:
        if self._redis is None:
            self._redis = self._conn.blocking()  # as the queue's reads: its socket timeout, its pool
        return self._redis

    def _model_error(self, tenant_name: str, model: str) -> str | None:
        """Why ``tenant_name`` may not send ``model`` in a batch line, or None."""
        cfg = self._cfg()
        fleet = cfg.fleet_for_model(model)
        if fleet is None:
            return (f"The model `{model[:100]}` does not exist. Valid models: "
                    f"{', '.join(sorted(f.model for f in cfg.fleets)) or 'none'}")
        directory = self._tenancy.directory
        tenant = directory.get(tenant_name) or directory.default
        if not tenant.allows(fleet.name):
            return f"tenant {tenant_name!r} may not use model `{model[:100]}`"
        return None

    async def run(self) -> None:
        down = False  # an outage is logged once, and its end (a Sentinel failover: the new master answers)
        try:
            while True:
                try:
                    await self._adopt()
                    await self._sample()
                    if down:
                        down = False
                        _log.info("batches_redis_back")
                except REDIS_DOWN as e:
                    if not down:
                        down = True
                        _log.warning("batches_redis_unavailable", error=repr(e))
                except Exception:  # noqa: BLE001 — loop boundary: logged, the next poll goes on
                    _log.exception("batches_poll_failed")
                await asyncio.sleep(self._cfg().batches.poll_s)
        finally:
            await _aio.cancel_and_wait(set(self._tasks.values()), 5.0)
            if self._redis is not None:
                client, self._redis = self._redis, None
                with contextlib.suppress(*REDIS_DOWN):
                    await _aio.wait_for(client.aclose(), 5.0)

    async def _adopt(self) -> None:
        lease_ms = int(self._cfg().batches.lease_s * 1000)
        now = time.monotonic()
        self._failed = {b: t for b, t in self._failed.items() if now - t < _RETRY_S}
        for batch_id in await self.store.active():
            if batch_id not in self._tasks and batch_id not in self._failed \
                    and await self.lease.take(batch_id, lease_ms):
                task = asyncio.create_task(self._own(batch_id), name=f"batch:{batch_id}")
                self._tasks[batch_id] = task
                task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task.get_name().removeprefix("batch:"), None)

    async def _own(self, batch_id: str) -> None:
        _log.info("batch_taken", batch=batch_id)
        try:
            await _BatchRun(self, batch_id).run()
        except asyncio.CancelledError:
            raise
        except _LeaseLost:
            _log.warning("batch_lease_lost", batch=batch_id)
        except Exception:  # noqa: BLE001 — one batch's failure: logged, the lease lapses, it is retaken
            _log.exception("batch_run_failed", batch=batch_id, retry_in_s=_RETRY_S)
            self._failed[batch_id] = time.monotonic()
        finally:
            with contextlib.suppress(*REDIS_DOWN):
                await self.lease.release(batch_id)

    async def _sample(self) -> None:
        s = self.stats
        s.states = await self.store.states()
        active: list[dict[str, Any]] = []
        for batch_id in (await self.store.active())[:100]:
            h = await self.store.get(batch_id)
            if h is not None:
                active.append({"id": batch_id, "tenant": h.get("tenant", ""), "status": h.get("status", ""),
                               "total": int(h.get("total", "0")), "completed": int(h.get("completed", "0")),
                               "failed": int(h.get("failed", "0")),
                               "here": batch_id in self._tasks})
        s.active = active
        s.running = len(self._tasks)
        now, done = time.monotonic(), sum(s.written.values())
        last_t, last_done = s._last
        if last_t:
            s.rate = (done - last_done) / max(1e-6, now - last_t)
        s._last = (now, done)

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {"states": s.states, "active": s.active, "running_here": s.running,
                "lines_per_s_here": round(s.rate, 1), "written_here": dict(s.written)}


class _BatchRun:
    """One batch stepped by its lease holder until it is final or the lease is lost."""

    def __init__(self, runner: BatchRunner, batch_id: str) -> None:
        self.r = runner
        self.id = batch_id
        self.results = runner.keys.batch_results(batch_id)
        self._renew_at = 0.0
        self._reader: LineReader | None = None
        self._input: dict[str, str] | None = None
        self._last_entry = "0-0"
        self._sweep_at = time.monotonic() + _SWEEP_S
        self._cancels_sent: set[int] = set()

    @property
    def cfg(self) -> Config:
        return self.r._cfg()

    async def keep_lease(self) -> bool:
        now = time.monotonic()
        if now < self._renew_at:
            return True
        b = self.cfg.batches
        if not await self.r.lease.renew(self.id, int(b.lease_s * 1000)):
            _log.warning("batch_lease_lost", batch=self.id)
            return False
        self._renew_at = now + b.lease_s / 3
        return True

    async def run(self) -> None:
        store = self.r.store
        while await self.keep_lease():
            h = await store.get(self.id)
            if h is None or h["status"] in FINAL:
                return
            state = h["status"]
            expired = self.r._clock() >= int(h["expires_at"])
            if state == "validating":
                if expired:
                    await store.finish(h, "expired")
                else:
                    await self.validate(h)
                continue
            if expired and state == "in_progress":  # again after a takeover: each step is idempotent
                await self.expire(h)
                continue
            if state == "cancelling":
                if h.get("fed_line") == "0" and not await store.inflight_count(self.id):
                    await store.finish(h, "cancelled")
                    continue
                await self.cancel_queued()
            elif state == "in_progress" and h.get("fed_done") != "1":
                await self.feed(h)
            await self.collect(h)
            ending = h.get("fed_done") == "1" or state == "cancelling"
            if ending and not await store.inflight_count(self.id):
                await self.finalize(h)

    # validation ----------------------------------------------------------------------------------
    async def _input_meta(self, h: dict[str, str]) -> dict[str, str]:
        if self._input is None:
            try:
                self._input = await self.r.files.meta(h["tenant"], h["input_file_id"])
            except ApiError:
                self._input = {}
        return self._input

    async def validate(self, h: dict[str, str]) -> None:
        meta = await self._input_meta(h)
        errors: list[dict[str, Any]] = []
        total = 0
        if not meta:
            errors.append(_error("file_not_found", f"the input file {h['input_file_id']} was deleted", None))
        else:
            total = await self._check_lines(h, meta, errors)
            if not errors and total == 0:
                errors.append(_error("empty_file", "the input file holds no request line", None))
        if errors:
            await self.r.store.set_fields(self.id, {"errors": json.dumps({"object": "list", "data": errors})})
            await self.r.store.finish(h, "failed")
            _log.info("batch_failed_validation", batch=self.id, errors=len(errors))
            return
        await self.r.store.move(self.id, "in_progress", "in_progress_at", ("validating",),
                                fields={"total": str(total)})
        _log.info("batch_in_progress", batch=self.id, total=total)

    async def _check_lines(self, h: dict[str, str], meta: dict[str, str],
                           errors: list[dict[str, Any]]) -> int:
        cfg = self.cfg
        reader = LineReader(self.r.files, meta)
        seen: set[str] = set()
        total = 0
        tenant = h["tenant"]

        def model_error(model: str) -> str | None:
            return self.r._model_error(tenant, model)

        while len(errors) < _MAX_ERRORS:
            got = await reader.next_line(cfg.http.max_body_bytes + 65_536)
            if got is None:
                break
            number, raw, _ = got
            if number % 500 == 499:
                await asyncio.sleep(0)  # a long file shares the loop
                if not await self.keep_lease():
                    raise _LeaseLost(self.id)
            if raw is not None and not raw.strip():
                continue
            total += 1
            try:
                if raw is None:
                    raise lines.LineError("request_too_large", "the line is over the body limit of "
                                          f"{cfg.http.max_body_bytes} bytes (http.max_body_bytes)")
                line = lines.check(raw, h["endpoint"], cfg.http.max_body_bytes, model_error)
                if line.custom_id in seen:
                    raise lines.LineError("duplicate_custom_id",
                                          f"custom_id {line.custom_id[:100]!r} is not unique in the file")
                seen.add(line.custom_id)
            except lines.LineError as e:
                errors.append(_error(e.code, e.message, number + 1))
            if total > cfg.batches.max_lines:
                errors.append(_error("too_many_requests", f"the file has more than {cfg.batches.max_lines} "
                                     "requests ([batches] max_lines)", number + 1))
                break
        return total

    # feeding -------------------------------------------------------------------------------------
    def _reader_at(self, meta: dict[str, str], line: int, offset: int) -> LineReader:
        r = self._reader
        if r is None or r.line != line or r.offset != offset:
            r = self._reader = LineReader(self.r.files, meta, line=line, offset=offset)
        return r

    async def feed(self, h: dict[str, str], *, expiring: bool = False) -> bool:
        """Feed the next lines (as jobs; or, ``expiring``, written as expired); False with nothing to
        feed."""
        cfg = self.cfg
        inflight = 0 if expiring else await self.r.store.inflight_count(self.id)
        room = 1000 if expiring else min(_FEED_STEP, cfg.batches.lines_in_flight - inflight)
        if room <= 0:
            return True
        meta = await self._input_meta(h)
        if not meta:
            raise ApiError(400, "the input file is gone")
        start_line, start_offset = int(h["fed_line"]), int(h["fed_offset"])
        reader = self._reader_at(meta, start_line, start_offset)
        deadline_ms = int(h["expires_at"]) * 1000
        records: list[tuple[str, int, bytes, bytes]] = []
        while len(records) < room:
            got = await reader.next_line(cfg.http.max_body_bytes + 65_536)
            if got is None:
                break
            number, raw, _ = got
            if raw is None or not raw.strip():
                continue
            line = lines.parse(raw)
            cid = json.dumps(line.custom_id).encode()
            if expiring:
                data = lines.expired_line(_req_id(self.id, number), cid.decode())
                records.append(("err", number, data, b""))
            else:
                job = lines.job(line, _job_id(self.id, number), h["endpoint"], self.results,
                                cfg.batches.priority, h["tenant"], deadline_ms)
                records.append(("job", number, cid, job))
        fed = await self.r.store.feed(self.id, start_line, records, reader.line, reader.offset, reader.at_end,
                                      cfg.redis.stream)
        if not fed:
            self._reader = None
        return fed and bool(records)

    # collecting ----------------------------------------------------------------------------------
    async def collect(self, h: dict[str, str]) -> None:
        """Write the results that came in (waiting up to a moment for some)."""
        client = self.r._client()
        async with _aio.timeout(self.cfg.redis.op_timeout_s + _COLLECT_BLOCK_MS / 1000):
            reply = await client.xread({self.results: self._last_entry}, count=_COLLECT_COUNT,
                                       block=_COLLECT_BLOCK_MS)
        got: list[tuple[str, bytes]] = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._last_entry = entry_id.decode()
                got.append((self._last_entry, fields.get(b"result", b"")))
        if time.monotonic() >= self._sweep_at:
            self._sweep_at = time.monotonic() + _SWEEP_S
            got += await self._from_records()
        if got:
            await self._write(h, got)

    async def _from_records(self) -> list[tuple[str, bytes]]:
        """Results of lines in flight found in their idempotency records: a result whose stream entry
        was trimmed away is written all the same (its entry, if it is there, is deleted on its own)."""
        inflight = await self.r.store.inflight(self.id)
        if not inflight:
            return []
        numbers = sorted(inflight)
        client = self.r._client()
        async with _aio.timeout(self.cfg.redis.op_timeout_s):
            raws = await client.mget([self.r.keys.done(_job_id(self.id, n)) for n in numbers])
        return [("", raw) for raw in raws if raw is not None]

    async def _write(self, h: dict[str, str], got: list[tuple[str, bytes]]) -> None:
        parsed: list[tuple[str, int, lines.Outcome | None, str]] = []
        for entry, raw in got:
            out = lines.outcome(raw) if raw else None
            number = _line_of(self.id, out.id) if out is not None else None
            if out is None or number is None:  # not one of ours: drop the entry
                parsed.append((entry, -1, None, ""))
                continue
            parsed.append((entry, number, out, out.id))
        numbers = [n for _, n, _, _ in parsed if n >= 0]
        cids = dict(zip(numbers, await self.r.store.custom_ids(self.id, numbers), strict=True))
        records: list[tuple[int, str, str, bytes, str]] = []
        cancelling = h["status"] == "cancelling"
        for entry, number, out, job_id in parsed:
            cid = cids.get(number)
            if out is None or cid is None:  # not ours, or written already
                if entry:
                    records.append((max(number, 0), entry, "", b"", job_id or "-"))
                continue
            err_type = (out.error or {}).get("type")
            if out.status == "error" and cancelling and err_type == "CancelledError":
                which, data = "", b""  # cancelled before it ran: not done, not written
            elif out.status == "error" and err_type == DeadlineExceeded.type:
                which, data = "err", lines.expired_line(_req_id(self.id, number), cid)
            else:
                which, data = lines.result_line(_req_id(self.id, number), cid, job_id, out)
            records.append((number, entry, which, data, job_id))
        if not records:
            return
        written = await self.r.store.write(self.id, records)
        stats = self.r.stats.written
        for (_, _, which, _, _), w in zip(records, written, strict=True):
            if w:
                stats["completed" if which == "out" else "failed"] += 1

    # ending --------------------------------------------------------------------------------------
    async def _cancel_jobs(self, numbers: list[int], *, running_too: bool) -> None:
        """Cancel these lines' jobs: not started ones (the cancel key); ``running_too``: running ones
        as well (the cancel channel)."""
        keys = self.r.keys
        client = self.r._client()
        async with _aio.timeout(self.cfg.redis.op_timeout_s + len(numbers) / 1000):
            pipe = client.pipeline(transaction=False)
            for n in numbers:
                pipe.set(keys.cancel(_job_id(self.id, n)), b"1", ex=self.cfg.redis.result_ttl_s)
                if running_too:
                    pipe.publish(keys.cancel_channel, _job_id(self.id, n))
            await pipe.execute()

    async def cancel_queued(self) -> None:
        numbers = [n for n in await self.r.store.inflight(self.id) if n not in self._cancels_sent]
        if numbers:
            await self._cancel_jobs(numbers, running_too=False)
            self._cancels_sent.update(numbers)

    async def expire(self, h: dict[str, str]) -> None:
        """The window ended: lines in flight are cancelled and written as expired, then every line not
        yet fed; the batch ends ``expired``."""
        _log.info("batch_expiring", batch=self.id)
        await self.r._client().hset(self.r.keys.batch(self.id), "expiring", "1")
        inflight = await self.r.store.inflight(self.id)
        if inflight:
            await self._cancel_jobs(sorted(inflight), running_too=True)
            await self.r.store.write(self.id, [
                (n, "", "err", lines.expired_line(_req_id(self.id, n), cid), _job_id(self.id, n))
                for n, cid in sorted(inflight.items())])
        while True:
            h = await self.r.store.get(self.id) or h
            if h.get("fed_done") == "1" or h["status"] != "in_progress":
                break
            await self.feed(h, expiring=True)
            if not await self.keep_lease():
                return
        await self.r.store.finish(h, "expired")

    async def finalize(self, h: dict[str, str]) -> None:
        if h["status"] == "cancelling":
            await self.r.store.finish(h, "cancelled")
        elif h.get("expiring"):
            await self.r.store.finish(h, "expired")
        else:
            await self.r.store.move(self.id, "finalizing", "finalizing_at", ("in_progress",))
            await self.r.store.finish(h, "completed")
        _log.info("batch_finished", batch=self.id)


def _error(code: str, message: str, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


def _job_id(batch_id: str, line: int) -> str:
    return f"{batch_id}-{line}"


def _req_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id[6:]}_{line}"


def _line_of(batch_id: str, job_id: str) -> int | None:
    head, _, n = job_id.rpartition("-")
    return int(n) if head == batch_id and n.isdigit() else None
