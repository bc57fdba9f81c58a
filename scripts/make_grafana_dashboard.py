"""Write config/grafana/routerd.json: routerd's and the fleets' key figures on one dashboard.

Generated rather than hand-edited so panel layout stays regular; re-run after changing a panel.
``tests/test_dashboard.py`` checks that every metric it queries is one routerd or vLLM exports.
"""

import json
import sys
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}

PANELS = [
    # (title, unit, [(expr, legend)])
    ("Request rate by fleet", "reqps",
     [('sum by (fleet) (rate(routerd_requests_total{fleet=~"$fleet"}[1m]))', "{{fleet}}")]),
    ("Error ratio by fleet (non-2xx)", "percentunit",
     [('sum by (fleet) (rate(routerd_requests_total{fleet=~"$fleet",code!~"2.."}[5m])) / '
       'clamp_min(sum by (fleet) (rate(routerd_requests_total{fleet=~"$fleet"}[5m])), 1e-9)', "{{fleet}}")]),
    ("Time to first token p50 / p99 (through routerd)", "s",
     [('histogram_quantile(0.5, sum by (le, fleet) (rate(routerd_time_to_first_byte_seconds_bucket'
       '{fleet=~"$fleet"}[5m])))', "p50 {{fleet}}"),
      ('histogram_quantile(0.99, sum by (le, fleet) (rate(routerd_time_to_first_byte_seconds_bucket'
       '{fleet=~"$fleet"}[5m])))', "p99 {{fleet}}")]),
    ("Engine time to first token p99 (vLLM)", "s",
     [('histogram_quantile(0.99, sum by (le, fleet) (rate(vllm:time_to_first_token_seconds_bucket'
       '{fleet=~"$fleet"}[5m])))', "{{fleet}}")]),
    ("Per-instance load (routing's view)", "short",
     [('routerd_instance_load{fleet=~"$fleet"}', "{{instance}}")]),
    ("In flight from routerd, per instance", "short",
     [('routerd_instance_inflight{fleet=~"$fleet"}', "{{instance}}")]),
    ("Engine running / waiting requests", "short",
     [('vllm:num_requests_running{fleet=~"$fleet"}', "running {{instance}}"),
      ('vllm:num_requests_waiting{fleet=~"$fleet"}', "waiting {{instance}}")]),
    ("KV cache usage", "percentunit",
     [('vllm:kv_cache_usage_perc{fleet=~"$fleet"}', "{{instance}}")]),
    ("Generation tokens / s", "short",
     [('sum by (fleet) (rate(vllm:generation_tokens_total{fleet=~"$fleet"}[1m]))', "{{fleet}}")]),
    ("Instances by state", "short",
     [('sum by (fleet, state) (routerd_instance_state{fleet=~"$fleet"})', "{{fleet}} {{state}}")]),
    ("Restarts (15 min)", "short",
     [('increase(routerd_instance_restarts_total{fleet=~"$fleet"}[15m])', "{{instance}}")]),
    ("Retries and upstream failures", "ops",
     [('sum by (fleet) (rate(routerd_retries_total{fleet=~"$fleet"}[5m]))', "retries {{fleet}}"),
      ('sum by (fleet, reason) (rate(routerd_upstream_failures_total{fleet=~"$fleet"}[5m]))',
       "{{reason}} {{fleet}}")]),
    ("Circuit state (0 closed, 1 half-open, 2 open)", "short",
     [('routerd_circuit_state{fleet=~"$fleet"}', "{{instance}}")]),
    ("Admission: waiting and rejected", "short",
     [('sum by (fleet, source) (routerd_admission_queued{fleet=~"$fleet"})', "waiting {{fleet}} {{source}}"),
      ('sum by (fleet) (rate(routerd_admission_rejected_total{fleet=~"$fleet"}[5m]))',
       "rejected/s {{fleet}}")]),
    ("Queue depth", "short",
     [("routerd_queue_depth", "{{kind}}"), ("routerd_queue_held", "held by routerd")]),
    ("Queue jobs / s by outcome", "ops",
     [("sum by (outcome) (rate(routerd_queue_jobs_total[1m]))", "{{outcome}}")]),
    ("Scrape age", "s",
     [('routerd_scrape_age_seconds{fleet=~"$fleet"}', "{{instance}}")]),
    ("Engine preemptions / s", "ops",
     [('sum by (instance) (rate(vllm:num_preemptions_total{fleet=~"$fleet"}[5m]))', "{{instance}}")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "datasource": DS,
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": chr(65 + j), "datasource": DS, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)],
        })
    return {
        "title": "routerd", "uid": "routerd", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["routerd", "vllm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "fleet", "type": "query", "datasource": DS, "label": "Fleet",
             "query": "label_values(routerd_instance_ready, fleet)", "includeAll": True, "multi": True,
             "current": {"text": "All", "value": "$__all"}, "allValue": ".*", "refresh": 2},
        ]},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "config/grafana/routerd.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out} ({len(PANELS)} panels)")
