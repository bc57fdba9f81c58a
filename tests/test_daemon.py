"""The daemon as systemd runs it: READY only when serving, watchdog pings, drain on TERM, reload on HUP."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from typing import Any

import aiohttp
import pytest

from tests.fixtures.daemon import RouterdFactory, open_stream, wait_ready

pytestmark = pytest.mark.timeout(180)


def _static_fleet(url: str, name: str = "f", model: str = "m") -> dict[str, Any]:
    return {"name": name, "model": model, "engine": "static", "urls": [url]}


async def test_ready_only_after_listener_and_watchdog_pings(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: Any) -> None:
    sim = await sim_process(model="m")
    rp = await asyncio.to_thread(routerd_process, routerd_config(fleets=[_static_fleet(sim.url)]),
                                 wait_ready=False)
    await asyncio.to_thread(rp.wait_notify, "READY=1", 60)
    # READY=1 promises a bound listener: the very next connect must succeed.
    host, port = rp.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=2):
        pass
    async with aiohttp.ClientSession() as s, s.get(f"{rp.url}/healthz") as r:
        assert r.status == 200
    # WatchdogSec=0.4s in the fixture → a ping every 0.2s from the event loop: it keeps pinging (waited
    # for, not counted in a window: a busy machine delays a ping, and systemd's bound is the fixture's)
    for _ in range(100):
        if rp.messages.count("WATCHDOG=1") >= 3:
            break
        await asyncio.to_thread(rp.read_notify, 0.2)
    assert rp.messages.count("WATCHDOG=1") >= 3
    assert any(m.startswith("STATUS=") for m in rp.messages)
    rp.signal(signal.SIGTERM)
    await asyncio.to_thread(rp.wait_notify, "STOPPING=1", 20)
    assert await asyncio.to_thread(rp.wait_exit, 20) == 0


async def test_sigterm_drains_open_stream_and_refuses_new_requests(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: Any) -> None:
    sim = await sim_process(model="m", ttft_ms=10, itl_ms=40)
    rp = await asyncio.to_thread(routerd_process, routerd_config(fleets=[_static_fleet(sim.url)]))
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, rp.url)
        stream = await open_stream(s, rp.url, "m", 40)  # ≈ 1.6 s of tokens
        rp.signal(signal.SIGTERM)
        await asyncio.to_thread(rp.wait_notify, "STOPPING=1", 10)
        # A new request is refused while the open stream keeps going.
        refused = False
        try:
            async with aiohttp.ClientSession() as s2, s2.post(
                    f"{rp.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}) as r:
                refused = r.status == 503
        except aiohttp.ClientConnectionError:
            refused = True
        assert refused
        events = await stream.finish(20)
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"error"' in e for e in events)
    assert len([e for e in events if e != b"data: [DONE]"]) == 40
    assert await asyncio.to_thread(rp.wait_exit, 20) == 0


async def test_drain_timeout_ends_streams_with_an_error_event(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: Any) -> None:
    sim = await sim_process(model="m", ttft_ms=10, itl_ms=100)
    cfg = routerd_config(daemon={"drain_timeout_s": 0.5}, fleets=[_static_fleet(sim.url)])
    rp = await asyncio.to_thread(routerd_process, cfg)
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, rp.url)
        stream = await open_stream(s, rp.url, "m", 200)  # ≈ 20 s
        rp.signal(signal.SIGTERM)
        events = await stream.finish(15)
    assert events[-1] == b"data: [DONE]"
    assert b'"error"' in events[-2]
    assert await asyncio.to_thread(rp.wait_exit, 20) == 0


async def test_sighup_applies_keys_and_policy_and_rejects_a_bad_file(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: Any) -> None:
    sim = await sim_process(model="m")
    cfg = routerd_config(fleets=[_static_fleet(sim.url)])
    rp = await asyncio.to_thread(routerd_process, cfg)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, rp.url)
        async with s.post(f"{rp.url}/v1/completions", json=body) as r:
            assert r.status == 200
        new = json.loads(json.dumps(cfg))
        new["http"]["api_keys"] = ["sekret"]
        new["routing"]["policy"] = "round_robin"
        new.setdefault("daemon", {})["file_sd_path"] = str(rp.config_path.parent / "elsewhere.json")
        rp.rewrite_config(new)
        rp.signal(signal.SIGHUP)
        await asyncio.to_thread(rp.wait_notify, "RELOADING=1", 10)
        await asyncio.to_thread(rp.wait_notify, "READY=1", 10)
        # Bound at start-up (the file_sd writer has its path): said so, not silently ignored.
        assert "daemon.file_sd_path" in rp.log()
        assert not (rp.config_path.parent / "elsewhere.json").exists()
        async with s.post(f"{rp.url}/v1/completions", json=body) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == 401
        auth = {"Authorization": "Bearer sekret"}
        async with s.post(f"{rp.url}/v1/completions", json=body, headers=auth) as r:
            assert r.status == 200
        async with s.get(f"{rp.url}/admin/fleets") as r:
            assert (await r.json())["policy"] == "round_robin"
        # An invalid file is rejected with its reason; the running config stays.
        rp.config_path.write_text("[http]\nport = 'x'\n")
        rp.signal(signal.SIGHUP)
        line = await asyncio.to_thread(rp.wait_notify, "STATUS=reload rejected", 10)
        assert "$.http.port" in line
        async with s.post(f"{rp.url}/v1/completions", json=body, headers=auth) as r:
            assert r.status == 200
        # A file that is not UTF-8 is rejected the same way (it used to end the daemon).
        rp.config_path.write_bytes(b"[daemon]\nstate_dir = 'caf\xe9'\n")
        rp.signal(signal.SIGHUP)
        line = await asyncio.to_thread(rp.wait_notify, "STATUS=reload rejected", 10)
        assert "UTF-8" in line
        async with s.post(f"{rp.url}/v1/completions", json=body, headers=auth) as r:
            assert r.status == 200
        # So is a launcher that is not installed (it used to fail later, inside its engine's Ray actor).
        unknown = json.loads(json.dumps(new))
        unknown["fleets"].append({"name": "g", "model": "g", "engine": "nope"})
        rp.rewrite_config(unknown)
        rp.signal(signal.SIGHUP)
        line = await asyncio.to_thread(rp.wait_notify, "STATUS=reload rejected", 10)
        assert "$.fleets[1].engine: unknown launcher 'nope' (installed: sim, vllm)" in line
        async with s.post(f"{rp.url}/v1/completions", json=body, headers=auth) as r:
            assert r.status == 200
    assert rp.proc.poll() is None
    assert "reload_rejected" in rp.log()


def test_bad_config_exits_78(routerd_process: RouterdFactory, routerd_config: Any) -> None:
    cfg = routerd_config(fleets=[{"name": "x", "model": "m", "replicas": -1}])
    rp = routerd_process(cfg, wait_ready=False)
    assert rp.wait_exit(30) == 78


async def test_both_ways_in_through_one_daemon_with_queue_metrics(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: Any, redis_server: Any) -> None:
    from routerd.client import QueueClient
    from routerd.sim_tokens import expected_text

    sim = await sim_process(model="m")
    cfg = routerd_config(redis={"enabled": True, "url": redis_server.url}, fleets=[_static_fleet(sim.url)])
    rp = await asyncio.to_thread(routerd_process, cfg)
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, rp.url)
        client = QueueClient.from_url(redis_server.url)
        try:
            job = await client.submit({"model": "m", "prompt": "queue me", "max_tokens": 5},
                                      endpoint="/v1/completions")
            result = await client.wait(job, timeout=20)
        finally:
            await client.aclose()
        assert result.status == "ok"
        assert result.response["choices"][0]["text"] == expected_text(0, "queue me", 5)
        async with s.post(f"{rp.url}/v1/completions",
                          json={"model": "m", "prompt": "queue me", "max_tokens": 5}) as r:
            assert (await r.json())["choices"][0]["text"] == expected_text(0, "queue me", 5)
        end = asyncio.get_running_loop().time() + 10
        while True:  # the depth is sampled every 5 s
            async with s.get(f"{rp.url}/metrics") as r:
                text = await r.text()
            if 'routerd_queue_depth{kind="dead"} 0.0' in text:
                break
            assert asyncio.get_running_loop().time() < end, text[-2000:]
            await asyncio.sleep(0.5)
        assert 'routerd_queue_jobs_total{outcome="done"} 1.0' in text
        assert 'routerd_queue_paused 0.0' in text
        # Both ways in are counted per engine call: the queue job and the HTTP request.
        assert 'routerd_requests_total{code="200",fleet="f",instance="f:static0",' \
            'route="/v1/completions"} 2.0' in text
        assert 'routerd_instance_state{fleet="f",instance="f:static0",state="ready"} 1.0' in text


async def test_second_sigterm_exits_at_once(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: Any) -> None:
    sim = await sim_process(model="m", ttft_ms=10, itl_ms=100)
    cfg = routerd_config(daemon={"drain_timeout_s": 60.0}, fleets=[_static_fleet(sim.url)])
    rp = await asyncio.to_thread(routerd_process, cfg)
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, rp.url)
        stream = await open_stream(s, rp.url, "m", 300)  # ≈ 30 s
        rp.signal(signal.SIGTERM)
        await asyncio.to_thread(rp.wait_notify, "STOPPING=1", 10)
        started = asyncio.get_running_loop().time()
        rp.signal(signal.SIGTERM)
        code = await asyncio.to_thread(rp.wait_exit, 15)
        assert asyncio.get_running_loop().time() - started < 10  # not the 60 s drain
        events = await stream.finish(10)
    assert code == 0
    assert events[-1] == b"data: [DONE]"
    assert b'"error"' in events[-2]  # the open stream learns it was cut
    assert "never retrieved" not in rp.log()  # the abandoned drain's wait left no unread error


async def test_a_static_only_daemon_drains_and_undrains_a_static_instance(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: Any) -> None:
    """No Ray, no fleet manager: a static instance is drained (out of rotation, its stream finishes),
    stays out while its engine is healthy, and comes back on undrain; what only applies to launched
    engines is refused with the reason."""
    sims = [await sim_process(model="m", ttft_ms=10, itl_ms=40) for _ in range(2)]
    fleet = {"name": "f", "model": "m", "engine": "static", "urls": [s.url for s in sims]}
    rp = await asyncio.to_thread(routerd_process, routerd_config(fleets=[fleet]))
    admin = f"{rp.url}/admin"

    async def states(s: aiohttp.ClientSession) -> dict[str, str]:
        async with s.get(f"{admin}/fleets") as r:
            return {i["id"]: i["state"] for i in (await r.json())["fleets"]["f"]["instances"]}

    async def until(s: aiohttp.ClientSession, want: dict[str, str]) -> None:
        for _ in range(300):
            if await states(s) == want:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{await states(s)} never became {want}")

    async with aiohttp.ClientSession() as s:
        await wait_ready(s, rp.url)
        await until(s, {"f:static0": "ready", "f:static1": "ready"})
        async with s.post(f"{admin}/instances/f:static0/drain", json={"timeout_s": 10}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["draining"]["drained"] is True
        await asyncio.sleep(0.5)  # several rotation passes: a healthy engine is not taken back
        assert await states(s) == {"f:static0": "draining", "f:static1": "ready"}
        stream = await open_stream(s, rp.url, "m", 40)  # ≈ 1.6 s, on f:static1: the only one left
        async with s.post(f"{admin}/instances/f:static1/drain", json={"timeout_s": 30}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["draining"]["drained"] is True  # it waited for the stream
        events = await stream.finish(5)
        assert events[-1] == b"data: [DONE]"
        assert len(events) == 41
        assert not any(b'"error"' in e for e in events)
        for path, body, what in [("instances/f:static0/restart", {}, "cannot restart"),
                                 ("fleets/f/replicas", {"replicas": 3}, "is static"),
                                 ("instances/f:static0/drain", {"timeout_s": 1e9}, "invalid body")]:
            async with s.post(f"{admin}/{path}", json=body) as r:
                assert r.status == 400, path
                assert what in (await r.json())["error"]["message"], path
        async with s.delete(f"{admin}/fleets/f/replicas") as r:
            assert r.status == 400
        async with s.post(f"{admin}/instances/f:nothing/undrain") as r:
            assert r.status == 404
        for i in (0, 1):
            async with s.post(f"{admin}/instances/f:static{i}/undrain") as r:
                assert r.status == 200, await r.text()
        await until(s, {"f:static0": "ready", "f:static1": "ready"})
        served = set()
        for _ in range(6):
            async with s.post(f"{rp.url}/v1/completions",
                              json={"model": "m", "prompt": "x", "max_tokens": 1}) as r:
                assert r.status == 200
                served.add(r.headers["X-Routerd-Instance"])
        assert served <= {"f:static0", "f:static1"}
    rp.signal(signal.SIGTERM)
    assert await asyncio.to_thread(rp.wait_exit, 20) == 0
