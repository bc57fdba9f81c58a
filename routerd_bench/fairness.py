"""``routerd bench fairness``: a batch tenant floods the queue, an interactive tenant trickles over HTTP.

Method. ``--engines`` simulated engines (separate processes, ``--slots`` sequences each, ``--ttft-ms``,
``--itl-ms``, scheduling as vLLM V1 does — a new prefill beside the decodes — unless
``--no-chunked-prefill``) sit behind a real ``routerd run`` (static fleet, its own process) with a Redis this
benchmark starts. Each phase starts routerd afresh on an empty Redis:

1. ``alone``: the interactive tenant alone — one streaming chat (``--chat-tokens``) every
   ``1/--rate`` seconds (seeded Poisson arrivals) for ``--duration`` seconds;
2. ``flood, no tenants``: the same trickle while a producer has XADDed ``--jobs`` jobs of
   ``--batch-tokens`` each (several times what the fleet runs in the phase) — routerd as before tenants:
   one line, and admission bounded only by ``max_inflight_per_instance`` (the engines queue the rest);
3. ``flood, tenants``: the same with ``[[tenants]]``: batch (queue, weight 1) and interactive (HTTP,
   weight 1) — fair share in admission, which admits what the engines run;
4. ``shares``: three tenants all backlogged — two on the queue (weights 1 and 2, their jobs
   interleaved in the stream as two producers would) and one on HTTP (weight 3, closed-loop clients) —
   each tenant's share of slot-seconds (``routerd_tenant_slot_seconds_total``) over a window against
   its weight's share.

Time to first token is the first SSE event carrying generated text (``timed_request``). Utilisation is
the engines' own running count (``vllm:num_requests_running``) over their slots, sampled every 0.1 s
while the fleet is backlogged. Last, the admission decision's CPU cost per request is measured in
process: with tenants and a saturated fleet (every release picks between three tenants), without
tenants, and against a bare ``asyncio.Semaphore`` doing the same waits.

Targets (issue #14): interactive p99 TTFT under a flood ≤ 1.5 × alone; shares within 10 % of the
weights; utilisation ≥ 95 % under any backlog; decision ≤ 20 µs per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from routerd._net import free_port

from ._common import Processes, print_table, stop_process, summary, timed_request, wait_http, write_json

_KEY = "sk-interactive"


def _routerd_config(args: argparse.Namespace, urls: list[str], redis_url: str, state: str,
                    tenants: list[dict[str, Any]] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "daemon": {"state_dir": state, "drain_timeout_s": 2.0, "log_level": "warning"},
        "http": {"host": "127.0.0.1", "port": free_port(), "api_keys": [_KEY]},
        "redis": {"url": redis_url, "consumer": "bench", "block_ms": 200},
        "routing": {"scrape_interval_s": 0.1, **({"policy": args.policy} if args.policy else {})},
        "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": urls, "max_num_seqs": args.slots}],
    }
    if tenants is not None:
        cfg["tenants"] = tenants
        if args.engine_queue is not None:
            cfg["admission"] = {"engine_queue_per_instance": args.engine_queue}
    return cfg


class Routerd:
    """``routerd run`` in its own process (through ``serve`` below: the config as JSON)."""

    def __init__(self, procs: Processes, cfg: dict[str, Any]) -> None:
        path = Path(procs.tmp.name) / f"routerd-{cfg['http']['port']}.json"
        path.write_text(json.dumps(cfg))
        self.url = f"http://127.0.0.1:{cfg['http']['port']}"
        self.proc = subprocess.Popen([sys.executable, "-m", "routerd_bench.fairness", "serve", str(path)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.procs.append(self.proc)

    async def ready(self) -> None:
        await wait_http(self.url + "/readyz", timeout=60, proc=self.proc)

    def stop(self) -> None:
        stop_process(self.proc, 30.0)

    async def metric(self, s: aiohttp.ClientSession, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed by the value of ``label``, from routerd's ``/metrics``."""
        async with s.get(self.url + "/metrics") as r:
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(name + "{") and f'{label}="' in line:
                labels, value = line.rsplit(" ", 1)
                key = labels.split(f'{label}="', 1)[1].split('"', 1)[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    async def slot_seconds(self, s: aiohttp.ClientSession) -> dict[str, float]:
        return await self.metric(s, "routerd_tenant_slot_seconds_total", "tenant")


async def _running(s: aiohttp.ClientSession, engines: list[str]) -> float:
    total = 0.0
    for url in engines:
        async with s.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("vllm:num_requests_running{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def _sample_utilisation(s: aiohttp.ClientSession, engines: list[str], slots: int,
                              stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        out.append(await _running(s, engines) / slots)
        await asyncio.sleep(0.1)


async def _trickle(s: aiohttp.ClientSession, url: str, args: argparse.Namespace, seed: int) -> list[float]:
    """The interactive tenant: Poisson arrivals of streaming chats; their TTFTs (seconds)."""
    rng = random.Random(seed)
    tasks = []
    end = time.monotonic() + args.duration
    i = 0
    while time.monotonic() < end:
        body = msgspec.json.encode({"model": "m", "stream": True, "max_tokens": args.chat_tokens,
                                    "messages": [{"role": "user", "content": f"interactive question {i}"}]})
        tasks.append(asyncio.create_task(timed_request(s, url + "/v1/chat/completions", body, True,
                                                       headers={"Authorization": f"Bearer {_KEY}"})))
        i += 1
        await asyncio.sleep(rng.expovariate(args.rate))
    timings = await asyncio.gather(*tasks)
    failed = sum(1 for t in timings if not t.ok)
    if failed:
        print(f"  {failed} interactive request(s) failed", file=sys.stderr)
    return [t.ttft for t in timings if t.ok]


async def _flood(redis_url: str, n: int, args: argparse.Namespace, tenants: list[str | None]) -> None:
    """XADD ``n`` jobs per tenant, the tenants' interleaved (producers writing at once); their lengths
    ``--batch-tokens`` ± ``--length-spread`` (seeded)."""
    from routerd.client import QueueClient

    rng = random.Random(args.seed)
    spread = args.batch_tokens * args.length_spread
    async with QueueClient.from_url(redis_url) as q:
        for k, tenant in enumerate(tenants):
            ids = range(k, n * len(tenants), len(tenants))
            bodies = [{"model": "m", "prompt": f"batch job {i} of {tenant}",
                       "max_tokens": max(1, round(args.batch_tokens + rng.uniform(-spread, spread)))}
                      for i in ids]
            await q.submit_many(bodies, tenant=tenant, reply_to=f"bench:replies:{tenant or ''}")


async def _wait_saturated(s: aiohttp.ClientSession, engines: list[str], slots: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while await _running(s, engines) < slots:
        if time.monotonic() > end:
            raise TimeoutError("the flood did not fill the engines")
        await asyncio.sleep(0.05)


async def _wait_idle(s: aiohttp.ClientSession, engines: list[str]) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if await _running(s, engines) == 0:
            return
        await asyncio.sleep(0.1)


async def _phase(args: argparse.Namespace, procs: Processes, engines: list[str], redis_url: str,
                 name: str, tenants: list[dict[str, Any]] | None, flood: bool) -> dict[str, Any]:
    import redis.asyncio as aioredis

    raw: Any = aioredis.Redis.from_url(redis_url)
    await raw.flushall()
    await raw.aclose()
    rd = Routerd(procs, _routerd_config(args, engines, redis_url, f"{procs.tmp.name}/{name}", tenants))
    util: list[float] = []
    try:
        await rd.ready()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            stop = asyncio.Event()
            sampler = None
            if flood:
                await _flood(redis_url, args.jobs, args, ["batch" if tenants else None])
                await _wait_saturated(s, engines, args.engines * args.slots, 30)
                sampler = asyncio.create_task(_sample_utilisation(s, engines, args.engines * args.slots,
                                                                  stop, util))
            jobs_before = await rd.metric(s, "routerd_queue_jobs_total", "outcome")
            started = time.monotonic()
            ttft = await _trickle(s, rd.url, args, args.seed)
            window = time.monotonic() - started
            jobs = await rd.metric(s, "routerd_queue_jobs_total", "outcome")
            stop.set()
            if sampler is not None:
                await sampler
    finally:
        rd.stop()
    async with aiohttp.ClientSession() as s:
        await _wait_idle(s, engines)
    done, preempted = (jobs.get(k, 0.0) - jobs_before.get(k, 0.0) for k in ("done", "preempted"))
    return {"phase": name, "ttft_ms": summary(ttft), "utilisation": _mean(util) if util else None,
            "batch_jobs_done": int(done), "batch_jobs_preempted": int(preempted),
            "batch_jobs_per_s": round(done / window, 2)}


async def _shares(args: argparse.Namespace, procs: Processes, engines: list[str],
                  redis_url: str) -> dict[str, Any]:
    import redis.asyncio as aioredis

    raw: Any = aioredis.Redis.from_url(redis_url)
    await raw.flushall()
    await raw.aclose()
    weights = {"bulk": 1.0, "batch": 2.0, "web": 3.0}
    tenants = [{"name": "bulk", "weight": 1.0}, {"name": "batch", "weight": 2.0},
               {"name": "web", "weight": 3.0, "api_keys": ["sk-web"]}]
    rd = Routerd(procs, _routerd_config(args, engines, redis_url, f"{procs.tmp.name}/shares", tenants))
    slots = args.engines * args.slots
    util: list[float] = []
    try:
        await rd.ready()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await _flood(redis_url, args.jobs, args, ["bulk", "batch"])
            stop = asyncio.Event()
            body = msgspec.json.encode({"model": "m", "prompt": "web request",
                                        "max_tokens": args.batch_tokens})

            async def web() -> None:  # closed loop: always one waiting per client
                while not stop.is_set():
                    await timed_request(s, rd.url + "/v1/completions", body, False,
                                        headers={"Authorization": "Bearer sk-web"})

            clients = [asyncio.create_task(web()) for _ in range(2 * slots)]
            await _wait_saturated(s, engines, slots, 30)
            await asyncio.sleep(args.warmup)
            sampler = asyncio.create_task(_sample_utilisation(s, engines, slots, stop, util))
            before = await rd.slot_seconds(s)
            await asyncio.sleep(args.duration)
            after = await rd.slot_seconds(s)
            stop.set()
            await asyncio.gather(sampler, *clients)
    finally:
        rd.stop()
    async with aiohttp.ClientSession() as s:
        await _wait_idle(s, engines)
    used = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in weights}
    total_used, total_weight = sum(used.values()), sum(weights.values())
    rows = {t: {"weight": w, "want": round(w / total_weight, 4), "share": round(used[t] / total_used, 4),
                "error_pct": round((used[t] / total_used - w / total_weight) / (w / total_weight) * 100, 1)}
            for t, w in weights.items()}
    return {"tenants": rows, "utilisation": _mean(util)}


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4) if xs else float("nan")


# -- the admission decision's cost, in process ----------------------------------------------------------
async def _decision_cost(n: int, tenants: int) -> dict[str, float]:
    """CPU µs per admitted request: 4 × slots workers of ``tenants`` tenants loop through tickets of a
    fleet of ``slots`` (so every release hands the slot to a waiter), against a bare semaphore."""
    from routerd.config import AdmissionConfig
    from routerd.dataplane.admission import Admission
    from routerd.registry import Instance, InstanceState, LoadSnapshot, Registry
    from routerd.tenants.fairshare import Share

    slots = 64
    registry = Registry()
    inst = Instance(id="f:0", fleet="f", url="http://x", state=InstanceState.READY)
    inst.snapshot = LoadSnapshot(scraped_at=0.0, capacity=slots)
    registry.add(inst)

    async def run(enter: Any, names: list[str]) -> float:
        per = n // (4 * slots)

        async def worker(tenant: str) -> None:
            for _ in range(per):
                async with enter(tenant):
                    await asyncio.sleep(0)

        cpu = time.process_time()
        await asyncio.gather(*(worker(names[i % len(names)]) for i in range(4 * slots)))
        return (time.process_time() - cpu) / (per * 4 * slots) * 1e6

    sem = asyncio.Semaphore(slots)
    base = await run(lambda _t: sem, ["x"])
    plain = Admission(registry, AdmissionConfig(max_inflight_per_instance=slots))
    one = await run(lambda t: plain.ticket("f", tenant=t, source="queue"), ["default"])
    names = [f"t{i}" for i in range(tenants)]
    fair = Admission(registry, AdmissionConfig(max_inflight_per_instance=256),
                     shares={t: Share(weight=1.0 + i) for i, t in enumerate(names)})
    many = await run(lambda t: fair.ticket("f", tenant=t, source="queue"), names)
    return {"semaphore_us": round(base, 2), "no_tenants_us": round(one, 2),
            f"{tenants}_tenants_us": round(many, 2), "decision_us_over_semaphore": round(many - base, 2)}


# -- the benchmark ----------------------------------------------------------------------------------------
async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from routerd.redis_server import EmbeddedRedis

    load_before = os.getloadavg()
    with Processes() as procs:
        engines = list(await asyncio.gather(*(procs.sim("m", max_num_seqs=args.slots, ttft_ms=args.ttft_ms,
                                                         itl_ms=args.itl_ms, seed=i,
                                                         chunked_prefill=args.chunked_prefill)
                                               for i in range(args.engines))))
        async with EmbeddedRedis(Path(procs.tmp.name) / "redis") as redis_url:
            phases = [await _phase(args, procs, engines, redis_url, "alone", _fair_tenants(args),
                                    flood=False)]
            if not args.skip_baseline:
                phases.append(await _phase(args, procs, engines, redis_url, "flood, no tenants", None,
                                           flood=True))
            phases.append(await _phase(args, procs, engines, redis_url, "flood, tenants", _fair_tenants(args),
                                       flood=True))
            shares = None if args.skip_shares else await _shares(args, procs, engines, redis_url)
    decision = await _decision_cost(args.decisions, 3)
    alone = phases[0]["ttft_ms"]["p99"]
    for p in phases:
        p["p99_vs_alone"] = round(p["ttft_ms"]["p99"] / alone, 2)
    return {"config": {k: v for k, v in vars(args).items() if k != "json"},
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "phases": phases, "shares": shares, "decision": decision}


def _fair_tenants(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"name": "batch", "weight": 1.0},
            {"name": "interactive", "weight": args.interactive_weight, "api_keys": [_KEY]}]


