"""Engines answer only routerd (issue 27): the launched engines' API key, a static fleet's, and the
sim guarding what vLLM guards.

Against real processes: sims in-process and as ``routerd sim-engine``, routerd from the one builder,
and sims launched through Ray by the real launch path (engine actor, launcher plugin), adopted by a
routerd restarted on the same state dir.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd import assembly, config
from routerd.config import Config
from routerd.fleet import FleetManager, RayCluster
from routerd.registry import InstanceState, Registry
from routerd.trust import Trust
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.sim import SimEngineFactory, SimProcessFactory

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}
UNAUTHORIZED = {"error": "Unauthorized"}
SIM_ARGS = {"max-num-seqs": 8, "ttft-ms": 5, "itl-ms": 3}


async def status_of(session: aiohttp.ClientSession, method: str, url: str,
                    headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with session.request(method, url, json=BODY if method == "POST" else None,
                               headers=headers or {}) as r:
        raw = await r.read()
        try:
            return r.status, await r.json(content_type=None)
        except ValueError:
            return r.status, raw


async def test_the_sim_guards_what_vllm_guards(sim_engine: SimEngineFactory,
                                                sim_process: SimProcessFactory) -> None:
    eng = await sim_engine(model="m", api_key=("k-one", "k-two"), ttft_ms=1.0, itl_ms=0.5)
    proc = await sim_process(model="m", api_key="k-cli", ttft_ms=1, itl_ms=1)  # --api-key on its argv
    async with aiohttp.ClientSession() as s:
        guarded = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                   ("POST", "/v2/rerank"), ("POST", "/inference/v1/generate"), ("POST", "/cohere/v2/chat")]
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k-one"},
                            {"Authorization": "k-one"}):
                assert await status_of(s, method, eng.url + path, headers) == (401, UNAUTHORIZED), \
                    (path, headers)
        for auth in ("Bearer k-one", "bearer k-two", "BEARER k-one"):  # either key; the scheme in any case
            status, body = await status_of(s, "POST", eng.url + "/v1/completions", {"Authorization": auth})
            assert status == 200, (auth, body)
            assert body["choices"][0]["text"]
        for path in ("/health", "/metrics", "/load", "/kv_event_sources", "/version", "/ping"):
            status, _ = await status_of(s, "GET", eng.url + path)
            assert status == 200, path

        assert await status_of(s, "POST", proc.url + "/v1/completions") == (401, UNAUTHORIZED)
        status, _ = await status_of(s, "POST", proc.url + "/v1/completions",
                                    {"Authorization": "Bearer k-cli"})
        assert status == 200
        assert (await status_of(s, "GET", proc.url + "/metrics"))[0] == 200


def static_cfg(tmp_path: Path, fleets: list[dict[str, Any]], environ: dict[str, str]) -> Config:
    return config.parse({
        "daemon": {"state_dir": str(tmp_path / "state")},
        "redis": {"enabled": False},
        "routing": {"scrape_interval_s": 0.05, "stale_after_s": 1.0, "retry_backoff_ms": 1},
        "fleets": [{"engine": "static", "max_num_seqs": 8, **f} for f in fleets],
    }, environ=environ)


async def test_a_static_fleet_is_sent_its_api_key_and_only_its_own(
        tmp_path: Path, sim_engine: SimEngineFactory) -> None:
    launched_key = Trust.load("", tmp_path / "state").engine_api_key  # what routerd derives there
    right = await sim_engine(model="right", api_key=("k-static",))
    wrong = await sim_engine(model="wrong", api_key=("k-static",))
    bare = await sim_engine(model="bare", api_key=(launched_key,))
    cfg = static_cfg(tmp_path, [
        {"name": "right", "model": "right", "urls": [right.url], "api_key": "env:ENGINE_KEY"},
        {"name": "wrong", "model": "wrong", "urls": [wrong.url], "api_key": "not-the-key"},
        # no api_key: routerd sends none — never the launched engines' key to an engine it did not launch
        {"name": "bare", "model": "bare", "urls": [bare.url]}], {"ENGINE_KEY": "k-static"})
    assert "k-static" in config.secret_values(cfg)  # the redactor learns it
    async with assembly.running(cfg, Registry()) as rd, aiohttp.ClientSession() as s:
        fleets = ("right", "wrong", "bare")
        assert await eventually(lambda: all(rd.registry.ready_count(f) == 1 for f in fleets), 10), rd.status()
        for stream in (False, True):
            body = {**BODY, "model": "right", "stream": stream}
            async with s.post(rd.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Routerd-Instance"] == "right:static0"
        for fleet in ("wrong", "bare"):
            async with s.post(rd.url + "/v1/completions", json={**BODY, "model": fleet}) as r:
                # routerd's error, not the engine's 401 passed on: the client's own key was fine
                assert r.status == 502, await r.text()
                error = (await r.json())["error"]
                assert error["type"] == "UpstreamError"
                assert "refused routerd's API key" in error["message"], error
                assert "[[fleets]] api_key" in error["message"]


def test_check_config_refuses_an_api_key_routerd_does_not_take(tmp_path: Path) -> None:
    launched = {"name": "l", "model": "l", "engine": "sim", "api_key": "k"}
    cases = {
        "$.fleets[0].api_key: routerd gives the engines it launches": launched,
        "$.fleets[0].engine_args.api-key: routerd gives": {**launched, "api_key": "",
                                                            "engine_args": {"api-key": "k"}},
        "$.fleets[0].env.VLLM_API_KEY: routerd gives": {**launched, "api_key": "",
                                                         "env": {"VLLM_API_KEY": "k"}},
        "$.fleets[0].api_key: env:NOPE: the environment variable is not set": {
            "name": "s", "model": "s", "engine": "static", "urls": ["http://h:1"], "api_key": "env:NOPE"},
        "$.fleets[0].api_key: one token of printable characters": {
            "name": "s", "model": "s", "engine": "static", "urls": ["http://h:1"], "api_key": "k\nX: 1"},
        "$.fleets[0].api_key: the fleet's urls carry user:password": {
            "name": "s", "model": "s", "engine": "static", "urls": ["http://u:p@h:1"], "api_key": "k"},
    }
    for expected, fleet in cases.items():
        with pytest.raises(config.ConfigError) as e:
            config.parse({"fleets": [fleet]}, environ={})
        assert any(p.startswith(expected) for p in e.value.problems), (expected, e.value.problems)


# ---- launched engines, through Ray --------------------------------------------------------------


def launched_cfg(rc: RayTestCluster, state: Path, secret: str = "") -> Config:
    return config.parse({
        "daemon": {"state_dir": str(state), "drain_timeout_s": 5},
        "redis": {"enabled": False},
        "ray": {"address": rc.address, "namespace": f"{rc.namespace}-ekey"},
        "routing": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
        "health": {"restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 2.0, "startup_timeout_s": 60},
        "control": {"secret": secret},
        "fleets": [{"name": "k", "model": "m", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
                    "engine_args": SIM_ARGS}],
    }, environ={})


@contextlib.asynccontextmanager
async def keyless_manager(cfg: Config) -> AsyncIterator[Registry]:
    """A fleet manager as routerd had it before engines had keys: it launches them without one."""
    cluster = await RayCluster.connect(cfg.ray, config.state_dir(cfg))
    registry = Registry()
    try:
        async with aiohttp.ClientSession() as session:
            fm = FleetManager(cfg, registry, cluster, session)
            await fm.start()
            try:
                yield registry
            finally:
                await fm.shutdown(stop_engines=False)
    finally:
        await cluster.close()


def engine(registry: Registry) -> tuple[str, int, int]:
    inst = registry.get("k:0")
    assert inst is not None
    assert inst.pid is not None
    return inst.url, inst.pid, inst.generation


def proc_file(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


async def served(s: aiohttp.ClientSession, url: str) -> None:
    async with s.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 200, await r.text()


@pytest.mark.ray
@pytest.mark.timeout(240)
async def test_launched_engines_answer_only_routerd_across_restarts_and_a_rotation(
        ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = launched_cfg(ray_cluster, state)
    key = Trust.load("", state).engine_api_key  # the secret file routerd generates, and then reads
    ready = lambda r: r.ready_count("k") == 1  # noqa: E731

    # An engine launched before engines had keys: open to anyone.
    async with keyless_manager(cfg) as registry, aiohttp.ClientSession() as s:
        assert await eventually(lambda: ready(registry), 60), list(registry)
        legacy_url, legacy_pid, _ = engine(registry)
        await served(s, legacy_url)

    # routerd with keys adopts it and the rolling update replaces it with a keyed one (a fleet of one
    # replica is rolled at once, as for a changed spec).
    async with assembly.running(cfg, Registry(), stop_engines=False) as rd, aiohttp.ClientSession() as s:
        assert await eventually(lambda: ready(rd.registry) and engine(rd.registry)[1] != legacy_pid, 60), \
            rd.status()
        url, pid, generation = engine(rd.registry)
        assert await status_of(s, "POST", url + "/v1/completions") == (401, UNAUTHORIZED)
        assert await status_of(s, "GET", url + "/v1/models") == (401, UNAUTHORIZED)
        for path in ("/health", "/metrics"):
            assert (await status_of(s, "GET", url + path))[0] == 200, path
        status, _ = await status_of(s, "POST", url + "/v1/completions", {"Authorization": f"Bearer {key}"})
        assert status == 200
        await served(s, rd.url)
        # In the engine's environment, not on its command line (which `ps` shows every user) nor in
        # the log its actor writes.
        assert key.encode() not in proc_file(pid, "cmdline")
        assert f"VLLM_API_KEY={key}".encode() in proc_file(pid, "environ")
        logs = list((state / "engines" / "k-0").glob("g*.log"))
        assert logs
        assert not any(key in p.read_text() for p in logs)

    # A restart on the same state dir: the same key, the same engine adopted, served at once.
    async with assembly.running(cfg, Registry(), stop_engines=False) as rd, aiohttp.ClientSession() as s:
        assert engine(rd.registry) == (url, pid, generation)
        inst = rd.registry.get("k:0")
        assert inst is not None
        assert inst.state is InstanceState.READY
        await served(s, rd.url)

    # The shared secret rotated: the engine, which would refuse every request, is restarted in place
    # with the new key.
    rotated = launched_cfg(ray_cluster, state, secret="a-new-shared-secret-0123456789")
    new_key = Trust.load(rotated.control.secret, state).engine_api_key
    async with assembly.running(rotated, Registry(), stop_engines=True) as rd, \
            aiohttp.ClientSession() as s:
        assert await eventually(lambda: ready(rd.registry) and engine(rd.registry)[2] > generation, 60), \
            rd.status()
        await served(s, rd.url)
        url = engine(rd.registry)[0]
        for k, expected in ((key, 401), (new_key, 200)):
            status, _ = await status_of(s, "POST", url + "/v1/completions", {"Authorization": f"Bearer {k}"})
            assert status == expected
