"""One KV-event subscription per ready engine, found through ``GET /kv_event_sources``: routerd's
launchers make engines publish, the registry says which are up, and each view follows its engine —
through a restart on new ports — on real sim-engine processes started from the launcher's own plan."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from routerd_builtin.launchers import SimLauncher, VllmLauncher

from routerd._net import free_port
from routerd.plugins import LaunchSpec
from routerd.registry import Instance, InstanceState, Registry
from routerd.routing.engine_cache.subscriber import ViewHealth
from routerd.routing.engine_cache.subscriptions import EngineEvents, EngineEventsCollector, connect_endpoint
from routerd.sim_tokens import token_ids
from routerd.vllm_wire import block_hash
from tests.fixtures.helpers import eventually, starts
from tests.fixtures.sim import REPO, SimEngineFactory, SimProcessFactory, _wait_healthy
from tests.fixtures.vllm import parse_metrics

ROOT = block_hash.none_hash(block_hash.LAUNCH_SEED)


def _keys(prompt: str, root: bytes = ROOT) -> list[int]:
    return block_hash.block_keys(token_ids(prompt.split()), 16, root)


async def test_the_vllm_launcher_makes_the_engine_publish_keyed_as_routerd_keys() -> None:
    spec = LaunchSpec(fleet="f", index=0, model="m", engine="vllm", engine_args={"model": "/m"})
    plan = await VllmLauncher().plan(spec, host="127.0.0.1", port=8000, workdir="/w")
    argv = plan.argv
    cfg = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert cfg["enable_kv_cache_events"] is True
    assert cfg["publisher"] == "zmq"
    # vLLM binds only wildcards (else it connects); tcp://*:0 binds its node IP, VLLM_HOST_IP: the
    # engine's own address, never every interface, on ports it picks and reports in /kv_event_sources
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == ("tcp://*:0", "tcp://*:0")
    assert plan.env["VLLM_HOST_IP"] == "127.0.0.1"
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256"
    assert plan.env["PYTHONHASHSEED"] == block_hash.LAUNCH_SEED
    off = await VllmLauncher().plan(
        LaunchSpec(fleet="f", index=0, model="m", engine="vllm", engine_args={"kv-events": False}),
        host="127.0.0.1", port=8000, workdir="/w")
    assert "--kv-events-config" not in off.argv
    assert "PYTHONHASHSEED" not in off.env
    own = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:7000"}'
    mine = await VllmLauncher().plan(
        LaunchSpec(fleet="f", index=0, model="m", engine="vllm", engine_args={"kv-events-config": own}),
        host="127.0.0.1", port=8000, workdir="/w")
    assert mine.argv.count("--kv-events-config") == 1
    assert mine.argv[mine.argv.index("--kv-events-config") + 1] == own


async def test_the_sims_wildcard_endpoints_bind_its_own_host_not_every_interface(
        sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(kv_events_config=json.dumps(
        {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}))
    async with aiohttp.ClientSession() as s, s.get(f"{eng.url}/kv_event_sources") as r:
        src = (await r.json())["0"]
    for endpoint in (src["endpoint"], src["replay_endpoint"]):
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        assert int(endpoint.rpartition(":")[2]) > 0


def test_a_wildcard_endpoint_is_the_engines_own_host() -> None:
    assert connect_endpoint("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert connect_endpoint("tcp://0.0.0.0:5557", "http://[::1]:8000") == "tcp://[::1]:5557"
    assert connect_endpoint("tcp://127.0.0.1:5", "http://h:1") == "tcp://127.0.0.1:5"


def _popen(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **env})


class Launched:
    """A sim-engine process started from SimLauncher's plan, as the engine actor would start it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    async def start(self, port: int) -> None:
        spec = LaunchSpec(fleet="f", index=0, model="m", engine="sim",
                          engine_args={"kv-events": True, "ttft-ms": 1, "itl-ms": 1})
        plan = await SimLauncher().plan(spec, host="127.0.0.1", port=port, workdir=str(self.tmp))
        self.proc = await asyncio.to_thread(_popen, plan.argv, plan.env, self.tmp / f"sim-{port}.log")
        self.url = f"http://127.0.0.1:{port}"
        assert await _wait_healthy(self.proc, self.url, 30.0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
@starts("subprocess")
async def launched(tmp_path: Path) -> AsyncIterator[Launched]:
    eng = Launched(tmp_path)
    yield eng
    await asyncio.to_thread(eng.stop)


async def _send(url: str, prompt: str) -> None:
    async with aiohttp.ClientSession() as s, \
            s.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200


class Counters:
    """``routerd_kv_events_{batches,restarts}_total`` of one instance's rank 0 as ``/metrics`` exposes
    them, sampled every 20 ms for as long as the test runs: a counter must never go back."""

    def __init__(self, events: EngineEvents, instance: str) -> None:
        self.prom = CollectorRegistry(auto_describe=False)
        self.prom.register(EngineEventsCollector(events))
        self.instance = instance
        self.samples: list[tuple[float, float]] = []
        self.task = asyncio.create_task(self._sample())

    def read(self) -> tuple[float, float] | None:
        metrics = parse_metrics(generate_latest(self.prom).decode())
        try:
            batches, restarts = (metrics[f"routerd_kv_events_{name}_total"].value(instance=self.instance,
                                                                                 rank="0")
                                 for name in ("batches", "restarts"))
        except KeyError:
            return None  # no series yet
        return batches, restarts

    async def _sample(self) -> None:
        while True:
            got = self.read()
            if got is not None:
                self.samples.append(got)
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.wait([self.task])

    def assert_monotonic(self) -> None:
        for (b0, r0), (b1, r1) in itertools.pairwise(self.samples):
            assert b1 >= b0, f"batches_total went back: {b0} -> {b1}"
            assert r1 >= r0, f"restarts_total went back: {r0} -> {r1}"


async def test_each_ready_engine_is_subscribed_and_followed_through_restarts(launched: Launched) -> None:
    """Subscribed once ready; a restart (new event ports: a new generation) is followed, whether the
    instance stayed ready or left rotation meanwhile, as the fleet manager restarts one — each counted in
    ``restarts_total``, and ``batches_total`` never goes back (issue 26: it started again from 0 under
    the same labels, and restarts stayed 0)."""
    port = free_port()
    await launched.start(port)
    registry = Registry()
    inst = registry.add(Instance(id="f:0", fleet="f", url=launched.url, state=InstanceState.STARTING))
    async with aiohttp.ClientSession() as session:
        events = EngineEvents(registry, session, fleets=None, probe_interval_s=0.2, replay_timeout_s=1.0)
        task = asyncio.create_task(events.run(interval_s=0.1))
        counters = Counters(events, "f:0")

        async def served(prompt: str) -> list[int]:
            before = counters.read()
            await _send(launched.url, prompt)
            keys = _keys(prompt)
            assert await eventually(lambda: events.match("f:0", keys) == len(keys), 15)
            assert await eventually(lambda: (now := counters.read()) is not None
                                    and (before is None or now[0] > before[0]), 15)
            return keys

        try:
            assert events.match("f:0", [1]) is None  # not ready: not subscribed
            registry.set_state(inst, InstanceState.READY)
            assert await eventually(lambda: events.status("f:0")["cache_view"] == "events", 15)
            first = await served("the router sends a request to the engine " * 6)
            assert events.block_size("f:0") == 16
            # The engine restarts (new event ports, chosen by the launcher again); the fleet manager
            # counts a new generation.
            await asyncio.to_thread(launched.stop)
            await launched.start(port)
            inst.generation += 1
            registry.notify()
            await served("many users and each replica answers a batch " * 6)
            assert events.match("f:0", first) == 0  # the old engine's blocks are gone with it
            rank = events.status("f:0")["event_ranks"][0]
            assert rank["health"] == ViewHealth.COMPLETE.value
            # Again, out of rotation meanwhile (as the fleet manager restarts an engine).
            registry.set_state(inst, InstanceState.STARTING)
            await asyncio.to_thread(launched.stop)
            await launched.start(port)
            inst.generation += 1
            registry.set_state(inst, InstanceState.READY)
            await served("an engine that restarted holds nothing at all " * 6)
            batches, restarts = counters.read() or (0.0, 0.0)
            assert restarts == 2
            assert batches >= 3  # one at least per engine
            assert events.status("f:0")["event_ranks"][0]["restarts"] == 2
            registry.remove("f:0")
            assert await eventually(lambda: events.status("f:0")["cache_view"] == "model", 5)
        finally:
            await counters.stop()
            task.cancel()
            await asyncio.wait([task])
    assert events.views("f:0") == []
    counters.assert_monotonic()


async def test_an_engine_restarted_out_of_rotation_is_counted_by_the_next_subscription(
        sim_process: SimProcessFactory) -> None:
    """A static engine started again on the same ports while its instance was out of rotation (failed
    heartbeats): no subscription saw its seq go back; the next one finds the restart — whether the new
    engine has already published past where the last subscription left the stream (other content at
    that seq) or nothing yet. An instance out of rotation and back with the same engine is not a
    restart."""
    http, pub, rep = free_port(), free_port(), free_port()
    kv = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}",
                     "replay_endpoint": f"tcp://127.0.0.1:{rep}"})
    engine = await sim_process(port=http, kv_events_config=kv, ttft_ms=1, itl_ms=1)
    registry = Registry()
    inst = registry.add(Instance(id="f:static0", fleet="f", url=engine.url, static=True,
                                 state=InstanceState.READY))
    # this process's sim processes seed their block hashes as it is seeded (as vLLM does)
    root = block_hash.none_hash(os.environ.get("PYTHONHASHSEED"))
    prompts = [f"conversation {n} of many users and each replica answers a batch " * 4 for n in range(4)]
    keys = [_keys(p, root) for p in prompts]
    async with aiohttp.ClientSession() as session:
        events = EngineEvents(registry, session, fleets=None, probe_interval_s=0.2, replay_timeout_s=1.0)
        task = asyncio.create_task(events.run(interval_s=0.1))
        counters = Counters(events, "f:static0")

        def restarts() -> int:
            return int(events.status("f:static0")["event_ranks"][0]["restarts"])

        async def out_and_back(restart: bool, served_meanwhile: list[str]) -> None:
            nonlocal engine
            registry.set_state(inst, InstanceState.UNHEALTHY)  # the health monitor's verdict
            assert await eventually(lambda: events.views("f:static0") == [], 15)
            if restart:
                await asyncio.to_thread(engine.stop)
                engine = await sim_process(port=http, kv_events_config=kv, ttft_ms=1, itl_ms=1)
            for prompt in served_meanwhile:  # the engine serves others while out of routerd's rotation
                await _send(engine.url, prompt)
            registry.set_state(inst, InstanceState.READY)
            assert await eventually(lambda: len(events.views("f:static0")) == 1, 15)

        def holds(n: int) -> bool:
            return events.match("f:static0", keys[n]) == len(keys[n])

        try:
            with structlog.testing.capture_logs() as logs:
                await _send(engine.url, prompts[0])
                assert await eventually(lambda: holds(0), 15)
                # restarted, and it has published as much as the first engine had, and more, meanwhile
                await out_and_back(restart=True, served_meanwhile=prompts[1:3])
                assert await eventually(lambda: holds(1) and holds(2), 15)
                assert events.match("f:static0", keys[0]) == 0
                assert restarts() == 1
                # restarted, and idle: it has published nothing
                await out_and_back(restart=True, served_meanwhile=[])
                assert restarts() == 2
                await _send(engine.url, prompts[3])
                assert await eventually(lambda: holds(3), 15)
                # out of rotation and back, the same engine: its history replayed, no restart counted
                await out_and_back(restart=False, served_meanwhile=[])
                assert await eventually(lambda: holds(3), 15)
                assert restarts() == 2
            found = [(e["left_at"], e["found"]) for e in logs if e["event"] == "kv_event_engine_restarted"]
            assert len(found) == 2, found
            assert found[0][1] >= found[0][0], found  # the first by its content, not its seq
            assert found[1][1] is None, found  # the second: nothing published
        finally:
            await counters.stop()
            task.cancel()
            await asyncio.wait([task])
    counters.assert_monotonic()
    assert counters.samples[-1][1] == 2


