"""The queue consumer against a real redis-server, with a fake upstream (the dispatch's EngineCall Protocol).

What a producer relies on: one result per job id whatever happens, bad messages dead-lettered with a
reason while the consumer keeps going, deadlines and cancels honoured, streamed chunks in order, and
the backlog staying in Redis.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from routerd.client import QueueClient
from routerd.errors import BadRequest
from routerd.ingress.validate import read_head
from routerd.queue_wire import decode_result
from routerd.telemetry import Metrics
from tests.fixtures.helpers import until
from tests.fixtures.redis_server import (
    FakeUpstream,
    QueueBench,
    QueueBenchFactory,
    RedisServer,
    fields,
    xlen_at_least,
)

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


async def results_in(r: aioredis.Redis, reply_to: str) -> list[dict[str, Any]]:
    entries = await r.xrange(reply_to)
    return [msgspec.json.decode(f[b"result"]) for _, f in entries if b"result" in f]


async def test_jobs_get_one_result_each(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                        redis_async: aioredis.Redis) -> None:
    bench = queue_bench()
    q = QueueClient(redis_async)
    jobs = await q.submit_many([{**BODY, "prompt": f"p{i}"} for i in range(150)], reply_to="replies")
    jobs += await q.submit_many([{**BODY, "prompt": f"m{i}"} for i in range(50)], reply_to="replies",
                                encoding="msgpack")
    await bench.start()
    try:
        results = await q.wait_many(jobs, timeout=20)
    finally:
        await bench.stop()
    assert len(results) == 200
    for job, body_prompt in zip(jobs, [f"p{i}" for i in range(150)] + [f"m{i}" for i in range(50)],
                                strict=True):
        res = results[job.id]
        assert res.status == "ok"
        assert res.response["choices"][0]["text"] == f"echo:{body_prompt}"
        assert res.instance == "f:0"
    in_stream = await results_in(redis_async, "replies")
    assert sorted(r["id"] for r in in_stream) == sorted(j.id for j in jobs)  # exactly one each
    assert await redis_async.xpending("routerd:requests", "routerd") == {
        "pending": 0, "min": None, "max": None, "consumers": []}
    assert await redis_async.xlen("routerd:requests") == 0  # acknowledged and deleted
    status = await q.status(jobs[0])
    assert status.state == "done"
    assert status.instance == "f:0"
    assert status.consumer == "c1"


async def test_poison_messages_are_dead_lettered_and_consumer_goes_on(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    bad: list[bytes] = [
        b"\xc1 not msgpack",
        b'{"id": "x1", "endpoint": "/v1/completions"',  # truncated JSON
        msgspec.json.encode({"id": "x2", "endpoint": "/v1/completions", "body": BODY}),  # no reply_to
        msgspec.json.encode({"id": "x3", "endpoint": "/v1/unknown", "body": BODY, "reply_to": "r3"}),
        msgspec.json.encode({"id": "x4", "endpoint": "/v1/completions", "reply_to": "r4",
                             "body": {"model": "nope", "prompt": "p"}}),
        msgspec.json.encode({"id": "x5", "endpoint": "/v1/chat/completions", "reply_to": "r5",
                             "body": {"model": "m", "messages": "not a list"}}),
        msgspec.json.encode(["a", "list"]),
    ]
    for raw in bad:
        await redis_async.xadd("routerd:requests", {"job": raw})
    await redis_async.xadd("routerd:requests", {"nojobfield": b"1"})
    bench = queue_bench()
    q = QueueClient(redis_async)
    good = await q.submit(BODY)
    await bench.start()
    try:
        assert (await q.wait(good, timeout=10)).status == "ok"
        await until(lambda: xlen_at_least(redis_async, "routerd:dead", 8))
    finally:
        await bench.stop()
    dead = [fields(f) for _, f in await redis_async.xrange("routerd:dead")]
    reasons = [d["reason"] for d in dead]
    assert "not valid msgpack" in reasons[0]
    assert "not valid JSON" in reasons[1]
    assert "reply_to" in reasons[2]
    assert "endpoint" in reasons[3]
    assert "no fleet serves model 'nope'" in reasons[4]
    assert "body.messages" in reasons[5]
    assert all(d["deliveries"] == "1" for d in dead)
    for rid, code in (("r3", 400), ("r4", 404), ("r5", 400)):  # a readable reply_to gets an error
        (res,) = await results_in(redis_async, rid)
        assert res["status"] == "error"
        assert res["error"]["code"] == code
    assert bench.upstream.calls == {good.id: 1}  # no bad message reached an engine
    assert await redis_async.xlen("routerd:requests") == 0


# Bodies routerd will not send an engine, whichever way they come in: (endpoint, body, the field named).
BAD_BODIES = [
    ("/v1/chat/completions", {"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": ["x"]}, "messages"),
    ("/v1/completions", {"model": "m", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "p", "stream": "yes"}, "stream"),
]


async def test_a_jobs_body_is_checked_as_an_http_requests_body(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """A producer gets the HTTP ingress's answer for the same body: the bodies HTTP rejects are
    dead-lettered naming the same field, and what HTTP accepts (``stream: null``) runs."""
    for endpoint, body, param in BAD_BODIES:
        with pytest.raises(BadRequest) as err:
            read_head(endpoint, msgspec.json.encode(body))
        assert err.value.param == param
    bench = queue_bench()
    q = QueueClient(redis_async)
    bad = [await q.submit(body, endpoint=endpoint) for endpoint, body, _ in BAD_BODIES]
    null_stream = await q.submit({**BODY, "stream": None})
    await bench.start()
    try:
        assert (await q.wait(null_stream, timeout=10)).status == "ok"
        results = {job.id: await q.wait(job, timeout=10) for job in bad}
    finally:
        await bench.stop()
    for job, (_, _, param) in zip(bad, BAD_BODIES, strict=True):
        res = results[job.id]
        assert res.status == "error"
        assert res.error is not None
        assert res.error["code"] == 400
        assert res.error["message"].startswith(f"body.{param}:"), res.error
    assert bench.upstream.calls == {null_stream.id: 1}  # no bad body reached an engine
    assert await redis_async.xlen("routerd:dead") == len(BAD_BODIES)


async def test_duplicate_job_id_gets_one_result(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                                redis_async: aioredis.Redis) -> None:
    bench = queue_bench()
    q = QueueClient(redis_async)
    await q.submit(BODY, job_id="same", reply_to="rr")
    await bench.start()
    try:
        await q.wait("same", reply_to="rr", timeout=10)
        await q.submit(BODY, job_id="same", reply_to="rr")  # a producer retrying its XADD
        await until(lambda: _drained(redis_async))
    finally:
        await bench.stop()
    assert len(await results_in(redis_async, "rr")) == 1
    assert bench.upstream.calls["same"] == 1
    assert bench.ingress.stats["duplicates"] == 1


async def _drained(r: aioredis.Redis) -> bool:
    return int(await r.xlen("routerd:requests")) == 0


async def test_failing_engine_is_retried_then_one_result(redis_server: RedisServer,
                                                         queue_bench: QueueBenchFactory,
                                                         redis_async: aioredis.Redis) -> None:
    up = FakeUpstream(fail=lambda job_id, n: n < 3)  # the first two deliveries hit a dead engine
    bench = queue_bench(up, max_deliveries=5)
    q = QueueClient(redis_async)
    job = await q.submit(BODY)
    await bench.start()
    try:
        res = await q.wait(job, timeout=15)
    finally:
        await bench.stop()
    assert res.status == "ok"
    assert up.calls[job.id] == 3
    assert len(await results_in(redis_async, job.reply_to)) == 1
    assert await redis_async.exists(f"routerd:history:{job.id}") == 0  # cleared with the result


async def test_max_deliveries_dead_letters_with_history(redis_server: RedisServer,
                                                        queue_bench: QueueBenchFactory,
                                                        redis_async: aioredis.Redis) -> None:
    up = FakeUpstream(fail=lambda job_id, n: True)
    bench = queue_bench(up, max_deliveries=3)
    q = QueueClient(redis_async)
    job = await q.submit(BODY)
    await bench.start()
    try:
        res = await q.wait(job, timeout=20)
    finally:
        await bench.stop()
    assert res.status == "error"
    assert res.error is not None
    assert res.error["code"] == 502
    assert up.calls[job.id] == 3
    (dead,) = [fields(f) for _, f in await redis_async.xrange("routerd:dead")]
    assert "delivered 3 times" in dead["reason"]
    history = msgspec.json.decode(dead["history"])
    assert [h["delivery"] for h in history] == [1, 2, 3]
    assert all("connection refused" in h["error"] for h in history)
    assert msgspec.json.decode(dead["job"])["id"] == job.id  # the original message is kept


async def test_deadline_passed_gets_error_and_no_engine_slot(redis_server: RedisServer,
                                                             queue_bench: QueueBenchFactory,
                                                             redis_async: aioredis.Redis) -> None:
    bench = queue_bench()
    q = QueueClient(redis_async)
    expired = await q.submit(BODY, deadline_ms=int(time.time() * 1000) - 1)
    relative_ok = await q.submit(BODY, deadline_ms=60_000)  # < 1e11: ms after enqueueing
    await bench.start()
    try:
        res = await q.wait(expired, timeout=10)
        ok = await q.wait(relative_ok, timeout=10)
    finally:
        await bench.stop()
    assert res.status == "error"
    assert res.error is not None
    assert res.error["code"] == 504
    assert ok.status == "ok"
    assert expired.id not in bench.upstream.calls
    # Refused by admission, as an HTTP request would be: counted both ways in, with no instance.
    metrics = Metrics(bench.telemetry, []).render().decode()
    assert 'routerd_requests_total{code="504",fleet="f",instance="",' \
        'route="/v1/completions"} 1.0' in metrics


async def test_deadline_passing_during_run(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                           redis_async: aioredis.Redis) -> None:
    bench = queue_bench(FakeUpstream(delay_s=5))
    q = QueueClient(redis_async)
    job = await q.submit(BODY, deadline_ms=300)
    await bench.start()
    try:
        res = await q.wait(job, timeout=10)
    finally:
        await bench.stop()
    assert res.status == "error"
    assert res.error is not None
    assert res.error["code"] == 504


async def test_cancel_before_and_during_run(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                            redis_async: aioredis.Redis) -> None:
    hold = asyncio.Event()
    bench = queue_bench(FakeUpstream(hold=hold))
    q = QueueClient(redis_async)
    before = await q.submit(BODY)
    await q.cancel(before)
    during = await q.submit(BODY)
    await bench.start()
    try:
        await until(lambda: _running(q, during.id))
        await until(lambda: bench.called(during.id))
        await q.cancel(during)
        r_during = await q.wait(during, timeout=10)
        r_before = await q.wait(before, timeout=10)
        hold.set()
    finally:
        await bench.stop()
    assert r_before.status == "error"
    assert r_before.error is not None
    assert r_before.error["code"] == 499
    assert r_during.status == "error"
    assert r_during.error is not None
    assert r_during.error["code"] == 499
    assert before.id not in bench.upstream.calls
    assert len(await results_in(redis_async, during.reply_to)) == 1


async def _running(q: QueueClient, job_id: str) -> bool:
    return (await q.status(job_id)).state == "running"


async def test_streamed_job_chunks_in_order_then_result(redis_server: RedisServer,
                                                        queue_bench: QueueBenchFactory,
                                                        redis_async: aioredis.Redis) -> None:
    bench = queue_bench()
    q = QueueClient(redis_async)
    job = await q.submit({**BODY, "max_tokens": 20, "stream": True})
    await bench.start()
    try:
        items = [item async for item in q.chunks(job, timeout=10)]
    finally:
        await bench.stop()
    *chunks, result = items
    assert [c.seq for c in chunks] == list(range(20))  # type: ignore[union-attr]
    assert [c.data["choices"][0]["text"] for c in chunks] == [f"t{i}" for i in range(20)]  # type: ignore[union-attr]
    assert result.status == "ok"
    assert result.response["chunks"] == 20
    raw = await redis_async.xrange(job.reply_to)
    assert b"result" in raw[-1][1]
    assert all(b"chunk" in f for _, f in raw[:-1])


async def test_crashed_consumer_jobs_are_recovered_exactly_once(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    hold = asyncio.Event()
    up1 = FakeUpstream(hold=hold)
    first = queue_bench(up1, consumer="c1")
    q = QueueClient(redis_async)
    jobs = await q.submit_many([BODY] * 40, reply_to="replies")
    await first.start()
    await until(lambda: _held(first, 40))
    await first.crash()  # 40 jobs read, none acknowledged
    info = await redis_async.xpending("routerd:requests", "routerd")
    assert info["pending"] == 40
    # Another daemon (different name) takes them over after reclaim_idle_ms; the first comes back too.
    other = queue_bench(consumer="c2")
    again = queue_bench(consumer="c1")
    await other.start()
    await again.start()
    try:
        results = await q.wait_many(jobs, timeout=20)
    finally:
        await other.stop()
        await again.stop()
    assert all(r.status == "ok" for r in results.values())
    in_stream = await results_in(redis_async, "replies")
    assert sorted(r["id"] for r in in_stream) == sorted(j.id for j in jobs)
    total = other.ingress.stats["done"] + again.ingress.stats["done"]
    assert total >= 40
    assert other.ingress.stats["reclaimed"] + again.ingress.stats["reclaimed"] >= 40


async def _held(bench: QueueBench, n: int) -> bool:
    return bench.ingress.held >= n and sum(bench.upstream.calls.values()) >= n


async def test_result_record_matches_reply(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                           redis_async: aioredis.Redis) -> None:
    bench = queue_bench(result_ttl_s=100)
    q = QueueClient(redis_async)
    job = await q.submit(BODY)
    await bench.start()
    try:
        res = await q.wait(job, timeout=10)
    finally:
        await bench.stop()
    stored = decode_result(await redis_async.get(f"routerd:done:{job.id}"))
    assert stored == res
    for key in (f"routerd:done:{job.id}", job.reply_to, f"routerd:job:{job.id}"):
        assert 0 < await redis_async.ttl(key) <= 100


class _Exploding(FakeUpstream):
    """An upstream with a bug for one job: the consumer must contain it, not die of it."""

    async def forward(self, fleet: str, endpoint: str, body: bytes, sink: Any, *, stream: bool,
                      request_id: str, request: Any = None, **_: Any) -> Any:
        if b"boom" in body:
            self.calls[request_id] += 1
            raise ValueError("a bug triggered by this job")
        return await super().forward(fleet, endpoint, body, sink, stream=stream, request_id=request_id)


async def test_a_job_that_crashes_the_consumer_ends_dead_with_history(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    up = _Exploding()
    bench = queue_bench(up, max_deliveries=2, reclaim_idle_ms=200)
    q = QueueClient(redis_async)
    bad = await q.submit({**BODY, "prompt": "boom"})
    good = await q.submit_many([BODY] * 20)
    await bench.start()
    try:
        res = await q.wait(bad, timeout=20)
        assert all(r.status == "ok" for r in (await q.wait_many(good, timeout=10)).values())
    finally:
        await bench.stop()
    assert res.status == "error"
    assert up.calls[bad.id] == 2  # reclaimed once, then dead at max_deliveries
    (dead,) = [fields(f) for _, f in await redis_async.xrange("routerd:dead")]
    assert "delivered 2 times" in dead["reason"]
    assert ["a bug triggered" in h["error"] for h in msgspec.json.decode(dead["history"])] == [True, True]


async def test_stop_intake_finishes_in_flight_and_reads_no_more(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    hold = asyncio.Event()
    bench = queue_bench(FakeUpstream(hold=hold))
    q = QueueClient(redis_async)
    first = await q.submit_many([BODY] * 5)
    await bench.start()
    await until(lambda: _held(bench, 5))
    bench.ingress.stop_intake()
    later = await q.submit_many([BODY] * 5)
    await asyncio.sleep(0.5)
    assert not await bench.ingress.wait_idle(0.1)  # the five are still running
    hold.set()
    assert await bench.ingress.wait_idle(5)
    assert bench.task is not None
    await asyncio.wait_for(bench.task, 5)  # run() returns once idle after stop_intake
    assert all(r.status == "ok" for r in (await q.wait_many(first, timeout=1)).values())
    assert [(await q.status(j)).state for j in later] == ["queued"] * 5  # left for the next start
    again = queue_bench()  # the same consumer name
    await again.start()
    try:
        assert all(r.status == "ok" for r in (await q.wait_many(later, timeout=10)).values())
    finally:
        await again.stop()
    assert sum(bench.upstream.calls.values()) == 5


async def test_unusable_reply_to_fails_only_its_own_job(redis_server: RedisServer,
                                                       queue_bench: QueueBenchFactory,
                                                       redis_async: aioredis.Redis) -> None:
    """A reply_to that stops taking XADD mid-run (its key became a string) must not fail the other
    jobs whose results or chunks go to Redis in the same batch (they would be run by the engine
    again), and its own job is dead-lettered at once with the real reason, streamed or not."""
    hold = asyncio.Event()
    up = FakeUpstream(hold=hold)
    bench = queue_bench(up)
    q = QueueClient(redis_async)
    streamed = {**BODY, "stream": True, "max_tokens": 4}
    bad = await q.submit(BODY, reply_to="becomes-a-string")
    bad_stream = await q.submit(streamed, reply_to="becomes-a-string")
    good = await q.submit_many([BODY] * 5, reply_to="replies")
    good_stream = await q.submit_many([streamed] * 3)
    await bench.start()
    try:
        await until(_calls_at_least(up, 10))
        await asyncio.sleep(0.2)  # the streams wrote their first chunk and hold after it
        await redis_async.set("becomes-a-string", "x")  # SET replaces the reply stream
        hold.set()
        results = await q.wait_many(good + good_stream, timeout=10)
        await until(lambda: xlen_at_least(redis_async, "routerd:dead", 2))
    finally:
        await bench.stop()
    assert all(r.status == "ok" for r in results.values())
    assert all(up.calls[j.id] == 1 for j in good + good_stream)  # none run twice
    assert up.calls[bad.id] == up.calls[bad_stream.id] == 1  # no redelivery for what cannot succeed
    for job in good_stream:
        chunks = [i async for i in q.chunks(job, timeout=5)]
        assert len(chunks) == 5  # 4 chunks and the result
    dead = {d["entry"]: d for d in (fields(f) for _, f in await redis_async.xrange("routerd:dead"))}
    assert "WRONGTYPE" in dead[bad.entry]["reason"]
    assert "refused a chunk: WRONGTYPE" in dead[bad_stream.entry]["reason"]
    assert dead[bad_stream.entry]["deliveries"] == "1"
    stored = await q.result(bad.id)  # the result itself is kept in the job's done record
    assert stored is not None
    assert stored.status == "ok"
    stored = await q.result(bad_stream.id)
    assert stored is not None
    assert stored.status == "error"
    assert "refused a chunk" in stored.error["message"]
    assert await redis_async.xlen("routerd:requests") == 0


def _calls_at_least(up: FakeUpstream, n: int) -> Any:
    async def pred() -> bool:
        return sum(up.calls.values()) >= n
    return pred


class _SlowToUnwind(FakeUpstream):
    """An engine call that needs a moment to clean up when cancelled (closing its connection)."""

    async def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().forward(*args, **kwargs)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)
            raise


async def test_stopped_consumer_leaves_no_job_task_behind(redis_server: RedisServer,
                                                          queue_bench: QueueBenchFactory,
                                                          redis_async: aioredis.Redis) -> None:
    hold = asyncio.Event()
    bench = queue_bench(_SlowToUnwind(hold=hold))
    q = QueueClient(redis_async)
    await q.submit_many([BODY] * 5, reply_to="replies")
    await bench.start()
    await until(lambda: _held(bench, 5))
    await bench.crash()
    assert bench.ingress.held == 0  # every job task was cancelled *and* awaited by run()
    assert bench.admission.stats("f")["active"] == 0  # and gave its slot back


async def test_jobs_running_through_a_drain_are_not_taken_over(redis_server: RedisServer,
                                                              queue_bench: QueueBenchFactory,
                                                              redis_async: aioredis.Redis) -> None:
    """Draining can outlast reclaim_idle_ms: a job still running here must stay ours, not be
    XAUTOCLAIMed and run a second time by another consumer."""
    hold = asyncio.Event()
    # 3 s of idle time (not the fixture's 0.5 s): a test process starved for a second must not make the
    # keep-alive look broken.
    draining = queue_bench(FakeUpstream(hold=hold), consumer="c1", reclaim_idle_ms=3000)
    other = queue_bench(consumer="c2", reclaim_idle_ms=3000)
    q = QueueClient(redis_async)
    job = await q.submit(BODY)
    await draining.start()
    await until(lambda: _held(draining, 1))
    await other.start()
    draining.ingress.stop_intake()
    try:
        await asyncio.sleep(3.5)  # longer than reclaim_idle_ms and a reclaim pass
        hold.set()
        res = await q.wait(job, timeout=10)
    finally:
        hold.set()
        await draining.stop()
        await other.stop()
    assert res.status == "ok"
    assert draining.upstream.calls[job.id] == 1
    assert job.id not in other.upstream.calls
