"""``routerd bench routing``: what each routing policy — and vLLM Router's — gives on five workloads.

Method (``docs/benchmarks.md`` has the figures):

* **Workloads** (:mod:`routerd_bench.workloads`): ``heterogeneous`` (unequal instances, capacities not
  configured), ``multiturn`` (agent-like conversations on prefix-caching engines with a prefill cost),
  ``shared-prefix`` (a few long system prompts, skewed popularity), ``random`` (nothing shared),
  ``cache-pressure`` (conversations over shared prefixes, each engine's KV sized so that the plan's
  distinct prompt blocks fill 75 % of the fleet's). The prefix-caching engines publish vLLM's KV-cache
  events and report each request's cached prompt tokens.
* **Load.** Each instance kind's capacity is measured first (or given, ``--capacity-rps``): one fresh
  engine of that kind with prefix caching *off* is saturated (closed loop, twice its batch size) with
  the workload's own requests for ``--calibrate-s``; capacity = generated tokens/s ÷ mean output
  tokens per request, summed over the fleet. Arrivals run at ``--load`` × that (for ``multiturn`` the
  cache-blind capacity, so a router that keeps conversations on their cache runs further below
  saturation than one that does not).
* **Same traffic for every router.** One seeded plan per workload: bodies, Poisson arrival times of
  requests (or conversations) for ``--duration`` seconds and, for conversations, think times; a
  conversation's next turn goes its think time after the previous answer arrived, as an agent's does.
* **Fresh engines for every router**: each router runs on newly started engine processes, so no router
  inherits another's cache or queue. Routers: routerd (its data plane in its own process, uvloop,
  default settings, one run per policy in ``--policies``; ``cache_aware`` once per ``--views``: by the
  engines' KV events where they publish them, and by routerd's request-side model; each with every
  ``--replicas`` count: N independent routerd processes on the same engines, the client sending its
  i-th request to the (i mod N)-th) and, when ``vllm-router`` is installed, vLLM Router with each policy
  of ``--peers``, one after the other in the same run.
* **Figures per router**: time to first token (the first SSE event carrying generated text) and
  end-to-end latency, mean and p99; the fleet's prefix-cache hit ratio (Σ ``vllm:prefix_cache_hits``
  ÷ Σ ``vllm:prefix_cache_queries`` over the run, from the engines) beside the plan's ceiling (one
  cache that never evicts), and the later turns' (the engines' per-request cached tokens); each
  instance's share of the requests (the engines' ``vllm:request_success`` deltas, so it is the same
  measure for every router); failures; what routerd learned of each instance (``/admin/fleets``) at
  the end; per request, routerd's predicted hit (its log line's ``cached_tokens_est``) against the
  engine's cached tokens, in blocks, and which of the policy's rules chose.
* **Decision cost**: routerd's routing decision per request at 8k-token prompts, timed in-process
  (:mod:`routerd_bench.decision`); and what keying such a prompt for the engines' cache view costs the
  event loop and the request (:mod:`routerd_bench.keying`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from routerd.config import RoutingConfig

from . import workloads as wl
from ._common import (
    Processes,
    Timing,
    cpu_seconds,
    find_vllm_router,
    print_table,
    quantile,
    summary,
    timed_request,
    write_json,
)

TIMEOUT = aiohttp.ClientTimeout(total=600, sock_connect=10, sock_read=300)
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:request_success_total", "vllm:generation_tokens_total")


@dataclass(frozen=True)
class RouterSpec:
    """One router to measure: ``routerd`` with a policy, or ``vllm-router`` with one of its own.

    routerd's ``view``: ``events`` routes by the engines' own KV-cache events where the workload's
    engines publish them (else by the request-side model: there is nothing else), ``model`` by the
    request-side model even then. ``replicas``: that many independent routerd processes on the same
    engines, the client sending its i-th request to the (i mod N)-th."""

    kind: str
    policy: str
    view: str = "events"
    replicas: int = 1

    @property
    def label(self) -> str:
        label = f"{self.kind} {self.policy}"
        if self.kind == "routerd" and self.view == "model":
            label += " model"
        return label + (f" ×{self.replicas}" if self.replicas > 1 else "")

    def runs_on(self, work: wl.Workload) -> bool:
        """Whether this run measures anything on ``work``: a request-side-model run only where the
        engines publish events (elsewhere it is the same run as the events one)."""
        return self.view != "model" or work.kv_events


@dataclass(frozen=True)
class Outcome:
    request: wl.Request
    timing: Timing

    @property
    def request_id(self) -> str:
        return request_id(self.request)


def request_id(r: wl.Request) -> str:
    """The ``X-Request-Id`` a plan's request is sent with (routerd logs it with its prediction)."""
    return f"bench-c{r.conversation}-t{r.turn}"