async def test_an_engine_without_events_stays_on_the_model(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine()
    registry = Registry()
    registry.add(Instance(id="f:0", fleet="f", url=eng.url, state=InstanceState.READY))
    async with aiohttp.ClientSession() as session:
        events = EngineEvents(registry, session, fleets=None)
        await events.reconcile()
        status = events.status("f:0")
        await events.aclose()
    assert status == {"cache_view": "model", "events_error": "the engine publishes no KV events"}
    assert events.match("f:0", [1, 2]) is None


async def test_a_daemon_routes_a_static_fleet_by_its_engines_events(
        routerd_process: Any, routerd_config: Any, sim_process: SimProcessFactory) -> None:
    """The whole way through ``routerd run``: a static fleet of sim engines that publish (they say where
    on ``/kv_event_sources``), keyed as the sim keys, seeded as they are."""
    kv = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                     "replay_endpoint": "tcp://127.0.0.1:0"})
    sim = await sim_process(model="m", kv_events_config=kv)
    args: dict[str, Any] = {"kv-events": True, "tokenizer": "sim"}
    if os.environ.get("PYTHONHASHSEED"):  # the sim process inherits it, as a static engine's own setting
        args["hash-seed"] = os.environ["PYTHONHASHSEED"]
    fleet = {"name": "f", "model": "m", "engine": "static", "urls": [sim.url], "engine_args": args}
    rp = await asyncio.to_thread(routerd_process, routerd_config(fleets=[fleet]))
    prompt = "the router sends a request to the engine " * 8
    long = "many users and each replica answers a batch of prompts " * 120  # keyed in the daemon's worker
    async with aiohttp.ClientSession() as s:
        async def view() -> dict[str, Any]:
            async with s.get(f"{rp.url}/admin/fleets") as r:
                return (await r.json())["fleets"]["f"]["instances"][0]["cache_view"] or {}

        for _ in range(200):
            if (await view()).get("cache_view") == "events":
                break
            await asyncio.sleep(0.1)
        assert (await view())["cache_view"] == "events"
        for text in (prompt, prompt, long, long):
            async with s.post(f"{rp.url}/v1/completions", json={"model": "m", "prompt": text,
                                                              "max_tokens": 2}) as r:
                assert r.status == 200
        async with s.get(f"{rp.url}/metrics") as r:
            text = await r.text()
    assert 'routerd_kv_events_view{fleet="f",health="complete",instance="f:static0",rank="0"} 1.0' in text
    lines = [json.loads(line) for line in rp.log_path.read_text().splitlines() if line.startswith("{")]
    requests = [e for e in lines if e.get("event") == "request"]
    assert [e["cache_view"] for e in requests] == ["events"] * 4
    assert requests[1]["matched_blocks"] == (len(prompt.split()) - 1) // 16  # the engine holds them
    assert len(long) > 4096
    assert requests[3]["matched_blocks"] == (len(long.split()) - 1) // 16
    keying = [e["event"] for e in lines if e.get("event", "").startswith("keying_process")]
    assert keying[0] == "keying_process_started"  # one worker, which never failed
    assert keying[1:] in ([], ["keying_process_ready"])
    # started with routerd, not by the first long request: a spawn is seconds that request would wait
    names = [e.get("event") for e in lines]
    assert names.index("keying_process_started") < names.index("request")


