"""``routerd bench queue``: jobs/s through the Redis queue end to end, against a plain stream loop.

Method. A fresh redis-server (AOF on, unix socket) and zero-latency simulated engines (separate
processes running ``SimEngine(SimConfig(ttft_ms=0, itl_ms=0))``) are started; N jobs are enqueued up front;
then routerd's queue path (QueueIngress → admission → router → upstream over HTTP → engine → result
script) is started in this process and timed until the N-th result is stored. The baseline is the
least any consumer must do on the same Redis: ``XADD`` the same N messages, then ``XREADGROUP COUNT
256`` + pipelined ``XACK`` until drained. Overhead per job = 1/routerd rate − 1/baseline rate.
Because the machine is shared and wall-clock rates are noisy, CPU time per job of routerd's process
is reported too, next to the CPU time per request of a bare aiohttp client posting straight to the
same engines (``direct_http``): the difference is what the queue path itself costs.

``routerd bench queue serve --config FILE`` runs only the queue path (data plane with static fleets +
consumer, no Ray, no HTTP listener) until SIGTERM/SIGINT; the crash tests run it as a subprocess so it
can really be SIGKILLed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import redis.asyncio as aioredis

from routerd import log
from routerd._net import free_port
from routerd.client import QueueClient
from routerd.config import Config, load, parse
from routerd.redis_keys import RedisKeys
from routerd.redis_server import EmbeddedRedis
from routerd.registry import Registry

if TYPE_CHECKING:
    from routerd.assembly import Routerd


@contextlib.asynccontextmanager
async def queue_path(cfg: Config, url: str, *, consumer: str | None = None) -> AsyncIterator[Routerd]:
    """routerd with the queue consumer on ``url`` (static fleets: scraped, health-checked, routed), its
    loops running but the consumer's: the caller runs ``routerd.queue.run()`` when it is ready."""
    from routerd.assembly import running  # the data plane pulls in aiohttp's server side; only here

    redis = msgspec.structs.replace(cfg.redis, enabled=True, url=url, consumer=consumer or cfg.redis.consumer)
    async with running(msgspec.structs.replace(cfg, redis=redis), Registry(), consume=False) as routerd:
        yield routerd


async def wait_ready(registry: Registry, fleets: list[str], timeout: float) -> None:
    """Until every instance of ``fleets`` is ready (at least one each): a run that starts with one of
    several ready sends its first requests there alone (on a loaded machine the others follow late)."""
    deadline = time.monotonic() + timeout

    def waiting(f: str) -> bool:
        return registry.ready_count(f) == 0 or registry.ready_count(f) < len(registry.instances(f))

    while any(waiting(f) for f in fleets):
        if time.monotonic() > deadline:
            raise TimeoutError("engines did not become ready")
        await asyncio.sleep(0.05)


def _loop_runner() -> Any:
    """uvloop when installed, as the daemon runs: the figures should be the daemon's."""
    try:
        import uvloop
    except ImportError:  # optional off Linux
        return asyncio.run
    return uvloop.run


# -- serve: the queue path alone, for the crash tests -------------------------------------------------
def serve_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="routerd bench queue serve")
    p.add_argument("--config", required=True)
    p.add_argument("--consumer", default=None)
    args = p.parse_args(argv)
    cfg = load(args.config)
    log.setup(cfg.daemon.log_level, json=True)
    code: int = _loop_runner()(_serve(cfg, args.consumer))
    return code