def counters(text: str) -> dict[str, float]:
    """The sums over all label sets of the :data:`COUNTERS` in one ``/metrics`` page."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, float]]:
    async def one(url: str) -> dict[str, float]:
        async with session.get(url + "/metrics") as r:
            return counters(await r.text())

    return list(await asyncio.gather(*(one(u) for u in urls)))


def plan_digest(plan: Sequence[wl.Request]) -> str:
    """Identifies a plan: equal digests mean identical bodies at identical planned times."""
    h = hashlib.blake2b(digest_size=8)
    for r in plan:
        h.update(f"{r.at:.6f}:{r.think_s:.6f}:{r.conversation}:{r.turn}:".encode())
        h.update(r.body)
    return h.hexdigest()


async def calibrate(session: aiohttp.ClientSession, kind: dict[str, Any], sample: Sequence[wl.Request],
                    seconds: float) -> float:
    """Requests/s one engine of ``kind`` completes when saturated with ``sample``'s requests (prefix
    caching off): generated tokens/s over the window ÷ the sample's mean output tokens."""
    with Processes() as procs:
        url = await procs.sim(wl.MODEL, **{**kind, "enable_prefix_caching": False})
        stop = asyncio.Event()

        async def worker(i: int) -> None:
            n = i
            while not stop.is_set():
                await timed_request(session, url + wl.CHAT, sample[n % len(sample)].body, True)
                n += 7

        tasks = [asyncio.create_task(worker(i)) for i in range(2 * int(kind["max_num_seqs"]))]
        try:
            await asyncio.sleep(min(1.0, seconds / 3))  # fill the batch first
            (c0,), t0 = await scrape(session, [url]), time.perf_counter()
            await asyncio.sleep(seconds)
            (c1,), t1 = await scrape(session, [url]), time.perf_counter()
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    tokens_per_s = (c1["vllm:generation_tokens_total"] - c0["vllm:generation_tokens_total"]) / (t1 - t0)
    return tokens_per_s / (sum(r.max_tokens for r in sample) / len(sample))


async def drive(session: aiohttp.ClientSession, urls: Sequence[str], plan: Sequence[wl.Request],
                session_key: str) -> list[Outcome]:
    """Send ``plan`` through the routers at ``urls``: one task per conversation, its turns in order, each
    later turn its think time after the previous answer; the i-th request sent goes to
    ``urls[i % len(urls)]`` (a round-robin load balancer in front of several routers). Each request
    carries its ``X-Request-Id`` (:attr:`Outcome.request_id`), which routerd logs with its prediction."""
    by_conv: dict[int, list[wl.Request]] = collections.defaultdict(list)
    for r in plan:
        by_conv[r.conversation].append(r)
    outcomes: list[Outcome] = []
    start = time.perf_counter() + 0.05
    sent = itertools.count()

    async def conversation(turns: list[wl.Request]) -> None:
        await asyncio.sleep(max(0.0, start + turns[0].at - time.perf_counter()))
        for r in turns:
            await asyncio.sleep(r.think_s)
            headers = {"X-Request-Id": request_id(r)}
            if session_key == "header":
                headers["X-Session-Id"] = f"conv-{r.conversation}"
            url = urls[next(sent) % len(urls)]
            outcomes.append(Outcome(r, await timed_request(session, url + wl.CHAT, r.body, True,
                                                           headers=headers)))

    async with asyncio.TaskGroup() as tg:
        for turns in by_conv.values():
            tg.create_task(conversation(sorted(turns, key=lambda r: r.turn)))
    return outcomes


def events_args(work: wl.Workload) -> dict[str, Any]:
    """A static fleet's ``engine_args`` for routing by the sims' KV events: their tokenizer, their block
    size, and their ``PYTHONHASHSEED`` (they inherit ours; unset, vLLM's default seed on both sides)."""
    args: dict[str, Any] = {"kv-events": True, "tokenizer": "sim",
                            "block-size": int(work.fleet[0]["block_size"])}
    if os.environ.get("PYTHONHASHSEED"):
        args["hash-seed"] = os.environ["PYTHONHASHSEED"]
    return args