def test_which_fleets_are_keyed(tmp_path: Path) -> None:
    from routerd.config import FleetConfig
    from routerd.routing.engine_cache.block_keys import SimKeyer
    from routerd.routing.engine_cache.subscriptions import fleet_keyers

    fleets = [
        FleetConfig(name="sim-off", model="m", engine="sim"),
        FleetConfig(name="sim-on", model="m", engine="sim",
                    engine_args={"kv-events": True, "block-size": 32}),
        FleetConfig(name="vllm-no-tokenizer", model="m", engine="vllm", engine_args={"model": str(tmp_path)}),
        FleetConfig(name="vllm-off", model="m", engine="vllm", engine_args={"kv-events": False}),
        FleetConfig(name="static", model="m", engine="static", urls=["http://127.0.0.1:1"],
                    engine_args={"kv-events": True, "tokenizer": "sim", "hash-seed": 7}),
        FleetConfig(name="static-off", model="m", engine="static", urls=["http://127.0.0.1:1"]),
    ]
    keyers = fleet_keyers(fleets)
    assert sorted(keyers) == ["sim-on", "static"]
    keyer, size, root = keyers["sim-on"]
    assert isinstance(keyer, SimKeyer)
    assert size == 32
    assert root == block_hash.none_hash(block_hash.LAUNCH_SEED)
    assert keyers["static"][1:] == (16, block_hash.none_hash("7"))


