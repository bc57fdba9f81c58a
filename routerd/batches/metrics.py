"""``/metrics`` for batches: from the runner's last sample, so a scrape never waits on Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .runner import BatchRunner
from .wire import STATES


class BatchCollector:
    """Batches per state (every routerd's), lines done and failed per active batch, lines written here."""

    def __init__(self, runner: BatchRunner) -> None:
        self._runner = runner

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are built per collect

    def collect(self) -> Iterator[Any]:
        s = self._runner.stats
        states = GaugeMetricFamily("routerd_batches", "Batches by state (all routerd on this Redis)",
                                   labels=["state"])
        for state in STATES:
            states.add_metric([state], max(0, s.states.get(state, 0)))
        yield states
        lines = GaugeMetricFamily("routerd_batch_lines", "Lines of each batch not yet final, by outcome "
                                  "(total, completed, failed)", labels=["batch", "tenant", "outcome"])
        for b in s.active:
            for outcome in ("total", "completed", "failed"):
                lines.add_metric([b["id"], b["tenant"], outcome], b[outcome])
        yield lines
        written = CounterMetricFamily("routerd_batch_lines_written", "Batch lines this routerd wrote to "
                                      "an output (completed) or error file (failed)", labels=["outcome"])
        for outcome, n in s.written.items():
            written.add_metric([outcome], n)
        yield written
        yield GaugeMetricFamily("routerd_batches_running", "Batches this routerd runs now (holds the "
                                "lease of)", value=s.running)
        yield GaugeMetricFamily("routerd_batch_lines_per_second", "Batch lines this routerd wrote per "
                                "second over its last poll", value=s.rate)
