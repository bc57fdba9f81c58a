"""``routerd bench scale``'s pieces that are cheap to check (its runs take minutes: they are the bench's).

Why: every part of the bench reads its options from one parser, so a part whose options are missing
fails only after the parts before it have run for minutes; the replicas' config must be one that
``routerd run`` reads as meant (the same fleet, one Redis, each its own consumer name); and the targets
must say "not met" when the figures miss them.
"""

from __future__ import annotations

import math
import tomllib
from typing import Any

from routerd import config
from routerd_bench import scale, scale_replicas


def test_the_parser_holds_every_parts_options() -> None:
    args = scale.parser().parse_args(["--instances", "16", "--processes", "2", "--lease-s", "1.5"])
    assert args.instances == [16]
    assert args.seconds > 0
    assert args.warmup >= 0
    assert args.processes == 2
    assert args.lease_s == 1.5
    assert args.failover_rate > 0
    assert args.quality_workloads == ["heterogeneous", "multiturn"]


def test_a_replicas_config_is_what_routerd_reads() -> None:
    fleet = {"name": "bench", "model": "bench", "engine": "static", "urls": ["http://127.0.0.1:1"],
             "engine_args": {"kv-events": True, "tokenizer": "sim", "block-size": 16}}
    text = scale_replicas.config_text(
        {"redis": {"url": "redis://127.0.0.1:6390", "consumer": "r1", "block_ms": 200},
         "control": {"lease_s": 1.5}}, [fleet])
    cfg = config.parse(tomllib.loads(text), environ={})
    assert cfg.redis.url == "redis://127.0.0.1:6390"
    assert cfg.redis.consumer == "r1"
    assert cfg.control.lease_s == 1.5
    (f,) = cfg.fleets
    assert f.urls == ["http://127.0.0.1:1"]
    assert f.engine_args["kv-events"] is True
    assert f.engine_args["block-size"] == 16
    empty = scale_replicas.config_text({}, [{**fleet, "engine_args": {}}])
    assert config.parse(tomllib.loads(empty), environ={}).fleets[0].engine_args == {}


def _run(processes: int, view: str, p99: float, later: float, fleet: float) -> dict[str, Any]:
    return {"processes": processes, "view": view, "ttft_ms": {"p99": p99}, "later_turn_hit_ratio": later,
            "prefix_hit_ratio": fleet}


def test_targets_met_and_missed() -> None:
    out = {"processes": 4, "workloads": {
        "heterogeneous": {"runs": [_run(1, "model", 100.0, math.nan, 0.0),
                                   _run(4, "model", 130.0, math.nan, 0.0)]},
        "multiturn": {"runs": [_run(1, "events", 50.0, 0.9, 0.8), _run(4, "events", 50.0, 0.86, 0.7),
                               _run(1, "model", 50.0, 0.9, 0.8), _run(4, "model", 50.0, 0.5, 0.5)]}}}
    got = {(t["workload"], t["target"]): t for t in scale_replicas.quality_targets(out)}
    het = got[("heterogeneous", "4 processes: p99 TTFT ÷ one's ≤ 1.2")]
    assert het["value"] == 1.3
    assert het["met"] is False
    mt = got[("multiturn", "4 processes by events: later turns' hit ratio ÷ one's ≥ 0.95")]
    assert mt["value"] == 0.956
    assert mt["met"] is True
    # the request-side model's figures are reported, with no target
    model = got[("multiturn", "4 processes by model: later turns' hit ratio ÷ one's (no target)")]
    assert model["met"] is None
    out["workloads"]["heterogeneous"]["runs"][1]["ttft_ms"]["p99"] = 110.0
    out["workloads"]["multiturn"]["runs"][1]["later_turn_hit_ratio"] = 0.8
    got = {(t["workload"], t["target"]): t for t in scale_replicas.quality_targets(out)}
    assert got[("heterogeneous", "4 processes: p99 TTFT ÷ one's ≤ 1.2")]["met"] is True
    assert got[("multiturn", "4 processes by events: later turns' hit ratio ÷ one's ≥ 0.95")]["met"] is False
