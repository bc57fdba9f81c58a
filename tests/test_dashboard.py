"""The Grafana dashboard and Prometheus config only query metrics that routerd or vLLM really export."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from routerd.registry import Instance, InstanceState, Registry
from routerd.telemetry import Metrics, Telemetry, queue_collector, registry_collector

ROOT = Path(__file__).resolve().parent.parent
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@dataclass
class _Queue:
    """The queue consumer's figures, as ``/metrics`` reads them (telemetry.QueueFigures)."""

    stats: dict[str, int]
    depth: dict[str, int]
    paused: bool
    held: int


def _routerd_families() -> set[str]:
    reg = Registry()
    reg.add(Instance(id="f:0", fleet="f", url="http://127.0.0.1:1", state=InstanceState.READY))
    t = Telemetry()
    queue = _Queue(stats={"done": 1}, depth={"backlog": 0}, paused=False, held=0)
    metrics = Metrics(t, [registry_collector(reg, lambda fleet: {
        "active": 0, "queued_http": 0, "queued_queue": 0, "limit": 1, "admitted_total": 0,
        "rejected_total": 0, "expired_total": 0}), queue_collector(queue)])
    t.count_request("f", "f:0", 200)
    t.retries.labels("f").inc()
    t.upstream_failures.labels("f", "f:0", "connect").inc()
    t.ttfb_seconds.labels("f").observe(0.01)
    text = metrics.render().decode()
    return {_family(m.group(1)) for m in re.finditer(r"^# TYPE (\S+) ", text, re.M)}


def _vllm_families() -> set[str]:
    text = (ROOT / "tests" / "data" / "vllm" / "metrics.txt").read_text()
    return {_family(m.group(1)) for m in re.finditer(r"^# TYPE (\S+) ", text, re.M)}


def test_every_dashboard_query_names_an_exported_metric() -> None:
    board = json.loads((ROOT / "config" / "grafana" / "routerd.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert len(board["panels"]) >= 10
    known = _routerd_families() | _vllm_families()
    used = {_family(n) for e in exprs for n in re.findall(r"\b(routerd_[a-z_]+|vllm:[a-z_]+)", e)}
    assert used, exprs
    assert not used - known, sorted(used - known)
    # The key figures are all there.
    for figure in ("routerd_requests", "routerd_time_to_first_byte_seconds", "routerd_instance_load",
                   "vllm:kv_cache_usage_perc", "routerd_instance_restarts", "routerd_queue_depth"):
        assert figure in used, figure


def test_prometheus_scrapes_routerd_engines_and_ray() -> None:
    cfg = yaml.safe_load((ROOT / "config" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["routerd"]["static_configs"][0]["targets"] == ["127.0.0.1:8080"]
    assert jobs["vllm"]["file_sd_configs"][0]["files"] == ["/var/lib/routerd/file_sd/engines.json"]
    assert jobs["ray"]["file_sd_configs"][0]["files"][0].endswith("prom_metrics_service_discovery.json")