async def _serve(cfg: Config, consumer: str | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with queue_path(cfg, cfg.redis.url, consumer=consumer) as routerd:
        ingress = routerd.queue
        assert ingress is not None
        await wait_ready(routerd.registry, [f.name for f in cfg.fleets], 30)
        run = asyncio.create_task(ingress.run())
        print("serving", flush=True)
        await stop.wait()
        ingress.stop_intake()
        await ingress.wait_idle(cfg.daemon.drain_timeout_s)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
    return 0


# -- the benchmark ------------------------------------------------------------------------------------
STREAM = "bench:requests"
# Every job's result on one stream, in the producers' own family of the namespace (``bench:reply:…``):
# any other ``bench:`` name is routerd's, and the client refuses it as a reply_to.
REPLIES = RedisKeys(stream=STREAM).reply("all")


def bench_config(url: str, urls: list[str], max_num_seqs: int, jobs: int, **sections: Any) -> Config:
    """routerd's config for a queue benchmark (``bench queue``, ``bench batch``): the consumer on
    ``url`` reading ``STREAM``, one static fleet of ``urls``, and every one of ``jobs`` replies kept
    (``reply_maxlen`` at least twice them: they are counted on ``REPLIES``); ``sections`` added."""
    return parse({
        "redis": {"url": url, "stream": STREAM, "group": "bench", "dead_stream": "bench:dead",
                  "consumer": "bench", "read_batch": 256, "reply_maxlen": max(10_000, 2 * jobs)},
        "admission": {"max_inflight_per_instance": max_num_seqs},
        "routing": {"scrape_interval_s": 0.5},
        "fleets": [{"name": "bench", "model": "bench", "engine": "static", "urls": urls,
                    "max_num_seqs": max_num_seqs}],
        **sections}, environ={})


# A simulated engine in its own process (so it has its own core), through the sim's public API.
_ENGINE = """
import asyncio, sys
from routerd.sim.config import SimConfig
from routerd.sim.server import SimEngine

async def main() -> None:
    cfg = SimConfig(model=sys.argv[1], max_num_seqs=int(sys.argv[3]), ttft_ms=float(sys.argv[4]),
                    itl_ms=float(sys.argv[5]))
    engine = SimEngine(cfg)
    await engine.start("127.0.0.1", int(sys.argv[2]))
    await asyncio.Event().wait()

asyncio.run(main())
"""


def start_engines(n: int, model: str, max_num_seqs: int, *, ttft_ms: float = 0.0, itl_ms: float = 0.0,
                  ) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``n`` simulated engines as subprocesses (zero latency unless told); their base URLs."""
    procs, urls = [], []
    for _ in range(n):
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _ENGINE, model, str(port), str(max_num_seqs), str(ttft_ms), str(itl_ms)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


async def wait_http(urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        for url in urls:
            while True:
                try:
                    async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not come up")
                await asyncio.sleep(0.05)


async def baseline(client: Any, n: int, batch: int = 256) -> float:
    """Messages/s of the least a consumer must do: XREADGROUP + XACK, pipelined, after XADD."""
    stream, group = "bench:baseline", "g"
    await client.delete(stream)
    payload = msgspec.json.encode({"id": "x" * 32, "endpoint": "/v1/completions", "reply_to": "r",
                                   "body": {"model": "bench", "prompt": "hello", "max_tokens": 1}})
    for i in range(0, n, 1000):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(1000, n - i)):
            pipe.xadd(stream, {"job": payload})
        await pipe.execute()
    await client.xgroup_create(stream, group, id="0")
    started = time.perf_counter()
    done = 0
    while done < n:
        reply = await client.xreadgroup(group, "c", {stream: ">"}, count=batch, block=1000)
        ids = [eid for _, entries in reply for eid, _ in entries]
        await client.xack(stream, group, *ids)
        done += len(ids)
    elapsed = time.perf_counter() - started
    await client.delete(stream)
    return n / elapsed


async def direct_http(urls: list[str], n: int, concurrency: int) -> tuple[float, float]:
    """Requests/s and CPU µs/request of a bare aiohttp client posting straight to the engines: the
    share of routerd's per-job cost that is the HTTP call itself, not the queue."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i: int) -> None:
            async with sem, s.post(urls[i % len(urls)] + "/v1/completions",
                                   json={"model": "bench", "prompt": f"p{i}", "max_tokens": 1}) as r:
                await r.read()

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - wall), (time.process_time() - cpu) / n * 1e6


async def run_bench(n: int, engines: int, redis_url: str | None, max_num_seqs: int) -> dict[str, Any]:
    procs, urls = start_engines(engines, "bench", max_num_seqs)
    tmp = tempfile.mkdtemp(prefix="rdbq")
    try:
        await wait_http(urls, 30)
        async with contextlib.AsyncExitStack() as stack:
            url = redis_url
            if url is None:
                url = await stack.enter_async_context(EmbeddedRedis(Path(tmp) / "redis"))
            cfg = bench_config(url, urls, max_num_seqs, n)
            raw: Any = aioredis.Redis.from_url(url, socket_timeout=30)
            stack.push_async_callback(raw.aclose)
            base_rate = await baseline(raw, n)
            q = QueueClient(raw, stream=STREAM)
            await raw.delete(REPLIES)  # on a --redis of an earlier run: count this run's replies only
            t0 = time.perf_counter()
            await q.submit_many([{"model": "bench", "prompt": f"p{i}", "max_tokens": 1} for i in range(n)],
                                reply_to=REPLIES)
            submit_rate = n / (time.perf_counter() - t0)
            http_rate, http_cpu_us = await direct_http(urls, min(n, 5000), max_num_seqs)
            async with queue_path(cfg, url) as routerd:
                ingress = routerd.queue
                assert ingress is not None
                await wait_ready(routerd.registry, ["bench"], 30)
                started, cpu = time.perf_counter(), time.process_time()
                run = asyncio.create_task(ingress.run())
                while await raw.xlen(REPLIES) < n:
                    if run.done():
                        run.result()
                    await asyncio.sleep(0.01)
                elapsed = time.perf_counter() - started
                cpu_us = (time.process_time() - cpu) / n * 1e6
                ingress.stop_intake()
                await asyncio.wait_for(run, 30)
            errors = sum(1 for _, f in await raw.xrange(REPLIES)
                         if b'"status":"error"' in f[b"result"])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    rate = n / elapsed
    return {"jobs": n, "engines": engines, "jobs_per_s": round(rate, 1),
            "baseline_msgs_per_s": round(base_rate, 1), "submit_jobs_per_s": round(submit_rate, 1),
            "overhead_us_per_job": round((1 / rate - 1 / base_rate) * 1e6, 1),
            "routerd_cpu_us_per_job": round(cpu_us, 1), "direct_http_req_per_s": round(http_rate, 1),
            "direct_http_cpu_us_per_req": round(http_cpu_us, 1),
            "queue_cpu_us_per_job": round(cpu_us - http_cpu_us, 1), "errors": errors,
            "elapsed_s": round(elapsed, 3)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    p = argparse.ArgumentParser(prog="routerd bench queue", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--redis", default=None, help="an existing Redis (default: a fresh embedded one)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    log.setup("warning", json=False)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    res = _loop_runner()(run_bench(args.jobs, args.engines, args.redis, args.max_num_seqs))
    report(res, args.json)
    return 0


def report(res: dict[str, Any], json_path: str | None, width: int = 28) -> None:
    """The figures as a two-column table, and in ``json_path`` if given (``bench queue`` and
    ``bench batch`` alike)."""
    print(f"{'metric':<{width}}{'value':>14}")
    for k, v in res.items():
        print(f"{k:<{width}}{v:>14}")
    if json_path:
        Path(json_path).write_text(msgspec.json.encode(res).decode() + "\n")
