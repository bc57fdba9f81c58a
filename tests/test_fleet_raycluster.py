"""routerd's own local Ray head: started once in the state dir, found again after a restart, outliving
the driver that started it; plus the launchers' command lines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from routerd_builtin.launchers import SimLauncher, VllmLauncher

from routerd.config import RayConfig
from routerd.fleet.ray_cluster import LocalHead, RayCluster, RayConnectError, short_temp_dir
from routerd.plugins import LaunchSpec


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(") ", 1)[1][0] != "Z"


async def test_unreachable_address_fails_within_the_timeout(tmp_path: Path) -> None:
    cfg = RayConfig(address="127.0.0.1:9", connect_timeout_s=3)
    with pytest.raises(RayConnectError):
        await asyncio.wait_for(RayCluster.connect(cfg, tmp_path), 30)


def test_long_state_dirs_get_a_short_stable_ray_temp_dir(tmp_path: Path) -> None:
    long = tmp_path / ("x" * 80)
    assert len(str(short_temp_dir(long))) <= 40
    assert short_temp_dir(long) == short_temp_dir(long)
    assert short_temp_dir(Path("/s")) == Path("/s/ray")


async def test_vllm_launcher_command_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTERD_VLLM_CPU", "1")
    spec = LaunchSpec(fleet="f", index=0, model="served", engine="vllm", tensor_parallel_size=2,
                      engine_args={"model": "/m", "vllm-bin": "/v/vllm", "max-model-len": 256,
                                   "enforce-eager": True, "enable-prefix-caching": False})
    plan = await VllmLauncher().plan(spec, host="127.0.0.1", port=8123, workdir="/w")
    assert plan.argv[:3] == ["/v/vllm", "serve", "/m"]
    argv = " ".join(plan.argv)
    assert "--served-model-name served --host 127.0.0.1 --port 8123 --tensor-parallel-size 2" in argv
    assert "--distributed-executor-backend mp" in argv
    assert "--max-model-len 256 --enforce-eager" in argv
    assert "disable-log-stats" not in argv
    assert "enable-prefix-caching" not in argv
    assert plan.env["OMP_NUM_THREADS"] == ""  # removed from what the engine inherits from Ray
    assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    with pytest.raises(ValueError, match="metrics"):
        await VllmLauncher().plan(LaunchSpec(fleet="f", index=0, model="m", engine="vllm",
                                             engine_args={"disable-log-stats": True}),
                                  host="127.0.0.1", port=1, workdir="/w")


async def test_sim_launcher_command() -> None:
    spec = LaunchSpec(fleet="f", index=0, model="sim-m", engine="sim", engine_args={"itl_ms": 3})
    plan = await SimLauncher().plan(spec, host="127.0.0.1", port=9, workdir="/w")
    assert plan.argv[1:] == ["-m", "routerd", "sim-engine", "--host", "127.0.0.1", "--port", "9",
                             "--model", "sim-m", "--itl-ms", "3"]


def _session(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


@pytest.mark.ray
@pytest.mark.timeout(240)
async def test_local_head_outlives_the_driver_is_found_again_and_make_stop_stops_it_with_its_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """routerd's own head outlives the driver that started it and is found again from the state dir.
    Then ``make stop``: ``ray start --block`` drains its node on SIGTERM until the raylet exits or the
    drain times out, and a node holding a detached actor never drains, so the script must not wait for
    that (here the drain is 600 s, so waiting for it means not stopping at all). When it returns, every
    process the head started — the detached actor and its engine process too — is gone. (One head for
    both: each start of one cost ~10 s of CI.)"""
    monkeypatch.setenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "600")  # inherited by the head
    import subprocess
    import sys

    import ray

    cfg = RayConfig(num_cpus=2, num_gpus=1, resources={"accel": 2.0}, connect_timeout_s=60)
    state = tmp_path / "state"
    first = await RayCluster.connect(cfg, state)
    rec = json.loads((state / "ray" / "head.json").read_text())
    sid = os.getsid(rec["pid"])
    try:
        assert first.local_head
        assert first.is_local()
        total, _ = await first.resources()
        assert total["GPU"] == 1.0
        assert total["accel"] == 2.0
        await first.close()  # the driver goes; the head must stay
        assert _alive(rec["pid"])
        cluster = await RayCluster.connect(cfg, state)
        assert cluster.address == first.address
        assert json.loads((state / "ray" / "head.json").read_text())["pid"] == rec["pid"]

        @ray.remote(num_cpus=0)
        class Holder:  # a detached actor with a child process: what an engine actor is to Ray
            def __init__(self) -> None:
                self.child = subprocess.Popen(["sleep", "600"])

            def child_pid(self) -> int:
                return self.child.pid

        holder = Holder.options(lifetime="detached", name="holder", namespace=cfg.namespace).remote()
        child = await asyncio.to_thread(ray.get, holder.child_pid.remote(), timeout=60)
        assert _alive(child)
        await cluster.close()
        script = Path(__file__).parent.parent / "scripts" / "stop-local-ray.py"
        proc = await asyncio.create_subprocess_exec(sys.executable, str(script),
                                                    str(state / "ray" / "head.json"),
                                                    stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, out
        assert not _alive(rec["pid"]), out
        assert not _alive(child)
        assert _session(sid) == []
        assert LocalHead(cfg, state).find() is None
    finally:
        for pid in _session(sid):  # only the head's own session: what this test started
            os.kill(pid, signal.SIGKILL)
