"""``routerd bench lora``: time to first token for many LoRA adapters on few slots, routerd against an
adapter-blind least-load router and llm-d's adapter-affinity score, on the same engines and traffic.

Method (``docs/benchmarks.md`` has the figures):

* **Fleet.** ``--instances`` simulated engines with ``--enable-lora --max-loras`` (vLLM's scheduler:
  at most that many distinct adapters in a running batch, the others' requests wait; ``--max-cpu-loras``
  adapters' weights kept, twice max-loras by default (vLLM's is max-loras); one adapter's weights read in
  ``--load-s``, stalling the engine's steps as vLLM's ``add_lora`` does, whether by the load route or
  when a request's adapter had left the cache).
* **Traffic.** ``--adapters`` adapters, the k-th most popular asked for ∝ 1/k^s (Zipf, ``--zipf``);
  Poisson arrivals (open loop: a request goes at its time whatever the answers) at ``--load`` × the
  fleet's capacity for ``--duration`` seconds. Capacity is measured as ``routerd bench routing`` does:
  an engine saturated (closed loop, twice its batch) with base-model requests for ``--calibrate-s``,
  generated tokens/s ÷ mean output tokens — one engine per instance, all at once, so that they share
  the CPU as in the run; summed. No adapter costs anything there, so 70 % of it is 70 % of what the
  fleet does at best. One seeded plan for every router.
* **Routers, one after the other in one run, each on newly started engines**: ``routerd`` (its data
  plane in its own process, its adapter routing and placement, the adapters declared in its config,
  the engines started with none loaded); ``least-load`` (adapter-blind: the fewest requests it has in
  flight); ``llm-d`` (llm-d's ``lora-affinity-scorer`` — 1.0 when the adapter is running there, 0.8
  when a slot is free, 0.6 when it is waiting there, else 0 — read from the engines'
  ``vllm:lora_requests_info`` every 50 ms, plus its ``queue-scorer`` with the same weight, the best
  score chosen, ties at random). The two baselines are this module's own proxy
  (``python -m routerd_bench.lora router``), in their own process as routerd is. Placing nothing, they
  run as such deployments do: every adapter registered on every engine before the run (vLLM's
  ``--lora-modules``), the engine swapping weights in as requests ask.
* **Rounds.** ``--repeats N`` runs every router N times on the same plan, each round in another order
  (round k of seed s starts with router (k + s) mod 3), so that the machine's load as it drifts (other
  processes on a shared machine) falls on every router alike. A router's figures are over every round's
  measured requests together (a p99 over N × the requests); each target is also judged per round, and
  met when both the pooled ratio and the median round's are within it.
* **Figures per router**, over the requests planned after ``--warmup-s`` (those before run, unmeasured,
  for every router alike): time to first token (the first SSE event carrying text) p50/p99, end-to-end
  p50/p99; the engines' adapter loads per 1,000 requests (the sims' ``sim:lora_loads``: the load route
  and every reload into the cache); time spent waiting for a slot — in the engines, requests held back
  by the ``max_loras`` check (``vllm:num_requests_waiting_by_reason{reason="deferred"}`` sampled every
  ``--sample-s``, integrated), plus in routerd, requests waiting for their adapter's load before being
  sent (``routerd_adapter_slot_wait_seconds``) — in total (request-seconds) and per request.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from routerd import _aio

from . import workloads as wl
from ._common import Processes, print_table, summary, write_json
from .routing import TIMEOUT, Outcome, calibrate, drive, plan_digest

ROUTERS = ("routerd", "llm-d", "least-load")
# One instance: 8 sequences at 50 ms a token (75 ms a step with a full batch), short chat prompts.
ENGINE: dict[str, Any] = {"max_num_seqs": 8, "ttft_ms": 50.0, "itl_ms": 50.0, "batch_factor": 0.5,
                          "enable_prefix_caching": False, "enable_lora": True}
# Seconds to read one adapter's weights onto the GPU: LoRAX measured 20 ms a layer, 0.5 to over 1 s an
# adapter, moving a LoRA's weights to the GPU (predibase/lorax#433); the low end.
LOAD_S = 0.5
# Adapters' weights an engine keeps, × max-loras (vLLM's --max-cpu-loras; its default is --max-loras):
# an operator serving more adapters than slots sets it higher, an r = 8 adapter being megabytes of CPU
# memory; at max-loras, a load pushes out weights of adapters still registered, re-read mid-batch
CPU_LORAS_PER_SLOT = 2
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"


@dataclass(frozen=True)
class Traffic:
    """The seeded plan: bodies, arrival times, and each request's adapter."""

    plan: list[wl.Request]
    adapter: dict[int, str]  # conversation (request) number → adapter
    names: list[str]  # adapters, most popular first


