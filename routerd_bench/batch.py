"""``routerd bench batch``: a chat batch through the Batch API against the same lines as plain queue jobs.

Method. Zero-latency simulated engines (subprocesses) and a fresh embedded Redis, as ``routerd bench
queue``. The same N chat requests (``max_tokens`` 1) run twice through one in-process routerd (queue
consumer and batch runner in this process):

1. *queue*: submitted up front with the producers' client (``submit_many``) to one reply stream, then
   the consumer is started and timed until the N-th result is stored;
2. *batch*: the lines as a JSONL file stored in Redis (``/v1/files``'s store), a batch created on it,
   then the consumer and the batch runner are started and timed until the batch is ``completed`` — its
   runner fed every line as a queue job (``[batches] lines_in_flight`` at a time) and wrote every
   result to the output file.

Reported: lines/s and this process's CPU µs per line in each, their ratio (the batch's overhead per
line: validating, feeding, collecting and writing the output file on top of the queue path), and the
Redis memory each waiting line takes (``used_memory`` after the jobs were queued, or after the file was
stored, minus before, per line): a queued job holds its stream entry, a batch line its bytes in the file
while at most ``lines_in_flight`` of its lines are jobs at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from routerd import log
from routerd.client import QueueClient
from routerd.redis_server import EmbeddedRedis

from .queue import (
    REPLIES,
    STREAM,
    _loop_runner,
    bench_config,
    queue_path,
    report,
    start_engines,
    wait_http,
    wait_ready,
)


def _bodies(n: int) -> list[dict[str, Any]]:
    return [{"model": "bench", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 1}
            for i in range(n)]


async def _memory(client: Any) -> int:
    info = await client.info("memory")
    return int(info["used_memory"])


async def _pieces(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 65_536):
        yield data[i:i + 65_536]


async def run_bench(n: int, engines: int, max_num_seqs: int, in_flight: int) -> dict[str, Any]:
    procs, urls = start_engines(engines, "bench", max_num_seqs)
    tmp = tempfile.mkdtemp(prefix="rdbb")
    try:
        await wait_http(urls, 30)
        async with contextlib.AsyncExitStack() as stack:
            url = await stack.enter_async_context(EmbeddedRedis(Path(tmp) / "redis"))
            cfg = bench_config(url, urls, max_num_seqs, n,
                               batches={"lines_in_flight": in_flight, "poll_s": 0.2})
            raw: Any = aioredis.Redis.from_url(url, socket_timeout=30)
            stack.push_async_callback(raw.aclose)
            bodies = _bodies(n)
            async with queue_path(cfg, url) as routerd:
                ingress = routerd.queue
                runner = routerd.batches.runner if routerd.batches is not None else None
                assert ingress is not None
                assert runner is not None
                await wait_ready(routerd.registry, ["bench"], 30)
                # 1. plain queue jobs
                before = await _memory(raw)
                await QueueClient(raw, stream=STREAM).submit_many(bodies, endpoint="/v1/chat/completions",
                                                                  reply_to=REPLIES)
                queue_mem = (await _memory(raw) - before) / n
                started, cpu = time.perf_counter(), time.process_time()
                run = asyncio.create_task(ingress.run())
                while await raw.xlen(REPLIES) < n:
                    if run.done():
                        run.result()
                    await asyncio.sleep(0.01)
                queue_s, queue_cpu = time.perf_counter() - started, time.process_time() - cpu
                # 2. the same lines as a batch (the consumer goes on running)
                lines = b"".join(json.dumps({"custom_id": f"q{i}", "method": "POST",
                                             "url": "/v1/chat/completions", "body": b}).encode() + b"\n"
                                 for i, b in enumerate(bodies))
                before = await _memory(raw)
                meta = await runner.files.upload("default", "bench.jsonl", "batch", _pieces(lines))
                batch_mem = (await _memory(raw) - before) / n
                started, cpu = time.perf_counter(), time.process_time()
                batch = await runner.store.create("default", meta, "/v1/chat/completions", 86_400, None)
                peak_jobs = 0
                while True:
                    h = await runner.store.get(batch["id"])
                    assert h is not None
                    if h["status"] in ("completed", "failed", "expired", "cancelled"):
                        break
                    peak_jobs = max(peak_jobs, await raw.hlen(runner.keys.batch_inflight(batch["id"])))
                    await asyncio.sleep(0.05)
                batch_s, batch_cpu = time.perf_counter() - started, time.process_time() - cpu
                ingress.stop_intake()
                await asyncio.wait_for(run, 30)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    queue_us, batch_us = queue_cpu / n * 1e6, batch_cpu / n * 1e6
    return {"lines": n, "status": h["status"], "completed": int(h["completed"]), "failed": int(h["failed"]),
            "queue_lines_per_s": round(n / queue_s, 1), "batch_lines_per_s": round(n / batch_s, 1),
            "queue_cpu_us_per_line": round(queue_us, 1), "batch_cpu_us_per_line": round(batch_us, 1),
            "batch_over_queue_cpu": round(batch_us / queue_us, 2),
            "queue_redis_bytes_per_waiting_line": round(queue_mem), "batch_redis_bytes_per_waiting_line":
            round(batch_mem), "batch_peak_jobs_in_flight": peak_jobs, "lines_in_flight": in_flight}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="routerd bench batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--lines-in-flight", type=int, default=512)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    log.setup("warning", json=False)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    res = _loop_runner()(run_bench(args.lines, args.engines, args.max_num_seqs, args.lines_in_flight))
    report(res, args.json, width=38)
    return 0
