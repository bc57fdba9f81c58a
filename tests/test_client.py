"""The producers' client and ``routerd submit`` against a real Redis and a running consumer."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import structlog

from routerd.client import NotDurable, QueueClient
from routerd.submit import submit_main
from tests.fixtures.helpers import until
from tests.fixtures.redis_server import FakeUpstream, QueueBenchFactory, RedisServer

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


async def test_status_follows_a_job_from_queued_to_done(redis_server: RedisServer,
                                                        queue_bench: QueueBenchFactory,
                                                        redis_async: aioredis.Redis) -> None:
    hold = asyncio.Event()
    bench = queue_bench(FakeUpstream(hold=hold))
    q = QueueClient(redis_async)
    assert (await q.status("never-submitted")).state == "unknown"
    job = await q.submit({**BODY, "stream": True})
    assert (await q.status(job)).state == "queued"
    await bench.start()
    try:
        for _ in range(200):
            st = await q.status(job)
            if st.state == "running" and st.instance:
                break
            await asyncio.sleep(0.02)
        assert st.state == "running"
        assert st.consumer == "c1"
        assert st.instance == "f:0"  # known from the engine's first byte (the upstream's header)
        assert await q.result(job.id) is None
        hold.set()
        result = await q.wait(job, timeout=10)
    finally:
        hold.set()
        await bench.stop()
    done = await q.status(job)
    assert done.state == "done"
    assert done.result == result
    assert result.response["chunks"] == 3


async def test_wait_times_out_without_a_consumer(redis_async: aioredis.Redis) -> None:
    q = QueueClient(redis_async)
    job = await q.submit(BODY)
    with pytest.raises(TimeoutError):
        await q.wait(job, timeout=0.3)
    with pytest.raises(TimeoutError, match="1 of 1 results missing"):
        await q.wait_many([job], timeout=0.2)


async def test_chunks_deadline_is_a_timeout_even_while_the_caller_works(
        redis_async: aioredis.Redis) -> None:
    """The deadline passing while the caller handles a chunk must surface as TimeoutError from the
    iterator, never as a stray cancellation of the caller's task."""
    q = QueueClient(redis_async)
    job = await q.submit({**BODY, "stream": True})
    for seq in range(3):  # a run that never finishes: chunks, no result
        await redis_async.xadd(job.reply_to, {"chunk": msgspec.json.encode(
            {"id": job.id, "seq": seq, "delivery": 1, "data": {"n": seq}})})
    seen: list[Any] = []

    async def consume() -> None:
        async for item in q.chunks(job, timeout=0.3):
            seen.append(item)
            await asyncio.sleep(0.2)  # the caller's own work

    with pytest.raises(TimeoutError):
        await consume()
    assert len(seen) >= 1
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_submit_wire_format_is_the_interface(redis_async: aioredis.Redis) -> None:
    q = QueueClient(redis_async)
    chat = await q.submit({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                          priority=3, deadline_ms=5000, encoding="msgpack")
    plain = await q.submit(BODY, job_id="my-id", reply_to="my-replies")
    entries = await redis_async.xrange("routerd:requests")
    first = msgspec.msgpack.decode(entries[0][1][b"job"])
    second = msgspec.json.decode(entries[1][1][b"job"])
    assert first == {"id": chat.id, "endpoint": "/v1/chat/completions", "reply_to": chat.reply_to,
                     "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                     "priority": 3, "deadline_ms": 5000}
    assert second["id"] == "my-id"
    assert second["reply_to"] == "my-replies"
    assert second["endpoint"] == "/v1/completions"
    assert plain.entry == entries[1][0].decode()


async def test_routerd_submit_command(redis_server: RedisServer, redis_async: aioredis.Redis,
                                      queue_bench: QueueBenchFactory,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    bench = queue_bench()
    await bench.start()
    # The consumer runs in this process: its log lines (one per job) are kept off the stdout under test.
    try:
        with structlog.testing.capture_logs():
            code = await asyncio.to_thread(submit_main, ["--redis", redis_server.url, "--model", "m",
                                                         "--wait", "--timeout", "10", "say hi"])
            out = capsys.readouterr().out
            assert code == 0
            result = msgspec.json.decode(out.strip().splitlines()[-1])
            assert result["status"] == "ok"
            assert result["response"]["choices"][0]["text"] == "echo:say hi"
            code = await asyncio.to_thread(submit_main, ["--redis", redis_server.url, "--model", "m",
                                                         "--wait", "--stream", "--max-tokens", "4", "s"])
            lines = capsys.readouterr().out.strip().splitlines()
            assert code == 0
            assert [msgspec.json.decode(x)["choices"][0]["text"] for x in lines[:-1]] == [
                "t0", "t1", "t2", "t3"]
            assert msgspec.json.decode(lines[-1])["response"]["chunks"] == 4
            code = await asyncio.to_thread(submit_main, ["--redis", redis_server.url, "--model", "m", "x"])
            job_id = capsys.readouterr().out.strip()
            assert code == 0
            assert len(job_id) == 32
    finally:
        await bench.stop()


async def test_a_result_stored_twice_is_kept_as_first_seen(queue_bench: QueueBenchFactory,
                                                           redis_async: aioredis.Redis) -> None:
    """A failover can lose a job's stored result with the old master, and routerd runs the job again: a
    second result with the same job id. The client that saw the first keeps answering it."""
    bench = queue_bench(FakeUpstream(fail=lambda job_id, n: n > 1))  # the second run fails
    q = QueueClient(redis_async)
    job = await q.submit(BODY, job_id="twice")
    await bench.start()
    try:
        first = await q.wait(job, timeout=10)
        assert first.status == "ok"
        await redis_async.delete(q.keys.done(job.id))  # lost with the old master
        await q.submit(BODY, job_id=job.id)  # ... and the job run again
        await until(lambda: _results_on(redis_async, job.reply_to, 2), 30, "the second result")
    finally:
        await bench.stop()
    assert (await QueueClient(redis_async).result(job.id)).status == "error"  # what Redis holds now
    assert await q.result(job.id) is first
    assert await q.wait(job, timeout=5) is first
    assert (await q.wait_many([job], timeout=5))[job.id] is first
    assert (await q.status(job)).result is first


async def _results_on(r: aioredis.Redis, stream: str, n: int) -> bool:
    return sum(b"result" in fields for _, fields in await r.xrange(stream)) >= n


async def test_a_durable_submit_no_replica_confirms_raises_not_durable(redis_async: aioredis.Redis) -> None:
    """``durable=True`` waits for a replica (``WAIT``); with none, NotDurable names the jobs, queued."""
    q = QueueClient(redis_async, op_timeout_s=0.3)
    with pytest.raises(NotDurable) as raised:
        await q.submit_many([BODY, BODY], durable=True)
    assert raised.value.replicas == 0
    assert len(raised.value.jobs) == 2
    assert await redis_async.xlen(q.keys.stream) == 2
    assert [j.id for j in raised.value.jobs] == [
        msgspec.json.decode(f[b"job"])["id"] for _, f in await redis_async.xrange(q.keys.stream)]
