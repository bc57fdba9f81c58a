"""The daemon with launched (Ray) fleets: reload scales while a stream is open, engines outlive routerd."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures.daemon import RouterdFactory, open_stream
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def _fleet(session: aiohttp.ClientSession, url: str, name: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/admin/fleets") as r:
        data = await r.json()
    fleets = data["fleets"]
    fleet = fleets[name] if isinstance(fleets, dict) else next(f for f in fleets if f["name"] == name)
    instances: list[dict[str, Any]] = fleet["instances"]
    return instances


async def _ready_pids(session: aiohttp.ClientSession, url: str, name: str, n: int,
                      timeout: float = 90.0) -> set[int]:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            insts = await _fleet(session, url, name)
            ready = [i for i in insts if i["state"] == "ready"]
            if len(ready) == n and len(insts) == n:
                return {int(i["pid"]) for i in ready}
        except (aiohttp.ClientError, KeyError, StopIteration):
            pass
        assert asyncio.get_running_loop().time() < end, f"fleet {name} never had {n} ready instances"
        await asyncio.sleep(0.2)


def _file_sd(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(cfg["daemon"]["state_dir"]) / "file_sd" / "engines.json"
    if not path.exists():
        return []
    groups: list[dict[str, Any]] = json.loads(path.read_text())
    return groups


async def test_reload_scales_while_streaming_and_engines_outlive_routerd(
        ray_cluster: RayTestCluster, routerd_process: RouterdFactory, routerd_config: Any) -> None:
    fleet = {"name": "s", "model": "m", "engine": "sim", "replicas": 1, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 8, "ttft-ms": 5, "itl-ms": 40}}
    cfg = routerd_config(ray={"address": ray_cluster.address, "namespace": f"d-{uuid.uuid4().hex[:8]}"},
                         fleets=[fleet])
    rp = await asyncio.to_thread(routerd_process, cfg)
    async with aiohttp.ClientSession() as s:
        (pid0,) = await _ready_pids(s, rp.url, "s", 1)
        assert await eventually(lambda: len(_file_sd(cfg)) == 1, 5)

        # Open a stream (60 tokens x 40 ms), then reload: two replicas and another policy.
        stream = await open_stream(s, rp.url, "m", 60)
        new = json.loads(json.dumps(cfg))
        new["fleets"][0]["replicas"] = 2
        new["routing"]["policy"] = "power_of_two"
        rp.rewrite_config(new)
        rp.signal(signal.SIGHUP)
        await asyncio.to_thread(rp.wait_notify, "RELOADING=1", 10)
        pids = await _ready_pids(s, rp.url, "s", 2)
        assert pid0 in pids  # scaling up leaves the running engine alone
        events = await stream.finish(30)
        assert events[-1] == b"data: [DONE]"
        assert not any(b'"error"' in e for e in events)
        assert len(events) == 61
        assert await eventually(lambda: len(_file_sd(new)) == 2, 5)
        async with s.get(f"{rp.url}/admin/fleets") as r:
            assert (await r.json())["policy"] == "power_of_two"

    # SIGTERM: routerd exits, the detached engines keep running.
    rp.signal(signal.SIGTERM)
    assert await asyncio.to_thread(rp.wait_exit, 60) == 0
    assert all(_alive(p) for p in pids)

    # A new routerd with the same config adopts them: same PIDs, no reload of weights.
    rp2 = await asyncio.to_thread(routerd_process, new)
    async with aiohttp.ClientSession() as s:
        assert await _ready_pids(s, rp2.url, "s", 2, timeout=60) == pids
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        async with s.post(f"{rp2.url}/v1/completions", json=body) as r:
            assert r.status == 200

    # With stop_engines_on_exit (applied by reload), a stop takes the engines down, leaving no process.
    last = json.loads(json.dumps(new))
    last["daemon"]["stop_engines_on_exit"] = True
    rp2.rewrite_config(last)
    rp2.signal(signal.SIGHUP)
    await asyncio.to_thread(rp2.wait_notify, "RELOADING=1", 10)
    await asyncio.to_thread(rp2.wait_notify, "READY=1", 10)
    rp2.signal(signal.SIGTERM)
    assert await asyncio.to_thread(rp2.wait_exit, 90) == 0, rp2.log()
    assert await eventually(lambda: not any(_alive(p) for p in pids), 15), \
        [p for p in pids if _alive(p)]
