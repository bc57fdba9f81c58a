"""``routerd bench scale``: what routerd relays at saturation with 1 and N workers, and what watching idle
instances costs (issue 20).

Method (the relay part):

* **Upstreams**: ``--engines`` simulated engines, each its own process, with a fixed pace (``batch_factor
  = 0``, ``--itl-ms`` between a stream's events, ``max_num_seqs`` far above the load), so an engine is
  never what saturates.
* **Routers, one after the other on the same engines in the same run**: ``routerd run`` with
  ``[daemon] workers`` = each of ``--workers`` (a real daemon: embedded Redis, its queue consumer idle,
  info logging to /dev/null, uvloop), then the vLLM Router (``power_of_two``) when it is installed.
* **Saturation**: ``--streams`` concurrent chat streams, closed loop (each client starts its next
  stream when one ends), for ``--duration`` s: relayed SSE events per second as the client counts them;
  then ``--concurrency`` closed-loop clients of non-streamed requests: requests per second.
* **CPU** from ``/proc`` over the same window, per process of the router (a routerd daemon's parent,
  each worker, its Redis): total, per relayed event and per request, and each worker's share of
  routerd's CPU (the target: neither of 2 workers below a quarter). The load generator is this process,
  pinned to one core (``--loadgen-cpu``, default the last) with its own CPU reported beside, so what it
  costs is known rather than mixed into the router's.

On a machine where load generator, engines and router share few cores, the rates are what the machine
gives, not the router's ceiling: the CPU per event and per request are the figures that carry over
(``1e6 / cpu µs per event`` is one core's ceiling).

The idle part (CPU of watching 16, 64, 256 idle instances) is ``routerd_bench.scale_idle``'s
``async def run(args) -> dict``, run here when that module is installed (``--no-idle`` skips it).
The parts with several ``routerd run`` on one Redis — routing quality with 1 and ``--processes``
routerd behind a round-robin client, and the controller's failover gap under load — are
:mod:`routerd_bench.scale_replicas` (``--no-replicas``, ``--no-failover`` skip them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from routerd._net import free_port

from . import scale_replicas
from . import workloads as wl
from ._common import Processes, cpu_seconds, find_vllm_router, print_table, wait_http, write_json

MODEL = "scale"
# Set when each worker and the daemon still scraped and probed every engine for themselves (at the
# defaults, three processes' scrapes of four Python engines starved a small machine's engines); kept so
# that relay figures compare across runs: the relay is what is measured here, the cost of watching is
# the idle part's.
SCRAPE_S, HEARTBEAT_S = 1.0, 2.0
TIMEOUT = aiohttp.ClientTimeout(total=300, sock_connect=10, sock_read=60)


@dataclass
class Router:
    """One router under test: its URL and the processes whose CPU is its cost, by role."""

    name: str
    url: str
    pids: dict[str, int] = field(default_factory=dict)  # role ("parent", "w0", "redis", ...) → pid


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (``/proc/<pid>/task/*/children``), depth first."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def roles(parent: int) -> dict[str, int]:
    """A ``routerd run`` daemon's processes by role: the parent, ``w<i>`` per worker, ``redis``, others
    by their command name (the keying process, ...)."""
    out = {"parent": parent}
    for pid in descendants(parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker" in argv:
            out[f"w{argv[argv.index(b'--worker') + 1].split(b',')[0].decode()}"] = pid
        else:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            out["redis" if comm.startswith("redis-server") else f"{comm}-{pid}"] = pid
    return out


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for role, pid in pids.items():
        try:
            out[role] = cpu_seconds(pid)
        except OSError:  # gone: its share is what it used until then, which we no longer see
            out[role] = 0.0
    return out


def _config(engines: list[str], workers: int, state: Path, port: int) -> str:
    urls = ", ".join(f'"{u}"' for u in engines)
    return (f'[daemon]\nstate_dir = "{state}"\nworkers = {workers}\ndrain_timeout_s = 5.0\n'
            f'[http]\nhost = "127.0.0.1"\nport = {port}\nmax_connections = 100000\n'
            f'[redis]\nurl = "embedded"\n[routing]\npolicy = "least_load"\nscrape_interval_s = {SCRAPE_S}\n'
            f'[health]\nheartbeat_interval_s = {HEARTBEAT_S}\n'
            f'[[fleets]]\nname = "f"\nmodel = "{MODEL}"\nengine = "static"\nurls = [{urls}]\n')


async def start_routerd(procs: Processes, engines: list[str],
                        workers: int) -> tuple[Router, subprocess.Popen[bytes]]:
    """``routerd run`` with ``workers`` in front of ``engines``; returned once ``/readyz`` says ready."""
    port = free_port()
    tmp = Path(procs.tmp.name) / f"routerd-{workers}w-{port}"
    tmp.mkdir()
    (tmp / "routerd.toml").write_text(_config(engines, workers, tmp / "state", port))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    argv = [sys.executable, "-m", "routerd", "run", "--config", str(tmp / "routerd.toml"),
            "--log-format", "json"]
    proc = await asyncio.to_thread(subprocess.Popen, argv, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=env)
    procs.procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    await wait_http(url + "/readyz", timeout=120.0, proc=proc)
    router = Router(f"routerd workers={workers}", url, roles(proc.pid))
    while sum(1 for r in router.pids if r.startswith("w")) < (workers if workers > 1 else 0):
        await asyncio.sleep(0.1)
        router.pids = roles(proc.pid)
    return router, proc


def stop_routerd(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def _streams(session: aiohttp.ClientSession, url: str, *, clients: int, duration: float,
                   max_tokens: int) -> tuple[int, int, int]:
    """Closed-loop chat streams: (events, streams finished, failures) within ``duration``."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json"}
    counts = [0, 0, 0]
    stop_at = time.monotonic() + duration

    async def client() -> None:
        while time.monotonic() < stop_at:
            try:
                async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                    if r.status != 200:
                        await r.read()
                        counts[2] += 1
                        continue
                    tail = b""
                    async for chunk in r.content.iter_any():
                        # "data: " opens each event; one split across two chunks is counted once
                        counts[0] += (tail + chunk).count(b"data: ") - tail.count(b"data: ")
                        tail = chunk[-8:]
                        if time.monotonic() >= stop_at:
                            return
                    counts[1] += 1
            except (aiohttp.ClientError, TimeoutError):
                counts[2] += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return counts[0], counts[1], counts[2]


