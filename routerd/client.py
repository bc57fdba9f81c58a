"""The producers' client: put jobs on routerd's Redis queue and get their results back.

It talks to Redis only (never to routerd), so producers keep working while routerd restarts. Every
job's one result is kept in its idempotency record (``<ns>:done:<id>``) as well as sent to
``reply_to``, so :meth:`QueueClient.wait` finds it even if the reply stream was read by someone else,
and :meth:`QueueClient.status` can answer "done" with the result. ``queued`` is known only for jobs
submitted through this client (a plain ``XADD`` leaves no status until routerd starts the job).

Across a Redis failover (Sentinel): replication is asynchronous, so a job whose ``XADD`` the master
acknowledged can be missing from the replica it promotes. ``submit(..., durable=True)`` waits (``WAIT``)
until a replica has the jobs too, and raises :class:`NotDurable` when none confirms them in time. A
result stored just before a failover can be lost with it and the job run again: its second result
carries the same job id, and this client keeps the first it saw (``wait``, ``result``, ``wait_many``
and ``status`` answer that one from then on).

    async with QueueClient.from_url("redis://127.0.0.1:6379/0") as q:
        job = await q.submit({"model": "sim-small", "prompt": "hi", "max_tokens": 8})
        result = await q.wait(job, timeout=30)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from . import _aio
from .config_schema import RedisConfig, cluster_names
from .queue_wire import ChunkView, ResultView, decode_chunk, decode_result, json_encode, msgpack_encode
from .redis_conn import RedisConn
from .redis_keys import RedisKeys

State = Literal["unknown", "queued", "running", "done"]

_W3C = TraceContextTextMapPropagator()


# Its longest blocking read (a result's or a stream's wait is sliced into reads of at most 1 s): the
# socket timeout covers it with room to spare.
_READ_BLOCK_MS = 5000
_KEPT_RESULTS = 100_000  # the first result seen per job id, kept for this many jobs (oldest dropped)


class NotDurable(Exception):
    """Jobs the master queued but no replica confirmed within the client's op time-out (``WAIT``): a
    failover now could lose them. Submitting them again with the same job ids is safe — routerd stores
    one result per job id — and so is keeping them (they are queued)."""

    def __init__(self, jobs: list[Submitted], replicas: int) -> None:
        super().__init__(f"{len(jobs)} job(s) queued, but {replicas} replica(s) confirmed them, not 1")
        self.jobs = jobs
        self.replicas = replicas

class Submitted(msgspec.Struct, frozen=True):
    """A submitted job: its id, where its result goes, and its stream entry."""

    id: str
    reply_to: str
    entry: str


class JobStatus(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    state: State
    consumer: str = ""
    instance: str = ""
    result: ResultView | None = None


class QueueClient:
    """Async client for one routerd deployment (identified by its request stream's name)."""

    def __init__(self, redis: aioredis.Redis, *, stream: str = "routerd:requests",
                 op_timeout_s: float = 5.0, status_ttl_s: int = 86_400, id_prefix: str = "",
                 cluster: bool = False) -> None:
        self.redis: Any = redis
        # ``cluster``: the deployment's ``[redis] cluster``, its keys under one hash tag
        self.keys = RedisKeys.for_stream(stream, cluster=cluster)
        # Begins every job id this client makes, and so every per-job key (reply, result, status,
        # cancel): the scope of a producer's Redis ACL (``routerd redis-acl --producer-prefix``).
        self.id_prefix = id_prefix
        self._timeout = op_timeout_s
        self._status_ttl_s = status_ttl_s
        self._first: dict[str, ResultView] = {}  # job id → the first result seen (insertion order)

    @classmethod
    def from_url(cls, url: str, *, stream: str = "routerd:requests", password: str | None = None,
                 username: str | None = None, op_timeout_s: float = 5.0, id_prefix: str = "",
                 ssl_ca_certs: str = "", ssl_certfile: str = "", ssl_keyfile: str = "",
                 cluster: bool = False) -> QueueClient:
        """``username``/``password``: a Redis ACL user's (a userinfo in ``url`` wins over them);
        ``ssl_*``: for a ``rediss://`` URL, the CA and a client certificate and key (PEM files);
        ``cluster``: the deployment runs on a Redis Cluster (its ``[redis] cluster``)."""
        cfg = RedisConfig(username=username or "", password=password or "", op_timeout_s=op_timeout_s,
                          ssl_ca_certs=ssl_ca_certs, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                          cluster=cluster, stream=stream)
        return cls.from_config(cfg, url, id_prefix=id_prefix)

    @classmethod
    def from_config(cls, cfg: RedisConfig, url: str | None = None, *, id_prefix: str = "") -> QueueClient:
        """A client reaching Redis as a routerd with ``[redis]`` = ``cfg`` does — its URL (or ``url``),
        user, password, TLS, its sentinels (``sentinels``, ``service_name``: the client follows the
        master through a failover) and its ``cluster`` setting — on ``cfg.stream``::

            QueueClient.from_config(RedisConfig(sentinels=["10.0.0.1:26379", "10.0.0.2:26379"],
                                                service_name="routerd", url="redis:///0"))
        """
        stream = cfg.stream
        if cfg.cluster:  # a config's, loaded, is tagged already; a hand-made one is tagged here
            stream = cluster_names(stream, cfg.dead_stream)[0]
            cfg = msgspec.structs.replace(cfg, stream=stream)
        client = RedisConn(url or cfg.url, cfg, pooled=False).blocking(_READ_BLOCK_MS)
        return cls(client, stream=stream, op_timeout_s=cfg.op_timeout_s, id_prefix=id_prefix,
                   cluster=cfg.cluster)

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> QueueClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # submit --------------------------------------------------------------------------------------
    def _job(self, body: Mapping[str, Any], endpoint: str | None, job_id: str | None,
             reply_to: str | None, priority: int, deadline_ms: int | None,
             tenant: str | None = None, session: str | None = None,
             trace: Mapping[str, str] | None = None) -> tuple[str, str, dict[str, Any]]:
        job_id = job_id or self.id_prefix + uuid.uuid4().hex
        reply_to = reply_to or self.keys.reply(job_id)
        owned = self.keys.reserved(reply_to)
        if owned is not None:  # routerd would dead-letter it: say so before it is sent
            raise ValueError(f"reply_to {reply_to!r} is routerd's own key: {owned}")
        elsewhere = self.keys.elsewhere(reply_to)
        if elsewhere is not None:
            raise ValueError(f"reply_to {reply_to!r} is {elsewhere}")
        if endpoint is None:
            endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        job = {"id": job_id, "endpoint": endpoint, "body": dict(body), "reply_to": reply_to,
               "priority": priority, "deadline_ms": deadline_ms}
        if tenant is not None:
            job["tenant"] = tenant
        if session is not None:
            job["session"] = session
        if trace:
            job.update(trace)
        return job_id, reply_to, job

    def _queue(self, pipe: Any, job_id: str, job: dict[str, Any], encoding: str) -> None:
        status = self.keys.status(job_id)
        # HSETNX before the XADD, in one MULTI: routerd's "running" can never be overwritten by it.
        pipe.hsetnx(status, "state", "queued")
        pipe.expire(status, self._status_ttl_s)
        payload = msgpack_encode(job) if encoding == "msgpack" else json_encode(job)
        pipe.xadd(self.keys.stream, {"job": payload})

    async def submit(self, body: Mapping[str, Any], *, endpoint: str | None = None,
                     job_id: str | None = None, reply_to: str | None = None, priority: int = 0,
                     deadline_ms: int | None = None, encoding: Literal["json", "msgpack"] = "json",
                     tenant: str | None = None, session: str | None = None, durable: bool = False,
                     ) -> Submitted:
        """Enqueue one OpenAI request. ``deadline_ms``: Unix ms, or ms after enqueueing if < 1e11;
        ``tenant``: a ``[[tenants]]`` name (None: ``default``); ``session``: keeps a conversation's
        jobs on one instance while it is not saturated (None: the body's ``user``); ``durable``: return
        only once a replica has the job too (``WAIT 1``), so that a failover to it cannot lose it; raises
        :class:`NotDurable` when none confirms it within the op time-out (the job is queued)."""
        return (await self.submit_many([body], endpoint=endpoint, reply_to=reply_to, priority=priority,
                                       deadline_ms=deadline_ms, encoding=encoding,
                                       job_ids=[job_id] if job_id else None, tenant=tenant,
                                       session=session, durable=durable))[0]

    async def submit_many(self, bodies: Iterable[Mapping[str, Any]], *, endpoint: str | None = None,
                          reply_to: str | None = None, priority: int = 0,
                          deadline_ms: int | None = None, encoding: Literal["json", "msgpack"] = "json",
                          job_ids: Sequence[str] | None = None, batch: int = 500,
                          tenant: str | None = None, session: str | None = None,
                          durable: bool = False) -> list[Submitted]:
        """Enqueue many jobs in pipelined batches (one MULTI per batch); returns them in order.
        ``durable``: each batch waits for a replica (``WAIT 1``) as in :meth:`submit`; a batch none
        confirms raises :class:`NotDurable` with the jobs queued so far.

        Each job carries the W3C context of the caller's current OpenTelemetry span, if any
        (``traceparent``/``tracestate``): routerd's spans for it join the caller's trace."""
        trace = trace_context()
        out: list[Submitted] = []
        pending: list[tuple[str, str]] = []
        pipe = self._pipeline(durable)
        for i, body in enumerate(bodies):
            jid = job_ids[i] if job_ids else None
            job_id, reply, job = self._job(body, endpoint, jid, reply_to, priority, deadline_ms, tenant,
                                           session, trace)
            self._queue(pipe, job_id, job, encoding)
            pending.append((job_id, reply))
            if len(pending) >= batch:
                out += await self._flush(pipe, pending, durable, out)
                pending = []
                pipe = self._pipeline(durable)
        if pending:
            out += await self._flush(pipe, pending, durable, out)
        return out

    def _pipeline(self, durable: bool) -> Any:
        """A batch's MULTI; a durable one spells MULTI … EXEC out in a plain pipeline, so that the
        ``WAIT`` after it runs on the same connection (WAIT counts that connection's writes)."""
        if not durable:
            return self.redis.pipeline(transaction=True)
        pipe = self.redis.pipeline(transaction=False)
        pipe.execute_command("MULTI")
        return pipe

    async def _flush(self, pipe: Any, pending: list[tuple[str, str]], durable: bool = False,
                     before: Sequence[Submitted] = ()) -> list[Submitted]:
        if durable:
            pipe.execute_command("EXEC")
            pipe.execute_command("WAIT", 1, max(1, int(self._timeout * 1000)))
        async with _aio.timeout(self._timeout * (2 if durable else 1) + len(pending) / 1000):
            replies = await pipe.execute()
        entries = (replies[-2] if durable else replies)[2::3]
        out = [Submitted(jid, reply, _s(entry)) for (jid, reply), entry in zip(pending, entries, strict=True)]
        if durable and int(replies[-1]) < 1:
            raise NotDurable([*before, *out], int(replies[-1]))
        return out

    # results -------------------------------------------------------------------------------------
    async def result(self, job_id: str) -> ResultView | None:
        """The job's result if it has one (from its idempotency record; the first this client saw),
        else None."""
        if (kept := self._first.get(job_id)) is not None:
            return kept
        async with _aio.timeout(self._timeout):
            raw = await self.redis.get(self.keys.done(job_id))
        return None if raw is None else self._keep(decode_result(raw))

    def _keep(self, result: ResultView) -> ResultView:
        """The first result this client saw for ``result.id``: a job run again after a failover lost its
        stored result has a second one, which is not the answer the producer may already have acted on."""
        kept = self._first.setdefault(result.id, result)
        if len(self._first) > _KEPT_RESULTS:
            del self._first[next(iter(self._first))]
        return kept

    async def wait(self, job: Submitted | str, *, timeout: float, reply_to: str | None = None,
                   ) -> ResultView:
        """Wait for one job's result (blocking on its reply stream). Raises TimeoutError."""
        job_id = job if isinstance(job, str) else job.id
        reply = reply_to or (job.reply_to if isinstance(job, Submitted) else self.keys.reply(job_id))
        deadline = asyncio.get_running_loop().time() + timeout
        async with contextlib.aclosing(self._reply_entries(reply, job_id, deadline)) as entries:
            async for item in entries:
                if isinstance(item, ResultView):
                    return item
        raise TimeoutError(job_id)  # pragma: no cover - the iterator only ends by timeout

    async def wait_many(self, jobs: Sequence[Submitted | str], *, timeout: float,
                        poll_s: float = 0.05) -> dict[str, ResultView]:
        """Wait for many results by polling their idempotency records in batches, riding out a Redis
        restart. Raises TimeoutError (with how many are missing) if not all arrive in time."""
        missing = [j if isinstance(j, str) else j.id for j in jobs]
        results: dict[str, ResultView] = {}
        deadline = time.monotonic() + timeout
        while missing:
            still: list[str] = []
            for i in range(0, len(missing), 1000):
                results.update({j: self._first[j] for j in missing[i:i + 1000] if j in self._first})
                part = [j for j in missing[i:i + 1000] if j not in self._first]
                if not part:
                    continue
                try:
                    async with _aio.timeout(self._timeout):
                        raws = await self.redis.mget([self.keys.done(j) for j in part])
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                    still += part  # Redis restarting: results are durable, look again shortly
                    continue
                for job_id, raw in zip(part, raws, strict=True):
                    if raw is None:
                        still.append(job_id)
                    else:
                        results[job_id] = self._keep(decode_result(raw))
            missing = still
            if missing:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(missing)} of {len(jobs)} results missing")
                await asyncio.sleep(poll_s)
        return results

    async def chunks(self, job: Submitted, *, timeout: float) -> AsyncIterator[ChunkView | ResultView]:
        """A streamed job's chunks in order, then its result. Chunks of an abandoned earlier run (routerd
        died mid-stream and ran the job again) are dropped: a newer run restarts the sequence."""
        run = 0
        # The deadline bounds each fetch, not a block around the yields: a timeout spanning a yield
        # would fire in the caller's code as a bare CancelledError instead of a TimeoutError here.
        deadline = asyncio.get_running_loop().time() + timeout
        async with contextlib.aclosing(self._reply_entries(job.reply_to, job.id, deadline)) as entries:
            async for item in entries:
                if isinstance(item, ResultView):
                    yield item
                    return
                if item.delivery < run:
                    continue
                run = item.delivery
                yield item

    async def _reply_entries(self, reply_to: str, job_id: str, deadline: float,
                             ) -> AsyncGenerator[ChunkView | ResultView, None]:
        """This job's entries on ``reply_to``, then its result; TimeoutError at ``deadline`` (loop time).

        The deadline is checked before every fetch as well as bounding it: redis-py can swallow the
        cancellation by which an expiring timeout interrupts a call (see ``routerd._aio``), and then
        only this check ends the loop. Entries that are not this job's, or not readable at all (a
        reply stream is the producer's to share), are skipped. A ``reply_to`` that is not a stream
        (routerd dead-letters such a job and stores its error result) is left for the result record.
        """
        loop = asyncio.get_running_loop()
        last, readable = "0-0", True
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(job_id)
            reply: Any = None
            if readable:
                try:
                    async with _aio.timeout_at(deadline):
                        reply = await self.redis.xread({reply_to: last}, count=500,
                                                       block=max(1, min(1000, int(left * 1000))))
                except redis.exceptions.ResponseError as e:
                    if not str(e).startswith("WRONGTYPE"):
                        raise
                    readable = False
            if not reply:
                async with _aio.timeout_at(deadline):
                    done = await self.result(job_id)  # the reply stream may be gone, trimmed or no stream
                if done is not None:
                    yield done
                    return
                if not readable:
                    await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
                continue
            for entry_id, fields in reply[0][1]:
                last = _s(entry_id)
                item = _reply_item(fields, job_id)
                if isinstance(item, ResultView):
                    item = self._keep(item)
                if item is not None:
                    yield item
                    if isinstance(item, ResultView):
                        return

    # control -------------------------------------------------------------------------------------
    async def cancel(self, job: Submitted | str, *, ttl_s: int = 86_400) -> None:
        """Cancel a job: before it runs (the key) or while it runs (the channel). A job that already
        has a result keeps it."""
        job_id = job if isinstance(job, str) else job.id
        async with _aio.timeout(self._timeout):
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(self.keys.cancel(job_id), b"1", ex=ttl_s)
            pipe.publish(self.keys.cancel_channel, job_id)
            await pipe.execute()

    async def status(self, job: Submitted | str) -> JobStatus:
        """queued / running (on which consumer and instance) / done (with the result) / unknown."""
        job_id = job if isinstance(job, str) else job.id
        async with _aio.timeout(self._timeout):
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(self.keys.done(job_id))
            pipe.hgetall(self.keys.status(job_id))
            raw, fields = await pipe.execute()
        fields = {_s(k): _s(v) for k, v in fields.items()}
        if raw is not None or job_id in self._first:
            result = self._first.get(job_id) or self._keep(decode_result(raw))
            return JobStatus(id=job_id, state="done", result=result, instance=result.instance,
                             consumer=fields.get("consumer", ""))
        state = fields.get("state", "unknown")
        if state not in ("queued", "running"):
            state = "unknown"
        return JobStatus(id=job_id, state=state,
                         consumer=fields.get("consumer", ""), instance=fields.get("instance", ""))


def trace_context() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of routerd's own span in progress (``routerd submit``'s),
    else of the caller's current OpenTelemetry span; ``{}`` without either."""
    from .tracing import current_context

    if carrier := current_context():
        return carrier
    _W3C.inject(carrier)
    return carrier


def _s(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _reply_item(fields: dict[bytes, bytes], job_id: str) -> ChunkView | ResultView | None:
    """The entry as this job's chunk or result; None for anyone else's entry or one not readable."""
    try:
        if b"result" in fields:
            result = decode_result(fields[b"result"])
            return result if result.id == job_id else None
        if b"chunk" in fields:
            chunk = decode_chunk(fields[b"chunk"])
            return chunk if chunk.id == job_id else None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # msgspec's ValidationError too
        return None
    return None
