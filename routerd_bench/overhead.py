"""``routerd bench overhead``: the latency routerd adds per request, and the rate it sustains on one core.

Method:

* Simulated engines with a fixed latency (``batch_factor = 0``, large ``max_num_seqs``, so a request's
  time does not depend on what else runs; zero model time by default, so that the engine's step
  boundaries do not put the two requests of a pair into different steps) each in their own
  process; routerd's data plane in its own process (uvloop, ``least_load``, info logging with its
  one canonical line per request, to /dev/null).
* **Peers** (``--peers``, by default the Rust vLLM Router with ``power_of_two``) run in front of the
  same engines and go through every phase below right after routerd, in the same run.
* **Added latency, one request at a time (sequential):** ``--sequential`` requests, each sent straight
  to an engine and then through the router; the differences show the idle path.
* **Added latency (paired):** Poisson arrivals at each of ``--rates``; each arrival sends the *same*
  request twice at the same instant, once straight to an engine (round-robin over them) and once
  through routerd (which routes it to one of the same engines). The per-pair difference of end-to-end
  latency (and, for streams, of time to first token) is routerd's added latency; p50/p90/p99 over all
  pairs. A control run sends both requests of each pair direct: its spread is the measurement's own
  noise (a shared CPU, the engine's step timing).
* **Added latency per route** (``--routes``, by default chat, embeddings and the Responses API):
  ``--sequential`` rounds, one request at a time; each round sends every route's request straight to an
  engine and then through routerd, the routes interleaved so that a drifting machine shifts them all
  alike. The added p50 of each route against chat's says what a route's own reading (its body, its
  usage, its answer) costs beyond the one sequence they share.
* **Sustained rate:** ``--concurrency`` closed-loop clients through routerd for ``--duration``
  seconds; completed requests per second, and routerd's CPU seconds from ``/proc`` over the same
  window. ``rate / cpu_share`` is what one fully used core would carry (routerd is one event loop),
  and ``cpu_share / rate`` the CPU time one request costs.
* **Instructions per request** (``--instructions N``, needs valgrind): CPU time per request swings
  with whatever else a shared machine runs; the instructions a request costs do not. A second data
  plane runs under ``valgrind --tool=callgrind`` with counting switched on only while ``N`` requests
  run one at a time, its scrapes and heartbeats slowed to once a minute so that their time-driven
  work does not land in the count of a process slowed fifty-fold; what idle work is left is counted
  apart and taken out (the net figure, :func:`instructions`).
* **What tracing costs** (``--tracing``): a second routerd, ``routerd+tracing``, traces every request
  (``sample_ratio = 1.0``) to a do-nothing OTLP/HTTP receiver in a process of its own (so its CPU is
  not routerd's), and goes through every phase beside the first; ``--instructions`` counts both
  under callgrind, every thread of the data plane (the export thread's encoding and posting) included.
  ``--tracing-endpoint URL`` sends the spans to a collector of one's own instead.

Both for non-streaming and streaming requests. The load generator and engines share the machine with
routerd, so on a small machine the figures are an upper bound of the real overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from routerd._net import free_port
from routerd.tracing._export import DELAY_S

from ._common import (
    Processes,
    Timing,
    cpu_seconds,
    print_table,
    summary,
    timed_request,
    wait_http,
    write_json,
)

MODEL = "bench"
TRACED = "routerd+tracing"


def _route_bodies(max_tokens: int) -> dict[str, tuple[str, bytes]]:
    """What ``--routes`` may name: its path and one non-streamed request of it."""
    text = "the quick brown fox"
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                          "max_tokens": max_tokens, "ignore_eos": True}),
        "completions": ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": max_tokens,
                                            "ignore_eos": True}),
        "embeddings": ("/v1/embeddings", {"model": MODEL, "input": text}),
        "responses": ("/v1/responses", {"model": MODEL, "input": text, "max_output_tokens": max_tokens,
                                        "store": False}),
        "messages": ("/v1/messages", {"model": MODEL, "max_tokens": max_tokens,
                                      "messages": [{"role": "user", "content": text}]}),
        "rerank": ("/v1/rerank", {"model": MODEL, "query": text, "documents": [text, "a lazy dog"]}),
        "tokenize": ("/tokenize", {"model": MODEL, "prompt": text}),
    }
    return {name: (path, msgspec.json.encode(body)) for name, (path, body) in bodies.items()}


ROUTES = ("chat", "completions", "embeddings", "responses", "messages", "rerank", "tokenize")


async def per_route(session: aiohttp.ClientSession, engines: list[str], router: str, *, routes: list[str],
                    count: int, max_tokens: int) -> list[dict[str, Any]]:
    """``count`` rounds, one request at a time: each route's request direct, then via ``router``, the
    routes interleaved; the added latency per route, and its p50 against chat's."""
    bodies = _route_bodies(max_tokens)
    timings: dict[str, list[tuple[Timing, Timing]]] = {r: [] for r in routes}
    for i in range(count):
        for name in routes:
            path, body = bodies[name]
            direct = await timed_request(session, engines[i % len(engines)] + path, body, False)
            via = await timed_request(session, router + path, body, False)
            timings[name].append((direct, via))
    out: list[dict[str, Any]] = []
    for name in routes:
        ok = [(d, v) for d, v in timings[name] if d.ok and v.ok]
        out.append({"route": name, "path": bodies[name][0], "requests": count, "failed": count - len(ok),
                    "direct_e2e_ms": summary([d.e2e for d, _ in ok]),
                    "added_e2e_ms": summary([v.e2e - d.e2e for d, v in ok])})
    chat = next((r["added_e2e_ms"]["p50"] for r in out if r["route"] == "chat"), None)
    for r in out:
        p50 = r["added_e2e_ms"]["p50"]
        r["vs_chat"] = round(p50 / chat, 2) if chat and p50 is not None else None
    return out