def adapter_names(n: int) -> list[str]:
    return [f"lora-{k:02d}" for k in range(n)]


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def _body(model: str, i: int, rng: random.Random, max_tokens: int) -> tuple[bytes, int]:
    words = [f"w{rng.randrange(10_000)}" for _ in range(rng.randint(20, 60))]
    text = f"request {i}: " + " ".join(words)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode(), len(words) + 2


def traffic(n_adapters: int, s: float, rate: float, duration: float, seed: int,
            mean_tokens: int) -> Traffic:
    """Poisson arrivals at ``rate`` for ``duration`` seconds, each for an adapter drawn by Zipf(``s``)."""
    rng = random.Random(seed)
    names = adapter_names(n_adapters)
    weights = zipf_weights(n_adapters, s)
    plan: list[wl.Request] = []
    adapter: dict[int, str] = {}
    t = rng.expovariate(rate)
    while t < duration:
        i = len(plan)
        name = rng.choices(names, weights)[0]
        max_tokens = rng.randint(mean_tokens // 2, mean_tokens * 3 // 2)
        body, prompt = _body(name, i, rng, max_tokens)
        plan.append(wl.Request(at=t, body=body, conversation=i, turn=0, think_s=0.0, prompt_tokens=prompt,
                               max_tokens=max_tokens))
        adapter[i] = name
        t += rng.expovariate(rate)
    return Traffic(plan, adapter, names)


def base_sample(n: int, seed: int, mean_tokens: int) -> list[wl.Request]:
    """Base-model requests of the plan's shape, for measuring an engine's capacity."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        max_tokens = rng.randint(mean_tokens // 2, mean_tokens * 3 // 2)
        body, prompt = _body(wl.MODEL, i, rng, max_tokens)
        out.append(wl.Request(at=0.0, body=body, conversation=i, turn=0, think_s=0.0, prompt_tokens=prompt,
                              max_tokens=max_tokens))
    return out


def make_adapters(root: Path, names: Sequence[str]) -> dict[str, str]:
    """A directory per adapter with its ``adapter_config.json`` (what the sim reads): name → path."""
    paths = {}
    for name in names:
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
        paths[name] = str(d)
    return paths


# ---- reading the engines' and routerd's /metrics --------------------------------------------------

def metric_sum(text: str, name: str, label: str = "") -> float:
    """The sum of ``name``'s series (those whose labels contain ``label``) in one ``/metrics`` page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def lora_info(text: str) -> tuple[set[str], set[str], int]:
    """``vllm:lora_requests_info`` as llm-d reads it: of its series, the one with the highest value
    (the latest): running adapters, waiting adapters, max_lora."""
    best, found = -1.0, (set[str](), set[str](), 0)
    for line in text.splitlines():
        if not line.startswith("vllm:lora_requests_info{"):
            continue
        value = float(line.rsplit(" ", 1)[1])
        if value < best:
            continue
        labels = dict(part.split("=", 1) for part in _label_parts(line[line.index("{") + 1:line.rindex("}")]))
        best = value
        found = ({a for a in labels.get("running_lora_adapters", "").split(",") if a},
                 {a for a in labels.get("waiting_lora_adapters", "").split(",") if a},
                 int(labels.get("max_lora", "0") or 0))
    return found


def _label_parts(text: str) -> list[str]:
    parts, cur, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
            continue
        if ch == "," and not quoted:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    if cur:
        parts.append(cur)
    return parts


@dataclass
class Sample:
    t: float
    loads: float  # Σ sim:lora_loads over the engines
    deferred: float  # Σ requests held back by max_loras now
    routerd_wait_s: float  # routerd_adapter_slot_wait_seconds (0 for the baselines)
    routerd_loads: float


async def sampler(session: aiohttp.ClientSession, engines: Sequence[str], routerd: str | None,
                  every_s: float, out: list[Sample], stop: asyncio.Event) -> None:
    """Every ``every_s``: the engines' loads and deferred requests, routerd's slot-wait seconds."""
    async def page(url: str) -> str:
        try:
            async with asyncio.timeout(5), session.get(url + "/metrics") as r:
                return await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return ""

    while not stop.is_set():
        t = time.perf_counter()
        pages = await asyncio.gather(*(page(u) for u in engines))
        mine = await page(routerd) if routerd else ""
        out.append(Sample(t, sum(metric_sum(p, "sim:lora_loads_total") for p in pages),
                          sum(metric_sum(p, WAITING_BY_REASON, 'reason="deferred"') for p in pages),
                          metric_sum(mine, "routerd_adapter_slot_wait_seconds_total"),
                          metric_sum(mine, "routerd_adapter_loads_total", 'outcome="ok"')))
        with contextlib.suppress(TimeoutError):
            await _aio.wait_for(stop.wait(), max(0.0, every_s - (time.perf_counter() - t)))


def window(samples: Sequence[Sample], t0: float, t1: float) -> dict[str, float]:
    """Loads, deferred request-seconds and routerd's wait seconds between ``t0`` and ``t1``."""
    inside = [s for s in samples if t0 <= s.t <= t1]
    if len(inside) < 2:
        return {"loads": math.nan, "engine_wait_s": math.nan, "routerd_wait_s": math.nan,
                "routerd_loads": math.nan}
    first, last = inside[0], inside[-1]
    deferred = sum(a.deferred * (b.t - a.t) for a, b in itertools.pairwise(inside))
    return {"loads": last.loads - first.loads, "engine_wait_s": deferred,
            "routerd_wait_s": last.routerd_wait_s - first.routerd_wait_s,
            "routerd_loads": last.routerd_loads - first.routerd_loads}


# ---- the baselines: a small proxy --------------------------------------------------------------

class Baseline:
    """An adapter-blind least-load router (``least-load``) or llm-d's scoring (``llm-d``) in front of
    ``engines``: it streams each request through to the instance it picks."""

    def __init__(self, engines: Sequence[str], policy: str, seed: int, scrape_s: float = 0.05) -> None:
        self.engines = list(engines)
        self.policy = policy
        self.rng = random.Random(seed)
        self.scrape_s = scrape_s
        self.inflight = dict.fromkeys(self.engines, 0)
        # llm-d's view of each engine, scraped: running adapters, waiting adapters, max_lora, queue
        self.running: dict[str, set[str]] = {e: set() for e in self.engines}
        self.waiting: dict[str, set[str]] = {e: set() for e in self.engines}
        self.max_lora = dict.fromkeys(self.engines, 0)
        self.queue = dict.fromkeys(self.engines, 0.0)

    def affinity(self, engine: str, adapter: str) -> float:
        """llm-d's lora-affinity-scorer."""
        if adapter in self.running[engine]:
            return 1.0
        if len(self.running[engine]) < self.max_lora[engine]:
            return 0.8
        if adapter in self.waiting[engine]:
            return 0.6
        return 0.0

    def pick(self, model: str) -> str:
        if self.policy == "least-load":
            low = min(self.inflight.values())
            return self.rng.choice([e for e in self.engines if self.inflight[e] == low])
        # llm-d: lora-affinity-scorer + queue-scorer (1 - (q - min) / (max - min)), weights 1:1
        lo, hi = min(self.queue.values()), max(self.queue.values())
        scores = {e: self.affinity(e, model) + (1.0 - (self.queue[e] - lo) / (hi - lo) if hi > lo else 1.0)
                  for e in self.engines}
        best = max(scores.values())
        return self.rng.choice([e for e in self.engines if scores[e] == best])

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        async def one(e: str) -> None:
            try:
                async with asyncio.timeout(1.0), session.get(e + "/metrics") as r:
                    text = await r.text()
            except (aiohttp.ClientError, OSError, TimeoutError):
                return
            self.running[e], self.waiting[e], self.max_lora[e] = lora_info(text)
            self.queue[e] = metric_sum(text, "vllm:num_requests_waiting", 'model_name="')

        while True:
            await asyncio.gather(*(one(e) for e in self.engines))
            await asyncio.sleep(self.scrape_s)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app[SESSION]
        body = await request.read()
        try:
            model = str(json.loads(body).get("model", ""))
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        engine = self.pick(model)
        self.inflight[engine] += 1
        try:
            async with session.post(engine + request.path, data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                resp = web.StreamResponse(status=r.status, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            self.inflight[engine] -= 1


SESSION = web.AppKey("session", aiohttp.ClientSession)


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def serve_baseline(spec: dict[str, Any]) -> None:
    import signal

    router = Baseline(spec["engines"], spec["policy"], spec["seed"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        app = web.Application()
        app[SESSION] = session
        app.router.add_post("/v1/chat/completions", router.handle)
        app.router.add_get("/health", _health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", spec["port"]).start()
        scraping = asyncio.create_task(router.scrape(session))
        try:
            await stop.wait()
        finally:
            scraping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraping
            await runner.cleanup()


# ---- one router's run ------------------------------------------------------------------------------

async def _routerd(procs: Processes, session: aiohttp.ClientSession, engines: list[str],
                   args: argparse.Namespace, paths: dict[str, str], log_path: Path) -> str:
    engine_args: dict[str, Any] = {"enable-lora": True, "max-loras": args.max_loras}
    if args.max_cpu_loras:
        engine_args["max-cpu-loras"] = args.max_cpu_loras
    cfg = {"redis": {"enabled": False}, "daemon": {"log_level": "info"},
           "fleets": [{"name": wl.MODEL, "model": wl.MODEL, "engine": "static", "urls": engines,
                       "engine_args": engine_args,
                       "adapters": [{"name": n, "path": p} for n, p in paths.items()]}]}
    url, _ = await procs.plane(cfg, log_level="info", log_path=log_path)
    async with asyncio.timeout(30):  # every instance ready and scraped before the traffic starts
        while True:
            async with session.get(url + "/admin/fleets") as r:
                fleet = (await r.json())["fleets"][wl.MODEL]
            ready = [i for i in fleet["instances"] if i["state"] == "ready" and i["scrape_age_s"] is not None]
            if len(ready) == len(engines):
                return url
            await asyncio.sleep(0.1)


async def _baseline(procs: Processes, session: aiohttp.ClientSession, engines: list[str], policy: str,
                    paths: dict[str, str], seed: int) -> str:
    # every adapter registered on every engine, as --lora-modules does at start (not timed)
    async def register(engine: str) -> None:
        for name, path in paths.items():
            async with session.post(engine + "/v1/load_lora_adapter",
                                    json={"lora_name": name, "lora_path": path}) as r:
                if r.status != 200:
                    raise RuntimeError(f"{engine}: loading {name} answered {r.status}: {await r.text()}")

    await asyncio.gather(*(register(e) for e in engines))
    from routerd._net import free_port

    from ._common import wait_http

    port = free_port()
    spec = Path(procs.tmp.name) / f"baseline-{port}.json"
    spec.write_text(json.dumps({"engines": engines, "policy": policy, "seed": seed, "port": port}))
    proc = procs._spawn([sys.executable, "-m", "routerd_bench.lora", "router", str(spec)])
    url = f"http://127.0.0.1:{port}"
    await wait_http(url + "/health", proc=proc)
    return url


def engine_kind(args: argparse.Namespace) -> dict[str, Any]:
    return {**ENGINE, "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
            "lora_load_s": args.load_s}


async def run_one(session: aiohttp.ClientSession, router: str, args: argparse.Namespace, work: Traffic,
                  paths: dict[str, str]) -> tuple[dict[str, Any], list[Outcome]]:
    """One router on fresh engines: the plan, then its figures and its measured requests."""
    kind = engine_kind(args)
    with Processes() as procs:
        engines = list(await asyncio.gather(*(procs.sim(wl.MODEL, **kind) for _ in range(args.instances))))
        log_path = Path(procs.tmp.name) / "routerd.log"
        if router == "routerd":
            url = await _routerd(procs, session, engines, args, paths, log_path)
        else:
            url = await _baseline(procs, session, engines, router, paths, args.seed)
        samples: list[Sample] = []
        stop = asyncio.Event()
        watch = asyncio.create_task(sampler(session, engines, url if router == "routerd" else None,
                                            args.sample_s, samples, stop))
        t0 = time.perf_counter()
        try:
            outcomes = await drive(session, [url], work.plan, "none")
        finally:
            stop.set()
            await watch
        elapsed = time.perf_counter() - t0
        rules = await logged_rules(log_path, engines, len(outcomes)) if router == "routerd" else None
    # the measured window: from the first measured request's planned time to the last answer
    measured = [o for o in outcomes if o.request.at >= args.warmup_s]
    figures = window(samples, t0 + args.warmup_s, t0 + elapsed)
    result = figures_of(router, outcomes, measured, figures, elapsed, work)
    if rules is not None:
        result["routerd_rules"], result["routerd_share"] = rules
    return result, measured


async def logged_rules(log_path: Path, engines: Sequence[str], n: int, within_s: float = 10.0
                       ) -> tuple[dict[str, int], dict[str, int]]:
    """:func:`routerd_rules` once routerd has logged all ``n`` requests (it writes a request's line after
    the answer's last byte, so the client may be done first), or as they are after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        rules = routerd_rules(log_path, engines)
        if sum(rules[0].values()) >= n or time.monotonic() > deadline:
            return rules
        await asyncio.sleep(0.1)


def routerd_rules(log_path: Path, engines: Sequence[str]) -> tuple[dict[str, int], dict[str, int]]:
    """From routerd's request log lines: how often each rule chose, and each instance's requests."""
    rules: collections.Counter[str] = collections.Counter()
    share: collections.Counter[str] = collections.Counter()
    names = {e: f"i{n}" for n, e in enumerate(engines)}
    for line in log_path.read_text(errors="replace").splitlines():
        if '"event": "request"' not in line and '"event":"request"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        rules[str(rec.get("rule"))] += 1
        inst = str(rec.get("instance", ""))
        share[next((n for e, n in names.items() if e.split("//")[1] in inst), inst)] += 1
    return dict(rules.most_common()), dict(sorted(share.items()))


def figures_of(router: str, outcomes: Sequence[Outcome], measured: Sequence[Outcome], w: dict[str, float],
               elapsed: float, work: Traffic) -> dict[str, Any]:
    ok = [o for o in measured if o.timing.ok]
    n = max(len(measured), 1)
    wait_s = w["engine_wait_s"] + (w["routerd_wait_s"] if router == "routerd" else 0.0)
    by_rank = {name: k for k, name in enumerate(work.names)}
    head = [o.timing.ttft for o in ok if by_rank[work.adapter[o.request.conversation]] < 3]
    tail = [o.timing.ttft for o in ok if by_rank[work.adapter[o.request.conversation]] >= 3]
    return {
        "_window": w, "router": router, "requests": len(outcomes), "measured": len(measured),
        "failed": len(measured) - len(ok), "elapsed_s": round(elapsed, 2),
        "failures": dict(collections.Counter(str(o.timing.status) for o in measured if not o.timing.ok)),
        "ttft_ms": summary([o.timing.ttft for o in ok]), "e2e_ms": summary([o.timing.e2e for o in ok]),
        "ttft_ms_top3_adapters": summary(head), "ttft_ms_other_adapters": summary(tail),
        "loads": w["loads"], "loads_per_1000": round(w["loads"] / n * 1000, 1),
        "slot_wait_s": round(wait_s, 3), "slot_wait_ms_per_request": round(wait_s / n * 1000, 2),
        "engine_slot_wait_s": round(w["engine_wait_s"], 3),
        "routerd_slot_wait_s": round(w["routerd_wait_s"], 3) if router == "routerd" else None,
        "routerd_loads": w["routerd_loads"] if router == "routerd" else None,
    }


TARGETS = (("least-load", 0.5), ("llm-d", 0.8))


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """routerd's p99 TTFT ÷ each baseline's, in one round (or pooled)."""
    out = {}
    for other, _ in TARGETS:
        mine, theirs = runs.get("routerd"), runs.get(other)
        if mine is not None and theirs is not None and theirs["ttft_ms"]["p99"]:
            out[other] = round(mine["ttft_ms"]["p99"] / theirs["ttft_ms"]["p99"], 3)
    return out


def targets(runs: dict[str, dict[str, Any]], rounds: Sequence[dict[str, dict[str, Any]]] = ()
            ) -> list[dict[str, Any]]:
    """Each target judged on the p99 over every round's requests pooled (``value``); with several
    rounds, also each round's ratio (``rounds``, their median and range): the target is met when both
    the pooled and the median ratio are within the limit."""
    pooled = ratios(runs)
    per_round = [ratios(r) for r in rounds]
    out = []
    for other, limit in TARGETS:
        if other not in pooled:
            continue
        value = pooled[other]
        each = [r[other] for r in per_round if other in r]
        median = sorted(each)[len(each) // 2] if len(each) % 2 else \
            (sum(sorted(each)[len(each) // 2 - 1:len(each) // 2 + 1]) / 2 if each else value)
        out.append({"target": f"routerd p99 TTFT ÷ {other}'s ≤ {limit}", "value": value, "limit": limit,
                    "rounds": each, "median": round(median, 3),
                    "met": math.isfinite(value) and value <= limit and median <= limit})
    return out


def pooled(router: str, rounds: Sequence[tuple[dict[str, Any], list[Outcome]]], work: Traffic
           ) -> dict[str, Any]:
    """One router's figures over every round: latencies over all measured requests together, counts
    summed (per request: over all of them)."""
    if len(rounds) == 1:
        return rounds[0][0]
    measured = [o for _, m in rounds for o in m]
    w = {k: sum(r[0]["_window"][k] for r in rounds) for k in rounds[0][0]["_window"]}
    elapsed = sum(r[0]["elapsed_s"] for r in rounds)
    result = figures_of(router, [o for _, m in rounds for o in m], measured, w, elapsed, work)
    result["requests"] = sum(r[0]["requests"] for r in rounds)
    if router == "routerd":
        rules: collections.Counter[str] = collections.Counter()
        for r, _ in rounds:
            rules.update(r.get("routerd_rules") or {})
        result["routerd_rules"] = dict(rules.most_common())
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        kind = engine_kind(args)
        if args.capacity_rps:
            capacity, per_instance = args.capacity_rps, args.capacity_rps / args.instances
        else:
            # every instance at once, each on its own engine: the CPU they share is the run's
            sample = base_sample(200, args.seed + 1, args.mean_tokens)
            rates = await asyncio.gather(*(calibrate(session, kind, sample, args.calibrate_s)
                                           for _ in range(args.instances)))
            capacity = round(sum(rates), 2)
            per_instance = capacity / args.instances
        rate = args.load * capacity
        work = traffic(args.adapters, args.zipf, rate, args.duration, args.seed, args.mean_tokens)
        shares = collections.Counter(work.adapter.values())
        results: dict[str, Any] = {
            "params": vars(args).copy(), "cpus": os.cpu_count(), "engine": kind,
            "capacity_rps": round(capacity, 2), "capacity_rps_per_instance": round(per_instance, 3),
            "rate_rps": round(rate, 2), "requests": len(work.plan), "plan_digest": plan_digest(work.plan),
            "adapter_share": {n: round(shares[n] / max(len(work.plan), 1), 4) for n in work.names},
            "load_avg_at_start": list(os.getloadavg()), "runs": {}}
        print(f"capacity ≈ {capacity:.1f} req/s; {len(work.plan)} requests at {rate:.1f} req/s for "
              f"{len(work.names)} adapters (Zipf s={args.zipf})", flush=True)
        done: dict[str, list[tuple[dict[str, Any], list[Outcome]]]] = {r: [] for r in args.routers}
        rounds: list[dict[str, dict[str, Any]]] = []
        with Processes() as holder:  # the adapters' directories, one set for every router
            paths = make_adapters(Path(holder.tmp.name), work.names)
            for k in range(args.repeats):
                # each round (and seed) in another order: the machine's load as it drifts falls on every
                # router alike
                first = (k + args.seed) % len(args.routers)
                order = args.routers[first:] + args.routers[:first]
                this: dict[str, dict[str, Any]] = {}
                for router in order:
                    before = list(os.getloadavg())
                    result, measured = await run_one(session, router, args, work, paths)
                    result["load_avg_before"], result["load_avg_after"] = before, list(os.getloadavg())
                    result["round"] = k
                    done[router].append((result, measured))
                    this[router] = result
                    ok = result["measured"] - result["failed"]
                    print(f"  round {k} {router:<11} {ok} ok, {result['failed']} failed, "
                          f"{result['elapsed_s']} s, p99 TTFT {result['ttft_ms']['p99']:.0f} ms, "
                          f"load avg {before[0]:.1f}", flush=True)
                rounds.append(this)
                if args.repeats > 1:
                    print(f"  round {k} ratios {ratios(this)}", flush=True)
    results["runs"] = {router: pooled(router, done[router], work) for router in args.routers}
    if args.repeats > 1:
        results["rounds"] = rounds
    for r in [*results["runs"].values(), *(x for rd in rounds for x in rd.values())]:
        r.pop("_window", None)
    results["targets"] = targets(results["runs"], rounds if args.repeats > 1 else ())
    return results


def report(results: dict[str, Any]) -> None:
    rows = [[name, r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["e2e_ms"]["p50"], r["e2e_ms"]["p99"],
             r["ttft_ms_top3_adapters"]["p99"], r["ttft_ms_other_adapters"]["p99"], r["loads_per_1000"],
             r["slot_wait_s"], r["slot_wait_ms_per_request"], r["failed"]]
            for name, r in results["runs"].items()]
    p = results["params"]
    print_table(f"{p['adapters']} adapters (Zipf s={p['zipf']}) on {p['instances']} instances × "
                f"{p['max_loras']} slots (max-cpu-loras {p['max_cpu_loras'] or p['max_loras']}), "
                f"adapter load {p['load_s']} s; {p['repeats']} round(s) of {results['requests']} requests at "
                f"{results['rate_rps']} req/s ({p['load']:.0%} of {results['capacity_rps']} req/s), first "
                f"{p['warmup_s']} s unmeasured; load avg {results['load_avg_at_start'][0]:.2f}",
                ["router", "ttft p50 ms", "ttft p99 ms", "e2e p50 ms", "e2e p99 ms", "top-3 p99",
                 "others p99", "loads/1k req", "slot wait s", "wait ms/req", "failed"], rows)
    if results["targets"]:
        print_table("targets (value: the p99 over every round's requests; rounds: each round's)",
                    ["target", "value", "rounds", "median", "met"],
                    [[t["target"], t["value"], " ".join(f"{x:.2f}" for x in t["rounds"]) or "-",
                      t["median"], "yes" if t["met"] else "NO"] for t in results["targets"]])


def main(argv: list[str]) -> int:
    if argv[:1] == ["router"]:  # the baselines' proxy process
        import uvloop

        uvloop.run(serve_baseline(json.loads(Path(argv[1]).read_text())))
        return 0
    ap = argparse.ArgumentParser(prog="routerd bench lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    ap.add_argument("--adapters", type=int, default=24)
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity exponent s")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--max-cpu-loras", type=int, default=None,
                    help=f"adapters' weights an engine keeps in CPU memory (default {CPU_LORAS_PER_SLOT} × "
                         "max-loras; 0: vLLM's default, = max-loras)")
    ap.add_argument("--load-s", type=float, default=LOAD_S, help="seconds to read one adapter's weights")
    ap.add_argument("--load", type=float, default=0.7, help="arrival rate as a fraction of measured capacity")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per router")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="the plan's first seconds, not measured")
    ap.add_argument("--mean-tokens", type=int, default=64, help="mean output tokens (uniform ±50 %%)")
    ap.add_argument("--calibrate-s", type=float, default=3.0, help="seconds of the capacity measurement")
    ap.add_argument("--capacity-rps", type=float, default=0.0, help="this fleet capacity, not measured")
    ap.add_argument("--sample-s", type=float, default=0.1, help="how often the engines' counters are read")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every router on the same plan, each round in another order")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.max_cpu_loras is None:
        args.max_cpu_loras = CPU_LORAS_PER_SLOT * args.max_loras
    import uvloop

    results = uvloop.run(run(args))
    report(results)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
