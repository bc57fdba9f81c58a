"""``routerd bench {overhead,routing,queue,failover,autoscale,fairness,scale,batch,lora}``:
each prints a table and writes JSON with --json.

A package beside ``routerd``, not inside it: the benchmarks drive routerd from outside (and assemble it
in-process where they must inspect it), and nothing in the runtime imports them — only the
``routerd bench`` command, lazily. The tests take their shared harness (loads, assemblies, clusters)
from here too.

Each benchmark is a module here with ``main(argv: list[str]) -> int``; they are imported on demand so
one benchmark's dependencies do not slow another's start.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "overhead": "routerd's added latency per request and its sustained rate on one core",
    "routing": "TTFT, latency, prefix hits and spread per policy (and vLLM Router) on four workloads",
    "queue": "end-to-end jobs/s through the Redis queue, against a plain stream loop",
    "failover": "time from an engine's death or hang to it leaving rotation",
    "autoscale": "an elastic fleet under rising and falling load, and a burst from zero",
    "fairness": "an interactive tenant's time to first token under a batch tenant's flood; shares by weight",
    "scale": "relayed events/s and requests/s with 1 and N workers (and vLLM Router); idle watching CPU",
    "batch": "a chat batch through the Batch API against the same lines as plain queue jobs (CPU, memory)",
    "lora": "TTFT for 24 LoRA adapters on 4×4 slots: routerd, adapter-blind least-load, llm-d's scoring",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print("usage: routerd bench {" + ",".join(BENCHMARKS) + "} [--json FILE] ...", file=sys.stderr)
        for name, text in BENCHMARKS.items():
            print(f"  {name:<10} {text}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"routerd_bench.{argv[0]}")
    code: int = module.main(argv[1:])
    return code
