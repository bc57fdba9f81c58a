"""The engine actor's process supervision: process group, parent-death signal, stop and the orphan check.

The first tests run the actor class in-process (it is plain Python; Ray only wraps it), against a real
simulated engine; the last one runs it as a real Ray actor and SIGKILLs the actor's worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest

from routerd.fleet.actor import EngineActor, group_members
from routerd.plugins import LaunchSpec
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster

pytestmark = pytest.mark.subprocess  # the engine actor's supervisor starts engines (sim processes)

SPEC = LaunchSpec(fleet="t", index=0, model="sim-t", engine="sim",
                  engine_args={"max-num-seqs": 4, "ttft-ms": 5, "itl-ms": 2})


def port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


async def wait_health(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


async def test_engine_runs_in_its_own_group_and_stop_leaves_nothing(tmp_path: Path) -> None:
    actor = EngineActor(msgspec.json.encode(SPEC), 1, str(tmp_path))
    info = await actor.start()
    try:
        pid = info["pid"]
        assert os.getpgid(pid) == pid != os.getpgid(0)
        await wait_health(info["url"])
        probe = await actor.probe(1.0)
        assert probe == {"process_alive": True, "http_status": 200, "error": ""}
        use = actor.resource_use()
        assert use["processes"] == 1
        assert use["rss_bytes"] > 10_000_000
        assert "sim-engine" in await asyncio.to_thread(Path(info["log_path"]).read_text)
        assert msgspec.json.decode(info["spec"].encode(), type=LaunchSpec) == SPEC
    finally:
        report = await actor.stop(grace_s=5.0)
    assert report["stopped"] is True
    assert report["leftover"] == []
    assert group_members(pid) == []
    assert not port_open(info["url"])


async def test_sigstopped_engine_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    actor = EngineActor(msgspec.json.encode(SPEC), 1, str(tmp_path))
    info = await actor.start()
    await wait_health(info["url"])
    os.kill(info["pid"], signal.SIGSTOP)
    probe = await actor.probe(0.5)
    assert probe["process_alive"] is True
    assert probe["error"] == "timeout"
    started = time.monotonic()
    report = await actor.stop(grace_s=0.5)
    assert report["forced"] is True
    assert report["stopped"] is True
    assert time.monotonic() - started < 5.0
    assert group_members(info["pid"]) == []


async def test_restart_engine_bumps_generation_and_port(tmp_path: Path) -> None:
    actor = EngineActor(msgspec.json.encode(SPEC), 3, str(tmp_path))
    first = await actor.start()
    try:
        await wait_health(first["url"])
        waiter = asyncio.ensure_future(actor.wait_exit(3))
        second = await actor.restart_engine()
        assert await asyncio.wait_for(waiter, 5.0) is not None  # the old generation's sentinel fired
        assert second["generation"] == 4
        assert second["pid"] != first["pid"]
        await wait_health(second["url"])
        assert group_members(first["pid"]) == []
    finally:
        await actor.stop(grace_s=5.0)


async def test_killed_supervisor_takes_its_engine_along(tmp_path: Path) -> None:
    """A parent that dies by SIGKILL (no clean-up runs): PDEATHSIG takes the engine down."""
    script = (
        "import asyncio, sys, msgspec\n"
        "from routerd.fleet.actor import EngineActor\n"
        "from routerd.plugins import LaunchSpec\n"
        "async def main():\n"
        "    spec = LaunchSpec(fleet='t', index=1, model='m', engine='sim')\n"
        f"    a = EngineActor(msgspec.json.encode(spec), 1, {str(tmp_path)!r})\n"
        "    info = await a.start()\n"
        "    print(info['pid'], info['url'], flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen(  # noqa: ASYNC220  # a test's fork+exec; returns at once
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(parent.stdout.readline), 30)
        pid_s, url = line.split()
        await wait_health(url)
        parent.kill()
        parent.wait(5)
        assert await eventually(lambda: not group_members(int(pid_s)), 5.0)
        # The listening socket can outlive the zombie's appearance in /proc by a moment.
        assert await eventually(lambda: not port_open(url), 3.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
        if parent.stdout is not None:
            parent.stdout.close()


@pytest.mark.ray
async def test_sigkill_of_the_ray_actor_leaves_no_engine(ray_cluster: RayTestCluster, tmp_path: Path) -> None:
    import ray

    from routerd.config import RayConfig
    from routerd.fleet.ray_cluster import RayCluster

    cluster = await RayCluster.connect(RayConfig(address=ray_cluster.address,
                                                 namespace=ray_cluster.namespace), tmp_path)
    try:
        pg = await cluster.placement_group(f"t-pg-{os.getpid()}", {"CPU": 0.5, "GPU": 1})
        await pg.ready()
        actor = await cluster.create_actor(EngineActor, "routerd:t:9", {"CPU": 0.5, "GPU": 1}, pg,
                                           msgspec.json.encode(SPEC), 1, str(tmp_path))
        info = await actor.start.remote()
        await wait_health(info["url"])
        assert info["node_id"]
        os.kill(info["actor_pid"], signal.SIGKILL)
        with pytest.raises(ray.exceptions.ActorDiedError):
            await asyncio.wait_for(actor.wait_exit.remote(1), 10)
        assert await eventually(lambda: not group_members(info["pid"]), 5.0)
        assert await eventually(lambda: not port_open(info["url"]), 3.0)
        await cluster.remove_placement_group(pg)
    finally:
        await cluster.close()


async def test_info_never_holds_up_a_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On GPU nodes info() runs nvidia-smi, which can take seconds; Ray runs every method of this async
    # actor on one loop, so done inline it made a concurrent heartbeat time out on a healthy engine.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    slow = bin_dir / "nvidia-smi"
    slow.write_text("#!/bin/sh\nsleep 1.5\n")
    slow.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    actor = EngineActor(msgspec.json.encode(SPEC), 1, str(tmp_path / "state"))
    info = await actor.start()
    try:
        await wait_health(info["url"])

        async def call_info() -> dict[str, object]:
            res = actor.info()
            return await res if asyncio.iscoroutine(res) else res  # type: ignore[no-any-return]  # either shape

        probe = asyncio.create_task(actor.probe(1.0))
        await asyncio.sleep(0)  # the probe is on its way
        full = await call_info()
        assert (await probe)["http_status"] == 200
        assert full["resources"]["gpu_memory_bytes"] == 0  # type: ignore[index]  # a dict when alive
    finally:
        await actor.stop(grace_s=5.0)
