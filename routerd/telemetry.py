"""routerd's own Prometheus metrics (``routerd_*``) on a private CollectorRegistry.

Events (requests, retries, failures) are counters and histograms updated where they happen. State
(in-flight per instance, scrape age, circuit state, readiness) is *not* mirrored into gauges that could
drift: a collector reads it from the registry at scrape time, so what ``/metrics`` shows is exactly
what routing sees. The registry is private so two data planes in one process (tests, benchmarks)
never share series.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from .registry import CircuitState, Instance, Registry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 120.0, 300.0, 600.0)
_CIRCUIT = {CircuitState.CLOSED: 0.0, CircuitState.HALF_OPEN: 1.0, CircuitState.OPEN: 2.0}


class _RegistryCollector(Collector):
    """Per-instance state read from the registry at collection time."""

    def __init__(self, registry: Registry, admission_stats: Callable[[str], dict[str, int]] | None,
                 clock: Callable[[], float]) -> None:
        self._registry = registry
        self._admission_stats = admission_stats
        self._clock = clock

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are built per collect

    def collect(self) -> Iterator[Any]:
        now = self._clock()
        labels = ["fleet", "instance"]
        inflight = GaugeMetricFamily("routerd_instance_inflight", "Requests routerd has in flight to an "
                                     "instance", labels=labels)
        load = GaugeMetricFamily("routerd_instance_load", "Normalised load routing uses", labels=labels)
        ready = GaugeMetricFamily("routerd_instance_ready", "1 when the instance is in rotation",
                                  labels=labels)
        age = GaugeMetricFamily("routerd_scrape_age_seconds", "Seconds since the last successful "
                                "/metrics scrape", labels=labels)
        errors = CounterMetricFamily("routerd_scrape_errors", "Failed /metrics scrapes", labels=labels)
        circuit = GaugeMetricFamily("routerd_circuit_state", "Circuit breaker: 0 closed, 1 half-open, "
                                    "2 open", labels=labels)
        restarts = CounterMetricFamily("routerd_instance_restarts", "Times routerd restarted an "
                                       "instance (a crash loop shows as a steady rise)", labels=labels)
        generation = GaugeMetricFamily("routerd_instance_generation", "Launch generation of the "
                                       "instance's current engine", labels=labels)
        state = GaugeMetricFamily("routerd_instance_state", "1 for the instance's current state",
                                  labels=[*labels, "state"])
        learned = _LearnedFamilies(labels)
        for inst in self._registry:
            lv = [inst.fleet, inst.id]
            learned.add(lv, inst)
            restarts.add_metric(lv, inst.restarts)
            generation.add_metric(lv, inst.generation)
            state.add_metric([*lv, inst.state.value], 1.0)
            inflight.add_metric(lv, inst.inflight)
            load.add_metric(lv, inst.load())
            ready.add_metric(lv, 1.0 if inst.state.value == "ready" else 0.0)
            if inst.snapshot is not None:
                age.add_metric(lv, now - inst.snapshot.scraped_at)
            errors.add_metric(lv, inst.scrape_errors_total)
            circuit.add_metric(lv, _CIRCUIT[inst.circuit(now)])
        yield from (inflight, load, ready, age, errors, circuit, restarts, generation, state)
        yield from learned.families()
        if self._admission_stats is not None:
            active = GaugeMetricFamily("routerd_admission_active", "Admitted requests per fleet",
                                       labels=["fleet"])
            queued = GaugeMetricFamily("routerd_admission_queued", "Requests waiting for admission",
                                       labels=["fleet", "source"])
            rejected = CounterMetricFamily("routerd_admission_rejected", "Requests refused by admission",
                                           labels=["fleet"])
            for fleet in self._registry.fleets():
                s = self._admission_stats(fleet)
                active.add_metric([fleet], s["active"])
                queued.add_metric([fleet, "http"], s["queued_http"])
                queued.add_metric([fleet, "queue"], s["queued_queue"])
                rejected.add_metric([fleet], s["rejected_total"])
            yield from (active, queued, rejected)


class _LearnedFamilies:
    """What routing has learned of each instance (:mod:`routerd.speed`): capacity and its
    source, expected wait, speeds, and the prefix-cache hit ratio the engine reports beside the one
    routing predicts. A figure not learned yet has no sample (routing uses a prior meanwhile)."""

    def __init__(self, labels: list[str]) -> None:
        self.capacity = GaugeMetricFamily(
            "routerd_instance_capacity", "Requests the instance runs at once, by where routerd got it: "
            "launch (spec's max-num-seqs), engine, learned (a running plateau while requests wait), "
            "config (the fleet's max_num_seqs)", labels=[*labels, "source"])
        self.wait = GaugeMetricFamily(
            "routerd_instance_expected_wait_seconds", "Seconds a request sent now would wait before its "
            "prefill starts: work queued ahead over what the instance gets through", labels=labels)
        self.decode = GaugeMetricFamily(
            "routerd_instance_decode_tokens_per_second", "Learned decode speed of one sequence "
            "(generated tokens after the first over decode time)", labels=labels)
        self.prefill = GaugeMetricFamily(
            "routerd_instance_prefill_tokens_per_second", "Learned prefill speed: computed (uncached) "
            "prompt tokens per second of a request's prefill", labels=labels)
        self.running = GaugeMetricFamily(
            "routerd_instance_request_running_seconds", "Learned mean seconds a request runs there "
            "(prefill + decode)", labels=labels)
        self.hit = GaugeMetricFamily(
            "routerd_instance_prefix_cache_hit_ratio", "Prefix-cache hit ratio over the last ~30 s of "
            "traffic: as the engine reports it (source=engine), as routerd predicted it over prompts it "
            "counted in the engine's tokens (source=predicted), and over prompts whose tokens it "
            "estimated from their bytes (source=estimated)", labels=[*labels, "source"])

    def add(self, lv: list[str], inst: Instance) -> None:
        capacity, source = inst.capacity_source()
        self.capacity.add_metric([*lv, source], capacity)
        self.wait.add_metric(lv, inst.expected_wait_s())
        learned = inst.learned
        for family, value in ((self.decode, learned.decode_tokens_per_s),
                              (self.prefill, learned.prefill_tokens_per_s),
                              (self.running, learned.running_s)):
            if value is not None:
                family.add_metric(lv, value)
        for source, ratio in (("engine", learned.prefix_hit_ratio),
                              ("predicted", inst.predicted_prefix_hit_ratio),
                              ("estimated", inst.estimated_prefix_hit_ratio)):
            if ratio is not None:
                self.hit.add_metric([*lv, source], ratio)

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        return (self.capacity, self.wait, self.decode, self.prefill, self.running, self.hit)


class QueueFigures(Protocol):
    """What ``/metrics`` reads of the queue consumer (routerd/ingress/queue/consumer.py)."""

    @property
    def stats(self) -> Mapping[str, int]: ...  # jobs by outcome

    @property
    def depth(self) -> Mapping[str, int]: ...  # the stream sampled from Redis

    @property
    def paused(self) -> bool: ...

    @property
    def held(self) -> int: ...


class _QueueCollector(Collector):
    """The Redis queue's counters and sampled depth, read from the consumer at collection time."""

    def __init__(self, queue: QueueFigures) -> None:
        self._queue = queue

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        jobs = CounterMetricFamily("routerd_queue_jobs", "Queue jobs by outcome (read, done, dead, "
                                   "redelivered, reclaimed, duplicates, cancelled, expired)",
                                   labels=["outcome"])
        q = self._queue
        for outcome, n in q.stats.items():
            jobs.add_metric([outcome], n)
        depth = GaugeMetricFamily("routerd_queue_depth", "Request stream sampled from Redis: backlog "
                                  "(not yet read), pending (read, not acknowledged), dead letters",
                                  labels=["kind"])
        for kind, n in q.depth.items():
            depth.add_metric([kind], n)
        yield jobs
        yield depth
        yield GaugeMetricFamily("routerd_queue_held", "Jobs this routerd holds (read, not finished)",
                                value=q.held)
        yield GaugeMetricFamily("routerd_queue_paused", "1 while Redis is unreachable and the queue "
                                "path is paused", value=1.0 if q.paused else 0.0)


