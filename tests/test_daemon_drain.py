"""SIGTERM always ends the daemon: exit 0 within ``drain_timeout_s`` plus a few seconds, whatever is in
flight — queue jobs (streamed and not), HTTP streams, HTTP bodies half sent — with the embedded Redis
or an external one (issue 9: a daemon that logged ``drain_finished`` and then never exited).

Each case runs one real ``routerd run`` per mix, all at once (a daemon starts in ~0.6 s of CPU; run
one after the other, 30 of them would take minutes). Engines are slow (10 tokens/s, thousands of
tokens asked), so everything is still in flight when the drain times out and has to be cut.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from routerd.client import QueueClient, Submitted
from routerd.redis_server import embedded_url
from tests.fixtures.daemon import OpenStream, RouterdFactory, RouterdProcess, open_stream, wait_ready

pytestmark = pytest.mark.timeout(240)

DRAIN_S = 3.0
EXIT_MARGIN_S = 5.0  # "a few seconds" past the drain: closing streams, tasks, Redis and the listener
KINDS = ("queue", "queue_stream", "http_stream", "half_body")
MIXES = [mix for n in range(1, len(KINDS) + 1) for mix in itertools.combinations(KINDS, n)]
PER_KIND = 3


@dataclass
class Inflight:
    """What one daemon has in flight when it gets SIGTERM, and what the test must close afterwards."""

    jobs: list[Submitted] = field(default_factory=list)
    streams: list[OpenStream] = field(default_factory=list)
    sockets: list[asyncio.StreamWriter] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def close(self) -> None:
        for t in self.tasks + [s.task for s in self.streams]:
            t.cancel()
        await asyncio.gather(*self.tasks, *(s.task for s in self.streams), return_exceptions=True)
        for w in self.sockets:
            w.close()


async def _half_body(url: str, *, trickle: bool) -> tuple[asyncio.StreamWriter, asyncio.Task[None]]:
    """A POST whose headers promise 100 kB, of which only the start arrives: then one byte every
    0.3 s (``trickle``), or nothing more at all."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: routerd\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n" + b'{"model": "m", "prompt": "')
    await writer.drain()

    async def keep_trickling() -> None:
        try:
            while trickle and not writer.is_closing():
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.3)
            await reader.read()  # until routerd closes the connection
        except OSError:
            return

    return writer, asyncio.create_task(keep_trickling())


async def _running(q: QueueClient, jobs: list[Submitted], streamed: bool) -> bool:
    for job in jobs:
        if (await q.status(job)).state != "running":
            return False
        if streamed and not await q.redis.xlen(job.reply_to):
            return False  # a streamed job is in flight once its first chunk is out
    return True


async def _until(pred: Callable[[], Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "work never got in flight"
        await asyncio.sleep(0.1)


async def _load(rp: RouterdProcess, mix: tuple[str, ...], q: QueueClient,
                session: aiohttp.ClientSession) -> Inflight:
    inflight = Inflight()
    body = {"model": "m", "prompt": "drain me", "max_tokens": 2000}  # 200 s of tokens at 10/s
    for kind, streamed in (("queue", False), ("queue_stream", True)):
        if kind in mix:
            jobs = await q.submit_many([{**body, "stream": streamed}] * PER_KIND)
            await _until(lambda jobs=jobs, streamed=streamed: _running(q, jobs, streamed))
            inflight.jobs += jobs
    if "http_stream" in mix:
        inflight.streams = list(await asyncio.gather(
            *(open_stream(session, rp.url, "m", 2000) for _ in range(PER_KIND))))
    if "half_body" in mix:
        for i in range(PER_KIND):
            writer, task = await _half_body(rp.url, trickle=i % 2 == 0)
            inflight.sockets.append(writer)
            inflight.tasks.append(task)
    return inflight


def _config(routerd_config: Callable[..., dict[str, Any]], sim_url: str, redis_url: str,
            index: int) -> dict[str, Any]:
    redis: dict[str, Any] = {"enabled": True, "url": redis_url, "reclaim_interval_s": 0.5}
    if redis_url != "embedded":  # daemons sharing one Redis each get their own streams
        redis |= {"stream": f"mix{index}:requests", "group": f"mix{index}", "dead_stream": f"mix{index}:dead"}
    # Up to 15 daemons on one simulated engine, on two cores that other tests share: the subject is
    # the drain, so a heartbeat, scrape or connect slowed by the load must not take the engine out of
    # rotation (at load 20 some daemons' first scrapes all timed out: never ready in 30 s).
    cfg = routerd_config(daemon={"drain_timeout_s": DRAIN_S}, redis=redis,
                         routing={"scrape_interval_s": 0.5, "connect_timeout_s": 10.0,
                                  "scrape_timeout_s": 5.0, "stale_after_s": 15.0,
                                  "circuit_failure_threshold": 50},
                         health={"heartbeat_timeout_s": 10.0, "failure_threshold": 10},
                         fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim_url]}])
    cfg["daemon"]["state_dir"] += f"-{index}"
    return cfg


