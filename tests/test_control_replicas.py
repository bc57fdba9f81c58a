"""Several routerd (real ``routerd run`` processes) on one Redis and one Ray cluster: exactly one controls
the fleets. Started at the same moment, both come up and nobody removes the other's placement groups;
an engine SIGKILLed is restarted once, not fought over; the controller SIGKILLed — together with an
engine — is replaced within the lease, which adopts the engines (none relaunched) and restarts the dead
one exactly once; a partitioned controller stops controlling before the other starts."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from routerd.client import QueueClient
from routerd.fleet.actor import group_members
from routerd_bench._common import SHARED_SECRET
from routerd_bench.scale_replicas import fleets_view, log_events
from tests.fixtures.daemon import RouterdFactory, RouterdProcess
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.redis_server import RedisServer
from tests.test_control_lease import PausableProxy

LEASE_S = 1.5


def events(rp: RouterdProcess, name: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``rp`` whose event is ``name``."""
    return log_events(rp.log_path, name)


def events_since(rp: RouterdProcess, name: str, since: float) -> list[dict[str, Any]]:
    """:func:`events` logged at or after the wall-clock time ``since`` (a replica's start-up term, if it had
    one, is not what happened after a kill)."""
    return [e for e in events(rp, name)
            if datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp() >= since]


async def logged_since(rp: RouterdProcess, name: str, since: float, timeout: float = 60.0) -> dict[str, Any]:
    """The first ``name`` event ``rp`` logs at or after ``since``, waited for."""
    assert await eventually(lambda: bool(events_since(rp, name, since)), timeout, step=0.2), rp.log()
    return events_since(rp, name, since)[0]


def launches(*rps: RouterdProcess) -> Counter[str]:
    """Engines started or restarted, per instance, by all of ``rps`` together."""
    return Counter(e["instance"] for rp in rps for name in ("engine_started", "engine_restarted")
                   for e in events(rp, name))


async def status(s: aiohttp.ClientSession, rp: RouterdProcess) -> dict[str, Any]:
    return await fleets_view(s, rp.url)  # what the replicas benchmark reads, too