async def test_a_static_fleet_can_name_each_urls_publisher(sim_engine: SimEngineFactory) -> None:
    """``engine_args.kv-event-sources``, one per URL: used instead of asking the engine (here the URL's
    engine publishes nothing itself; the named publisher is another's)."""
    from routerd.config import FleetConfig
    from routerd.routing.engine_cache.subscriptions import static_sources

    quiet = await sim_engine()
    publishing = await sim_engine(kv_events_config=json.dumps(
        {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}))
    assert publishing.kv_events is not None
    src = {"endpoint": publishing.kv_events.endpoint, "replay_endpoint": publishing.kv_events.replay_endpoint}
    fleet = FleetConfig(name="f", model="m", engine="static", urls=[quiet.url + "/"],
                        engine_args={"kv-event-sources": [src]})
    sources = static_sources([fleet])
    assert sources == {quiet.url: src}
    registry = Registry()
    registry.add(Instance(id="f:static0", fleet="f", url=quiet.url, state=InstanceState.READY))
    async with aiohttp.ClientSession() as session:
        events = EngineEvents(registry, session, fleets=None, sources=sources, probe_interval_s=0.2)
        task = asyncio.create_task(events.run(interval_s=0.1))
        try:
            assert await eventually(lambda: events.status("f:static0")["cache_view"] == "events", 10)
            prompt = "the router sends a request to the engine " * 6
            await _send(publishing.url, prompt)
            root = block_hash.none_hash(os.environ.get("PYTHONHASHSEED"))
            keys = block_hash.block_keys(token_ids(prompt.split()), 16, root)
            assert await eventually(lambda: events.match("f:static0", keys) == len(keys), 10)
        finally:
            task.cancel()
            await asyncio.wait([task])