def _all_ready(procs: list[RouterdProcess], timeout: float) -> None:
    """Until every daemon said READY=1, their notify sockets read in turn: one nobody reads holds only 10
    datagrams, so a READY=1 sent while the test waited for another daemon's was dropped behind its
    watchdog pings (15 daemons starting on a loaded machine)."""
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        for rp in waiting:
            rp.read_notify(0.01)
        waiting = [rp for rp in waiting if "READY=1" not in rp.messages]
        assert time.monotonic() < deadline, f"{len(waiting)} routerd(s) never ready: {waiting[0].log()}"


def _redis_url(rp: RouterdProcess, cfg: dict[str, Any]) -> str:
    url: str = cfg["redis"]["url"]
    if url == "embedded":
        found = embedded_url(rp.config["daemon"]["state_dir"] + "/redis")
        assert found is not None
        return found
    return url


@pytest.mark.parametrize("redis_mode", ["embedded", "external"])
async def test_sigterm_exits_0_in_time_whatever_is_in_flight(
        redis_mode: str, request: pytest.FixtureRequest, routerd_process: RouterdFactory,
        routerd_config: Callable[..., dict[str, Any]], sim_process: Any) -> None:
    sim = await sim_process(model="m", itl_ms=100, ttft_ms=10, max_num_seqs=512, batch_factor=0)
    redis_url = "embedded" if redis_mode == "embedded" else request.getfixturevalue("redis_server").url
    configs = [_config(routerd_config, sim.url, redis_url, i) for i in range(len(MIXES))]
    procs = [await asyncio.to_thread(routerd_process, cfg, wait_ready=False) for cfg in configs]
    await asyncio.to_thread(_all_ready, procs, 120)
    clients = [QueueClient.from_url(_redis_url(rp, cfg),
                                    stream=cfg["redis"].get("stream", "routerd:requests"))
               for rp, cfg in zip(procs, configs, strict=True)]
    inflight: list[Inflight] = []
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_ready(session, rp.url) for rp in procs))
            inflight = list(await asyncio.gather(*(
                _load(rp, mix, q, session) for rp, mix, q in zip(procs, MIXES, clients, strict=True))))
            for rp in procs:
                rp.signal(signal.SIGTERM)
            exits = await _exits(procs, DRAIN_S + EXIT_MARGIN_S + 10)
            await asyncio.gather(*(i.close() for i in inflight))
        if redis_mode == "external":  # nothing was lost: each job has its result or waits in Redis
            for q, cfg, load in zip(clients, configs, inflight, strict=True):
                r = cfg["redis"]
                pending = {p["message_id"].decode() for p in await q.redis.xpending_range(
                    r["stream"], r["group"], min="-", max="+", count=1000)}
                for job in load.jobs:
                    assert job.entry in pending or await q.result(job.id) is not None
    finally:
        await asyncio.gather(*(q.aclose() for q in clients))
    failed = [(mix, code, round(t, 1), rp.log()[-1500:])
              for mix, (code, t), rp in zip(MIXES, exits, procs, strict=True)
              if code != 0 or t > DRAIN_S + EXIT_MARGIN_S]
    assert not failed, f"{len(failed)} of {len(MIXES)} mixes did not exit 0 in time: {failed}"


