"""Poison in Redis: whatever a producer can XADD, PUBLISH or SET must not make the consumer raise in a
loop, redeliver forever or stop. Every message that can never run is dead-lettered on its first
delivery with a reason that says why, gets an error result when its id is readable, and never reaches
an engine; the consumer keeps serving good jobs meanwhile. Messages go in with plain redis-py, raw.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from routerd.client import QueueClient
from routerd.redis_keys import RedisKeys
from tests.fixtures.helpers import until
from tests.fixtures.redis_server import (
    FakeForwardResult,
    FakeUpstream,
    QueueBenchFactory,
    RedisServer,
    fields,
    xlen_at_least,
)

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}
DEEP = 100_000


def _json(job_id: str, reply_to: str, body: bytes) -> bytes:
    return (b'{"id":"' + job_id.encode() + b'","endpoint":"/v1/completions","body":' + body
            + b',"reply_to":"' + reply_to.encode() + b'"}')


def _msgpack_deep(job_id: str, reply_to: str) -> bytes:
    """A msgpack job whose body holds arrays nested DEEP levels (id and reply_to after it)."""
    enc = msgspec.msgpack.encode
    return (b"\x84" + enc("endpoint") + enc("/v1/completions") + enc("body") + b"\x81" + enc("x")
            + b"\x91" * DEEP + b"\x01" + enc("id") + enc(job_id) + enc("reply_to") + enc(reply_to))


# (name, raw job field, salvaged id or None, reply_to or None, words the reason must hold)
POISON: list[tuple[str, bytes, str | None, str | None, str]] = [
    ("non-utf8 prompt", _json("p1", "r1", b'{"model":"m","prompt":"\xff\xfe"}'), "p1", "r1", "not UTF-8"),
    ("json 100k deep", _json("p2", "r2", b'{"model":"m","prompt":' + b"[" * DEEP + b"]" * DEEP + b"}"),
     "p2", "r2", "nested too deeply"),
    ("msgpack 100k deep", _msgpack_deep("p3", "r3"), "p3", "r3", "nested too deeply"),
    ("non-utf8 id", b'{"id":"\xff","endpoint":"/v1/completions","body":{},"reply_to":"r4"}', None, None,
     "not UTF-8"),
    ("wrong types", msgspec.json.encode({"id": 5, "endpoint": "/v1/completions", "body": BODY,
                                         "reply_to": ["x"]}), None, None, "Expected `str`"),
    ("body not an object", msgspec.json.encode({"id": "p6", "endpoint": "/v1/completions",
                                                "body": "hi", "reply_to": "r6"}), "p6", "r6",
     "Expected `object`"),
    ("priority not an int", msgspec.json.encode({"id": "p7", "endpoint": "/v1/completions", "body": BODY,
                                                 "reply_to": "r7", "priority": "high"}), "p7", "r7",
     "priority"),
    ("no endpoint", msgspec.json.encode({"id": "p8", "body": BODY, "reply_to": "r8"}), "p8", "r8",
     "endpoint"),
    ("msgpack ext in body", msgspec.msgpack.encode({
        "id": "p9", "endpoint": "/v1/completions", "reply_to": "r9",
        "body": {**BODY, "x": msgspec.msgpack.Ext(1, b"ab")}}), "p9", "r9", "cannot be sent as JSON"),
    ("reply_to is the request stream", msgspec.json.encode({
        "id": "p10", "endpoint": "/v1/completions", "body": BODY, "reply_to": "routerd:requests"}),
     "p10", None, "routerd's own key: the request stream"),
    # Python's json.dumps writes NaN; the id and reply_to before it are readable, so it gets its result
    ("json NaN after the id", b'{"id":"p11","reply_to":"r11","endpoint":"/v1/completions",'
     b'"body":{"model":"m","prompt":"hi","temperature":NaN}}', "p11", "r11", "not valid JSON"),
    # msgpack bin used to reach the engine base64-encoded, as the prompt, and come back "ok"
    ("msgpack bytes prompt", msgspec.msgpack.encode({
        "id": "p12", "endpoint": "/v1/completions", "reply_to": "r12",
        "body": {"model": "m", "prompt": b"hello"}}), "p12", "r12", "body.prompt: msgpack bin (bytes)"),
    ("msgpack bytes content", msgspec.msgpack.encode({
        "id": "p13", "endpoint": "/v1/chat/completions", "reply_to": "r13",
        "body": {"model": "m", "messages": [{"role": "user", "content": b"hi"}]}}), "p13", "r13",
     "body.messages[0].content: msgpack bin (bytes)"),
    ("msgpack NaN", msgspec.msgpack.encode({
        "id": "p14", "endpoint": "/v1/completions", "reply_to": "r14",
        "body": {**BODY, "temperature": float("nan")}}), "p14", "r14", "body.temperature: nan"),
    ("msgpack int key", msgspec.msgpack.encode({
        "id": "p15", "endpoint": "/v1/completions", "reply_to": "r15",
        "body": {**BODY, "logit_bias": {50256: -100}}}), "p15", "r15", "body.logit_bias: a key of type int"),
    ("invalid job, reply_to routerd's", msgspec.json.encode({
        "id": "p16", "endpoint": "/v1/completions", "body": "hi", "reply_to": "routerd:usage:2099-01-01"}),
     "p16", None, "Expected `object`"),
]


async def test_every_poison_message_is_dead_on_first_delivery_with_its_reason(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """Non-UTF-8 bytes and 100,000-deep nesting used to raise out of the decoder on every delivery:
    reclaimed forever, never dead-lettered, no result for the producer."""
    entries = {}
    for name, raw, *_ in POISON:
        entries[name] = (await redis_async.xadd("routerd:requests", {"job": raw})).decode()
    entries["no job field"] = (await redis_async.xadd("routerd:requests", {"jb": b"1"})).decode()
    bench = queue_bench(max_deliveries=3, reclaim_idle_ms=200)
    q = QueueClient(redis_async)
    await bench.start()
    try:
        good = await q.submit_many([BODY] * 5)
        assert all(r.status == "ok" for r in (await q.wait_many(good, timeout=10)).values())
        await until(lambda: xlen_at_least(redis_async, "routerd:dead", len(entries)), timeout=15)
        await asyncio.sleep(1.0)  # several reclaim periods: nothing comes back
    finally:
        await bench.stop()
    dead = {d["entry"]: d for d in (fields(f) for _, f in await redis_async.xrange("routerd:dead"))}
    assert len(dead) == len(entries)
    for name, _, job_id, reply_to, words in POISON:
        d = dead[entries[name]]
        assert words in d["reason"], (name, d["reason"])
        assert d["deliveries"] == "1", name
        if job_id is None:
            continue
        stored = await q.result(job_id)  # the error result, where wait_many and status find it
        assert stored is not None, name
        assert stored.status == "error"
        assert stored.error is not None
        assert words in stored.error["message"]
        assert stored.error["code"] == 400
        if reply_to is not None:
            assert (await q.wait(job_id, reply_to=reply_to, timeout=5)).status == "error", name
    assert "no `job` field" in dead[entries["no job field"]]["reason"]
    assert set(bench.upstream.calls) == {j.id for j in good}  # no poison reached an engine
    assert await redis_async.xlen("routerd:requests") == 0  # nothing left to redeliver
    assert bench.ingress.stats["dead"] == len(entries)


# The client's own family: reply streams, a batch's results among them (the batch runner is a producer).
CLIENTS_OWN = ("reply", "batch_results")


def _every_key(keys: RedisKeys, job_id: str = "x1") -> dict[str, str]:
    """Every name :class:`RedisKeys` gives, found by looking at the class: a key family added later is
    covered without touching this test."""
    names = {}
    for attr in dir(RedisKeys):
        if attr.startswith("_") or attr in ("from_config", "for_stream", "reserved", "elsewhere", "tagged",
                                            "group"):  # group: not a key; the others: not names
            continue
        value = getattr(keys, attr)
        if callable(value):  # a key family takes its suffix (a file's piece: its id and number); a single
            # key (the shared view's) none
            params = inspect.signature(value).parameters
            value = value(*([job_id, 0][:len(params)]))
        assert isinstance(value, str), attr
        names[attr] = value
    assert {"done", "status", "ratelimit", "usage", "dead", "stream"} <= set(names)
    return names


def test_every_key_routerd_owns_is_reserved_and_only_the_clients_reply_is_not() -> None:
    for keys in (RedisKeys(), RedisKeys(stream="acme:jobs:in", dead="acme-dead"),
                 RedisKeys(stream="solo", dead="x"), RedisKeys.for_stream("routerd:requests", cluster=True)):
        every = _every_key(keys)
        if keys.tagged:  # [redis] cluster: every name in the one slot of the tag, none "elsewhere"
            assert {keys.elsewhere(name) for name in every.values()} == {None}, every
        for attr, name in every.items():
            why = keys.reserved(name)
            if attr in CLIENTS_OWN:
                assert why is None, name
            else:
                assert why is not None, (attr, name)
        assert keys.reserved(keys.usage("2026-01-01") + ":more") is not None
        assert keys.reserved(keys.ns + "x:done:1") is None  # another namespace
    assert RedisKeys().reserved("elsewhere") is None
    assert RedisKeys().reserved("routerd") is not None  # the namespace itself


async def test_reply_to_naming_a_key_routerd_owns_is_dead_without_touching_it(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """``reply_to: routerd:ratelimit:<tenant>`` turned the bucket into a stream (every rate-limit call
    then failed WRONGTYPE, for every routerd). Every key family is refused; each job is dead-lettered
    with the reason and its error result is stored, and nothing is written to the key it named."""
    keys = RedisKeys()
    await redis_async.hset(keys.ratelimit("default"), mapping={"r": "5", "t": "0", "ts": "1"})
    await redis_async.hset(keys.usage("2026-01-01"), "default|f|requests", "3")
    names = {attr: name for attr, name in _every_key(keys, "victim").items() if attr not in CLIENTS_OWN}
    before = {name: await redis_async.type(name) for name in names.values()}
    q = QueueClient(redis_async)
    with pytest.raises(ValueError, match="routerd's own key"):
        await q.submit(BODY, reply_to=keys.ratelimit("default"))  # the client refuses it; raw XADD:
    jobs = {}
    for attr, name in names.items():
        raw = msgspec.json.encode({"id": f"own-{attr}", "endpoint": "/v1/completions", "body": BODY,
                                   "reply_to": name})
        jobs[attr] = (f"own-{attr}", (await redis_async.xadd("routerd:requests", {"job": raw})).decode())
    bench = queue_bench()
    await bench.start()
    try:
        good = await q.submit(BODY)
        assert (await q.wait(good, timeout=10)).status == "ok"
        await until(lambda: xlen_at_least(redis_async, "routerd:dead", len(jobs)), timeout=15)
    finally:
        await bench.stop()
    assert bench.upstream.calls == {good.id: 1}
    dead = {d["entry"]: d for d in (fields(f) for _, f in await redis_async.xrange("routerd:dead"))}
    for attr, (job_id, entry) in jobs.items():
        assert "routerd's own key" in dead[entry]["reason"], attr
        stored = await q.result(job_id)
        assert stored is not None, attr
        assert stored.error is not None
        assert stored.error["code"] == 400
    for attr, name in names.items():
        if attr in ("stream", "dead", "consumer_names"):
            continue  # streams, which the queue itself writes, and the consumers' names it lists
        assert await redis_async.type(name) == before[name], (attr, name)
    assert await redis_async.hget(keys.ratelimit("default"), "r") == b"5"


async def test_reply_to_that_is_not_a_stream_is_refused_before_the_engine(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """A streamed job whose reply_to holds a string called the engine 5 times over ~50 s and then died
    with a generic reason; now both kinds die at once, with the real reason, and no engine call."""
    await redis_async.set("a-string", "x")
    await redis_async.hset("a-hash", "k", "v")
    bench = queue_bench()
    q = QueueClient(redis_async)
    plain = await q.submit(BODY, reply_to="a-string")
    streamed = await q.submit({**BODY, "stream": True}, reply_to="a-string")
    hashed = await q.submit({**BODY, "stream": True}, reply_to="a-hash")
    await bench.start()
    try:
        good = await q.submit({**BODY, "stream": True})
        assert (await q.wait(good, timeout=10)).status == "ok"
        await until(lambda: xlen_at_least(redis_async, "routerd:dead", 3), timeout=15)
        # The producer's own wait on such a reply_to ends with the stored error, not WRONGTYPE.
        waited = await q.wait(streamed, timeout=5)
    finally:
        await bench.stop()
    assert waited.status == "error"
    assert bench.upstream.calls == {good.id: 1}
    dead = {d["entry"]: d for d in (fields(f) for _, f in await redis_async.xrange("routerd:dead"))}
    assert "'a-string' holds a string, not a stream" in dead[plain.entry]["reason"]
    assert "'a-string' holds a string, not a stream" in dead[streamed.entry]["reason"]
    assert "'a-hash' holds a hash, not a stream" in dead[hashed.entry]["reason"]
    assert {d["deliveries"] for d in dead.values()} == {"1"}
    for job in (plain, streamed, hashed):
        stored = await q.result(job.id)
        assert stored is not None
        assert stored.status == "error"
    assert await redis_async.get("a-string") == b"x"  # the producer's key is left as it was


async def test_wrong_typed_per_job_keys_fail_nobody(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                                    redis_async: aioredis.Redis) -> None:
    """A producer can create keys in routerd's namespace (a job's status hash, history list, chunk
    cursor) with the wrong type. A script step that raised on one used to abort the whole batch:
    every other job in it failed, was run again, and failed again."""
    q = QueueClient(redis_async)
    odd = await q.submit_many([{**BODY, "stream": True}] * 2 + [BODY] * 2)
    for job in odd:
        await redis_async.delete(f"routerd:job:{job.id}")
        await redis_async.rpush(f"routerd:job:{job.id}", "not a hash")
        await redis_async.hset(f"routerd:chunks:{job.id}", "not", "a string")
        await redis_async.set(f"routerd:history:{job.id}", "not a list")
    await redis_async.set(f"routerd:chunks:{odd[1].id}", "garbage cursor")
    others = await q.submit_many([{**BODY, "stream": True}] * 10 + [BODY] * 10)
    up = FakeUpstream()
    bench = queue_bench(up)
    await bench.start()
    try:
        results = await q.wait_many(odd + others, timeout=10)
    finally:
        await bench.stop()
    assert all(r.status == "ok" for r in results.values())
    assert all(up.calls[j.id] == 1 for j in odd + others)  # none run twice
    for job in odd[:2]:
        chunks = [i async for i in q.chunks(job, timeout=5)]
        assert len(chunks) == 4  # 3 chunks and the result
    assert await redis_async.xlen("routerd:dead") == 0


async def test_extreme_numbers_get_a_result(queue_bench: QueueBenchFactory, redis_server: RedisServer,
                                            redis_async: aioredis.Redis) -> None:
    """Priorities and deadlines at the ends of 64 bits: a result each, nothing raises in the consumer."""
    q = QueueClient(redis_async)
    far = await q.submit(BODY, deadline_ms=2**64 - 1, priority=2**63 - 1)
    past = await q.submit(BODY, deadline_ms=-(2**63), priority=-(2**63))
    huge = msgspec.json.encode({"id": "huge", "endpoint": "/v1/completions", "body": BODY,
                                "reply_to": "rh"}).replace(b'"body"', b'"priority":' + b"9" * 40 + b',"body"')
    await redis_async.xadd("routerd:requests", {"job": huge})
    bench = queue_bench()
    await bench.start()
    try:
        results = await q.wait_many([far, past, "huge"], timeout=10)
    finally:
        await bench.stop()
    assert results[far.id].status == "ok"
    assert results[past.id].error is not None
    assert results[past.id].error["type"] == "DeadlineExceededError"
    assert results["huge"].status == "ok"  # a 40-digit priority is just very urgent
    assert bench.upstream.calls == {far.id: 1, "huge": 1}


class _GarbledEngine(FakeUpstream):
    """An engine whose answers hold bytes that are not UTF-8, and JSON nested too deep to decode."""

    async def forward(self, fleet: str, endpoint: str, body: bytes, sink: Any, *, stream: bool,
                      request_id: str, request: Any = None, **_: Any) -> Any:
        self.calls[request_id] += 1
        if stream:
            await sink.start(200, {"content-type": "text/event-stream"})
            await sink.write(b'data: {"choices": [{"text": "\xff"}]}\n\n')
            await sink.write(b"data: " + b"[" * DEEP + b"]" * DEEP + b"\n\ndata: [DONE]\n\n")
        else:
            await sink.start(200, {"content-type": "application/json"})
            await sink.write(b'{"choices": [{"text": "\xff"}]}')
        return FakeForwardResult(instance=f"{fleet}:0", attempts=1, status=200, ok=True, error=None)


async def test_engine_bytes_that_do_not_decode_end_the_job_once(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """Such an answer used to raise out of the sink: the job crashed, was reclaimed and run again."""
    up = _GarbledEngine()
    bench = queue_bench(up)
    q = QueueClient(redis_async)
    plain = await q.submit(BODY)
    streamed = await q.submit({**BODY, "stream": True})
    await bench.start()
    try:
        items = [i async for i in q.chunks(streamed, timeout=10)]
        result = await q.wait(plain, timeout=10)
    finally:
        await bench.stop()
    assert result.error is not None
    assert "not valid JSON" in result.error["message"]
    assert len(items) == 3  # both events, passed on as text, and the result
    assert items[-1].status == "ok"  # type: ignore[union-attr]
    assert (up.calls[plain.id], up.calls[streamed.id]) == (1, 1)


async def test_garbage_on_the_cancel_channel_does_not_stop_the_consumer(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """Anyone can PUBLISH on the cancel channel; bytes that are not UTF-8 used to raise out of the
    listener and end the whole consumer (and with it the daemon)."""
    hold = asyncio.Event()
    bench = queue_bench(FakeUpstream(hold=hold))
    q = QueueClient(redis_async)
    await bench.start()
    try:
        running = await q.submit(BODY)
        await until(lambda: bench.called(running.id), timeout=15)
        assert await redis_async.publish("routerd:cancel", b"\xff\xfe") == 1
        await q.cancel(running)  # the listener still works: this cancel reaches the running job
        res = await q.wait(running, timeout=5)
        hold.set()
        after = await q.submit(BODY)
        assert (await q.wait(after, timeout=5)).status == "ok"
    finally:
        await bench.stop()
    assert res.error is not None
    assert res.error["code"] == 499
    assert bench.task is not None
    assert bench.task.exception() is None


async def test_a_job_id_on_the_cancel_channel_without_its_cancel_key_cancels_nothing(
        queue_bench: QueueBenchFactory, redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """Whoever may PUBLISH on the cancel channel (every producer, under ``routerd redis-acl``) used to
    cancel any running job by naming it; a cancel is now one whose key (``<ns>:cancel:<id>``, which a
    producer's ACL lets it set for its own jobs only) is set too."""
    hold = asyncio.Event()
    bench = queue_bench(FakeUpstream(hold=hold))
    q = QueueClient(redis_async)
    await bench.start()
    try:
        theirs, mine = await q.submit(BODY), await q.submit(BODY)
        await until(lambda: bench.called(theirs.id), timeout=15)
        await until(lambda: bench.called(mine.id), timeout=15)
        assert await redis_async.publish("routerd:cancel", theirs.id) == 1  # a name, no key
        await q.cancel(mine)  # key and name: handled after the bare name, in order
        cancelled = await q.wait(mine, timeout=5)
        hold.set()
        served = await q.wait(theirs, timeout=5)
    finally:
        await bench.stop()
    assert cancelled.error is not None
    assert cancelled.error["code"] == 499
    assert served.status == "ok", served


async def test_unreadable_entries_on_a_shared_reply_stream_are_skipped(queue_bench: QueueBenchFactory,
        redis_server: RedisServer, redis_async: aioredis.Redis) -> None:
    """A reply stream is the producer's and may be shared: an entry the client cannot decode (written
    by someone else) must not end the wait of the job whose result follows it."""
    bench = queue_bench()
    q = QueueClient(redis_async)
    for junk in (b"\xff", b"[" * DEEP, b'{"id": 1}', b"{}"):
        await redis_async.xadd("shared", {"result": junk})
        await redis_async.xadd("shared", {"chunk": junk})
    job = await q.submit({**BODY, "stream": True}, reply_to="shared")
    await bench.start()
    try:
        items = [i async for i in q.chunks(job, timeout=10)]
        assert (await q.wait(job, timeout=5)).status == "ok"
    finally:
        await bench.stop()
    assert len(items) == 4  # its 3 chunks and its result

