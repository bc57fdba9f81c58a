"""``routerd bench autoscale``: an elastic fleet under a load that rises and falls, and a burst from zero.

Runs a real Ray head (its own, unless ``--ray-address``), ``routerd run`` in its own process with one
autoscaled fleet of simulated engines (``min_replicas = 0``), and an open-loop load generator here
(Poisson arrivals, streamed completions, TTFT = the first event carrying text). The load is a share of
*the max fleet's capacity*: what the fleet at ``max_replicas`` completes per second with every slot busy,
measured right after the cold burst (``--calibrate-s`` of closed-loop clients, one per slot) — on a
shared machine the sims get less CPU than their latency model assumes, and an analytic capacity would
make "90 %" an overload. Phases:

1. **cold** — the fleet at zero; a burst of ``max_replicas × max_num_seqs`` requests at once. Reports
   the first request's time to first token against its engine's start-up (from routerd's own log: the
   cold-start decision to the first replica ready), and how long until the fleet ran its max; then
   **idle** — no load until the fleet is back at zero.
2. **steps** — 10 % held (``--low-s``), up to 90 % in steps of 10 % (``--step-s`` each), 90 % held
   (``--hold-s``), down again in steps, 10 % held: a day's traffic, compressed.
3. **steady** — on the way down the steps, ``--steady-load`` (a 10 % level) is held for ``--steady-s``:
   decisions per ``scale_down_delay_s`` once settled (the first delay excluded).
4. **jump** — 10 % then straight to 90 % (``--jump-s`` each), then 10 %: the worst case. At 90 % the
   max fleet has 10 % to spare, so the backlog gathered while replicas start drains slowly; reported
   beside the targets, not in them.

Per phase: requests, failures, p50/p99 TTFT and the share within ``--ttft-target-ms``; reaction to scale
up (from the jump to the decision, and to every replica ready); instance-seconds against a fixed fleet at
max over the same time. Targets (issue #13): ≥ 99 % within the TTFT target outside the first cold
start (steps and steady) with ≤ 60 % of the fixed fleet's instance-seconds (over the steps); zero →
first token ≤ start-up + 2 s; 0 failed requests; at most one decision per ``scale_down_delay_s`` under
steady load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from routerd._net import free_port

from ._common import Timing, quantile, timed_request, write_json

FLEET = "auto"
MODEL = "sim-auto"


@dataclass
class Sample:
    """One request: when it was sent (seconds into the run), its phase and what the client saw."""

    sent: float
    phase: str
    timing: Timing


@dataclass
class Timeline:
    """The fleet as ``/admin/fleets`` showed it, polled: (t, desired, launched, ready) and decisions."""

    wall0: float = 0.0  # time.time() at the run's start: decisions carry wall times
    points: list[tuple[float, int, int, int]] = field(default_factory=list)
    decisions: dict[tuple[float, int, int], dict[str, Any]] = field(default_factory=dict)
    startup_s: float | None = None

    def instance_seconds(self, start: float, end: float) -> float:
        """The integral of launched replicas (starting, ready or restarting) over [start, end]."""
        total = 0.0
        pts = [p for p in self.points if start <= p[0] <= end]
        for (t0, _, n, _), (t1, _, _, _) in itertools.pairwise(pts):
            total += n * (t1 - t0)
        return total

    def first(self, cond: Callable[[tuple[float, int, int, int]], bool], after: float) -> float | None:
        return next((p[0] for p in self.points if p[0] >= after and cond(p)), None)


def _toml(cfg: dict[str, Any]) -> str:
    """The daemon's config file: sections of scalars, then ``[[fleets]]`` with their sub-tables."""
    lines: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)

    for section, body in cfg.items():
        if section != "fleets":
            lines += [f"[{section}]", *(f"{k} = {value(v)}" for k, v in body.items()), ""]
    for fleet in cfg["fleets"]:
        lines.append("[[fleets]]")
        lines += [f"{k} = {value(v)}" for k, v in fleet.items() if k != "autoscale"]
        lines += ["[fleets.autoscale]", *(f"{k} = {value(v)}" for k, v in fleet["autoscale"].items()), ""]
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def _daemon(cfg: dict[str, Any], workdir: Path) -> AsyncIterator[str]:
    """``routerd run`` on ``cfg`` in its own process until the block ends (SIGTERM, engines stopped)."""
    path = workdir / "routerd.toml"
    path.write_text(_toml(cfg))
    log = (workdir / "routerd.log").open("wb")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    argv = [sys.executable, "-m", "routerd", "run", "--config", str(path), "--log-format", "json"]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=asyncio.subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{cfg['http']['port']}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                if proc.returncode is not None:
                    raise RuntimeError(f"routerd exited ({proc.returncode}); see {workdir / 'routerd.log'}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with asyncio.timeout(1.0), s.get(f"{url}/readyz") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.2)
            else:
                raise TimeoutError("routerd did not become ready in 120 s")
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()  # drains, and stops the engines (stop_engines_on_exit)
        try:
            async with asyncio.timeout(120):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.close()


async def _watch(session: aiohttp.ClientSession, url: str, t0: float, timeline: Timeline,
                 stop: asyncio.Event) -> None:
    """Poll ``/admin/fleets`` every 0.2 s into ``timeline``."""
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, KeyError):
            async with asyncio.timeout(2.0), session.get(f"{url}/admin/fleets") as r:
                fleet = (await r.json())["fleets"][FLEET]
            auto = fleet["autoscale"] or {}
            launched = sum(1 for i in fleet["instances"] if i["state"] != "draining")
            timeline.points.append((time.monotonic() - t0, int(fleet["replicas"]), launched,
                                    int(fleet["ready"])))
            timeline.startup_s = auto.get("startup_s") or timeline.startup_s
            for d in auto.get("recent", []):
                timeline.decisions.setdefault((d["at"], d["from"], d["to"]), d)
        await asyncio.sleep(0.2)