async def _routerd(procs: Processes, session: aiohttp.ClientSession, engines: list[str], policy: str,
                   engine_args: dict[str, Any], log_path: Path) -> tuple[str, int]:
    # A new user's config: a static fleet of URLs, no capacities, every routing setting at its default
    # (the KV-event settings when the run routes by the engines' events). Its request log lines (info)
    # go to ``log_path``: each holds the request's id and the hit routerd predicted for it.
    cfg = {"redis": {"enabled": False}, "daemon": {"log_level": "info"},
           "routing": {"policy": policy},
           "fleets": [{"name": wl.MODEL, "model": wl.MODEL, "engine": "static", "urls": engines,
                       "engine_args": engine_args}]}
    url, proc = await procs.plane(cfg, log_level="info", log_path=log_path)
    events = bool(engine_args.get("kv-events"))
    async with asyncio.timeout(30):  # every instance ready and scraped once before the traffic starts
        while True:
            async with session.get(url + "/admin/fleets") as r:
                fleet = (await r.json())["fleets"][wl.MODEL]
            ready = [i for i in fleet["instances"] if i["state"] == "ready" and i["scrape_age_s"] is not None
                     and (not events or (i.get("cache_view") or {}).get("cache_view") == "events")]
            # with events, its keying worker up too: its start (seconds of CPU) is not the run's
            worker = not events or '"keying_process_ready"' in await asyncio.to_thread(log_path.read_text)
            if len(ready) == len(engines) and worker:
                return url, proc.pid
            await asyncio.sleep(0.1)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and of its live descendants (routerd and its keying worker)."""
    total = cpu_seconds(pid)
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            total += tree_cpu_seconds(int(child))
    return total


def predictions(logs: Sequence[Path], outcomes: Sequence[Outcome], block_size: int) -> dict[str, Any]:
    """routerd's predicted hit per request (``cached_tokens_est`` in its request log line) against what
    the engine then served from its cache (the usage's ``cached_tokens``), in blocks, per cache view;
    and under ``rules``, how often each of the policy's rules chose (why a request left its cache)."""
    predicted: dict[str, tuple[float, str]] = {}
    rules: collections.Counter[str] = collections.Counter()
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            if '"cached_tokens_est"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            predicted[str(rec.get("request_id"))] = (float(rec["cached_tokens_est"]),
                                                     str(rec.get("cache_view", "model")))
            rules[str(rec.get("rule"))] += 1
    off: dict[str, list[float]] = collections.defaultdict(list)
    for o in outcomes:
        p = predicted.get(o.request_id)
        if p is not None and o.timing.ok and o.timing.cached_tokens >= 0:
            off[p[1]].append(abs(p[0] - o.timing.cached_tokens) / block_size)
    out: dict[str, Any] = {
        view: {"requests": len(xs), "exact": round(sum(x == 0 for x in xs) / len(xs), 4),
               "blocks_off_mean": round(sum(xs) / len(xs), 3),
               "blocks_off_p99": round(quantile(xs, 0.99), 2), "blocks_off_max": round(max(xs), 2)}
        for view, xs in sorted(off.items()) if xs}
    return {**out, "rules": dict(rules.most_common())}


def later_turn_hit_ratio(outcomes: Sequence[Outcome]) -> float:
    """Of the prompt tokens of every conversation's second and later turns, the share the engines served
    from cache (their own per-request count)."""
    later = [o.timing for o in outcomes
             if o.request.turn >= 1 and o.timing.ok and o.timing.cached_tokens >= 0]
    prompt = sum(t.prompt_tokens for t in later)
    return round(sum(t.cached_tokens for t in later) / prompt, 4) if prompt else math.nan


async def _routerd_view(session: aiohttp.ClientSession, url: str, names: dict[str, str]) -> dict[str, Any]:
    """What routerd learned of each instance (``/admin/fleets``), by the benchmark's instance names."""
    keep = ("capacity", "capacity_source", "decode_tokens_per_s", "prefill_tokens_per_s",
            "prefix_hit_ratio", "predicted_prefix_hit_ratio", "estimated_prefix_hit_ratio")
    async with session.get(url + "/admin/fleets") as r:
        instances = (await r.json())["fleets"][wl.MODEL]["instances"]
    return {names.get(i["url"], i["id"]): {k: i.get(k) for k in keep} for i in instances}


