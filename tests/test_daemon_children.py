"""The daemon's own processes (issue 26, items 6 and 7), with real ``routerd run`` processes, the
embedded Redis and, where the keying process matters, a fleet routerd keys requests for:

- a second daemon on the same state dir exits at once (75) and leaves the first untouched;
- a terminal's Ctrl-C (SIGINT to the whole process group) reaches routerd alone: its embedded Redis and
  keying process live on through the drain, which still acknowledges its jobs, and are stopped in order;
- a SIGKILLed routerd leaves none of them behind, nor its state dir locked.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from routerd.client import QueueClient
from routerd.redis_server import embedded_url
from routerd.state_lock import EXIT_LOCKED, LOCK_FILE
from tests.fixtures.daemon import RouterdFactory, RouterdProcess, wait_ready
from tests.fixtures.helpers import eventually
from tests.fixtures.sim import SimProcessFactory

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


async def _daemon(routerd_process: RouterdFactory, routerd_config: Callable[..., dict[str, Any]],
                  sim_process: SimProcessFactory, *, keyed: bool = True, own_group: bool = False,
                  itl_ms: float = 1.0) -> RouterdProcess:
    """routerd on the embedded Redis, in front of a sim, ready. ``keyed``: the sim publishes KV events,
    so routerd keys requests in its keying process, which is up too."""
    fleet: dict[str, Any] = {"name": "f", "model": "m", "engine": "static"}
    sim_args: dict[str, Any] = {"itl_ms": itl_ms}
    if keyed:
        sim_args["kv_events_config"] = json.dumps({"enable_kv_cache_events": True,
                                                   "endpoint": "tcp://127.0.0.1:0",
                                                   "replay_endpoint": "tcp://127.0.0.1:0"})
        fleet["engine_args"] = {"kv-events": True, "tokenizer": "sim"}
        if os.environ.get("PYTHONHASHSEED"):
            fleet["engine_args"]["hash-seed"] = os.environ["PYTHONHASHSEED"]
    sim = await sim_process(model="m", **sim_args)
    cfg = routerd_config(daemon={"drain_timeout_s": 30.0},
                         redis={"enabled": True, "url": "embedded", "reclaim_interval_s": 0.5},
                         fleets=[{**fleet, "urls": [sim.url]}])
    rp = await asyncio.to_thread(routerd_process, cfg, own_group=own_group)
    if keyed:
        assert await eventually(lambda: bool(_events(rp, "keying_process_ready")), 60), rp.log()
    return rp


def _events(rp: RouterdProcess, name: str) -> list[dict[str, Any]]:
    lines = rp.log_path.read_text(errors="replace").splitlines()
    return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e.get("event") == name]


def _children(pid: int) -> dict[int, str]:
    """pid → command line of every live child of ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and cmdline:
            found[int(entry.name)] = cmdline
    return found


def _supervised(rp: RouterdProcess, *, keyed: bool = True) -> dict[str, int]:
    """The children routerd stops in order: its embedded Redis and (``keyed``) its keying process."""
    children = _children(rp.proc.pid)
    redis_pid = _events(rp, "embedded_redis_started")[0]["pid"]
    keying = [pid for pid, cmd in children.items() if "spawn_main" in cmd]
    assert redis_pid in children, children
    assert len(keying) == int(keyed), children
    return {"redis": redis_pid, **({"keying": keying[0]} if keyed else {})}