class Generator:
    """Open-loop Poisson arrivals of streamed completions; every request is kept as a :class:`Sample`."""

    def __init__(self, session: aiohttp.ClientSession, url: str, t0: float, max_tokens: int,
                 rng: random.Random) -> None:
        self.session = session
        self.endpoint = f"{url}/v1/completions"
        self.t0 = t0
        self.body = json.dumps({"model": MODEL, "prompt": "autoscale", "max_tokens": max_tokens,
                                "stream": True}).encode()
        self.rng = rng
        self.samples: list[Sample] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.segments: list[tuple[float, float, float]] = []  # (start, end, requests/s) of each run()

    def send(self, phase: str) -> None:
        task = asyncio.create_task(self._one(phase))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _one(self, phase: str) -> None:
        sent = time.monotonic() - self.t0
        timing = await timed_request(self.session, self.endpoint, self.body, stream=True)
        self.samples.append(Sample(sent=sent, phase=phase, timing=timing))

    async def run(self, phase: str, rate: float, seconds: float) -> None:
        """``rate`` requests/s for ``seconds``, exponentially spaced."""
        self.segments.append((time.monotonic() - self.t0, time.monotonic() - self.t0 + seconds, rate))
        end = time.monotonic() + seconds
        while True:
            gap = self.rng.expovariate(rate) if rate > 0 else seconds
            if time.monotonic() + gap >= end:
                await asyncio.sleep(max(0.0, end - time.monotonic()))
                return
            await asyncio.sleep(gap)
            self.send(phase)

    async def calibrate(self, timeline: Timeline, max_replicas: int, clients: int, seconds: float) -> float:
        """What the max fleet completes per second: ``clients`` (its slots) closed-loop for ``seconds``
        once every replica is ready. The load phases are shares of this."""
        for _ in range(600):
            if timeline.points and timeline.points[-1][3] >= max_replicas:
                break
            await asyncio.sleep(0.1)
        done = 0
        end = time.monotonic() + seconds

        async def client() -> None:
            nonlocal done
            while time.monotonic() < end:
                timing = await timed_request(self.session, self.endpoint, self.body, stream=True)
                done += timing.ok

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done / (time.monotonic() - started)

    async def drain(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout)