def _body(stream: bool, max_tokens: int) -> bytes:
    return msgspec.json.encode({"model": MODEL, "prompt": "the quick brown fox", "max_tokens": max_tokens,
                                "stream": stream, "ignore_eos": True})


async def paired(session: aiohttp.ClientSession, engines: list[str], routerd: str, *, rate: float,
                 duration: float, stream: bool, max_tokens: int, rng: random.Random) -> dict[str, Any]:
    """Open-loop pairs at ``rate``/s: the same request direct and via routerd, sent together.

    Passing an engine's URL as ``routerd`` gives the control run: both requests direct, so the spread
    of the differences is the measurement's own noise (engine step timing, a shared CPU).
    """
    body = _body(stream, max_tokens)
    pairs: list[tuple[Timing, Timing]] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        direct, via = await asyncio.gather(
            timed_request(session, engines[i % len(engines)] + "/v1/completions", body, stream),
            timed_request(session, routerd + "/v1/completions", body, stream))
        pairs.append((direct, via))

    start = time.perf_counter()
    next_at = start
    i = 0
    while next_at - start < duration:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    elapsed = time.perf_counter() - start
    ok = [(d, v) for d, v in pairs if d.ok and v.ok]
    out: dict[str, Any] = {
        "pairs": len(pairs), "failed": len(pairs) - len(ok), "achieved_rate": round(len(pairs) / elapsed, 1),
        "direct_e2e_ms": summary([d.e2e for d, _ in ok]),
        "routerd_e2e_ms": summary([v.e2e for _, v in ok]),
        "added_e2e_ms": summary([v.e2e - d.e2e for d, v in ok]),
    }
    if stream:
        out["added_ttft_ms"] = summary([v.ttft - d.ttft for d, v in ok])
    return out


async def sustained(session: aiohttp.ClientSession, routerd: str, pid: int, *, concurrency: int,
                    duration: float, stream: bool, max_tokens: int) -> dict[str, Any]:
    """Closed loop through routerd: requests/s and routerd's CPU share over the window."""
    body = _body(stream, max_tokens)
    url = routerd + "/v1/completions"
    done: list[Timing] = []
    stop_at = time.perf_counter() + duration

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            done.append(await timed_request(session, url, body, stream))

    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu1, t1 = cpu_seconds(pid), time.perf_counter()
    ok = [t for t in done if t.ok]
    rate = len(ok) / (t1 - t0)
    share = (cpu1 - cpu0) / (t1 - t0)
    return {"requests": len(done), "failed": len(done) - len(ok), "rate": round(rate, 1),
            "routerd_cpu_share": round(share, 3),
            "rate_per_core": round(rate / share, 1) if share > 0 else None,
            "cpu_us_per_request": round(share / rate * 1e6, 1) if rate > 0 else None,
            "e2e_ms": summary([t.e2e for t in ok])}


