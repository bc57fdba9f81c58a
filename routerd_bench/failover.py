"""``routerd bench failover``: how fast a dead or hung engine leaves rotation, and what clients see.

Runs a real Ray head (its own, unless ``--ray-address``), a fleet of simulated engines launched as Ray
actors, and routerd's data plane, all on this machine; then:

1. a steady phase at ``--load`` (default 0.95) of the fleet's capacity for ``--steady-s`` seconds with
   the default health settings, counting restarts (any restart here is a false one) and failures;
2. ``--kills`` rounds of SIGKILL and ``--stops`` rounds of SIGSTOP of one engine under load, timing each
   from the signal to the instance leaving rotation, then waiting for its replacement. The streams the
   engine held are resumed on the other instance (routerd/resume.py): each client checks its stream is
   the whole generation, exactly (the simulated engine's text is known), and times the resume gap it
   saw — from the last event before the signal to the first after;
3. ``--node-rounds`` node losses on a multi-node cluster of their own (routerd_bench/node_loss.py) and
   ``--restarts`` restarts of ``routerd run`` under ``--restart-rate`` requests/s, socket-activated and,
   once, binding its own port (routerd_bench/restart.py).

Targets (issue #4): SIGKILL → out ≤ 2 s; SIGSTOP → out ≤ heartbeat_timeout_s + one interval; zero failed
requests that had not started streaming; no false restart at 95 % load. Issue #12: no stream cut (none
ends with an error event, none differs from the whole generation); resume gap p99 ≤ detection + one
time to first token (SIGKILL: ≤ 0.5 s); node loss: every affected stream resumed, no queue job lost,
the replacement ready within engine start-up; a restart at 100 requests/s: 0 refused, 0 failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from .in_process import running_routerd
from .load import Load
from .ray_nodes import own_head


async def _wait(cond: Any, timeout: float, step: float = 0.01) -> float:
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout:
            raise TimeoutError
        await asyncio.sleep(step)
    return time.monotonic() - started


async def _fault_round(registry: Any, fleet: str, sig: signal.Signals, rng: random.Random,
                       load: Load | None = None) -> float:
    """Signal one ready engine; seconds until it left rotation; then wait for its replacement.

    First a second of traffic on the whole fleet again: a replacement that has just joined holds only
    requests still before their first token, and a fault then would measure no mid-stream failure."""
    await asyncio.sleep(1.0)
    ready = registry.routable(fleet)
    victim = rng.choice(ready)
    iid, gen, pid = victim.id, victim.generation, victim.pid
    if load is not None:
        load.fault(iid)
    t0 = time.monotonic()
    os.kill(pid, sig)
    await _wait(lambda: all(i.id != iid for i in registry.routable(fleet)), 30.0, 0.005)
    took = time.monotonic() - t0
    if load is not None:
        load.out()

    def back() -> bool:
        inst = registry.get(iid)
        return inst is not None and inst.generation > gen and inst in registry.routable(fleet)

    await _wait(back, 120.0, 0.05)
    return took


async def run(args: argparse.Namespace, address: str, state_dir: str) -> dict[str, Any]:
    from routerd import config as config_mod

    seqs = 8
    cfg = config_mod.parse({
        "daemon": {"state_dir": state_dir}, "redis": {"enabled": False},
        "ray": {"address": address, "namespace": f"routerd-bench-{os.getpid()}"},
        "fleets": [{"name": "bench", "model": "sim-bench", "engine": "sim", "replicas": args.replicas,
                    "num_cpus_per_instance": 0.5, "max_num_seqs": seqs,
                    "engine_args": {"max-num-seqs": seqs, "ttft-ms": 30, "itl-ms": 10}}],
    }, environ={})
    h = cfg.health
    rng = random.Random(args.seed)
    async with running_routerd(cfg) as r, aiohttp.ClientSession() as session:
        registry, url = r.registry, r.url
        await _wait(lambda: registry.ready_count("bench") == args.replicas, 120.0, 0.1)
        load = Load(url, "sim-bench")
        stop = asyncio.Event()
        n_clients = max(1, round(args.load * args.replicas * seqs))
        clients = [asyncio.create_task(load.client(session, stop, stream=i % 2 == 0))
                   for i in range(n_clients)]
        try:
            await asyncio.sleep(args.steady_s)
            false_restarts = sum(i.restarts for i in registry)
            steady = {"ok": load.ok, "failed_before_stream": load.failed_before_stream,
                      "failed_mid_stream": load.failed_mid_stream}
            kills, stops = [], []
            for _ in range(args.kills):
                kills.append(await _fault_round(registry, "bench", signal.SIGKILL, rng, load))
            kill_gaps, kill_ttfts = load.resume_gaps, load.fault_ttfts
            load.resume_gaps, load.fault_ttfts = [], []
            for _ in range(args.stops):
                stops.append(await _fault_round(registry, "bench", signal.SIGSTOP, rng, load))
            stop_gaps, stop_ttfts = load.resume_gaps, load.fault_ttfts
        finally:
            stop.set()
            await asyncio.gather(*clients)
        async with session.get(f"{url}/metrics") as resp:
            resumed = _resume_counts(await resp.text())
    return {
        "config": {"replicas": args.replicas, "max_num_seqs": seqs, "clients": n_clients, "load": args.load,
                   "steady_s": args.steady_s, "heartbeat_interval_s": h.heartbeat_interval_s,
                   "heartbeat_timeout_s": h.heartbeat_timeout_s, "failure_threshold": h.failure_threshold},
        "steady": {**steady, "false_restarts": false_restarts},
        "sigkill_to_out_s": kills, "sigstop_to_out_s": stops,
        "total": {"ok": load.ok, "failed_before_stream": load.failed_before_stream,
                  "failed_mid_stream": load.failed_mid_stream, "wrong_text": load.wrong_text,
                  "errors": load.errors},
        "resume": {**resumed, "sigkill_gap_s": kill_gaps, "sigstop_gap_s": stop_gaps,
                   "sigkill_ttft_after_s": kill_ttfts, "sigstop_ttft_after_s": stop_ttfts},
        "targets": {"sigkill_to_out_s": 2.0,
                    "sigstop_to_out_s": h.heartbeat_timeout_s + h.heartbeat_interval_s,
                    "streams_cut": 0, "sigkill_gap_p99_s": 0.5,
                    # detection (heartbeat timeout + one interval) plus one time to first token on the
                    # instances left (p99 of the new streams then; the engine's 30 ms when none)
                    "sigstop_gap_p99_s": h.heartbeat_timeout_s + h.heartbeat_interval_s
                    + (_quantile(stop_ttfts, 0.99) if stop_ttfts else 0.03)},
    }


def _quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _resume_counts(metrics: str) -> dict[str, float]:
    """routerd's own count of resumed streams (``routerd_resumes_total``, summed over reasons), of those
    that completed, and of streams cut."""
    out = {"resumes": 0.0, "resumed_completed": 0.0, "streams_cut": 0.0}
    for line in metrics.splitlines():
        for key in out:
            if line.startswith(f"routerd_{key}_total{{"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def _gaps(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"p50 {statistics.median(xs):.3f}  p99 {_quantile(xs, 0.99):.3f}  (n={len(xs)})"


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"p50 {statistics.median(xs):.3f}  max {max(xs):.3f}  (n={len(xs)})"


def _node_and_restart_rounds(args: argparse.Namespace, address: str, state: str) -> dict[str, Any]:
    """Issue #12's node-loss rounds (routerd_bench/node_loss.py, on a cluster of their own) and restart
    rounds (routerd_bench/restart.py, ``routerd run`` processes over engines on ``address``)."""
    from .node_loss import node_loss_rounds
    from .restart import restart_rounds

    out: dict[str, Any] = {}
    if args.node_rounds:
        out["node_loss"] = asyncio.run(node_loss_rounds(args.node_rounds, str(Path(state) / "nodes")))
    if args.restarts:
        out["restart"] = asyncio.run(restart_rounds(address, state, rate_per_s=args.restart_rate,
                                                    restarts=args.restarts))
    return out


def _node_and_restart_rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    from . import node_loss, restart

    return ((node_loss.table_rows(result["node_loss"]) if "node_loss" in result else [])
            + (restart.table_rows(result["restart"]) if "restart" in result else []))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="routerd bench failover", description=__doc__.splitlines()[0])
    ap.add_argument("--ray-address", default="", help="use this cluster instead of a throwaway local head")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--load", type=float, default=0.95, help="closed-loop clients / total max_num_seqs")
    ap.add_argument("--steady-s", type=float, default=600.0, help="the false-restart run (issue: 10 min)")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--stops", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--node-rounds", type=int, default=1,
                    help="node losses on a multi-node cluster of its own (0: none)")
    ap.add_argument("--restarts", type=int, default=1, help="routerd restarts under load (0: none)")
    ap.add_argument("--restart-rate", type=float, default=100.0, help="requests/s during the restarts")
    ap.add_argument("--json", dest="json_path", default="")
    args = ap.parse_args(argv)
    from routerd import log

    log.setup("warning")  # one log line per request would cost the CPU being measured
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="rbf") as state:
        if args.ray_address:
            result = asyncio.run(run(args, args.ray_address, state))
            result.update(_node_and_restart_rounds(args, args.ray_address, state))
        else:
            with own_head() as (address, _):
                result = asyncio.run(run(args, address, state))
                result.update(_node_and_restart_rounds(args, address, state))
    t = result["total"]
    rows = [
        ("SIGKILL → out of rotation (s)", _fmt(result["sigkill_to_out_s"]),
         f"≤ {result['targets']['sigkill_to_out_s']}"),
        ("SIGSTOP → out of rotation (s)", _fmt(result["sigstop_to_out_s"]),
         f"≤ {result['targets']['sigstop_to_out_s']}"),
        ("failed before streaming", str(t["failed_before_stream"]), "0"),
        ("streams cut (error event mid-stream, or not the whole text)",
         str(t["failed_mid_stream"] + t["wrong_text"]), "0"),
        ("streams resumed (routerd: resumes / completed)",
         f"{result['resume']['resumes']:.0f} / {result['resume']['resumed_completed']:.0f}", "-"),
        ("resume gap after SIGKILL (s)", _gaps(result["resume"]["sigkill_gap_s"]),
         f"p99 ≤ {result['targets']['sigkill_gap_p99_s']}"),
        ("  TTFT of streams sent as it left rotation (s)", _gaps(result["resume"]["sigkill_ttft_after_s"]),
         "-"),
        ("resume gap after SIGSTOP (s)", _gaps(result["resume"]["sigstop_gap_s"]),
         f"p99 ≤ {result['targets']['sigstop_gap_p99_s']:.2f}"),
        ("  TTFT of streams sent as it left rotation (s)", _gaps(result["resume"]["sigstop_ttft_after_s"]),
         "-"),
        ("requests ok", str(t["ok"]), "-"),
        (f"false restarts ({args.steady_s:.0f}s at {args.load:.0%} load)",
         str(result["steady"]["false_restarts"]), "0"),
    ]
    rows += _node_and_restart_rows(result)
    width = max(len(r[0]) for r in rows)
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<40}  target {target}")
    if t["errors"]:
        print("first errors:", *t["errors"], sep="\n  ", file=sys.stderr)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0
