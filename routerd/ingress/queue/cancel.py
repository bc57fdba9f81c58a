"""Producer cancels: a job id published on the cancel channel cancels that job if it is held here and
its cancel key is set.

The cancel *key* (checked before a job is dispatched, see :mod:`.store`) covers jobs not yet read;
the channel reaches jobs already waiting for admission or running. The channel alone is not enough:
whoever may publish on it could name any job, while the key is per job, so a producer's Redis ACL
(``routerd redis-acl``) lets it cancel its own jobs only. Only the producer's cancel becomes
the job's result (a 499 error): :mod:`.job` tells it from a shutdown by ``cancel_requested``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from ... import _aio, log
from ..._aio import wait_for
from ...redis_keys import RedisKeys
from .held import Held, text
from .results import REDIS_DOWN

_log = log.get("routerd.queue")


def cancel_local(held: Held, job_id: str) -> bool:
    """Cancel job ``job_id`` if it is held here (waiting for admission or running) or set aside here
    (it comes back for its result)."""
    running = held.by_job.get(job_id)
    if running is None:
        return held.cancel_aside(job_id)
    if running.finishing or running.task is None or running.cancel_requested:
        return False
    running.cancel_requested = True
    running.task.cancel()
    return True


def _holds(held: Held, job_id: str) -> bool:
    return job_id in held.by_job or job_id in held.aside_jobs


async def listen_for_cancels(client: Callable[[], aioredis.Redis], keys: RedisKeys, held: Held, *,
                             op_timeout_s: Callable[[], float], rng: random.Random) -> None:
    """Cancel held jobs named on the cancel channel whose cancel key is set, resubscribing with backoff
    whenever Redis goes away."""
    backoff = 0.1
    while True:
        pubsub: Any = client().pubsub()
        try:
            async with _aio.timeout(op_timeout_s()):
                await pubsub.subscribe(keys.cancel_channel)
            backoff = 0.1
            while True:
                async with _aio.timeout(op_timeout_s() + 1.0):
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is not None and msg.get("type") == "message":
                    job_id = text(msg["data"])
                    # anyone who may PUBLISH here could name any job: its cancel key says it is meant
                    if job_id is not None and _holds(held, job_id):
                        async with _aio.timeout(op_timeout_s()):
                            requested = await client().exists(keys.cancel(job_id))
                        if requested:
                            cancel_local(held, job_id)
        except REDIS_DOWN:
            pass
        except Exception:  # noqa: BLE001 — loop boundary: a bad message must not end the consumer
            _log.exception("queue_cancel_listener_failed")
        finally:
            with contextlib.suppress(*REDIS_DOWN):
                await wait_for(pubsub.aclose(), 1.0)
        await asyncio.sleep(backoff * (0.5 + rng.random()))
        backoff = min(backoff * 2, 2.0)