async def _exits(procs: list[RouterdProcess], limit_s: float) -> list[tuple[int | None, float]]:
    """(exit code or None, seconds from now to the exit) of every process, polled up to ``limit_s``."""
    started = time.monotonic()
    exits: dict[int, tuple[int | None, float]] = {}
    while len(exits) < len(procs) and time.monotonic() - started < limit_s:
        for i, rp in enumerate(procs):
            if i not in exits and (code := rp.proc.poll()) is not None:
                exits[i] = (code, time.monotonic() - started)
        await asyncio.sleep(0.05)
    return [exits.get(i, (None, limit_s)) for i in range(len(procs))]


async def test_sigterm_under_the_reported_load_exits_0(
        routerd_process: RouterdFactory, routerd_config: Callable[..., dict[str, Any]],
        sim_process: Any) -> None:
    """The load that hung 3 of 3 times in issue 9: 30 queue jobs (half streamed) and 20 HTTP streams
    on the embedded Redis, fast tokens, so the queue writer is busy sending chunks when the drain
    times out and cancels it — the moment redis-py could swallow that cancellation."""
    sim = await sim_process(model="m", itl_ms=8, ttft_ms=10, max_num_seqs=64)
    cfg = _config(routerd_config, sim.url, "embedded", 0)
    rp = await asyncio.to_thread(routerd_process, cfg)
    q = QueueClient.from_url(_redis_url(rp, cfg))
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, rp.url)
            body = {"model": "m", "prompt": "drain me", "max_tokens": 2000}
            jobs = await q.submit_many([{**body, "stream": i % 2 == 0} for i in range(30)])
            await _until(lambda: _running(q, jobs[::2], streamed=True))
            streams = await asyncio.gather(*(open_stream(session, rp.url, "m", 2000) for _ in range(20)))
            await asyncio.sleep(0.5)
            rp.signal(signal.SIGTERM)
            ((code, took),) = await _exits([rp], DRAIN_S + EXIT_MARGIN_S + 10)
            await Inflight(streams=list(streams)).close()
    finally:
        await q.aclose()
    assert code == 0, rp.log()
    assert took <= DRAIN_S + EXIT_MARGIN_S, rp.log()


async def test_requests_waiting_for_admission_are_answered_503_when_the_drain_ends(
        routerd_process: RouterdFactory, routerd_config: Callable[..., dict[str, Any]],
        sim_process: Any) -> None:
    """Issue 18.7: a SIGTERM finds HTTP requests waiting for an admission slot of a saturated fleet;
    when the drain ends each of them is answered 503 with ``Retry-After`` in OpenAI's error shape —
    not a closed connection — and the daemon exits 0."""
    sim = await sim_process(model="m", itl_ms=100, ttft_ms=10, max_num_seqs=4)
    cfg = routerd_config(daemon={"drain_timeout_s": 1.0}, admission={"max_inflight_per_instance": 2},
                         fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}])
    rp = await asyncio.to_thread(routerd_process, cfg)
    parked_n = 12

    async def parked(session: aiohttp.ClientSession) -> tuple[int, dict[str, str], bytes]:
        body = {"model": "m", "prompt": "wait for me", "max_tokens": 4}
        async with session.post(f"{rp.url}/v1/completions", json=body) as r:
            return r.status, dict(r.headers), await r.read()

    async def queued(session: aiohttp.ClientSession) -> bool:
        async with session.get(f"{rp.url}/metrics") as r:
            text = await r.text()
        return f'routerd_admission_queued{{fleet="f",source="http"}} {float(parked_n)}' in text

    async with aiohttp.ClientSession() as session:
        await wait_ready(session, rp.url)
        streams = [await open_stream(session, rp.url, "m", 2000) for _ in range(2)]  # every slot
        waiting = [asyncio.create_task(parked(session)) for _ in range(parked_n)]
        try:
            await _until(lambda: queued(session))
            rp.signal(signal.SIGTERM)
            answers = await asyncio.wait_for(asyncio.gather(*waiting), DRAIN_S + EXIT_MARGIN_S)
            ((code, _),) = await _exits([rp], EXIT_MARGIN_S + 10)
        finally:
            for t in waiting + [s.task for s in streams]:
                t.cancel()
            await asyncio.gather(*waiting, *(s.task for s in streams), return_exceptions=True)
    assert code == 0
    for status, headers, body in answers:
        assert status == 503, body
        assert int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["type"] == "ServiceUnavailableError"
