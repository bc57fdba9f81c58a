"""Every ``routerd bench`` command run as a user runs it — ``python -m routerd bench NAME … --json FILE`` —
at its smallest size, on sim engines: it exits 0 and the JSON holds its figures (issue 26 item 14: ``bench
queue`` had crashed out of the box, and no test ran the commands).

These check that the figures are produced, not their values: a busy CI machine changes every one of
them. ``routing`` has its own run in tests/test_bench_routing.py. vLLM Router, the peer some benchmarks
measure beside routerd, is left out (``--peers`` with none, ``--no-peers``): those runs are routerd's.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import routerd_bench
from tests.fixtures.ray_cluster import RayTestCluster

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(240)]  # each runs `routerd bench` as a process

SMOKED = {"overhead", "queue", "failover", "autoscale", "fairness", "scale", "batch", "lora"}
ELSEWHERE = {"routing"}  # tests/test_bench_routing.py runs it through the command too


def _bench(tmp_path: Path, name: str, *args: str, timeout_s: float = 200) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", "routerd", "bench", name, *args, "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False,
                          stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def _finite(stats: dict[str, Any]) -> bool:
    return stats["n"] > 0 and all(math.isfinite(stats[k]) for k in ("p50", "p99"))


def test_every_benchmark_has_a_smoke_run() -> None:
    assert set(routerd_bench.BENCHMARKS) == SMOKED | ELSEWHERE


def test_bench_queue(tmp_path: Path) -> None:
    """It crashed before its first job: its reply stream was a name the client refuses."""
    r = _bench(tmp_path, "queue", "--jobs", "50", "--max-num-seqs", "16")
    assert (r["jobs"], r["errors"]) == (50, 0)
    for figure in ("jobs_per_s", "baseline_msgs_per_s", "submit_jobs_per_s", "routerd_cpu_us_per_job",
                   "direct_http_req_per_s"):
        assert r[figure] > 0, figure


def test_bench_batch(tmp_path: Path) -> None:
    """A batch's lines all written, and both runs' figures produced."""
    r = _bench(tmp_path, "batch", "--lines", "300", "--max-num-seqs", "16", "--lines-in-flight", "64")
    assert (r["status"], r["completed"], r["failed"]) == ("completed", 300, 0)
    assert 0 < r["batch_peak_jobs_in_flight"] <= 64
    for figure in ("queue_lines_per_s", "batch_lines_per_s", "queue_cpu_us_per_line", "batch_cpu_us_per_line",
                   "queue_redis_bytes_per_waiting_line", "batch_redis_bytes_per_waiting_line"):
        assert r[figure] > 0, figure


def test_bench_lora(tmp_path: Path) -> None:
    """Every router of the comparison runs the same plan, and each has every figure."""
    r = _bench(tmp_path, "lora", "--adapters", "6", "--instances", "2", "--max-loras", "2",
               "--load-s", "0.05", "--capacity-rps", "8", "--duration", "3", "--warmup-s", "0.5",
               "--mean-tokens", "8", "--sample-s", "0.05")
    assert set(r["runs"]) == {"routerd", "llm-d", "least-load"}
    assert r["requests"] > 0
    assert len(r["adapter_share"]) == 6
    for name, run in r["runs"].items():
        assert (run["requests"], run["failed"]) == (r["requests"], 0), (name, run["failures"])
        assert _finite(run["ttft_ms"]), name
        assert _finite(run["e2e_ms"]), name
        for figure in ("loads_per_1000", "slot_wait_s", "slot_wait_ms_per_request", "engine_slot_wait_s"):
            assert run[figure] >= 0, (name, figure)  # NaN compares False
        assert run["loads"] > 0, name  # 6 adapters on 2 × 2 slots: something had to be loaded
    assert math.isfinite(r["runs"]["routerd"]["routerd_slot_wait_s"])
    assert sum(r["runs"]["routerd"]["routerd_rules"].values()) == r["requests"]
    assert {t["target"].split(" ÷ ")[1].split("'")[0] for t in r["targets"]} == {"least-load", "llm-d"}


def test_bench_overhead(tmp_path: Path) -> None:
    r = _bench(tmp_path, "overhead", "--engines", "1", "--rates", "--duration", "0.5", "--sequential", "5",
               "--concurrency", "4", "--peers", "--log-level", "warning")
    assert r["routers"] == ["routerd"]
    assert sorted(s["kind"] for s in r["sequential"]) == ["non_stream", "stream"]
    for seq in r["sequential"]:
        assert (seq["requests"], seq["failed"]) == (5, 0)
        assert _finite(seq["added_e2e_ms"])
        assert _finite(seq["direct_e2e_ms"])
    routes = [(x["route"], x["failed"]) for x in r["routes"]]
    assert routes == [("chat", 0), ("embeddings", 0), ("responses", 0)]
    assert all(_finite(x["added_e2e_ms"]) for x in r["routes"])
    assert sorted(s["kind"] for s in r["sustained"]) == ["non_stream", "stream"]
    for sustained in r["sustained"]:
        assert sustained["failed"] == 0
        assert sustained["rate"] > 0
        assert sustained["cpu_us_per_request"] > 0


def test_bench_fairness(tmp_path: Path) -> None:
    r = _bench(tmp_path, "fairness", "--engines", "1", "--jobs", "20", "--duration", "1", "--warmup", "0.2",
               "--decisions", "1000", "--skip-baseline", "--skip-shares")
    assert [p["phase"] for p in r["phases"]] == ["alone", "flood, tenants"]
    for phase in r["phases"]:
        assert _finite(phase["ttft_ms"])
        assert phase["p99_vs_alone"] > 0
    assert r["shares"] is None  # --skip-shares
    assert all(r["decision"][k] > 0 for k in ("semaphore_us", "no_tenants_us", "3_tenants_us"))


def test_bench_scale(tmp_path: Path) -> None:
    r = _bench(tmp_path, "scale", "--workers", "1", "--kinds", "request", "--engines", "1",
               "--concurrency", "4", "--duration", "0.5", "--no-peers", "--no-idle", "--no-replicas",
               "--no-failover")
    [row] = r["relay"]["rows"]
    assert row["router"] == "routerd workers=1"
    assert row["failed"] == 0
    assert row["rate"] > 0
    assert row["cpu_us_per_unit"] > 0


@pytest.mark.ray
def test_bench_failover(tmp_path: Path, ray_cluster: RayTestCluster) -> None:
    # one engine (each is a Ray actor and a process to start): killed once, out of rotation, replaced
    r = _bench(tmp_path, "failover", "--ray-address", ray_cluster.address, "--replicas", "1",
               "--load", "0.25", "--steady-s", "0", "--kills", "1", "--stops", "0", "--node-rounds", "0",
               "--restarts", "0")
    [out_s] = r["sigkill_to_out_s"]
    assert 0 < out_s < 60
    assert r["sigstop_to_out_s"] == []
    assert r["total"]["ok"] > 0
    assert r["steady"]["false_restarts"] == 0


@pytest.mark.ray
def test_bench_autoscale(tmp_path: Path, ray_cluster: RayTestCluster) -> None:
    r = _bench(tmp_path, "autoscale", "--ray-address", ray_cluster.address, "--max-replicas", "1",
               "--max-num-seqs", "2", "--max-tokens", "2", "--itl-ms", "10", "--scale-down-delay-s", "1",
               "--calibrate-s", "0.5", "--low-s", "0.3", "--step-s", "0.1", "--hold-s", "0.3",
               "--steady-s", "0.3", "--jump-s", "0.3")
    assert set(r["phases"]) >= {"cold", "steps", "jump"}
    assert r["cold_start"]["first_ttft_s"] > 0
    assert r["failed_total"] == 0
    assert r["instance_seconds"]["autoscaled"] > 0