def test_check_config_names_bad_kv_event_settings() -> None:
    from routerd.config import ConfigError, parse

    raw = {"fleets": [
        {"name": "v", "model": "v", "engine": "vllm", "engine_args": {"kv-events": "yes", "block-size": 0}},
        {"name": "s", "model": "s", "engine": "static", "urls": ["http://127.0.0.1:1"],
         "engine_args": {"kv-events": True, "hash-seed": [1],
                         "kv-event-sources": [{"endpoint": "http://127.0.0.1:2"}]}},
    ]}
    with pytest.raises(ConfigError) as e:
        parse(raw)
    problems = "\n".join(e.value.problems)
    for path in ("$.fleets[0].engine_args.kv-events", "$.fleets[0].engine_args.block-size",
                 "$.fleets[1].engine_args.tokenizer", "$.fleets[1].engine_args.hash-seed",
                 "$.fleets[1].engine_args.kv-event-sources[0]"):
        assert path + ":" in problems, problems


def test_status_shows_where_the_cache_picture_comes_from() -> None:
    from routerd.status import render

    def row(view: dict[str, Any] | None) -> str:
        inst = {"id": "f:0", "state": "ready", "cache_view": view}
        line = next(x for x in render({"fleets": {"f": {"instances": [inst]}}}).splitlines()
                    if x.startswith("f:0"))
        return line

    header = render({"fleets": {}}).splitlines()[0].split()
    assert "VIEW" in header
    ranks = [{"health": "complete", "gaps_replayed": 2}, {"health": "complete", "gaps_replayed": 0}]
    assert " events+2 " in row({"cache_view": "events", "event_ranks": ranks})
    assert " events:partial " in row({"cache_view": "events", "event_ranks": [{"health": "partial"}]})
    assert " model " in row({"cache_view": "model", "events_error": "the engine publishes no KV events"})


def test_status_tells_a_predicted_hit_ratio_from_an_estimated_one() -> None:
    """``HIT`` is the engine's ratio, then routerd's: ``~`` marks one over prompt sizes estimated from
    bytes (a fleet routerd does not key), never to be read as exact."""
    from routerd.status import render

    def hit(**ratios: float) -> str:
        inst = {"id": "f:0", "state": "ready", **ratios}
        line = next(x for x in render({"fleets": {"f": {"instances": [inst]}}}).splitlines()
                    if x.startswith("f:0"))
        return line

    assert " 0.75/0.75 " in hit(prefix_hit_ratio=0.75, predicted_prefix_hit_ratio=0.75)
    assert " 0.75/~0.80 " in hit(prefix_hit_ratio=0.75, estimated_prefix_hit_ratio=0.80)
    assert " -/~0.80 " in hit(estimated_prefix_hit_ratio=0.80)
    assert " 0.75/- " in hit(prefix_hit_ratio=0.75)