def _plane_config(urls: list[str], log_level: str, tracing: str = "") -> dict[str, Any]:
    return {"redis": {"enabled": False}, "daemon": {"log_level": log_level},
            **({"tracing": {"endpoint": tracing, "sample_ratio": 1.0}} if tracing else {}),
            "routing": {"policy": "least_load", "scrape_interval_s": 0.2},
            "admission": {"max_inflight_per_instance": 4096, "max_queued": 100000},
            "fleets": [{"name": "bench", "model": MODEL, "engine": "static", "urls": urls,
                        "max_num_seqs": 1024}]}


async def sequential(session: aiohttp.ClientSession, engines: list[str], router: str, *, count: int,
                     stream: bool, max_tokens: int) -> dict[str, Any]:
    """One request at a time, alternating direct and via ``router``: the latency added on an idle path."""
    body = _body(stream, max_tokens)
    direct: list[Timing] = []
    via: list[Timing] = []
    for i in range(count):
        direct.append(await timed_request(session, engines[i % len(engines)] + "/v1/completions", body,
                                          stream))
        via.append(await timed_request(session, router + "/v1/completions", body, stream))
    ok = [(d, v) for d, v in zip(direct, via, strict=True) if d.ok and v.ok]
    return {"requests": count, "failed": count - len(ok),
            "direct_e2e_ms": summary([d.e2e for d, _ in ok]),
            "added_e2e_ms": summary([v.e2e - d.e2e for d, v in ok])}


def _spawn_callgrind_plane(procs: Processes, engines: list[str], log_level: str, tracing: str = "",
                           name: str = "plane") -> tuple[str, subprocess.Popen[bytes], Path]:
    """A data plane under callgrind, counting nothing yet: its URL, process and dump-file prefix."""
    cfg = _plane_config(engines, log_level, tracing)
    cfg["routing"].update(scrape_interval_s=60.0, stale_after_s=600.0)
    cfg["health"] = {"heartbeat_interval_s": 60.0}
    port = free_port()
    cfg["http"] = {"host": "127.0.0.1", "port": port}
    spec = Path(procs.tmp.name) / f"callgrind-{name}.json"
    spec.write_text(json.dumps({"config": cfg, "capacities": {}}))
    out = Path(procs.tmp.name) / f"callgrind-{name}.out"
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                             f"--callgrind-out-file={out}", sys.executable, "-m", "routerd_bench._common",
                             "plane", str(spec), "--log-level", log_level],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.procs.append(proc)
    return f"http://127.0.0.1:{port}", proc, out


def _dumps(out: Path) -> list[Path]:
    """callgrind's dump files (``out``, ``out.1``, …), oldest first."""
    return sorted(out.parent.glob(out.name + "*"), key=lambda f: f.stat().st_mtime)


def _dumped_instructions(dump: Path) -> int:
    return max((int(line.split()[1]) for line in dump.read_text().splitlines()
                if line.startswith(("summary:", "totals:"))), default=0)


class _Counted:
    """One data plane under callgrind, its counting switched on and off and dumped from outside."""

    def __init__(self, name: str, base: str, proc: subprocess.Popen[bytes], out: Path) -> None:
        self.name, self.url, self.proc, self.out = name, base + "/v1/completions", proc, out

    async def control(self, *args: str) -> None:
        await asyncio.to_thread(subprocess.run, ["callgrind_control", *args, str(self.proc.pid)],
                                check=True, capture_output=True, timeout=120)

    async def dumped(self) -> int:
        """Counting off, the count since the last dump (a new file; the counters are zeroed)."""
        dumps = len(_dumps(self.out))
        await self.control("-i", "off")
        await self.control("-d")
        for _ in range(100):
            if len(_dumps(self.out)) > dumps:
                break
            await asyncio.sleep(0.1)
        return _dumped_instructions(_dumps(self.out)[-1])


IDLE_S = 10.0  # how long the planes' idle work is counted, to take it out of the requests' counts
FLUSH_S = DELAY_S + 2.0  # long enough for the export thread to send what is queued


