"""The parts of ``routerd bench scale`` that need several ``routerd run`` processes (issue 20, item 6).

**Routing quality with 1 and N processes** (``quality``). ``routerd bench routing``'s heterogeneous
and multiturn workloads (:mod:`routerd_bench.workloads`) with its calibration, plan, client and
figures (:mod:`routerd_bench.routing`: ``run_workload`` measures the capacity and fixes the plan,
``drive`` sends it — the i-th request to the (i mod N)-th router, a round-robin load balancer —
``later_turn_hit_ratio`` and the engines' counters give the hit ratios). What differs from that
benchmark's ``--replicas``: the routers here are real daemons sharing what issue 20 shares —
``routerd run`` processes with the same config on one Redis (the bench's own ``EmbeddedRedis``, fresh
per run), each its own consumer name, so load, scrapes and sessions are shared through Redis, exactly
as replicas behind a load balancer run. Each run is on fresh engines and a fresh Redis; where the
engines publish KV events (multiturn) routerd runs once by the events and once by its request-side
model (events off), each with 1 and N processes.

**Controller failover under load** (``failover``). A Ray head of its own, one Redis, two ``routerd
run`` with the same config over a simulated fleet launched through Ray (``engine = "sim"``, the
default ``control.lease_s`` unless ``--lease-s``). The first started controls; both take requests at
``--failover-rate`` each (open loop, :class:`routerd_bench.restart.RateLoad`); the controller is
SIGKILLed; measured: the time from the kill to the survivor's ``control_acquired`` (its log's own
timestamp), the survivor's failed requests over the whole window (0 expected), the engines the
survivor launched or restarted (0 expected: it adopts) and whether the engines kept their PIDs.
Queue jobs go in at ``--failover-jobs-rate`` over the same window (both replicas consume); after it,
every job's result is awaited — those the killed replica held come back once the survivor reclaims
them (``redis.reclaim_idle_ms``, default 30 s) — and the results on the one reply stream are counted
per job: lost (none) and doubled (more than one) are expected 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from routerd._net import free_port
from routerd.client import QueueClient
from routerd.queue_wire import decode_result
from routerd.redis_server import EmbeddedRedis

from . import routing
from . import workloads as wl
from ._common import SHARED_SECRET, Processes, print_table, stop_process, summary, to_toml
from .ray_nodes import own_head
from .restart import RateLoad, child_env, logged, start_routerd

QUALITY_WORKLOADS = ("heterogeneous", "multiturn")
FAILOVER_MODEL = "sim-scale"
REPLIES = "bench:scale:replies"  # one reply stream for every job: a result written twice shows there


@dataclass
class Replica:
    """One ``routerd run`` of a run: where it serves, its process and its JSON log."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path


def config_text(sections: dict[str, dict[str, Any]], fleets: Sequence[dict[str, Any]]) -> str:
    """A ``routerd.toml`` from plain sections and ``[[fleets]]`` entries."""
    return to_toml({**sections, "fleets": list(fleets)})


def start_replica(run_dir: Path, name: str, redis_url: str, fleets: Sequence[dict[str, Any]],
                  extra: dict[str, dict[str, Any]] | None = None,
                  env: dict[str, str] | None = None) -> Replica:
    """``routerd run`` named ``name`` (its Redis consumer, so its control ident) on ``redis_url``."""
    port = free_port()
    state = run_dir / name
    state.mkdir(parents=True, exist_ok=True)
    sections: dict[str, dict[str, Any]] = {
        "daemon": {"state_dir": str(state), "drain_timeout_s": 5.0, "log_level": "info"},
        "http": {"host": "127.0.0.1", "port": port},
        "redis": {"url": redis_url, "consumer": name, "block_ms": 200},
        **(extra or {})}
    # Replicas with their own state dirs share one secret, or each refuses the others' records (and
    # their launched engines' API key is derived from it).
    sections["control"] = {"secret": SHARED_SECRET, **sections.get("control", {})}
    path = state / "routerd.toml"
    path.write_text(config_text(sections, fleets))
    log_path = state / "routerd.log"
    proc = start_routerd(path, env or child_env(), log_path, None)
    return Replica(name, f"http://127.0.0.1:{port}", proc, log_path)


