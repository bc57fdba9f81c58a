"""Cancellation that is never lost, and a stop that always ends: routerd/_aio.py and the daemon's
StopDeadline. The root cause of a daemon that never exited after SIGTERM (issue 9) was redis-py
swallowing the queue writer's cancellation (``asyncio.wait_for`` on Python 3.11, gh-86296)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis.asyncio as aioredis

from routerd import _aio
from routerd.ingress.queue.results import ResultWriter
from routerd.redis_keys import RedisKeys
from routerd.stop_deadline import StopDeadline
from routerd.tenants.usage import UsageLedger
from tests.fixtures.redis_server import RedisServer


async def _swallows_a_cancel() -> int:
    """What asyncio.wait_for does on 3.11 when the cancel arrives after its inner await finished."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0.05)
    return 1


async def test_a_cancel_swallowed_inside_the_block_is_raised_on_leaving_it() -> None:
    reached = asyncio.Event()

    async def loop_body() -> None:
        async with _aio.timeout(5.0):
            await _swallows_a_cancel()
        reached.set()  # without the check, the loop would go on as if never cancelled
        await asyncio.sleep(3600)

    task = asyncio.create_task(loop_body())
    await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert task in done
    assert task.cancelled()
    assert not reached.is_set()


async def test_a_swallowed_cancel_is_raised_even_when_the_block_ends_with_another_error() -> None:
    async def body() -> None:
        async with _aio.timeout(5.0):
            await _swallows_a_cancel()
            raise ConnectionError("the caller would catch this one and retry")

    task = asyncio.create_task(body())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)


async def test_own_expiry_is_still_a_timeout_and_cleanup_under_cancel_still_runs() -> None:
    with pytest.raises(TimeoutError):
        async with _aio.timeout(0.01):
            await asyncio.sleep(1)
    assert await _aio.wait_for(asyncio.sleep(0, "x"), 1.0) == "x"
    cleaned = asyncio.Event()

    async def with_cleanup() -> None:
        try:
            await asyncio.sleep(3600)
        finally:  # awaiting while being cancelled is cleanup, not a lost cancel
            async with _aio.timeout(1.0):
                await asyncio.sleep(0.01)
            cleaned.set()

    task = asyncio.create_task(with_cleanup())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()


Busy = tuple[Coroutine[Any, Any, None], Callable[[], None]]


async def _always_ends_when_cancelled(make: Callable[[], Busy], what: str, rng: random.Random,
                                      trials: int = 60) -> None:
    """``trials`` times: ``make()`` a fresh loop and its feed, run the loop, keep it busy (four
    feeders call the feed 1–20 times every 0–2 ms), cancel it at a random moment: it must end within
    4 s."""
    for trial in range(trials):
        loop, feed = make()
        task = asyncio.create_task(loop, name=what)
        stop = asyncio.Event()

        async def feeder(feed: Callable[[], None] = feed, stop: asyncio.Event = stop) -> None:
            while not stop.is_set():
                for _ in range(rng.randint(1, 20)):
                    feed()
                await asyncio.sleep(rng.random() * 0.002)

        feeders = [asyncio.create_task(feeder()) for _ in range(4)]
        await asyncio.sleep(0.005 + rng.random() * 0.03)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=4.0)
        stop.set()
        await asyncio.gather(*feeders)
        if task not in done:
            where = _aio.where(task)
            await _aio.cancel_and_wait([task], 1.0)
            pytest.fail(f"trial {trial}: the cancelled {what} is still running: {where}")


async def test_busy_queue_writer_always_ends_when_cancelled(redis_server: RedisServer) -> None:
    """The writer cancelled while it sends a batch: before the fix about one cancel in three was lost
    inside redis-py, the writer went back to waiting for work, and its TaskGroup (and the daemon)
    never finished stopping."""
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=5)

    def writer() -> Busy:
        w, n = ResultWriter(lambda: client, op_timeout_s=2.0, common={}), itertools.count()
        return w.run(), lambda: w.send("SET", f"k{next(n) % 100}", "v")

    try:
        await _always_ends_when_cancelled(writer, "queue writer", random.Random(9))
    finally:
        await client.aclose()


async def test_busy_usage_ledger_always_ends_when_cancelled(redis_server: RedisServer) -> None:
    """The tenants' usage ledger cancelled while it writes its increments (the daemon's stop): a
    cancel lost inside redis-py sent it back to its sleep, and the daemon's stop was forced (CI,
    stop 24: 'tenant-usage' still sleeping 15 s after its cancel)."""
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=5)
    rng = random.Random(24)

    def ledger() -> Busy:
        led = UsageLedger(lambda: client, RedisKeys(), retention_days=1, flush_interval_s=0.0,
                          op_timeout_s=2.0)
        return led.run(), lambda: led.add(f"t{rng.randint(0, 19)}", "f", requests=1, prompt_tokens=7,
                                          completion_tokens=3)

    try:
        await _always_ends_when_cancelled(ledger, "usage ledger", rng)
    finally:
        await client.aclose()


async def _stubborn(release: asyncio.Event) -> None:
    """A task that ignores cancel() until released."""
    while not release.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)


async def test_cancel_and_wait_returns_the_tasks_that_will_not_end() -> None:
    release = asyncio.Event()
    ends = asyncio.create_task(asyncio.sleep(3600), name="ends")
    stuck = asyncio.create_task(_stubborn(release), name="stuck")
    await asyncio.sleep(0)
    assert await _aio.cancel_and_wait([ends, stuck], 0.2) == {stuck}
    assert ends.cancelled()
    assert _aio.where(stuck).startswith("stuck: _stubborn (")
    release.set()
    assert await _aio.cancel_and_wait([stuck], 1.0) == set()


async def test_stop_deadline_exits_1_naming_what_is_stuck(capsys: pytest.CaptureFixture[str]) -> None:
    """The backstop of a stop: a task that ignores its cancellation cannot keep the process alive."""
    codes: list[int] = []
    fired = asyncio.Event()

    def exit_fn(code: int) -> None:
        codes.append(code)
        fired.set()

    release = asyncio.Event()
    stuck = asyncio.create_task(_stubborn(release), name="stuck-writer")
    deadline = StopDeadline(exit_fn)
    deadline.arm(30.0, "the stop outlasted its bound")
    deadline.arm(0.1, "second stop signal")  # a sooner arm wins; a later one never postpones it
    deadline.arm(60.0, "later")
    await asyncio.wait_for(fired.wait(), 2.0)
    assert codes == [1]
    out = capsys.readouterr().out
    assert "stop_forced" in out
    assert "second stop signal" in out
    assert "stuck-writer: _stubborn" in out
    release.set()
    assert await _aio.cancel_and_wait([stuck], 1.0) == set()