async def run_one(session: aiohttp.ClientSession, work: wl.Workload, fleet: Sequence[dict[str, Any]],
                  router: RouterSpec, plan: Sequence[wl.Request], session_key: str) -> dict[str, Any]:
    """One router (or ``router.replicas`` of them) on fresh engines: the plan, then its figures."""
    with Processes() as procs:
        engines = list(await asyncio.gather(*(procs.sim(wl.MODEL, **k) for k in fleet)))
        names = dict(zip(engines, work.kinds, strict=True))
        logs: list[Path] = []
        if router.kind == "routerd":
            args = events_args(work) if router.view == "events" and work.kv_events else {}
            logs = [Path(procs.tmp.name) / f"routerd-{n}.log" for n in range(router.replicas)]
            planes = await asyncio.gather(*(_routerd(procs, session, engines, router.policy, args, log)
                                            for log in logs))
            urls, pids = [u for u, _ in planes], [p for _, p in planes]
        else:
            urls, pids = [await procs.vllm_router(engines, router.policy)], []
        before = await scrape(session, engines)
        cpu0 = sum(tree_cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        outcomes = await drive(session, urls, plan, session_key)
        elapsed = time.perf_counter() - t0
        cpu = sum(tree_cpu_seconds(p) for p in pids) - cpu0
        after = await scrape(session, engines)
        view = await _routerd_view(session, urls[0], names) if router.kind == "routerd" else None
        predicted = predictions(logs, outcomes, int(fleet[0].get("block_size", 16))) if logs else None
    ok = [o for o in outcomes if o.timing.ok]

    def delta(name: str) -> list[float]:
        return [a[name] - b[name] for a, b in zip(after, before, strict=True)]

    hits, queries = sum(delta(COUNTERS[0])), sum(delta(COUNTERS[1]))
    served = delta(COUNTERS[2])
    result = {
        "router": router.kind, "policy": router.policy, "label": router.label,
        "requests": len(outcomes), "failed": len(outcomes) - len(ok), "elapsed_s": round(elapsed, 2),
        # why they failed: the HTTP status (0: no answer), 200 for a stream cut or without text
        "failures": dict(collections.Counter(str(o.timing.status) for o in outcomes if not o.timing.ok)),
        "ttft_ms": summary([o.timing.ttft for o in ok]), "e2e_ms": summary([o.timing.e2e for o in ok]),
        "prefix_hit_ratio": round(hits / queries, 4) if queries else math.nan,
        "later_turn_hit_ratio": later_turn_hit_ratio(outcomes),
        "share": {n: round(s / max(sum(served), 1), 4) for n, s in zip(work.kinds, served, strict=True)},
        "view": router.view if router.kind == "routerd" else None, "replicas": router.replicas,
        # every routerd process (and its keying worker) together, per request of the run
        "routerd_cpu_ms_per_request": round(cpu / max(len(outcomes), 1) * 1000, 2) if pids else None,
    }
    if view is not None:
        result["routerd_view"] = view
    if predicted is not None:
        result["prediction"] = predicted
    return result


def routers(args: argparse.Namespace) -> tuple[list[RouterSpec], str | None]:
    """routerd with each policy (``cache_aware`` with each of ``--views``, the others with the first),
    each with every ``--replicas`` count; then each peer (or why the peers are left out)."""
    out = [RouterSpec("routerd", p, view, n) for p in args.policies
           for view in (args.views if p == "cache_aware" else args.views[:1]) for n in args.replicas]
    peers = [p.split(":", 1) for p in args.peers]
    if peers and find_vllm_router() is None:
        return out, "vllm-router is not installed (pip install vllm-router): peers left out"
    return out + [RouterSpec(kind, policy) for kind, policy in peers], None


async def run_workload(session: aiohttp.ClientSession, name: str, args: argparse.Namespace,
                       specs: Sequence[RouterSpec]) -> dict[str, Any]:
    work = wl.build(name, scale=args.scale, engine_seed=args.seed)
    if args.capacity_rps:  # another run's capacity: the same seed then gives exactly its arrivals
        capacity, per_kind = args.capacity_rps, {}
    else:
        sample = work.plan(50.0, 10.0, args.seed + 1)[:200]
        # Each kind of instance at once, on its own engine: a few seconds saved, the same figures.
        kinds = list({tuple(sorted(k.items())): k for k in work.fleet}.values())
        rates = await asyncio.gather(*(calibrate(session, k, sample, args.calibrate_s) for k in kinds))
        # Rounded as reported, so that --capacity-rps with the reported figure repeats these arrivals.
        capacity = round(sum(rps * work.fleet.count(k) for k, rps in zip(kinds, rates, strict=True)), 2)
        per_kind = {work.kinds[work.fleet.index(k)].rstrip("0123456789"): round(rps, 3)
                    for k, rps in zip(kinds, rates, strict=True)}
    rate = args.load * capacity
    plan = work.plan(rate, args.duration, args.seed)
    fleet, fill = wl.fit_kv(work, plan) if work.kv_fill else (work.fleet, None)
    out: dict[str, Any] = {
        "description": work.description, "fleet": dict(zip(work.kinds, fleet, strict=True)),
        "kv_fill": fill, "kv_events": work.kv_events,
        "hit_ceiling": wl.hit_ceiling(plan, int(fleet[0].get("block_size", 16))),
        "capacity_rps": round(capacity, 2), "capacity_rps_per_instance_kind": per_kind,
        "load": args.load, "rate_rps": round(rate, 2), "requests": len(plan),
        "conversations": len({r.conversation for r in plan}), "plan_digest": plan_digest(plan),
        "mean_prompt_tokens": round(sum(r.prompt_tokens for r in plan) / max(len(plan), 1), 1),
        "load_avg_at_start": list(os.getloadavg()), "runs": [],
    }
    print(f"{name}: capacity ≈ {capacity:.1f} req/s, {len(plan)} requests at {rate:.1f} req/s", flush=True)
    for spec in [s for s in specs if s.runs_on(work)]:
        result = await run_one(session, work, fleet, spec, plan, args.session)
        out["runs"].append(result)
        print(f"  {spec.label:<26} {result['requests'] - result['failed']} ok, {result['failed']} failed, "
              f"{result['elapsed_s']} s", flush=True)
    return out


class _Targets:
    """The targets met or not in one run's ``results``; a target whose routers did not run is left out."""

    def __init__(self, results: dict[str, Any]) -> None:
        self.results = results
        self.out: list[dict[str, Any]] = []

    def run(self, work: str, label: str) -> dict[str, Any] | None:
        for r in self.results["workloads"].get(work, {}).get("runs", []):
            if r["label"] == label:
                return dict(r)
        return None

    def ratio(self, work: str, a: str, b: str, metric: str, stat: str, limit: float, what: str) -> None:
        ra, rb = self.run(work, a), self.run(work, b)
        if ra is not None and rb is not None and rb[metric][stat]:
            value = ra[metric][stat] / rb[metric][stat]
            self.add(work, what, round(value, 3), limit, math.isfinite(value) and value <= limit)

    def at_least(self, work: str, label: str, metric: str, limit: float, what: str) -> None:
        r = self.run(work, label)
        if r is not None:
            value = r[metric]
            self.add(work, what, value, limit, math.isfinite(value) and value >= limit)

    def add(self, work: str, what: str, value: float, limit: float, met: bool) -> None:
        self.out.append({"workload": work, "target": what, "value": value, "limit": limit, "met": met})


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets, from this run's figures (a target whose routers did not run is left out)."""
    default = "routerd " + RoutingConfig().policy
    t = _Targets(results)
    t.ratio("heterogeneous", default, "routerd least_load", "ttft_ms", "p99", 0.25,
            f"{default} p99 TTFT ÷ least_load's ≤ 0.25")
    t.ratio("heterogeneous", default, "vllm-router power_of_two", "ttft_ms", "p99", 0.5,
            f"{default} p99 TTFT ÷ vLLM Router power_of_two's ≤ 0.5")
    mt = t.run("multiturn", default)
    if mt is not None:
        t.at_least("multiturn", default, "prefix_hit_ratio", 0.75, "fleet prefix hit ratio ≥ 0.75")
        top = max(mt["share"].values())
        t.add("multiturn", "no instance over 40 % of requests", top, 0.4,
              mt["requests"] > mt["failed"] and top <= 0.4)
    t.ratio("multiturn", default, "routerd least_load", "ttft_ms", "mean", 0.5,
            f"{default} mean TTFT ÷ least_load's ≤ 0.5")
    t.ratio("multiturn", default, "vllm-router cache_aware", "ttft_ms", "mean", 0.8,
            f"{default} mean TTFT ÷ vLLM Router cache_aware's ≤ 0.8")
    t.ratio("random", "routerd cache_aware", "routerd least_load", "ttft_ms", "p99", 1.05,
            "cache_aware p99 TTFT ÷ least_load's ≤ 1.05")
    kv_targets(t, default)
    for name, k in t.results.get("keying_cost", {}).get("keyers", {}).items():
        p99 = k["process"]["loop_us"]["p99"]
        t.add(f"keying ({name})", f"{k['prompt_tokens']}-token prompt: event-loop p99 ≤ 1 ms", p99, 1000.0,
              p99 <= 1000.0)
    return t.out


def kv_targets(t: _Targets, default: str) -> None:
    """Issue #21's: the engines' own cache view (``default``, where the engines publish) against
    routerd's request-side model and vLLM Router; several routerd on one fleet; the prediction."""
    model = default + " model"
    for stat in ("mean", "p99"):
        t.ratio("cache-pressure", default, model, "ttft_ms", stat, 0.5,
                f"{stat} TTFT ÷ the request-side model's ≤ 0.5")
    pressure_model = t.run("cache-pressure", model)
    if pressure_model is not None:
        t.at_least("cache-pressure", default, "prefix_hit_ratio",
                   round(pressure_model["prefix_hit_ratio"] + 0.1, 4),
                   "hit ratio ≥ the request-side model's + 0.10")
    t.at_least("multiturn", default, "prefix_hit_ratio", 0.85, "fleet prefix hit ratio ≥ 0.85")
    t.ratio("multiturn", default, "vllm-router cache_aware", "ttft_ms", "p99", 1.0,
            f"{default} p99 TTFT ÷ vLLM Router cache_aware's ≤ 1")
    for work in t.results["workloads"]:
        t.at_least(work, default + " ×2", "later_turn_hit_ratio", 0.9,
                   "2 routerd: later turns' hit ratio ≥ 0.9")
        one = t.run(work, default)
        if one is None:
            continue
        if math.isfinite(one["prefix_hit_ratio"]):
            t.at_least(work, default + " ×4", "prefix_hit_ratio", round(0.95 * one["prefix_hit_ratio"], 4),
                       "4 routerd: hit ratio ≥ 0.95 × one's")
        events = one.get("prediction", {}).get("events")
        if events:
            t.add(work, "prediction by events: blocks off per request, max 0", events["blocks_off_max"], 0,
                  events["blocks_off_max"] == 0)

async def run(args: argparse.Namespace) -> dict[str, Any]:
    specs, note = routers(args)
    results: dict[str, Any] = {"params": vars(args).copy(), "routers": [s.label for s in specs],
                               "note": note, "cpus": os.cpu_count(), "workloads": {}}
    if note:
        print(note)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        for name in args.workload:
            results["workloads"][name] = await run_workload(session, name, args, specs)
    if args.decision_cost:
        from .decision import decision_cost

        results["decision_cost_us"] = await asyncio.to_thread(decision_cost, args.decision_prompt_tokens)
        from .keying import keying_cost

        results["keying_cost"] = await keying_cost(args.decision_prompt_tokens,
                                                   model_dir=args.keying_model_dir,
                                                   requests=args.keying_requests)
    results["targets"] = targets(results)
    return results


def report(results: dict[str, Any]) -> None:
    for name, w in results["workloads"].items():
        rows = [[r["label"], r["ttft_ms"]["mean"], r["ttft_ms"]["p99"], r["e2e_ms"]["mean"],
                 r["e2e_ms"]["p99"], r["prefix_hit_ratio"], r["later_turn_hit_ratio"],
                 " ".join(f"{k}={v:.2f}" for k, v in r["share"].items()), r["failed"],
                 r.get("routerd_cpu_ms_per_request") or "-"]
                for r in w["runs"]]
        fill = f"; KV {w['kv_fill']:.0%} full with every prompt once" if w.get("kv_fill") else ""
        fill += f"; hit ratio ceiling {w['hit_ceiling']}" if w.get("hit_ceiling") else ""
        print_table(f"{name}: {w['description']}\n  {w['requests']} requests at {w['rate_rps']} req/s "
                    f"({w['load']:.0%} of {w['capacity_rps']} req/s){fill}; "
                    f"load avg {w['load_avg_at_start'][0]:.2f}",
                    ["router", "ttft mean ms", "ttft p99 ms", "e2e mean ms", "e2e p99 ms", "hit ratio",
                     "later turns", "share", "failed", "routerd CPU ms/req"], rows)
        pred = [[r["label"], view, p["requests"], p["exact"], p["blocks_off_mean"], p["blocks_off_p99"],
                 p["blocks_off_max"], " ".join(f"{k}={v}" for k, v in r["prediction"]["rules"].items())]
                for r in w["runs"] for view, p in r.get("prediction", {}).items() if view != "rules"]
        if pred:
            print_table(f"{name}: routerd's predicted hit against the engine's cached tokens, per request, "
                        "in blocks",
                        ["router", "view", "requests", "exact", "mean off", "p99 off", "max off",
                         "rules that chose"], pred)
    cost = results.get("decision_cost_us")
    if cost:
        print_table(f"routerd's routing decision at {cost['prompt_tokens']}-token prompts, µs per request",
                    ["part", "p50", "p99", "mean"],
                    [[part, v["p50"], v["p99"], v["mean"]] for part, v in cost["parts"].items()])
    keying = results.get("keying_cost")
    if keying:
        rows = [[name, k["prompt_tokens"], mode, k[mode]["loop_us"]["p50"], k[mode]["loop_us"]["p99"],
                 k[mode]["wait_ms"]["p50"], k[mode]["wait_ms"]["p99"]]
                for name, k in keying["keyers"].items() for mode in ("process", "thread", "inline")]
        print_table(f"keying a prompt for the engines' cache view, {keying['requests']} requests: this "
                    "process's CPU µs while it is keyed (the event loop's bound), the request's wait in ms",
                    ["keyer", "tokens", "way", "loop p50 µs", "loop p99 µs", "wait p50 ms", "wait p99 ms"],
                    rows)
    if results["targets"]:
        print_table("targets", ["workload", "target", "value", "met"],
                    [[t["workload"], t["target"], t["value"], "yes" if t["met"] else "NO"]
                     for t in results["targets"]])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="routerd bench routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", nargs="+", choices=wl.WORKLOADS, default=list(wl.WORKLOADS))
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "least_load", "power_of_two"],
                    help="routerd policies, one run each")
    ap.add_argument("--views", nargs="+", choices=["events", "model"], default=["events", "model"],
                    help="cache_aware's cache picture, one run each where the engines publish KV events: "
                         "their events, or routerd's request-side model (the other policies: the first)")
    ap.add_argument("--replicas", nargs="+", type=int, default=[1],
                    help="independent routerd processes on the same engines, one run per count; the "
                         "client sends its i-th request to the (i mod N)-th")
    ap.add_argument("--peers", nargs="*", default=["vllm-router:cache_aware", "vllm-router:power_of_two"],
                    help="vLLM Router runs (vllm-router:<policy>); none: --peers")
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of measured capacity")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals per router")
    ap.add_argument("--calibrate-s", type=float, default=2.0, help="seconds per capacity measurement")
    ap.add_argument("--capacity-rps", type=float, default=0.0,
                    help="use this fleet capacity instead of measuring it (one --workload; with the same "
                         "--seed and --load, another run's arrivals exactly)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every prompt and answer length")
    ap.add_argument("--session", choices=["none", "header"], default="none",
                    help="send X-Session-Id per conversation (default: routers see the prompt only)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--decision-cost", action=argparse.BooleanOptionalAction, default=True,
                    help="time routerd's routing decision in-process")
    ap.add_argument("--decision-prompt-tokens", type=int, default=8192)
    ap.add_argument("--keying-model-dir", default="",
                    help="also time keying with this Hugging Face tokenizer directory (beside the sim's)")
    ap.add_argument("--keying-requests", type=int, default=200, help="prompts keyed per way of keying")
    args = ap.parse_args(argv)
    import uvloop

    results = uvloop.run(run(args))
    report(results)
    write_json(args.json, results)
    return 0