def _report(res: dict[str, Any]) -> None:
    print_table("interactive time to first token (ms)", ["phase", "n", "p50", "p90", "p99", "max",
                                                          "p99 / alone", "utilisation", "batch jobs/s",
                                                          "preempted"],
                [[p["phase"], *(p["ttft_ms"][k] for k in ("n", "p50", "p90", "p99", "max")),
                  p["p99_vs_alone"], "-" if p["utilisation"] is None else p["utilisation"],
                  p["batch_jobs_per_s"], p["batch_jobs_preempted"]] for p in res["phases"]])
    if res["shares"] is not None:
        rows = res["shares"]["tenants"]
        print_table(f"shares of slot-seconds, all backlogged (utilisation {res['shares']['utilisation']})",
                    ["tenant", "weight", "want", "share", "error %"],
                    [[t, r["weight"], r["want"], r["share"], r["error_pct"]] for t, r in rows.items()])
    print_table("admission decision, CPU µs per admitted request", list(res["decision"]),
                [list(res["decision"].values())])
    la = res["load_average"]
    print(f"\nload average: before {la['before'][0]:.2f}, after {la['after'][0]:.2f} (1 min)")


def serve_main(argv: list[str]) -> int:
    """``python -m routerd_bench.fairness serve SPEC.json``: ``routerd run`` on a config given as JSON."""
    from routerd import log
    from routerd.config import parse
    from routerd.daemon import Daemon

    path = Path(argv[0])
    cfg = parse(json.loads(path.read_text()), environ={})
    log.setup(cfg.daemon.log_level, json=True)
    import uvloop

    code: int = uvloop.run(Daemon(path, cfg).run())
    return code


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    p = argparse.ArgumentParser(prog="routerd bench fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--slots", type=int, default=4, help="max_num_seqs of each engine")
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--jobs", type=int, default=300, help="batch jobs XADDed at the flood's start")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="the engines schedule as vLLM V1 does (a prefill beside the decodes, TTFT its "
                        "own wait); --no-chunked-prefill: a prefill step stalls every decode (V0)")
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="batch jobs' max_tokens uniform in batch-tokens × (1 ± this)")
    p.add_argument("--chat-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=2.0, help="interactive chats per second")
    p.add_argument("--interactive-weight", type=float, default=1.0,
                   help="the interactive tenant's weight (the batch tenant's is 1)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each phase")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the shares window")
    p.add_argument("--decisions", type=int, default=200_000, help="admissions timed for the decision cost")
    p.add_argument("--policy", default="", help="routing.policy (default: routerd's default)")
    p.add_argument("--engine-queue", type=int, default=None,
                   help="admission.engine_queue_per_instance with tenants (default: routerd's, 0)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-baseline", action="store_true", help="skip the 'flood, no tenants' phase")
    p.add_argument("--skip-shares", action="store_true", help="skip the shares phase")
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    res = asyncio.run(run_bench(args))
    _report(res)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