async def _requests(session: aiohttp.ClientSession, url: str, *, clients: int, duration: float,
                    max_tokens: int) -> tuple[int, int]:
    """Closed-loop non-streamed completions: (answered 200, failures) within ``duration``."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json"}
    counts = [0, 0]
    stop_at = time.monotonic() + duration

    async def client() -> None:
        while time.monotonic() < stop_at:
            try:
                async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    counts[0 if r.status == 200 else 1] += 1
            except (aiohttp.ClientError, TimeoutError):
                counts[1] += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return counts[0], counts[1]


async def measure(router: Router, args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """One saturation window of ``kind`` ("stream" | "request") through ``router``: the rate and the CPU
    of each of its processes (and of this load generator)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:
        # warm-up: connections opened, code paths taken
        await _requests(session, router.url, clients=8, duration=1.0, max_tokens=1)
        await asyncio.sleep(0.5)  # the warm-up's streams and connections settle
        before, self0, t0 = _cpu(router.pids), cpu_seconds(os.getpid()), time.monotonic()
        if kind == "stream":
            events, done, failed = await _streams(session, router.url, clients=args.streams,
                                                  duration=args.duration, max_tokens=args.max_tokens)
            count = events
        else:
            count, failed = await _requests(session, router.url, clients=args.concurrency,
                                            duration=args.duration, max_tokens=1)
            done = count
        after, self1, t1 = _cpu(router.pids), cpu_seconds(os.getpid()), time.monotonic()
    window = t1 - t0
    used = {role: after[role] - before[role] for role in router.pids}
    total = sum(used.values())
    serving = {r: v for r, v in used.items() if r.startswith("w")} or {"all": total}
    serving_total = sum(serving.values())
    return {
        "router": router.name, "kind": kind, "window_s": round(window, 3), "count": count,
        "completed": done, "failed": failed, "rate": round(count / window, 1),
        "cpu_cores": round(total / window, 3),
        "cpu_us_per_unit": round(total / count * 1e6, 1) if count else None,
        "per_core_ceiling": round(count / total, 1) if total > 0 else None,
        "cpu_by_process": {r: round(v / window, 3) for r, v in used.items()},
        # each request-serving process's share of the router's request-path CPU
        "share": {r: round(v / serving_total, 3) for r, v in serving.items()} if serving_total else {},
        "loadgen_cpu_cores": round((self1 - self0) / window, 3),
    }