async def poll(s: aiohttp.ClientSession, rp: RouterdProcess, cond: Any, what: str,
               timeout: float = 60.0) -> dict[str, Any]:
    """``/admin/fleets`` of ``rp`` once ``cond(it)`` holds."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            last = await status(s, rp)
            if cond(last):
                return last
        except (aiohttp.ClientError, TimeoutError, KeyError) as e:
            last = repr(e)
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {last}\n{rp.log()}")


async def metric(s: aiohttp.ClientSession, rp: RouterdProcess, name: str) -> float:
    """One unlabelled sample of ``rp``'s ``/metrics``."""
    async with s.get(f"{rp.url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def ready(fleet: str, n: int) -> Any:
    def ok(st: dict[str, Any]) -> bool:
        insts = st["fleets"][fleet]["instances"]
        return len(insts) == n and all(i["state"] == "ready" for i in insts)
    return ok


async def settled(s: aiohttp.ClientSession, procs: list[RouterdProcess], fleet: str,
                  n: int) -> tuple[RouterdProcess, RouterdProcess, dict[str, Any]]:
    """(controller, follower, the controller's ``/admin/fleets``) once start-up is over: one controls,
    the other names it, and it has ``n`` ready engines of ``fleet``. Who controls is read then, not from
    the first answer: on a loaded machine a start-up term can lapse (the process busy building itself
    for longer than the 1.5 s lease) and the other replica take control and launch in its place."""
    end = time.monotonic() + 120.0
    last: Any = None
    while time.monotonic() < end:
        try:
            sts = [await status(s, rp) for rp in procs]
        except (aiohttp.ClientError, TimeoutError) as e:
            last = repr(e)
        else:
            last = [st["control"] for st in sts]
            on = [i for i, st in enumerate(sts) if st["control"]["controls"]]
            if len(on) == 1:
                c, f = on[0], 1 - on[0]
                named = sts[f]["control"]["controller"]
                agreed = named is not None and named["ident"] == sts[c]["control"]["this"]
                if agreed and ready(fleet, n)(sts[c]):
                    return procs[c], procs[f], sts[c]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no settled controller with {n} ready engines of {fleet}: {last}")


def pids(st: dict[str, Any], fleet: str) -> dict[str, int]:
    return {i["id"]: int(i["pid"]) for i in st["fleets"][fleet]["instances"]}


def replica_cfg(routerd_config: Any, tmp_path: Path, name: str, redis_url: str,
                stop_engines: bool = False, **extra: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = routerd_config(
        daemon={"state_dir": str(tmp_path / name), "stop_engines_on_exit": stop_engines},
        redis={"enabled": True, "url": redis_url, "consumer": name, "block_ms": 200},
        # One secret for every replica, as the README asks of replicas with state dirs of their own:
        # the engines' API key is derived from it.
        control={"lease_s": LEASE_S, "secret": SHARED_SECRET}, **extra)
    return cfg


@pytest.mark.ray
@pytest.mark.timeout(240)
async def test_two_replicas_one_controller_failover_adopts_and_restarts_once(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    fleet = {"name": "c", "model": "m", "engine": "sim", "replicas": 2, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 8, "ttft-ms": 5, "itl-ms": 3}}
    extra: dict[str, Any] = {
        "ray": {"address": ray_cluster.address, "namespace": f"ctl-{uuid.uuid4().hex[:8]}"},
        "health": {"restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 2.0}, "fleets": [fleet]}
    # stop_engines_on_exit: the engines go with the last routerd (a SIGKILLed one stops nothing).
    cfgs = [replica_cfg(routerd_config, tmp_path, name, redis_server.url, stop_engines=True, **extra)
            for name in ("ra", "rb")]

    # Started at the same moment: both come up, exactly one controls.
    procs = [routerd_process(cfg, wait_ready=False) for cfg in cfgs]
    await asyncio.gather(*(asyncio.to_thread(rp.wait_notify, "READY=1", 120) for rp in procs))
    async with aiohttp.ClientSession() as s:
        ctl, fol, st = await settled(s, procs, "c", 2)
        before = pids(st, "c")
        assert launches(ctl, fol) == {"c:0": 1, "c:1": 1}  # each engine launched once, by one of them
        for rp in procs:  # the loser removed none of the winner's new placement groups as strays
            assert events(rp, "stray_placement_group_removed") == []
            assert events(rp, "adopt_unwanted_stopping") == []
        # The follower follows the controller's fleet state, and its admin calls are the controller's.
        await poll(s, fol, lambda st: ready("c", 2)(st) and pids(st, "c") == before, "the follower following")
        async with s.post(f"{fol.url}/admin/instances/c:0/restart") as r:
            assert r.status == 200, await r.text()
        st = await poll(s, ctl, lambda st: ready("c", 2)(st) and pids(st, "c")["c:0"] != before["c:0"],
                        "c:0 restarted by the controller")
        assert launches(ctl, fol) == {"c:0": 2, "c:1": 1}
        assert Counter(e["instance"] for e in events(fol, "engine_restarted")) == Counter()
        before = pids(st, "c")

        # One engine SIGKILLed with both running: restarted exactly once (they used to fight over it).
        os.kill(before["c:0"], signal.SIGKILL)
        st = await poll(s, ctl, lambda st: ready("c", 2)(st) and pids(st, "c")["c:0"] != before["c:0"],
                        "c:0 restarted")
        await asyncio.sleep(LEASE_S)  # a fight would show as more restarts within this window
        assert launches(ctl, fol) == {"c:0": 3, "c:1": 1}
        before = pids(await poll(s, ctl, ready("c", 2), "still ready"), "c")

        # The controller SIGKILLed, and an engine with it, while nobody controls.
        killed_at = time.time()
        ctl.proc.send_signal(signal.SIGKILL)
        os.kill(before["c:1"], signal.SIGKILL)
        ctl.proc.wait(10)
        await poll(s, fol, lambda st: st["control"]["controls"], "the follower taking control")
        (took,) = events_since(fol, "control_acquired", killed_at)
        assert took["at"] - killed_at <= LEASE_S + 1.0, took
        st = await poll(s, fol, lambda st: ready("c", 2)(st) and pids(st, "c")["c:1"] != before["c:1"],
                        "the engines adopted, c:1 restarted")
        assert pids(st, "c")["c:0"] == before["c:0"]  # adopted, not relaunched
        started = Counter(e["instance"] for e in events_since(fol, "engine_started", killed_at))
        assert started == Counter()  # the new controller launched no engine
        await asyncio.sleep(LEASE_S)
        assert Counter(e["instance"] for e in events_since(fol, "engine_restarted", killed_at)) == {"c:1": 1}
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        async with s.post(f"{fol.url}/v1/completions", json=body) as r:
            assert r.status == 200
        assert events(fol, "fleet_control_started")[-1]["adopted"] == 2

    fol.signal(signal.SIGTERM)
    assert await asyncio.to_thread(fol.wait_exit, 90) == 0, fol.log()
    for pid in pids(st, "c").values():  # stopped by the controller on its way out
        assert await eventually(lambda pid=pid: not group_members(pid), 15)


@pytest.mark.timeout(90)
async def test_a_partitioned_controller_stops_before_the_other_starts(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        tmp_path: Path) -> None:
    async with PausableProxy(redis_server.port) as proxy, aiohttp.ClientSession() as s:
        a = await asyncio.to_thread(routerd_process, replica_cfg(routerd_config, tmp_path, "pa", proxy.url))
        await poll(s, a, lambda st: st["control"]["controls"], "a controlling")
        b = await asyncio.to_thread(routerd_process,
                                    replica_cfg(routerd_config, tmp_path, "pb", redis_server.url))
        await poll(s, b, lambda st: st["control"]["controller"] is not None, "b seeing a")
        assert await metric(s, a, "routerd_control_is_controller") == 1
        assert await metric(s, b, "routerd_control_is_controller") == 0
        proxy.open.clear()  # a's connections to Redis blocked, b's not
        paused = time.time()
        await poll(s, b, lambda st: st["control"]["controls"], "b taking control", timeout=20)
        stopped = events(a, "control_stopped")[0]
        (took,) = events(b, "control_acquired")
        assert stopped["at"] < took["at"], (stopped, took)
        assert stopped["at"] - paused <= LEASE_S
        st = await status(s, a)
        assert st["control"]["controls"] is False
        assert await metric(s, a, "routerd_control_is_controller") == 0
        assert await metric(s, a, "routerd_control_losses_total") == 1
        assert await metric(s, b, "routerd_control_is_controller") == 1
        assert await metric(s, b, "routerd_control_acquisitions_total") == 1
        assert await metric(s, b, "routerd_control_token") > await metric(s, a, "routerd_control_token")
        proxy.open.set()


class Load:
    """HTTP requests (streamed and not) on one replica and queue jobs for every replica, sent without a
    pause until :meth:`stop`: what each ended with, to count what failed."""

    def __init__(self, url: str, client: QueueClient, *, http_clients: int = 4,
                 submit_every_s: float = 0.03) -> None:
        self.url, self.client = url, client
        self.http: list[tuple[int, str]] = []  # (status, what went wrong: "" when nothing)
        self.jobs: list[str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._requests(i % 2 == 0)) for i in range(http_clients)]
        self._tasks.append(asyncio.create_task(self._submit(submit_every_s)))

    async def _requests(self, stream: bool) -> None:
        body = {"model": "m", "prompt": "hello there", "max_tokens": 12, "stream": stream}
        async with aiohttp.ClientSession() as s:
            while not self._stop.is_set():
                try:
                    async with s.post(f"{self.url}/v1/completions", json=body,
                                      timeout=aiohttp.ClientTimeout(total=30)) as r:
                        text = await r.text()
                    wrong = "" if r.status == 200 else text[:300]
                    if stream and not wrong and ('"error"' in text or not text.rstrip().endswith("[DONE]")):
                        wrong = text[-300:]
                    self.http.append((r.status, wrong))
                except (aiohttp.ClientError, TimeoutError) as e:
                    self.http.append((0, repr(e)))

    async def _submit(self, every_s: float) -> None:
        i = 0
        while not self._stop.is_set():
            job = await self.client.submit({"model": "m", "prompt": f"job {i}", "max_tokens": 20})
            self.jobs.append(job.id)
            i += 1
            await asyncio.sleep(every_s)

    def failed(self) -> list[tuple[int, str]]:
        return [h for h in self.http if h[0] != 200 or h[1]]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)


async def results_per_job(redis: aioredis.Redis, client: QueueClient, jobs: list[str]) -> Counter[int]:
    """How many results each job's reply stream holds, counted over the jobs (``{1: len(jobs)}``: every
    job exactly one)."""
    counts: Counter[int] = Counter()
    for job in jobs:
        entries = await redis.xrange(client.keys.reply(job))
        counts[sum(1 for _, fields in entries if b"result" in fields)] += 1
    return counts


@pytest.mark.ray
@pytest.mark.timeout(180)
async def test_the_controller_killed_under_load_no_request_fails_and_no_job_is_lost_or_doubled(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    """Streams and plain requests on the follower and queue jobs for both while the controller is
    SIGKILLed: the follower controls within the lease + 1 s and adopts the engines (same PIDs, none
    launched); none of its requests fails; the jobs the dead one held are reclaimed by the survivor
    (``reclaim_idle_ms`` short here) and every job ends with exactly one result."""
    fleet = {"name": "u", "model": "m", "engine": "sim", "replicas": 2, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 32, "ttft-ms": 5, "itl-ms": 10}}
    extra: dict[str, Any] = {
        "ray": {"address": ray_cluster.address, "namespace": f"load-{uuid.uuid4().hex[:8]}"},
        "fleets": [fleet]}
    cfgs = []
    for name in ("la", "lb"):
        cfg = replica_cfg(routerd_config, tmp_path, name, redis_server.url, stop_engines=True, **extra)
        cfg["redis"].update(reclaim_idle_ms=2000, reclaim_interval_s=0.3)
        cfgs.append(cfg)
    procs = [routerd_process(cfg, wait_ready=False) for cfg in cfgs]
    await asyncio.gather(*(asyncio.to_thread(rp.wait_notify, "READY=1", 120) for rp in procs))
    client = QueueClient.from_url(redis_server.url)
    redis = aioredis.Redis.from_url(redis_server.url)
    try:
        async with aiohttp.ClientSession() as s:
            ctl, fol, st = await settled(s, procs, "u", 2)
            before = pids(st, "u")
            await poll(s, fol, lambda st: ready("u", 2)(st) and pids(st, "u") == before, "the follower")

            load = Load(fol.url, client)
            held, consumer = 0, ctl.config["redis"]["consumer"]
            for _ in range(200):  # until the controller has queue jobs of its own running
                held = len(await redis.xpending_range("routerd:requests", "routerd", min="-", max="+",
                                                      count=100, consumername=consumer))
                if held >= 2:
                    break
                await asyncio.sleep(0.05)
            assert held >= 2, ctl.log()
            served_before = len(load.http)
            killed_at = time.time()
            ctl.proc.send_signal(signal.SIGKILL)
            ctl.proc.wait(10)
            await poll(s, fol, lambda st: st["control"]["controls"], "the follower taking control")
            took_after = events_since(fol, "control_acquired", killed_at)
            assert len(took_after) == 1, (took_after, fol.log())  # none: it controlled before the kill
            (took,) = took_after
            assert took["at"] - killed_at <= LEASE_S + 1.0, took
            await asyncio.sleep(1.0)  # load after the takeover too
            await load.stop()
            assert len(load.http) > served_before, "no request was served across the takeover"
            assert load.failed() == [], load.failed()[:5]

            # Its fleet control has begun (the follower's view was ready all along: wait for the adoption
            # itself, which takes a moment after the lease on a loaded machine), and launched nothing.
            assert (await logged_since(fol, "fleet_control_started", killed_at))["adopted"] == 2
            st = await poll(s, fol, ready("u", 2), "the engines adopted")
            assert pids(st, "u") == before  # adopted: the same processes
            assert events_since(fol, "engine_started", killed_at) == []
            assert events_since(fol, "engine_restarted", killed_at) == []

        results = await client.wait_many(load.jobs, timeout=60)
        assert {r.status for r in results.values()} == {"ok"}, [r.error for r in results.values()][:5]
        assert await results_per_job(redis, client, load.jobs) == {1: len(load.jobs)}
        reclaimed = events(fol, "queue_job_reclaimed")
        assert len(reclaimed) >= held, fol.log()  # the dead one's jobs, run by the survivor
        assert await redis.xlen("routerd:dead") == 0
        for _ in range(100):  # every job acknowledged: nothing left pending for the dead consumer
            if (await redis.xpending("routerd:requests", "routerd"))["pending"] == 0:
                break
            await asyncio.sleep(0.1)
        assert (await redis.xpending("routerd:requests", "routerd"))["pending"] == 0
    finally:
        await client.aclose()
        await redis.aclose()


@pytest.mark.ray
@pytest.mark.timeout(180)
async def test_a_request_on_the_follower_wakes_a_fleet_scaled_to_zero(
        ray_cluster: RayTestCluster, redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any, tmp_path: Path) -> None:
    """Only the controller starts engines, and its autoscaler sees its own requests: a request on the
    follower for a fleet at zero used to wait out the waiting room while the fleet stayed at zero. The
    follower now has the controller wake it (the wake relay), and the request is served."""
    fleet = {"name": "z", "model": "m", "engine": "sim", "replicas": 0, "num_cpus_per_instance": 0.25,
             "engine_args": {"max-num-seqs": 4, "ttft-ms": 5, "itl-ms": 3},
             "autoscale": {"min_replicas": 0, "max_replicas": 1, "scale_down_delay_s": 600.0}}
    extra: dict[str, Any] = {
        "ray": {"address": ray_cluster.address, "namespace": f"wake-{uuid.uuid4().hex[:8]}"},
        "admission": {"waiting_room_s": 60.0}, "fleets": [fleet]}
    ctl, fol = [await asyncio.to_thread(routerd_process, replica_cfg(
        routerd_config, tmp_path, name, redis_server.url, stop_engines=True, **extra))
        for name in ("za", "zb")]
    async with aiohttp.ClientSession() as s:
        st = await poll(s, fol, lambda st: st["control"]["controller"] is not None, "a controller")
        assert st["control"]["controller"]["ident"] == "za", st["control"]
        async with s.post(f"{fol.url}/v1/completions", json={"model": "m", "prompt": "wake", "max_tokens": 3},
                          timeout=aiohttp.ClientTimeout(total=90)) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Routerd-Instance"] == "z:0"
    assert launches(ctl, fol) == {"z:0": 1}
    assert [e["replicas"] for e in events(ctl, "autoscale_decision") if e["fleet"] == "z"] == [1]
    for rp in (fol, ctl):
        rp.signal(signal.SIGTERM)
        assert await asyncio.to_thread(rp.wait_exit, 90) == 0, rp.log()