class Telemetry:
    """The counters and histograms of the request path; :meth:`render` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.prom = CollectorRegistry(auto_describe=False)
        r = self.prom
        self.requests = Counter("routerd_requests", "Requests answered, by fleet, instance, status and "
                                "route (instance empty when none was reached; route: the path served, "
                                "or passthrough)", ["fleet", "instance", "code", "route"], registry=r)
        self.request_seconds = Histogram("routerd_request_duration_seconds", "Whole request, from "
                                         "arrival at routerd to the last byte, by fleet and route",
                                         ["fleet", "route"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb_seconds = Histogram("routerd_time_to_first_byte_seconds", "From the request reaching "
                                      "upstream to its first byte going to the client", ["fleet"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.retries = Counter("routerd_retries", "Attempts repeated on another instance before the "
                               "first byte", ["fleet"], registry=r)
        self.upstream_failures = Counter("routerd_upstream_failures", "Failed engine calls by reason",
                                         ["fleet", "instance", "reason"], registry=r)
        self.circuit_opened = Counter("routerd_circuit_opened", "Times an instance's circuit went from "
                                      "closed to open (a failed half-open trial re-opening it is not a "
                                      "new opening)", ["fleet", "instance"], registry=r)
        self.scrape_seconds = Histogram("routerd_scrape_duration_seconds", "One /metrics scrape",
                                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                 1.0, 2.5), registry=r)
        self.http_connections = Gauge("routerd_http_connections", "Open client connections on the HTTP "
                                      "listener (at most http.max_connections)", registry=r)
        self.http_connections_shed = Counter("routerd_http_connections_shed", "Client connections routerd "
                                             "refused or closed itself: refused (over max_connections), "
                                             "header_timeout, body_timeout, write_timeout", ["reason"],
                                             registry=r)
        # mid-stream resume (routerd/resume.py)
        self.resumes = Counter("routerd_resumes", "Streams continued on another instance after their "
                               "engine failed mid-stream, by what failed: disconnect, timeout, "
                               "instance_lost, error_event, incomplete (closed before [DONE]), and for a "
                               "continuation that failed before its first event, its reason",
                               ["fleet", "reason"], registry=r)
        self.resumed_completed = Counter("routerd_resumed_completed", "Resumed streams that then "
                                         "completed (ended with [DONE] and no error event)", ["fleet"],
                                         registry=r)
        self.resume_gap_seconds = Histogram("routerd_resume_gap_seconds", "Resumed streams: from the last "
                                            "byte the client got before the failure to the first after",
                                            ["fleet"], buckets=_LATENCY_BUCKETS, registry=r)
        self.streams_cut = Counter("routerd_streams_cut", "Streams that ended with an error event after "
                                   "their first byte, by why they were not continued: not_continuable, "
                                   "max_resumes, no_instance, refused (an engine would not "
                                   "continue it), disabled (routing.max_resumes = 0), engine_error (the "
                                   "engine blamed the request)", ["fleet", "reason"], registry=r)
        # Label children of the per-request series, cached: ``labels()`` takes a lock and validates
        # its arguments on every call.
        self._children: dict[tuple[str, str, str, str], Any] = {}
        self._request_seconds: dict[tuple[str, str], Any] = {}
        self._ttfb_seconds: dict[str, Any] = {}
        self._request_exemplars: dict[str, list[float]] = {}  # per fleet, when each bucket's was set
        self._ttfb_exemplars: dict[str, list[float]] = {}

    def count_request(self, fleet: str, instance: str, code: int, route: str = "") -> None:
        key = (fleet, instance, str(code), route)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(*key)
        child.inc()

    def observe_request(self, fleet: str, seconds: float, trace_id: str = "", route: str = "") -> None:
        """``trace_id`` (tracing on): the observation's exemplar, so a slow request's trace is a click
        away from the latency panel (shown to OpenMetrics scrapes: :meth:`render`)."""
        child = self._request_seconds.get((fleet, route))
        if child is None:
            child = self._request_seconds[(fleet, route)] = self.request_seconds.labels(fleet, route)
        child.observe(seconds, _exemplar(self._request_exemplars, fleet, seconds, trace_id)
                      if trace_id else None)

    def observe_ttfb(self, fleet: str, seconds: float, trace_id: str = "") -> None:
        child = self._ttfb_seconds.get(fleet)
        if child is None:
            child = self._ttfb_seconds[fleet] = self.ttfb_seconds.labels(fleet)
        child.observe(seconds, _exemplar(self._ttfb_exemplars, fleet, seconds, trace_id)
                      if trace_id else None)


EXEMPLAR_EVERY_S = 1.0  # a latency bucket's exemplar is renewed at most this often


def _exemplar(last: dict[str, list[float]], fleet: str, seconds: float,
              trace_id: str) -> dict[str, str] | None:
    """The observation's exemplar (its trace), when its bucket has had none for
    :data:`EXEMPLAR_EVERY_S`: a bucket shows only its latest, scraped every 15 s or so, and setting one
    costs more than the observation (prometheus_client checks the label every time) — a slow request's
    bucket, seldom hit, still gets each of its own."""
    at = last.get(fleet)
    if at is None:
        at = last[fleet] = [-math.inf] * (len(_LATENCY_BUCKETS) + 1)
    i = bisect_left(_LATENCY_BUCKETS, seconds)  # the bucket prometheus_client puts it in (value <= bound)
    now = time.monotonic()
    if now - at[i] < EXEMPLAR_EVERY_S:
        return None
    at[i] = now
    return {"trace_id": trace_id}



def registry_collector(registry: Registry, admission_stats: Callable[[str], dict[str, int]] | None = None,
                       clock: Callable[[], float] = time.monotonic) -> Collector:
    """Per-instance state read from ``registry`` (and each fleet's admission figures) at scrape time."""
    return _RegistryCollector(registry, admission_stats, clock)


def queue_collector(queue: QueueFigures) -> Collector:
    """The queue consumer's jobs by outcome, the stream's depth, what it holds, whether it is paused."""
    return _QueueCollector(queue)


class Metrics:
    """The ``GET /metrics`` body: the request path's counters (:class:`Telemetry`) and the collectors
    that read the other components' state at scrape time — added by the assembly (routerd/assembly/)
    once every bundle exists, before anything is served."""

    def __init__(self, telemetry: Telemetry, collectors: Iterable[Collector] = ()) -> None:
        self._prom = CollectorRegistry(auto_describe=False)
        self._prom.register(telemetry.prom)  # unchecked: its own series are checked where created
        self.add(collectors)

    def add(self, collectors: Iterable[Collector]) -> None:
        for collector in collectors:
            self._prom.register(collector)

    def render(self, openmetrics: bool = False) -> bytes:
        """The text format, or OpenMetrics (what a scraper asking for it gets: it carries exemplars)."""
        if openmetrics:
            om: bytes = openmetrics_latest(self._prom)  # type: ignore[no-untyped-call]  # untyped upstream
            return om
        data: bytes = generate_latest(self._prom)
        return data
