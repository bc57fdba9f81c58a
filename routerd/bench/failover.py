"""``routerd bench failover``: how fast a dead or hung engine leaves rotation, and what clients see.

Runs a real Ray head (its own, unless ``--ray-address``), a fleet of simulated engines launched as Ray
actors, and routerd's data plane, all on this machine; then:

1. a steady phase at ``--load`` (default 0.95) of the fleet's capacity for ``--steady-s`` seconds with
   the default health settings, counting restarts (any restart here is a false one) and failures;
2. ``--kills`` rounds of SIGKILL and ``--stops`` rounds of SIGSTOP of one engine under load, timing each
   from the signal to the instance leaving rotation, then waiting for its replacement.

Targets (issue #4): SIGKILL → out ≤ 2 s; SIGSTOP → out ≤ heartbeat_timeout_s + one interval; zero failed
requests that had not started streaming; no false restart at 95 % load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp


@dataclass
class Load:
    """Closed-loop clients (plain or streaming); a failure is "before stream" unless a chunk had reached
    the client first — only those may end in an error event. The failover test uses it too."""

    url: str
    model: str
    max_tokens: int = 24
    ok: int = 0
    failed_before_stream: int = 0
    failed_mid_stream: int = 0
    errors: list[str] = field(default_factory=list)

    async def client(self, session: aiohttp.ClientSession, stop: asyncio.Event, stream: bool) -> None:
        body = {"model": self.model, "prompt": "benchmark", "max_tokens": self.max_tokens, "stream": stream}
        while not stop.is_set():
            try:
                async with session.post(f"{self.url}/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    if resp.status != 200:
                        self._fail(f"{resp.status}: {(await resp.text())[:120]}")
                        continue
                    chunks, error = 0, False
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            error = error or b'"error"' in line
                            chunks += 0 if error else 1
                    if not error:
                        self.ok += 1
                    elif chunks and stream:
                        self.failed_mid_stream += 1
                    else:
                        self._fail("error before first chunk")
            except (aiohttp.ClientError, TimeoutError) as e:
                self._fail(repr(e))

    def _fail(self, why: str) -> None:
        self.failed_before_stream += 1
        if len(self.errors) < 10:
            self.errors.append(why)


@contextlib.contextmanager
def _own_head() -> Any:
    """A throwaway ``ray start --head --block`` (4 declared GPUs) torn down by SIGTERM at the end."""
    from routerd._net import free_port
    from routerd.fleet.ray_cluster import ray_binary, ray_env

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    argv = [ray_binary(), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
            "--num-cpus", "8", "--num-gpus", "4", "--include-dashboard=false",
            "--dashboard-agent-listen-port=0", "--ray-client-server-port", str(free_port()),
            "--temp-dir", tmp, "--disable-usage-stats"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ray_env())
    try:
        yield f"127.0.0.1:{port}", tmp
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.asynccontextmanager
async def _routerd(cfg: Any) -> AsyncIterator[tuple[Any, Any, str]]:
    from routerd import config as config_mod
    from routerd.dataplane import build_dataplane
    from routerd.fleet import FleetManager, RayCluster
    from routerd.ingress.listener import HttpListener
    from routerd.registry import Registry
    from routerd.upstream import make_session

    cluster = await RayCluster.connect(cfg.ray, config_mod.state_dir(cfg))
    registry = Registry()
    tasks: list[asyncio.Task[None]] = []
    try:
        async with make_session(cfg.routing) as session:  # one per process, as the daemon's
            fm = FleetManager(cfg, registry, cluster, session)
            try:
                await fm.start()
                dp = build_dataplane(cfg, registry, session, desired_replicas=fm.desired)
                async with HttpListener(dp.http) as listener:
                    url = await listener.start(port=0)
                    tasks = [asyncio.create_task(fm.run()), asyncio.create_task(dp.run())]
                    try:
                        yield fm, registry, url
                    finally:
                        for t in tasks:
                            t.cancel()
                        await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                await fm.shutdown(stop_engines=True)
    finally:
        await cluster.close()


async def _wait(cond: Any, timeout: float, step: float = 0.01) -> float:
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout:
            raise TimeoutError
        await asyncio.sleep(step)
    return time.monotonic() - started


async def _fault_round(registry: Any, fleet: str, sig: signal.Signals, rng: random.Random) -> float:
    """Signal one ready engine; seconds until it left rotation; then wait for its replacement."""
    ready = registry.routable(fleet)
    victim = rng.choice(ready)
    iid, gen, pid = victim.id, victim.generation, victim.pid
    t0 = time.monotonic()
    os.kill(pid, sig)
    await _wait(lambda: all(i.id != iid for i in registry.routable(fleet)), 30.0, 0.005)
    took = time.monotonic() - t0

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
    async with _routerd(cfg) as (_fm, registry, url), aiohttp.ClientSession() as session:
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
            kills = [await _fault_round(registry, "bench", signal.SIGKILL, rng) for _ in range(args.kills)]
            stops = [await _fault_round(registry, "bench", signal.SIGSTOP, rng) for _ in range(args.stops)]
        finally:
            stop.set()
            await asyncio.gather(*clients)
    return {
        "config": {"replicas": args.replicas, "max_num_seqs": seqs, "clients": n_clients, "load": args.load,
                   "steady_s": args.steady_s, "heartbeat_interval_s": h.heartbeat_interval_s,
                   "heartbeat_timeout_s": h.heartbeat_timeout_s, "failure_threshold": h.failure_threshold},
        "steady": {**steady, "false_restarts": false_restarts},
        "sigkill_to_out_s": kills, "sigstop_to_out_s": stops,
        "total": {"ok": load.ok, "failed_before_stream": load.failed_before_stream,
                  "failed_mid_stream": load.failed_mid_stream, "errors": load.errors},
        "targets": {"sigkill_to_out_s": 2.0,
                    "sigstop_to_out_s": h.heartbeat_timeout_s + h.heartbeat_interval_s},
    }


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"p50 {statistics.median(xs):.3f}  max {max(xs):.3f}  (n={len(xs)})"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="routerd bench failover", description=__doc__.splitlines()[0])
    ap.add_argument("--ray-address", default="", help="use this cluster instead of a throwaway local head")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--load", type=float, default=0.95, help="closed-loop clients / total max_num_seqs")
    ap.add_argument("--steady-s", type=float, default=600.0, help="the false-restart run (issue: 10 min)")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--stops", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default="")
    args = ap.parse_args(argv)
    from routerd import log

    log.setup("warning")  # one log line per request would cost the CPU being measured
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="rbf") as state:
        if args.ray_address:
            result = asyncio.run(run(args, args.ray_address, state))
        else:
            with _own_head() as (address, _):
                result = asyncio.run(run(args, address, state))
    t = result["total"]
    rows = [
        ("SIGKILL → out of rotation (s)", _fmt(result["sigkill_to_out_s"]),
         f"≤ {result['targets']['sigkill_to_out_s']}"),
        ("SIGSTOP → out of rotation (s)", _fmt(result["sigstop_to_out_s"]),
         f"≤ {result['targets']['sigstop_to_out_s']}"),
        ("failed before streaming", str(t["failed_before_stream"]), "0"),
        ("ended with an error event mid-stream", str(t["failed_mid_stream"]), "-"),
        ("requests ok", str(t["ok"]), "-"),
        (f"false restarts ({args.steady_s:.0f}s at {args.load:.0%} load)",
         str(result["steady"]["false_restarts"]), "0"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<40}  target {target}")
    if t["errors"]:
        print("first errors:", *t["errors"], sep="\n  ", file=sys.stderr)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0