async def _vllm_router(procs: Processes, engines: list[str]) -> Router | None:
    binary = find_vllm_router()
    if binary is None:
        return None
    url = await procs.vllm_router(engines, policy="power_of_two")
    return Router("vllm-router power_of_two", url, {"router": procs.procs[-1].pid})


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[int | None]:
    """This process (the load generator) on one core while measuring — the routers and engines, started
    outside, keep every core; the core, or None where there is only one."""
    usable = os.sched_getaffinity(0)
    core = max(usable) if cpu is None else cpu
    if core not in usable or len(usable) < 2:
        yield None
        return
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, usable)


async def relay(args: argparse.Namespace) -> dict[str, Any]:
    """The relay part: every router's stream and request windows, in one run on the same engines."""
    sim = {"max_num_seqs": 100_000, "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "batch_factor": 0,
           "default_max_tokens": args.max_tokens}
    out: dict[str, Any] = {"rows": [], "loadgen_core": None}
    with Processes() as procs:
        engines = list(await asyncio.gather(*(procs.sim(MODEL, **sim) for _ in range(args.engines))))
        for workers in args.workers:
            router, proc = await start_routerd(procs, engines, workers)
            try:
                for kind in args.kinds:
                    with pinned(args.loadgen_cpu) as core:
                        out["loadgen_core"] = core
                        out["rows"].append(await measure(router, args, kind))
            finally:
                await asyncio.to_thread(stop_routerd, proc)
        if args.peers:
            peer = await _vllm_router(procs, engines)
            if peer is None:
                out["peer_note"] = "vllm-router is not installed (pip install vllm-router): left out"
            else:
                for kind in args.kinds:
                    with pinned(args.loadgen_cpu):
                        out["rows"].append(await measure(peer, args, kind))
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"params": {k: v for k, v in vars(args).items() if k != "func"},
                               "machine": {"cpus": os.cpu_count(), "usable": len(os.sched_getaffinity(0)),
                                           "loadavg": os.getloadavg()}}
    if not args.no_relay:
        results["relay"] = await relay(args)
    if not args.no_idle:
        idle = _idle_module()
        if idle is None:
            results["idle_note"] = "routerd_bench.scale_idle is not installed: the idle part is left out"
        else:
            results["idle"] = await idle.run(args)
    if not args.no_replicas:
        results["replicas"] = await scale_replicas.quality(args)
    if not args.no_failover:
        results["failover"] = await scale_replicas.failover(args)
    return results


def _idle_module() -> Any:
    """``routerd_bench.scale_idle`` (the idle-CPU part: ``async def run(args) -> dict``), if present."""
    try:
        return importlib.import_module("routerd_bench.scale_idle")
    except ModuleNotFoundError as e:
        if e.name != "routerd_bench.scale_idle":
            raise
        return None