def log_events(log_path: Path, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of one ``routerd run`` whose event is ``event``."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if f'"{event}"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


async def fleets_view(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/admin/fleets", timeout=aiohttp.ClientTimeout(total=5)) as r:
        data: dict[str, Any] = await r.json()
        return data


async def poll_view(session: aiohttp.ClientSession, replica: Replica, cond: Any, what: str,
                    timeout_s: float = 60.0) -> dict[str, Any]:
    """``replica``'s ``/admin/fleets`` once ``cond(view)`` holds (its process alive meanwhile)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            raise RuntimeError(f"{replica.name} exited with {replica.proc.returncode} waiting for {what}; "
                               f"see {replica.log_path}")
        try:
            view = await fleets_view(session, replica.url)
            last = view
            if cond(view):
                return view
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as e:
            last = repr(e)
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{replica.name}: no {what} within {timeout_s}s (last view: {str(last)[:300]}); "
                       f"see {replica.log_path}")


@contextlib.asynccontextmanager
async def replicas(procs: Processes, n: int, fleets: Sequence[dict[str, Any]],
                   extra: dict[str, dict[str, Any]] | None = None) -> AsyncIterator[list[Replica]]:
    """``n`` ``routerd run`` with the same config on a fresh Redis of their own, each ready; stopped
    (SIGTERM, then the Redis) on the way out."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"x{n}-", dir=procs.tmp.name))
    async with EmbeddedRedis(run_dir / "redis") as redis_url:
        started: list[Replica] = []
        try:
            for i in range(n):
                started.append(await asyncio.to_thread(start_replica, run_dir, f"r{i}", redis_url, fleets,
                                                       extra))
            await asyncio.gather(*(logged(r.log_path, "routerd_ready", r.proc, timeout_s=180.0)
                                   for r in started))
            yield started
        finally:
            await asyncio.gather(*(asyncio.to_thread(stop_process, r.proc, 30.0) for r in started))


# routing quality ---------------------------------------------------------------------------------


def _routable(events: bool, n_engines: int) -> Any:
    """Every instance ready and scraped (by the events' cache view too, when routed by them)."""

    def ok(view: dict[str, Any]) -> bool:
        insts = view["fleets"][wl.MODEL]["instances"]
        ready = [i for i in insts if i["state"] == "ready" and i["scrape_age_s"] is not None
                 and (not events or (i.get("cache_view") or {}).get("cache_view") == "events")]
        return len(ready) == n_engines
    return ok


async def quality_run(session: aiohttp.ClientSession, work: wl.Workload, fleet: Sequence[dict[str, Any]],
                      plan: Sequence[wl.Request], n: int, events: bool) -> dict[str, Any]:
    """``plan`` through ``n`` routerd on one Redis, on fresh engines: its figures."""
    with Processes() as procs:
        engines = list(await asyncio.gather(*(procs.sim(wl.MODEL, **k) for k in fleet)))
        cfg = {"name": wl.MODEL, "model": wl.MODEL, "engine": "static", "urls": engines,
               "engine_args": routing.events_args(work) if events else {}}
        async with replicas(procs, n, [cfg]) as rs:
            for r in rs:
                await poll_view(session, r, _routable(events, len(engines)), "every instance routable")
                if events:  # its keying worker up: its start (seconds of CPU) is not the run's
                    await logged(r.log_path, "keying_process_ready", r.proc, timeout_s=120.0)
            before = await routing.scrape(session, engines)
            t0 = time.perf_counter()
            outcomes = await routing.drive(session, [r.url for r in rs], plan, "none")
            elapsed = time.perf_counter() - t0
            after = await routing.scrape(session, engines)
            # what each process learned of each instance (capacity, speed): the processes should agree
            names = dict(zip(engines, work.kinds, strict=True))
            views = {r.name: await routing._routerd_view(session, r.url, names) for r in rs}
    ok = [o for o in outcomes if o.timing.ok]

    def delta(name: str) -> list[float]:
        return [a[name] - b[name] for a, b in zip(after, before, strict=True)]

    hits, queries = sum(delta(routing.COUNTERS[0])), sum(delta(routing.COUNTERS[1]))
    served = delta(routing.COUNTERS[2])
    return {
        "processes": n, "view": "events" if events else "model",
        "label": f"routerd ×{n}" + (" events" if events else (" model" if work.kv_events else "")),
        "requests": len(outcomes), "failed": len(outcomes) - len(ok), "elapsed_s": round(elapsed, 2),
        "ttft_ms": summary([o.timing.ttft for o in ok]), "e2e_ms": summary([o.timing.e2e for o in ok]),
        "prefix_hit_ratio": round(hits / queries, 4) if queries else math.nan,
        "later_turn_hit_ratio": routing.later_turn_hit_ratio(outcomes),
        "share": {k: round(s / max(sum(served), 1), 4) for k, s in zip(work.kinds, served, strict=True)},
        "routerd_views": views,
        # where the tail is: on one instance (the routing) or on every one (the machine)
        "ttft_ms_by_instance": {i: summary([o.timing.ttft for o in ok if o.timing.instance == i])
                                for i in sorted({o.timing.instance for o in ok})},
    }


async def quality(args: argparse.Namespace) -> dict[str, Any]:
    """Each of ``args.quality_workloads`` with 1 and ``args.processes`` routerd (and, where the engines
    publish KV events, by them and by the request-side model); then the issue's targets."""
    out: dict[str, Any] = {"processes": args.processes, "workloads": {}}
    plan_args = argparse.Namespace(capacity_rps=0.0, seed=args.seed, load=args.load,
                                   duration=args.quality_duration, scale=1.0, calibrate_s=args.calibrate_s,
                                   session="none")
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for name in args.quality_workloads:
            # routing's own calibration and plan (no router run there): the same arrivals as its runs
            w = await routing.run_workload(session, name, plan_args, [])
            work = wl.build(name, scale=1.0, engine_seed=args.seed)
            plan = work.plan(args.load * w["capacity_rps"], args.quality_duration, args.seed)
            if routing.plan_digest(plan) != w["plan_digest"]:
                raise RuntimeError(f"{name}: the plan differs from the one routing calibrated")
            fleet = wl.fit_kv(work, plan)[0] if work.kv_fill else work.fleet
            w["runs"] = []
            for events in ((True, False) if work.kv_events else (False,)):
                for n in (1, args.processes):
                    result = await quality_run(session, work, fleet, plan, n, events)
                    w["runs"].append(result)
                    print(f"  {result['label']:<22} {result['requests'] - result['failed']} ok, "
                          f"{result['failed']} failed, {result['elapsed_s']} s", flush=True)
            out["workloads"][name] = w
    out["targets"] = quality_targets(out)
    return out


def quality_targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 20's: N processes' heterogeneous p99 TTFT ≤ 1.2 × one's; multiturn later turns' hit ratio
    with events ≥ 0.95 × one's (the fleet's hit ratio beside it)."""
    n = out["processes"]
    targets: list[dict[str, Any]] = []

    def run(work: str, procs: int, view: str) -> dict[str, Any] | None:
        for r in out["workloads"].get(work, {}).get("runs", []):
            if r["processes"] == procs and r["view"] == view:
                return dict(r)
        return None

    one, many = run("heterogeneous", 1, "model"), run("heterogeneous", n, "model")
    if one and many and one["ttft_ms"]["p99"]:
        value = many["ttft_ms"]["p99"] / one["ttft_ms"]["p99"]
        targets.append({"workload": "heterogeneous", "target": f"{n} processes: p99 TTFT ÷ one's ≤ 1.2",
                        "value": round(value, 3), "limit": 1.2, "met": math.isfinite(value) and value <= 1.2})
    for view in ("events", "model"):
        one, many = run("multiturn", 1, view), run("multiturn", n, view)
        if not (one and many):
            continue
        for metric, what in (("later_turn_hit_ratio", "later turns' hit ratio"),
                             ("prefix_hit_ratio", "fleet hit ratio")):
            value = many[metric] / one[metric] if one[metric] else math.nan
            target = view == "events" and metric == "later_turn_hit_ratio"
            targets.append({"workload": "multiturn", "target": f"{n} processes by {view}: {what} ÷ one's"
                            + (" ≥ 0.95" if target else " (no target)"), "value": round(value, 3),
                            "limit": 0.95 if target else None,
                            "met": (math.isfinite(value) and value >= 0.95) if target else None})
    return targets


# controller failover -----------------------------------------------------------------------------


def _ready(n: int) -> Any:
    def ok(view: dict[str, Any]) -> bool:
        insts = view["fleets"]["scale"]["instances"]
        return len(insts) == n and all(i["state"] == "ready" for i in insts)
    return ok


def _pids(view: dict[str, Any]) -> dict[str, int]:
    return {i["id"]: int(i["pid"]) for i in view["fleets"]["scale"]["instances"]}


async def failover(args: argparse.Namespace) -> dict[str, Any]:
    """Two replicas on one Ray head and one Redis, the controller SIGKILLed under load (module doc)."""
    fleet = {"name": "scale", "model": FAILOVER_MODEL, "engine": "sim", "replicas": args.failover_engines,
             "num_cpus_per_instance": 0.5, "max_num_seqs": 64,
             "engine_args": {"max-num-seqs": 64, "ttft-ms": 10, "itl-ms": 5}}
    with own_head() as (address, _), Processes() as procs:
        extra: dict[str, dict[str, Any]] = {
            "ray": {"address": address, "namespace": f"routerd-bench-scale-{os.getpid()}"}}
        if args.lease_s:
            extra["control"] = {"lease_s": args.lease_s}
        run_dir = Path(procs.tmp.name)
        async with EmbeddedRedis(run_dir / "redis") as redis_url, aiohttp.ClientSession() as session:
            # the survivor stops the engines on its way out (the killed one stops nothing)
            env = child_env(ROUTERD_DAEMON_STOP_ENGINES_ON_EXIT="true")
            a = await asyncio.to_thread(start_replica, run_dir, "ctl", redis_url, [fleet], extra)
            b: Replica | None = None
            try:
                await logged(a.log_path, "routerd_ready", a.proc, timeout_s=180.0)
                await poll_view(session, a, lambda v: v["control"]["controls"] and _ready(
                    args.failover_engines)(v), "control and every engine ready", 180.0)
                b = await asyncio.to_thread(start_replica, run_dir, "fol", redis_url, [fleet], extra, env)
                await logged(b.log_path, "routerd_ready", b.proc, timeout_s=180.0)
                view = await poll_view(session, b, lambda v: not v["control"]["controls"] and _ready(
                    args.failover_engines)(v), "following the controller", 60.0)
                before = _pids(view)
                queue = QueueClient.from_url(redis_url)
                try:
                    return await _kill_under_load(session, queue, args, a, b, before)
                finally:
                    await queue.aclose()
            finally:
                for r in (b, a):
                    if r is not None:
                        await asyncio.to_thread(stop_process, r.proc, 60.0)


async def _submit(queue: QueueClient, rate_per_s: float, stop: asyncio.Event, ids: list[str]) -> None:
    """One job every ``1 / rate_per_s`` seconds until ``stop``; their ids into ``ids``."""
    next_at = time.monotonic()
    while not stop.is_set():
        job = await queue.submit({"model": FAILOVER_MODEL, "prompt": "failover", "max_tokens": 4},
                                 reply_to=REPLIES)
        ids.append(job.id)
        next_at += 1.0 / rate_per_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))


async def _jobs_outcome(queue: QueueClient, ids: list[str], timeout_s: float) -> dict[str, Any]:
    """Every job's result awaited (up to ``timeout_s``), then the reply stream's results per job."""
    t0 = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await queue.wait_many(ids, timeout=timeout_s)
    waited = time.monotonic() - t0
    async with asyncio.timeout(30):
        entries = await queue.redis.xrange(REPLIES)
    per_job: dict[str, int] = {}
    errors = 0
    for _, fields in entries:
        if b"result" in fields:
            result = decode_result(fields[b"result"])
            per_job[result.id] = per_job.get(result.id, 0) + 1
            errors += result.status != "ok"
    return {"submitted": len(ids), "results": sum(per_job.values()),
            "lost": sum(1 for j in ids if j not in per_job),
            "doubled": sum(1 for n in per_job.values() if n > 1), "errors": errors,
            "all_results_after_s": round(waited, 2)}


async def _kill_under_load(session: aiohttp.ClientSession, queue: QueueClient, args: argparse.Namespace,
                           ctl: Replica, fol: Replica, before: dict[str, int]) -> dict[str, Any]:
    loads = {r.name: RateLoad(r.url, FAILOVER_MODEL, rate_per_s=args.failover_rate) for r in (ctl, fol)}
    stops = {name: asyncio.Event() for name in [*loads, "queue"]}
    jobs: list[str] = []
    drivers = [asyncio.create_task(load.run(stops[name])) for name, load in loads.items()]
    if args.failover_jobs_rate > 0:
        drivers.append(asyncio.create_task(_submit(queue, args.failover_jobs_rate, stops["queue"], jobs)))
    try:
        await asyncio.sleep(args.failover_before_s)
        killed_at = time.time()
        ctl.proc.send_signal(signal.SIGKILL)
        stops[ctl.name].set()  # the killed replica's clients go elsewhere; its figures are apart
        await asyncio.to_thread(ctl.proc.wait, 10)
        lease = args.lease_s or 5.0
        await poll_view(session, fol, lambda v: v["control"]["controls"], "control", 3 * lease + 30)
        taken = log_events(fol.log_path, "control_acquired")[-1]
        view = await poll_view(session, fol, _ready(len(before)), "every engine ready", 60.0)
        await asyncio.sleep(args.failover_after_s)
    finally:
        for stop in stops.values():
            stop.set()
        await asyncio.gather(*drivers)
    queued = await _jobs_outcome(queue, jobs, 120.0) if jobs else None
    relaunched = sum(len(log_events(fol.log_path, e)) for e in ("engine_started", "engine_restarted"))
    survivor, killed = loads[fol.name].summary(), loads[ctl.name].summary()
    gap = float(taken["at"]) - killed_at
    return {
        "lease_s": float(taken.get("lease_s", lease)), "rate_per_s_each": args.failover_rate,
        "engines": len(before), "kill_to_control_acquired_s": round(gap, 3),
        "engines_relaunched_by_survivor": relaunched, "engine_pids_kept": _pids(view) == before,
        "survivor": survivor, "killed_replica": {k: killed[k] for k in ("ok", "refused", "failed")},
        "queue": queued,
        "targets": [
            {"target": "control taken within the lease + 1 s", "value": round(gap, 3),
             "limit": float(taken.get("lease_s", lease)) + 1.0,
             "met": gap <= float(taken.get("lease_s", lease)) + 1.0},
            {"target": "failed requests on the surviving replica = 0",
             "value": survivor["failed"] + survivor["refused"], "limit": 0,
             "met": survivor["failed"] + survivor["refused"] == 0},
            {"target": "engines relaunched = 0 (adopted, same PIDs)", "value": relaunched, "limit": 0,
             "met": relaunched == 0 and _pids(view) == before},
            *([{"target": "queue jobs lost or doubled = 0", "value": queued["lost"] + queued["doubled"],
                "limit": 0, "met": queued["lost"] + queued["doubled"] == 0}] if queued else []),
        ],
    }


# report ----------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> None:
    q = results.get("replicas")
    if q:
        for name, w in q["workloads"].items():
            rows = [[r["label"], r["ttft_ms"]["mean"], r["ttft_ms"]["p99"], r["e2e_ms"]["p99"],
                     r["prefix_hit_ratio"], r["later_turn_hit_ratio"],
                     " ".join(f"{k}={v:.2f}" for k, v in r["share"].items()), r["failed"]] for r in w["runs"]]
            print_table(f"{name} through 1 and {q['processes']} routerd on one Redis (round-robin client): "
                        f"{w['requests']} requests at {w['rate_rps']} req/s; load avg "
                        f"{w['load_avg_at_start'][0]:.2f}",
                        ["routers", "ttft mean ms", "ttft p99 ms", "e2e p99 ms", "hit ratio", "later turns",
                         "share", "failed"], rows)
    f = results.get("failover")
    if f:
        s = f["survivor"]
        print_table(f"controller failover: 2 replicas, {f['engines']} engines through Ray, lease "
                    f"{f['lease_s']} s, {f['rate_per_s_each']:.0f} req/s to each",
                    ["figure", "value"],
                    [["SIGKILL → control_acquired (s)", f["kill_to_control_acquired_s"]],
                     ["survivor: ok / failed / refused", f"{s['ok']} / {s['failed']} / {s['refused']}"],
                     ["survivor: latency p99 / max (s)", f"{s['latency_p99_s']} / {s['latency_max_s']}"],
                     ["engines relaunched by the survivor", f["engines_relaunched_by_survivor"]],
                     ["engine PIDs kept", f["engine_pids_kept"]],
                     *([["queue jobs: submitted / lost / doubled / errors",
                         f"{qj['submitted']} / {qj['lost']} / {qj['doubled']} / {qj['errors']}"],
                        ["queue: every result after the window (s)", qj["all_results_after_s"]]]
                       if (qj := f.get("queue")) else [])])
    targets = [*(q or {}).get("targets", []),
               *({"workload": "failover", **t} for t in (f or {}).get("targets", []))]
    if targets:
        print_table("targets (several processes)", ["workload", "target", "value", "met"],
                    [[t["workload"], t["target"], t["value"],
                      "-" if t["met"] is None else ("yes" if t["met"] else "NO")] for t in targets])