async def instructions(procs: Processes, session: aiohttp.ClientSession, engines: list[str], *,
                       count: int, max_tokens: int, log_level: str,
                       planes: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Instructions per request under callgrind, ``count`` sequential requests of each kind, for each
    of ``planes`` (name → the OTLP endpoint it traces every request to, ``""``: not traced); empty when
    valgrind is not installed.

    The planes run side by side and take turns, one request each, so that each is measured in the same
    conditions. A plane also works when idle (admission's sweep, the export thread's wake-ups), more of it the
    slower a loaded machine runs the count; that idle rate is counted for :data:`IDLE_S` first (after
    the warm-up's spans are exported), and ``net_instructions_per_request`` is the count less it over
    the requests' window, which ends :data:`FLUSH_S` after the last request so that the spans it made
    are exported in it (``instructions_per_request`` is the raw count)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions skipped: valgrind is not installed")
        return []
    counted = []
    for name, tracing in (planes or {"routerd": ""}).items():
        base, proc, out = _spawn_callgrind_plane(procs, engines, log_level, tracing,
                                                 name=name.replace("+", "-"))
        counted.append(_Counted(name, base, proc, out))
    for c in counted:
        await wait_http(c.url.removesuffix("/v1/completions") + "/readyz", timeout=600.0, proc=c.proc)
    rows = []
    for stream in (False, True):
        body = _body(stream, max_tokens)
        for _ in range(50):  # warm-up, not counted
            for c in counted:
                await timed_request(session, c.url, body, stream)
        await asyncio.sleep(FLUSH_S)  # the warm-up's spans exported: not in the idle count
        await asyncio.gather(*(c.control("-i", "on") for c in counted))
        t0 = time.monotonic()
        await asyncio.sleep(IDLE_S)
        idle_s = time.monotonic() - t0
        idle = await asyncio.gather(*(c.dumped() for c in counted))
        failed = dict.fromkeys(range(len(counted)), 0)
        await asyncio.gather(*(c.control("-i", "on") for c in counted))
        t0 = time.monotonic()
        for _ in range(count):
            for i, c in enumerate(counted):
                failed[i] += not (await timed_request(session, c.url, body, stream)).ok
        await asyncio.sleep(FLUSH_S)  # the window's spans exported within it
        window_s = time.monotonic() - t0
        totals = await asyncio.gather(*(c.dumped() for c in counted))
        for i, c in enumerate(counted):
            background = idle[i] / idle_s * window_s
            rows.append({"kind": "stream" if stream else "non_stream", "router": c.name, "requests": count,
                         "failed": failed[i], "instructions_per_request": round(totals[i] / count),
                         "idle_instructions_per_s": round(idle[i] / idle_s),
                         "net_instructions_per_request": round((totals[i] - background) / count)})
    return rows


async def _otlp_sink(procs: Processes) -> str:
    """A do-nothing OTLP/HTTP receiver (it answers 200 to every ``POST /v1/traces``) in a process of
    its own, so that what it costs is not counted as routerd's: its base URL."""
    port = free_port()
    proc = procs._spawn([sys.executable, "-m", "routerd_bench.overhead", "sink", str(port)])
    url = f"http://127.0.0.1:{port}"
    await wait_http(url + "/health", proc=proc)
    return url


def _serve_sink(port: int) -> None:
    from aiohttp import web

    async def traces(request: web.Request) -> web.Response:
        await request.read()  # an empty ExportTraceServiceResponse: all taken
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def _peers(procs: Processes, engines: list[str], names: list[str]) -> dict[str, tuple[str, int]]:
    """Peer routers in front of the same engines: name → (URL, pid). Missing ones are reported."""
    out: dict[str, tuple[str, int]] = {}
    for name in names:
        policy = name.split(":", 1)[1] if ":" in name else "power_of_two"
        try:
            url = await procs.vllm_router(engines, policy=policy)
        except LookupError as e:
            print(f"peer {name} skipped: {e}")
            continue
        out[name] = (url, procs.procs[-1].pid)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    sim = {"max_num_seqs": 1024, "ttft_ms": args.engine_ttft_ms, "itl_ms": args.engine_itl_ms,
           "batch_factor": 0, "default_max_tokens": args.max_tokens}
    results: dict[str, Any] = {"params": vars(args).copy(), "paired": [], "sustained": [], "sequential": [],
                               "instructions": [], "routes": []}
    with Processes() as procs:
        engines = list(await asyncio.gather(*(procs.sim(MODEL, **sim) for _ in range(args.engines))))
        url, proc = await procs.plane(_plane_config(engines, args.log_level), log_level=args.log_level)
        routers = {"routerd": (url, proc.pid)}
        collector = args.tracing_endpoint or (await _otlp_sink(procs) if args.tracing else "")
        if collector:
            url, proc = await procs.plane(_plane_config(engines, args.log_level, collector),
                                          log_level=args.log_level)
            routers[TRACED] = (url, proc.pid)
        routers.update(await _peers(procs, engines, args.peers))
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for target, _pid in routers.values():  # warm-up: connections, code paths
                await paired(session, engines, target, rate=100, duration=1.0, stream=False,
                             max_tokens=args.max_tokens, rng=rng)
            if args.routes:  # routerd alone: a peer may serve only the OpenAI routes
                results["routes"] = await per_route(session, engines, routers["routerd"][0],
                                                    routes=args.routes, count=args.sequential,
                                                    max_tokens=args.max_tokens)
            for stream in (False, True):
                kind = "stream" if stream else "non_stream"
                for name, (target, _pid) in routers.items():
                    seq = await sequential(session, engines, target, count=args.sequential, stream=stream,
                                           max_tokens=args.max_tokens)
                    results["sequential"].append({"kind": kind, "router": name, **seq})
                for rate in args.rates:
                    control = await paired(session, engines[:1], engines[0], rate=rate,
                                           duration=args.duration / 2, stream=stream,
                                           max_tokens=args.max_tokens, rng=rng)
                    row: dict[str, Any] = {"kind": kind, "rate": rate, "control": control}
                    # The same seeded arrivals for every router, one after the other on the same engines.
                    for name, (target, _pid) in routers.items():
                        row[name] = await paired(session, engines, target, rate=rate,
                                                 duration=args.duration, stream=stream,
                                                 max_tokens=args.max_tokens,
                                                 rng=random.Random(args.seed + int(rate)))
                    results["paired"].append(row)
                for name, (target, pid) in routers.items():
                    s = await sustained(session, target, pid, concurrency=args.concurrency,
                                        duration=args.duration, stream=stream, max_tokens=args.max_tokens)
                    results["sustained"].append({"kind": kind, "router": name, **s})
            if args.instructions:
                planes = {"routerd": "", **({TRACED: collector} if collector else {})}
                results["instructions"] = await instructions(
                    procs, session, engines, count=args.instructions, max_tokens=args.max_tokens,
                    log_level=args.log_level, planes=planes)
    results["routers"] = list(routers)
    return results


def report(results: dict[str, Any]) -> None:
    routers = results.get("routers", ["routerd"])
    rows = []
    for r in results["sequential"]:
        a = r["added_e2e_ms"]
        rows.append([r["kind"], r["router"], a["p50"], a["p90"], a["p99"], r["direct_e2e_ms"]["p50"],
                     r["failed"]])
    print_table("added latency, one request at a time (idle path), ms",
                ["requests", "router", "p50", "p90", "p99", "direct p50", "failed"], rows)
    if results.get("routes"):
        print_table("added latency per route, one request at a time (routes interleaved), ms",
                    ["route", "path", "p50", "p90", "p99", "direct p50", "p50 vs chat", "failed"],
                    [[r["route"], r["path"], r["added_e2e_ms"]["p50"], r["added_e2e_ms"]["p90"],
                      r["added_e2e_ms"]["p99"], r["direct_e2e_ms"]["p50"],
                      "" if r["vs_chat"] is None else f"{r['vs_chat']:.2f}x", r["failed"]]
                     for r in results["routes"]])
    rows = []
    for r in results["paired"]:
        for name in routers:
            m = r[name]
            a = m["added_e2e_ms"]
            rows.append([r["kind"], r["rate"], name, "added e2e", a["p50"], a["p90"], a["p99"],
                         m["direct_e2e_ms"]["p50"], m["failed"]])
            if "added_ttft_ms" in m:
                t = m["added_ttft_ms"]
                rows.append([r["kind"], r["rate"], name, "added ttft", t["p50"], t["p90"], t["p99"], "", ""])
        n = r["control"]["added_e2e_ms"]
        rows.append([r["kind"], r["rate"], "-", "noise (direct-direct)", n["p50"], n["p90"], n["p99"],
                     r["control"]["direct_e2e_ms"]["p50"], r["control"]["failed"]])
    print_table("added latency (paired: same request direct and via the router), ms",
                ["requests", "pairs/s", "router", "metric", "p50", "p90", "p99", "direct p50", "failed"],
                rows)
    rows = []
    cpu = {s["kind"]: s["cpu_us_per_request"] for s in results["sustained"] if s.get("router") == "routerd"}
    for s in results["sustained"]:
        rows.append([s["kind"], s.get("router", "routerd"), s["rate"], s["routerd_cpu_share"],
                     s["rate_per_core"], s["cpu_us_per_request"],
                     _added(s["cpu_us_per_request"], cpu.get(s["kind"])) if s.get("router") == TRACED else "",
                     s["e2e_ms"]["p50"], s["e2e_ms"]["p99"], s["failed"]])
    print_table("sustained rate through the router (closed loop)",
                ["requests", "router", "req/s", "cpu", "req/s per core", "cpu µs/req", "vs routerd", "p50 ms",
                 "p99 ms", "failed"], rows)
    if results.get("instructions"):
        rows = results["instructions"]
        untraced = {(r["kind"], k): r[k] for r in rows if r["router"] == "routerd"
                    for k in ("instructions_per_request", "net_instructions_per_request")}

        def vs(r: dict[str, Any], k: str) -> str:
            return _added(r[k], untraced.get((r["kind"], k))) if r["router"] != "routerd" else ""

        print_table("instructions per request (callgrind, one request at a time, the planes taking turns; "
                    "net: less the plane's idle work over the same time)",
                    ["requests", "router", "count", "instructions", "vs routerd", "net", "vs routerd",
                     "idle/s", "failed"],
                    [[r["kind"], r["router"], r["requests"], r["instructions_per_request"],
                      vs(r, "instructions_per_request"), r["net_instructions_per_request"],
                      vs(r, "net_instructions_per_request"), r["idle_instructions_per_s"], r["failed"]]
                     for r in rows])


def _added(value: float | None, base: float | None) -> str:
    """``value`` against ``base`` in percent (what tracing adds), ``""`` where either is missing."""
    return f"{(value / base - 1) * 100:+.1f} %" if value and base else ""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="routerd bench overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--rates", type=float, nargs="*", default=[100.0, 300.0, 500.0],
                    help="paired arrivals per second (each a direct and a routerd request); none: --rates")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per phase")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop clients for the rate test")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--sequential", type=int, default=300,
                    help="requests sent one at a time (each direct, then via the router)")
    ap.add_argument("--routes", nargs="*", default=["chat", "embeddings", "responses"], choices=ROUTES,
                    help="routes whose added latency is measured side by side, --sequential rounds (none: "
                         "--routes)")
    ap.add_argument("--peers", nargs="*", default=["vllm-router:power_of_two"],
                    help="peer routers measured in the same run (vllm-router:<policy>); none: --peers")
    ap.add_argument("--engine-ttft-ms", type=float, default=0.0,
                    help="engine latency model; 0 keeps its step timing from splitting a pair")
    ap.add_argument("--engine-itl-ms", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instructions", type=int, default=0, metavar="N",
                    help="also count routerd's instructions per request under valgrind over N requests "
                         "of each kind (0: not)")
    ap.add_argument("--tracing", action="store_true",
                    help="what tracing costs: a second routerd traces every request (sample_ratio 1.0) to "
                         "a do-nothing OTLP/HTTP receiver in its own process, measured beside the first")
    ap.add_argument("--tracing-endpoint", default="", metavar="URL",
                    help="as --tracing, the spans sent to this OTLP/HTTP collector instead")
    args = ap.parse_args(argv)
    import uvloop

    results = uvloop.run(run(args))
    report(results)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":  # python -m routerd_bench.overhead sink PORT: the --tracing receiver
    if sys.argv[1:2] != ["sink"] or len(sys.argv) != 3:
        sys.exit("usage: python -m routerd_bench.overhead sink PORT")
    _serve_sink(int(sys.argv[2]))
