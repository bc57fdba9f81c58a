"""``routerd bench routing``: time to first token and latency per policy on a heterogeneous fleet.

Method:

* One static fleet of simulated engines of different speed and batch size (``--fast`` instances with
  ``max_num_seqs=8``, ``ttft_ms=40``, ``itl_ms=10``; ``--slow`` ones with ``max_num_seqs=4``,
  ``ttft_ms=120``, ``itl_ms=30``), each in its own process; routerd in its own process, restarted
  for each policy. Each instance's capacity (``max_num_seqs``) is given to routerd, as a launched
  fleet's config would.
* The fleet's capacity is measured, not computed: one instance of each kind is saturated directly
  (closed loop, twice its batch size) for ``--calibrate-s`` seconds, and the fleet's capacity is the
  sum over instances of their kind's completed requests/s. For each load in ``--loads`` (fractions
  of that), Poisson arrivals of streaming completions
  (``max_tokens = --max-tokens``) for ``--duration`` seconds — the *same* arrival sequence for every
  policy (one seed).
* Per policy and load: mean and p99 of time to first token (first SSE event) and of end-to-end
  latency, the share of requests each instance got, and the p99-TTFT change against round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
from typing import Any

import aiohttp
import msgspec

from ._common import Processes, Timing, print_table, summary, timed_request, write_json

MODEL = "bench"
POLICIES = ("round_robin", "least_load", "power_of_two")


async def measure_capacity(session: aiohttp.ClientSession, url: str, *, concurrency: int, duration: float,
                           max_tokens: int) -> float:
    """Requests/s one instance completes when saturated (closed loop, twice its batch size)."""
    body = msgspec.json.encode({"model": MODEL, "prompt": "route me somewhere quick",
                                "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    stop_at = time.perf_counter() + duration
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            if (await timed_request(session, url + "/v1/completions", body, True)).ok:
                done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def poisson(session: aiohttp.ClientSession, url: str, *, rate: float, duration: float,
                  max_tokens: int, seed: int) -> tuple[list[Timing], float]:
    rng = random.Random(seed)
    body = msgspec.json.encode({"model": MODEL, "prompt": "route me somewhere quick",
                                "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    done: list[Timing] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one() -> None:
        done.append(await timed_request(session, url + "/v1/completions", body, True))

    start = time.perf_counter()
    next_at = start + rng.expovariate(rate)
    while next_at - start < duration:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=120)
    return done, time.perf_counter() - start


async def run(args: argparse.Namespace) -> dict[str, Any]:
    fast = {"max_num_seqs": 8, "ttft_ms": 40.0, "itl_ms": 10.0, "batch_factor": 0.5}
    slow = {"max_num_seqs": 4, "ttft_ms": 120.0, "itl_ms": 30.0, "batch_factor": 0.5}
    kinds = [fast] * args.fast + [slow] * args.slow
    results: dict[str, Any] = {"params": vars(args).copy(), "fleet": {"fast": fast, "slow": slow}, "runs": []}
    with Processes() as procs:
        urls = list(await asyncio.gather(*(procs.sim(MODEL, **k, seed=i) for i, k in enumerate(kinds))))
        capacities = {f"bench:static{i}": int(k["max_num_seqs"]) for i, k in enumerate(kinds)}
        names = {f"bench:static{i}": ("fast" if k is fast else "slow") + str(i) for i, k in enumerate(kinds)}
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        async with aiohttp.ClientSession(connector=connector) as session:
            # The fleet's capacity, measured: saturate the first instance of each kind directly.
            per_kind = {}
            for name, kind in (("fast", fast), ("slow", slow)):
                if kind in kinds:
                    per_kind[name] = await measure_capacity(
                        session, urls[kinds.index(kind)], concurrency=2 * int(kind["max_num_seqs"]),
                        duration=args.calibrate_s, max_tokens=args.max_tokens)
            capacity = per_kind.get("fast", 0.0) * args.fast + per_kind.get("slow", 0.0) * args.slow
            results["fleet"]["capacity_rps"] = round(capacity, 1)
            results["fleet"]["measured_rps_per_instance"] = {k: round(v, 2) for k, v in per_kind.items()}
            await asyncio.sleep(1.0)
            for policy in args.policies:
                cfg = {"redis": {"enabled": False}, "daemon": {"log_level": "warning"},
                       "routing": {"policy": policy, "scrape_interval_s": args.scrape_interval_s},
                       "admission": {"max_inflight_per_instance": 4096, "max_queued": 100000},
                       "fleets": [{"name": "bench", "model": MODEL, "engine": "static", "urls": urls}]}
                url, proc = await procs.plane(cfg, capacities, log_level="warning")
                for load in args.loads:
                    rate = capacity * load
                    timings, elapsed = await poisson(session, url, rate=rate, duration=args.duration,
                                                     max_tokens=args.max_tokens, seed=args.seed)
                    ok = [t for t in timings if t.ok]
                    share = collections.Counter(names.get(t.instance, "?") for t in ok)
                    results["runs"].append({
                        "policy": policy, "load": load, "rate": round(rate, 1),
                        "requests": len(timings), "failed": len(timings) - len(ok),
                        "ttft_ms": summary([t.ttft for t in ok]), "e2e_ms": summary([t.e2e for t in ok]),
                        "share": {k: round(v / max(len(ok), 1), 3) for k, v in sorted(share.items())},
                    })
                    print(f"  {policy:<13} load {load:.2f}: {len(ok)} ok in {elapsed:.1f}s", flush=True)
                    await asyncio.sleep(1.0)  # let the engines drain before the next run
                proc.terminate()
                await asyncio.to_thread(proc.wait, 10)
    _compare(results)
    return results


def _compare(results: dict[str, Any]) -> None:
    base = {r["load"]: r for r in results["runs"] if r["policy"] == "round_robin"}
    for r in results["runs"]:
        b = base.get(r["load"])
        if b is not None and b["ttft_ms"]["p99"] > 0:
            r["p99_ttft_vs_round_robin"] = round(r["ttft_ms"]["p99"] / b["ttft_ms"]["p99"] - 1, 3)
            r["mean_e2e_vs_round_robin"] = round(r["e2e_ms"]["mean"] / b["e2e_ms"]["mean"] - 1, 3)


def report(results: dict[str, Any]) -> None:
    rows = []
    for r in results["runs"]:
        rows.append([r["policy"], r["load"], r["rate"], r["ttft_ms"]["mean"], r["ttft_ms"]["p99"],
                     r["e2e_ms"]["mean"], r["e2e_ms"]["p99"],
                     f"{r.get('p99_ttft_vs_round_robin', 0) * 100:+.0f}%", r["failed"],
                     " ".join(f"{k}={v:.2f}" for k, v in r["share"].items())])
    print_table(f"routing on a heterogeneous fleet (capacity ≈ {results['fleet']['capacity_rps']} req/s), ms",
                ["policy", "load", "req/s", "ttft mean", "ttft p99", "e2e mean", "e2e p99",
                 "p99 ttft vs rr", "failed", "share per instance"], rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="routerd bench routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    ap.add_argument("--fast", type=int, default=2, help="fast instances")
    ap.add_argument("--slow", type=int, default=2, help="slow instances")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--scrape-interval-s", type=float, default=0.2)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--calibrate-s", type=float, default=5.0, help="seconds per capacity measurement")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    import uvloop

    results = uvloop.run(run(args))
    report(results)
    write_json(args.json, results)
    return 0