def _phase_stats(samples: list[Sample], target_s: float) -> dict[str, Any]:
    ok = [s.timing for s in samples if s.timing.ok]
    ttfts = [t.ttft for t in ok]
    within = sum(1 for t in ttfts if t <= target_s)
    return {"requests": len(samples), "failed": len(samples) - len(ok),
            "ttft_p50_ms": round(quantile(ttfts, 0.5) * 1000, 1) if ttfts else math.nan,
            "ttft_p99_ms": round(quantile(ttfts, 0.99) * 1000, 1) if ttfts else math.nan,
            "within_target": round(within / len(samples), 4) if samples else math.nan}


def _missed(samples: list[Sample], target_s: float) -> dict[int, int]:
    """Requests over the TTFT target (or failed), by the 10 s of the run they were sent in."""
    out: dict[int, int] = {}
    for s in samples:
        if not s.timing.ok or s.timing.ttft > target_s:
            key = int(s.sent // 10 * 10)
            out[key] = out.get(key, 0) + 1
    return out


def _max_decisions_per_window(times: list[float], window: float) -> int:
    return max((sum(1 for u in times if t <= u < t + window) for t in times), default=0)


async def run(args: argparse.Namespace, address: str, workdir: Path) -> dict[str, Any]:
    seqs, max_r, delay = args.max_num_seqs, args.max_replicas, args.scale_down_delay_s
    # The sim's latency model at a full batch: one admitting step, then max_tokens decode steps. What
    # the max fleet really completes is measured (calibrate): on a shared machine the engines' CPU is less.
    service_s = (args.ttft_ms + args.max_tokens * args.itl_ms * 1.5) / 1000.0
    model_rps = max_r * seqs / service_s
    autoscale = {"min_replicas": 0, "max_replicas": max_r, "scale_down_delay_s": delay,
                 "target_wait_s": args.target_wait_s, "target_utilization": args.target_utilization}
    cfg = {
        "daemon": {"state_dir": str(workdir / "state"), "stop_engines_on_exit": True, "log_level": "info"},
        "http": {"host": "127.0.0.1", "port": free_port()},
        "redis": {"enabled": False},
        "ray": {"address": address, "namespace": f"routerd-bench-{os.getpid()}"},
        "admission": {"waiting_room_s": 120.0},
        "routing": {"policy": args.policy} if args.policy else {},
        "fleets": [{"name": FLEET, "model": MODEL, "engine": "sim", "replicas": 0,
                    "num_cpus_per_instance": 0.5, "max_num_seqs": seqs,
                    "engine_args": {"max-num-seqs": seqs, "ttft-ms": args.ttft_ms, "itl-ms": args.itl_ms},
                    "autoscale": autoscale}],
    }
    if not cfg["routing"]:
        del cfg["routing"]
    target_s = args.ttft_target_ms / 1000.0
    rng = random.Random(args.seed)
    timeline = Timeline()
    marks: dict[str, tuple[float, float]] = {}
    async with _daemon(cfg, workdir) as url, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                  timeout=aiohttp.ClientTimeout(total=300)) as session:
        t0 = time.monotonic()
        timeline.wall0 = time.time()
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(session, url, t0, timeline, stop))
        gen = Generator(session, url, t0, args.max_tokens, rng)

        def now() -> float:
            return time.monotonic() - t0

        try:
            # 1. cold: a burst from zero, then idle until the fleet is back at zero.
            start = now()
            for _ in range(max_r * seqs):
                gen.send("cold")
            await gen.drain(300)
            marks["cold"] = (start, now())
            capacity_rps = await gen.calibrate(timeline, max_r, max_r * seqs, args.calibrate_s)
            start = now()
            await _until_zero(timeline, (max_r + 2) * delay + 30)
            marks["idle"] = (start, now())
            # 2. steps: 10 % held, up to 90 % a 10 % step at a time, 90 % held, down again — holding
            # the steady level on the way (3.) — and 10 % held.
            start = now()
            levels = [round(0.1 * k, 1) for k in range(1, 10)]
            await gen.run("steps", 0.1 * capacity_rps, args.low_s)
            for level in levels[1:-1]:
                await gen.run("steps", level * capacity_rps, args.step_s)
            await gen.run("steps", 0.9 * capacity_rps, args.hold_s)
            for level in reversed(levels[1:-1]):
                if level == args.steady_load:
                    steady_start = now()
                    await gen.run("steady", level * capacity_rps, args.steady_s)
                    marks["steady"] = (steady_start, now())
                await gen.run("steps", level * capacity_rps, args.step_s)
            await gen.run("steps", 0.1 * capacity_rps, args.low_s)
            marks["steps"] = (start, now())
            # 4. jump: 10 % → 90 % at once → 10 %.
            start = now()
            await gen.run("jump", 0.1 * capacity_rps, args.jump_s)
            marks["jump_at"] = (now(), now())
            await gen.run("jump", 0.9 * capacity_rps, args.jump_s)
            await gen.run("jump", 0.1 * capacity_rps, args.jump_s)
            await gen.drain(300)
            marks["jump"] = (start, now())
        finally:
            await gen.drain(60)
            stop.set()
            await watcher
    cold = _cold_start_from_log(workdir / "routerd.log")
    steps = [seg for seg in gen.segments if marks["steps"][0] <= seg[0] < marks["steps"][1]]
    oracle = {f"u={u}": round(sum((e - b) * min(max_r, math.ceil(rate / capacity_rps * max_r / u - 1e-9))
                                  for b, e, rate in steps), 1) for u in (1.0, args.target_utilization)}
    return _report(args, gen.samples, timeline, marks, target_s, (capacity_rps, model_rps), service_s, cfg,
                   cold, oracle)