def report(results: dict[str, Any]) -> None:
    relayed = results.get("relay")
    if relayed:
        rows = []
        for r in relayed["rows"]:
            unit = "events/s" if r["kind"] == "stream" else "req/s"
            shares = " ".join(f"{k}={v:.2f}" for k, v in sorted(r["share"].items()))
            rows.append([r["router"], unit, r["rate"], r["cpu_cores"], r["cpu_us_per_unit"],
                         r["per_core_ceiling"], shares, r["loadgen_cpu_cores"], r["failed"]])
        print_table(f"relay at saturation (load generator pinned to core {relayed['loadgen_core']}; "
                    f"load average at start {results['machine']['loadavg'][0]:.2f})",
                    ["router", "unit", "rate", "router cpu", "cpu µs/unit", "per core", "worker shares",
                     "loadgen cpu", "failed"], rows)
        if relayed.get("peer_note"):
            print(relayed["peer_note"])
    idle = results.get("idle")
    if idle is not None:
        module = _idle_module()
        if module is not None and hasattr(module, "report"):
            module.report(idle)
        else:
            print("\nidle\n" + json.dumps(idle, indent=2, sort_keys=True))
    elif results.get("idle_note"):
        print(results["idle_note"])
    scale_replicas.report(results)


def parser() -> argparse.ArgumentParser:
    """Every part's options (the idle part's from its module)."""
    ap = argparse.ArgumentParser(prog="routerd bench scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="routerd runs, one per count")
    ap.add_argument("--kinds", nargs="+", choices=["stream", "request"], default=["stream", "request"])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--streams", type=int, default=192, help="concurrent chat streams (closed loop)")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop non-streamed clients")
    ap.add_argument("--max-tokens", type=int, default=200, help="events per stream")
    ap.add_argument("--itl-ms", type=float, default=10.0, help="the engines' time between events")
    ap.add_argument("--ttft-ms", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per window")
    ap.add_argument("--loadgen-cpu", type=int, default=None,
                    help="the core the load generator is pinned to (default: the last usable one)")
    ap.add_argument("--no-peers", dest="peers", action="store_false", help="leave vLLM Router out")
    ap.add_argument("--no-relay", action="store_true", help="leave the relay part out")
    ap.add_argument("--no-idle", action="store_true", help="leave the idle part out")
    ap.add_argument("--no-replicas", action="store_true", help="leave routing quality with N processes out")
    ap.add_argument("--no-failover", action="store_true", help="leave the controller failover out")
    ap.add_argument("--processes", type=int, default=4, help="routerd run on one Redis, against one")
    ap.add_argument("--quality-workloads", nargs="+", choices=wl.WORKLOADS,
                    default=list(scale_replicas.QUALITY_WORKLOADS))
    ap.add_argument("--quality-duration", type=float, default=5.0, help="seconds of arrivals per run")
    ap.add_argument("--load", type=float, default=0.8, help="arrivals as a fraction of measured capacity")
    ap.add_argument("--calibrate-s", type=float, default=2.0, help="seconds per capacity measurement")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--failover-rate", type=float, default=50.0, help="requests/s to each replica")
    ap.add_argument("--failover-jobs-rate", type=float, default=10.0, help="queue jobs/s (0: none)")
    ap.add_argument("--failover-engines", type=int, default=2)
    ap.add_argument("--failover-before-s", type=float, default=3.0, help="load before the SIGKILL")
    ap.add_argument("--failover-after-s", type=float, default=3.0, help="load after the takeover")
    ap.add_argument("--lease-s", type=float, default=0.0, help="control.lease_s (0: the default)")
    idle = _idle_module()
    if idle is not None:  # its own options (--instances, --seconds, --warmup, --page)
        idle.add_arguments(ap)
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from routerd import log

    log.setup("warning")  # the bench's own Redis and Ray lines are not the figures
    results = asyncio.run(run(args))
    report(results)
    write_json(args.json, results)
    return 0