def _open_files(pid: int) -> set[str]:
    return {os.path.realpath(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _completion(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json={
            "model": "m", "prompt": "still here", "max_tokens": 4}) as r:
        return r.status


async def test_a_second_daemon_on_the_same_state_dir_exits_at_once_and_leaves_the_first_alone(
        routerd_process: RouterdFactory, routerd_config: Callable[..., dict[str, Any]],
        sim_process: SimProcessFactory) -> None:
    first = await _daemon(routerd_process, routerd_config, sim_process, keyed=False)
    kids = _supervised(first, keyed=False)
    second = await asyncio.to_thread(routerd_process, first.config, wait_ready=False)  # the same config
    assert await asyncio.to_thread(second.wait_exit, 30) == EXIT_LOCKED
    [refused] = _events(second, "state_dir_in_use")
    assert refused["holder_pid"] == first.proc.pid
    assert str(first.proc.pid) in refused["message"]
    assert not _events(second, "embedded_redis_stale") + _events(second, "embedded_redis_started")
    assert "READY=1" not in second.read_notify()

    assert first.proc.poll() is None
    assert _supervised(first, keyed=False) == kids  # the same Redis, never restarted
    assert not _events(first, "embedded_redis_exited")
    assert await _completion(first.url) == 200
    url = embedded_url(Path(first.config["daemon"]["state_dir"]) / "redis")
    assert url is not None
    async with QueueClient.from_url(url) as q:
        job = await q.submit({"model": "m", "prompt": "and the queue", "max_tokens": 4})
        assert (await q.wait(job, timeout=30)).status == "ok"
    lock = Path(first.config["daemon"]["state_dir"]) / LOCK_FILE
    assert lock.read_text().strip() == str(first.proc.pid)
    for pid in kids.values():  # nothing it starts holds the lock (the Ray head and Redis outlive it)
        assert str(lock) not in _open_files(pid), pid


async def test_ctrl_c_reaches_routerd_alone_and_the_drain_keeps_its_redis(
        routerd_process: RouterdFactory, routerd_config: Callable[..., dict[str, Any]],
        sim_process: SimProcessFactory) -> None:
    """SIGINT to routerd's whole process group, as a terminal sends Ctrl-C: the embedded Redis is not
    signalled (it used to exit at the start of the drain and be restarted), the queue jobs in flight
    get their results, and each child is stopped by routerd after the drain."""
    rp = await _daemon(routerd_process, routerd_config, sim_process, own_group=True, itl_ms=100.0)
    kids = _supervised(rp)
    groups = {name: os.getpgid(pid) for name, pid in kids.items()}
    url = embedded_url(Path(rp.config["daemon"]["state_dir"]) / "redis")
    assert url is not None
    async with QueueClient.from_url(url) as q:
        jobs = await q.submit_many([{"model": "m", "prompt": "drain me", "max_tokens": 20}] * 3)
        assert await _until_running(q, jobs)
        waits = [asyncio.ensure_future(q.wait(job, timeout=60)) for job in jobs]
        os.killpg(rp.proc.pid, signal.SIGINT)
        results = await asyncio.gather(*waits)
    assert [r.status for r in results] == ["ok"] * 3
    assert await asyncio.to_thread(rp.wait_exit, 60) == 0
    log = rp.log()
    assert not _events(rp, "embedded_redis_exited"), log
    assert [e["pid"] for e in _events(rp, "embedded_redis_started")] == [kids["redis"]]
    assert [e["pid"] for e in _events(rp, "embedded_redis_stopped")] == [kids["redis"]]
    assert "KeyboardInterrupt" not in rp.log_path.read_text(), log  # the keying process was not hit
    names = [json.loads(line).get("event") for line in rp.log_path.read_text().splitlines()
             if line.startswith("{")]
    assert names.index("drain_finished") < names.index("embedded_redis_stopped")
    assert await eventually(lambda: not any(_alive(pid) for pid in kids.values()), 30)
    assert rp.proc.pid not in groups.values(), groups  # out of the group the terminal signals


async def _until_running(q: QueueClient, jobs: list[Any]) -> bool:
    async def running() -> bool:
        return [(await q.status(job)).state for job in jobs] == ["running"] * len(jobs)

    for _ in range(300):
        if await running():
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_sigkilled_daemon_leaves_no_child_and_no_lock(
        routerd_process: RouterdFactory, routerd_config: Callable[..., dict[str, Any]],
        sim_process: SimProcessFactory) -> None:
    """Each child is out of routerd's process group, and still dies with it (``PR_SET_PDEATHSIG``); the
    state dir is free for the next routerd at once (the kernel drops the lock with its holder)."""
    rp = await _daemon(routerd_process, routerd_config, sim_process)
    kids = _supervised(rp)
    rp.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(rp.wait_exit, 10)
    assert await eventually(lambda: not any(_alive(pid) for pid in kids.values()), 30), \
        {name: _alive(pid) for name, pid in kids.items()}
    again = await asyncio.to_thread(routerd_process, rp.config)
    async with aiohttp.ClientSession() as s:
        await wait_ready(s, again.url)
    assert await _completion(again.url) == 200