async def _until_zero(timeline: Timeline, timeout: float) -> None:
    """Wait until the polled fleet wants and runs no replica."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if timeline.points and timeline.points[-1][1] == 0 and timeline.points[-1][2] == 0:
            return
        await asyncio.sleep(0.5)


def _cold_start_from_log(path: Path) -> dict[str, float]:
    """From the daemon's own log: the cold-start decision and the first replica ready after it (the
    engine's start-up as the first request lived it, placement and warm-up included)."""
    decided = ready = None
    with path.open(errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            at = datetime.fromisoformat(rec.get("timestamp", "1970-01-01T00:00:00Z")).timestamp()
            event = rec.get("event")
            if decided is None and event == "autoscale_decision" and rec.get("reason") == "cold_start":
                decided = at
            elif decided is not None and event == "instance_ready":
                ready = at
                break
    return {"decided": decided, "ready": ready} if decided is not None and ready is not None else {}


def _report(args: argparse.Namespace, samples: list[Sample], timeline: Timeline,
            marks: dict[str, tuple[float, float]], target_s: float, capacity: tuple[float, float],
            service_s: float, cfg: dict[str, Any], cold_log: dict[str, float],
            oracle: dict[str, float]) -> dict[str, Any]:
    max_r, delay = args.max_replicas, args.scale_down_delay_s
    by_phase = {p: [s for s in samples if s.phase == p] for p in ("cold", "steps", "steady", "jump")}
    phases = {p: _phase_stats(v, target_s) for p, v in by_phase.items()}
    cold = sorted(by_phase["cold"], key=lambda s: s.sent)
    first = cold[0].timing if cold else None
    startup = cold_log["ready"] - cold_log["decided"] if cold_log else None
    cold_start, cold_end = marks["cold"]
    at_max = timeline.first(lambda p: p[3] >= max_r, cold_start)
    jump_at = marks["jump_at"][0]
    decisions = sorted(timeline.decisions.values(), key=lambda d: d["at"])

    def t_of(d: dict[str, Any]) -> float:
        return float(d["at"]) - timeline.wall0

    up_after_jump = next((t_of(d) for d in decisions if t_of(d) >= jump_at and d["to"] > d["from"]), None)
    ready_after_jump = timeline.first(lambda p: p[3] >= max_r, jump_at)
    steady_start, steady_end = marks["steady"]
    steady_decisions = [t_of(d) for d in decisions if steady_start + delay <= t_of(d) <= steady_end]
    steps_start, steps_end = marks["steps"]  # the steady hold is part of the steps' time
    used = timeline.instance_seconds(steps_start, steps_end)
    fixed = max_r * (steps_end - steps_start)
    outside_cold = by_phase["steps"] + by_phase["steady"]
    return {
        "config": {"max_replicas": max_r, "max_num_seqs": args.max_num_seqs, "ttft_ms": args.ttft_ms,
                   "itl_ms": args.itl_ms, "max_tokens": args.max_tokens, "service_s_full_batch": service_s,
                   "max_fleet_capacity_rps": round(capacity[0], 2),
                   "max_fleet_capacity_rps_by_the_sims_model": round(capacity[1], 2),
                   "autoscale": cfg["fleets"][0]["autoscale"],
                   "ttft_target_ms": args.ttft_target_ms, "low_s": args.low_s, "step_s": args.step_s,
                   "hold_s": args.hold_s, "steady_load": args.steady_load, "steady_s": args.steady_s,
                   "jump_s": args.jump_s, "policy": args.policy or "default", "loadavg": os.getloadavg()},
        "phases": phases,
        "cold_start": {"first_ttft_s": round(first.ttft, 3) if first is not None else None,
                       "engine_startup_s": round(startup, 3) if startup is not None else None,
                       "extra_s": round(first.ttft - startup, 3)
                       if first is not None and startup is not None else None,
                       "learned_startup_s": timeline.startup_s,
                       "to_max_ready_s": round(at_max - cold_start, 2) if at_max is not None else None,
                       "burst_s": round(cold_end - cold_start, 2)},
        "jump": {"to_decision_s": round(up_after_jump - jump_at, 2) if up_after_jump is not None else None,
                 "to_max_ready_s": round(ready_after_jump - jump_at, 2) if ready_after_jump is not None
                 else None},
        "instance_seconds": {"autoscaled": round(used, 1), "fixed_at_max": round(fixed, 1),
                             "ratio": round(used / fixed, 3) if fixed else math.nan, "span": "steps",
                             # an oracle that runs ceil(load × max / u) replicas, started instantly
                             "oracle": oracle,
                             "oracle_ratio": {k: round(v / fixed, 3) for k, v in oracle.items()} if fixed
                             else {}},
        "steady": {"decisions_after_first_delay": len(steady_decisions),
                   "max_per_scale_down_delay": _max_decisions_per_window(steady_decisions, delay)},
        "idle_to_zero_s": round(marks["idle"][1] - marks["idle"][0], 1),
        "within_target_outside_cold": _phase_stats(outside_cold, target_s)["within_target"],
        "missed_by_10s": _missed(outside_cold, target_s),
        "failed_total": sum(p["failed"] for p in phases.values()),
        "decisions": [{"t": round(t_of(d), 2), "from": d["from"], "to": d["to"], "reason": d["reason"],
                       "demand": d.get("demand"), "ready": d.get("ready")} for d in decisions],
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="routerd bench autoscale", description=__doc__.splitlines()[0])
    ap.add_argument("--ray-address", default="", help="use this cluster instead of a throwaway local head")
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--ttft-ms", type=float, default=20.0, help="the sim's prefill step")
    ap.add_argument("--itl-ms", type=float, default=60.0, help="the sim's decode step")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--scale-down-delay-s", type=float, default=10.0)
    ap.add_argument("--target-wait-s", type=float, default=0.5)
    ap.add_argument("--target-utilization", type=float, default=0.7)
    ap.add_argument("--ttft-target-ms", type=float, default=1000.0)
    ap.add_argument("--low-s", type=float, default=40.0, help="10 %% held before and after the steps")
    ap.add_argument("--step-s", type=float, default=10.0, help="each 10 %% step between")
    ap.add_argument("--hold-s", type=float, default=40.0, help="90 %% held at the top")
    ap.add_argument("--steady-load", type=float, default=0.5,
                    choices=[round(0.1 * k, 1) for k in range(2, 9)], help="held on the way down")
    ap.add_argument("--steady-s", type=float, default=40.0)
    ap.add_argument("--jump-s", type=float, default=20.0)
    ap.add_argument("--policy", default="", help="routing policy (default: routerd's)")
    ap.add_argument("--calibrate-s", type=float, default=15.0, help="measuring the max fleet's capacity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default="")
    args = ap.parse_args(argv)
    from .ray_nodes import own_head

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="rba") as tmp:
        if args.ray_address:
            result = asyncio.run(run(args, args.ray_address, Path(tmp)))
        else:
            with own_head() as (address, _):
                result = asyncio.run(run(args, address, Path(tmp)))
    _print(result, args)
    write_json(args.json_path, result)
    return 0


def _print(r: dict[str, Any], args: argparse.Namespace) -> None:
    c = r["config"]
    load = ", ".join(f"{x:.2f}" for x in c["loadavg"])
    print(f"max fleet: {c['max_replicas']} × {c['max_num_seqs']} slots, {c['max_fleet_capacity_rps']} req/s "
          f"measured ({c['max_fleet_capacity_rps_by_the_sims_model']} by the sim's model); "
          f"TTFT target {c['ttft_target_ms']:.0f} ms; load average {load}")
    print(f"\n{'phase':<8}{'requests':>10}{'failed':>8}{'p50 TTFT ms':>13}{'p99 TTFT ms':>13}{'within':>9}")
    for name, p in r["phases"].items():
        print(f"{name:<8}{p['requests']:>10}{p['failed']:>8}{p['ttft_p50_ms']:>13}{p['ttft_p99_ms']:>13}"
              f"{p['within_target']:>9.2%}")
    cs, j, i = r["cold_start"], r["jump"], r["instance_seconds"]
    rows = [
        ("within TTFT target outside the cold start", f"{r['within_target_outside_cold']:.2%}", "≥ 99 %"),
        ("instance-seconds vs a fixed fleet at max (steps)",
         f"{i['autoscaled']} / {i['fixed_at_max']} = {i['ratio']:.1%}", "≤ 60 %"),
        ("  an instant oracle at u = 1 / at the target u",
         " / ".join(f"{v:.1%}" for v in i["oracle_ratio"].values()), "-"),
        ("zero → first token (s)", f"{cs['first_ttft_s']} (its engine's start-up {cs['engine_startup_s']}, "
                                   f"extra {cs['extra_s']})", "≤ start-up + 2 s"),
        ("burst from zero → max replicas ready (s)", str(cs["to_max_ready_s"]), "-"),
        ("jump 10 % → 90 %: to the decision / to max ready (s)",
         f"{j['to_decision_s']} / {j['to_max_ready_s']}", "-"),
        ("failed requests", str(r["failed_total"]), "0"),
        (f"steady {c['steady_load']:.0%}: max decisions per scale_down_delay_s",
         str(r["steady"]["max_per_scale_down_delay"]), "≤ 1"),
        ("idle → zero (s)", str(r["idle_to_zero_s"]), "-"),
    ]
    width = max(len(x[0]) for x in rows)
    print()
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<44}  target {target}")
    print("\ndecisions:", ", ".join(f"{d['t']}s {d['from']}→{d['to']} {d['reason']}" for d in r["decisions"]))
