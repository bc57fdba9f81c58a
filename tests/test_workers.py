"""``[daemon] workers``: one daemon, N worker processes on its listening socket (routerd/workers.py).

Real ``routerd run`` processes, real redis-server, simulated engines as processes. Two daemons in all
(each start costs a few seconds): a socket-activated one (embedded Redis) shows both workers serving, a
reload reaching both, READY waiting for both and a stalled worker replaced; one on a test Redis shows
a SIGKILLed worker's pending queue jobs reclaimed by its replacement and run to one result each, then
SIGTERM draining both workers' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from routerd import config as config_mod
from routerd._net import free_port
from routerd.client import QueueClient
from routerd.workers import WorkerSpec, worker_consumer
from routerd_bench.restart import SocketHolder, child_env
from tests.fixtures.daemon import RouterdFactory, RouterdProcess, base_config, open_stream, to_toml
from tests.fixtures.helpers import eventually
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory

pytestmark = pytest.mark.timeout(150)


def test_workers_config_needs_redis_and_auto_is_the_usable_cores() -> None:
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.parse({"daemon": {"workers": 2}, "redis": {"enabled": False}}, {})
    assert e.value.problems[0].startswith("$.daemon.workers: more than one worker needs Redis")
    with pytest.raises(config_mod.ConfigError, match=r"\$.daemon.workers"):
        config_mod.parse({"daemon": {"workers": 0}}, {})
    cfg = config_mod.parse({}, {"ROUTERD_DAEMON_WORKERS": "auto"})
    assert config_mod.worker_count(cfg) == len(os.sched_getaffinity(0))
    assert config_mod.worker_count(config_mod.parse({}, {})) == 1  # the default: one process
    spec = WorkerSpec(3, 2, 9, (3, 4), 4242)
    assert WorkerSpec.parse(spec.arg()) == spec
    assert worker_consumer("host-a", 3) == "host-a-w3"


# -- helpers -----------------------------------------------------------------------------------------

def _log_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _worker_pids(log_path: Path) -> dict[int, int]:
    """Each worker index → the pid of its latest start (the parent's ``worker_started`` lines)."""
    pids: dict[int, int] = {}
    for line in _log_lines(log_path):
        if line.get("event") == "worker_started" and "worker" in line:
            pids[int(line["worker"])] = int(line["pid"])
    return pids


def _stalled(log_path: Path) -> list[int]:
    """The workers the daemon judged stalled (and killed), in order."""
    return [int(line["worker"]) for line in _log_lines(log_path) if line.get("event") == "worker_stalled"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _who_answers(url: str, n: int, *, headers: dict[str, str] | None = None) -> dict[str, int]:
    """``n`` requests, each on a new connection: answers counted by status and worker."""
    seen: dict[str, int] = {}
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def one() -> None:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            async with s.post(f"{url}/v1/completions", json=body, headers=headers or {},
                              timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
                key = f"{r.status}:w{r.headers.get('X-Routerd-Worker', '?')}"
                seen[key] = seen.get(key, 0) + 1

        await asyncio.gather(*(one() for _ in range(n)))
    return seen


class _Notify:
    """A NOTIFY_SOCKET of our own: systemd's part for a daemon started without the fixture."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def read(self) -> list[str]:
        while True:
            try:
                self.messages += self.sock.recv(65536).decode().split("\n")
            except BlockingIOError:
                return self.messages


# -- a socket-activated daemon with two workers --------------------------------------------------------

@pytest.fixture
def holder() -> Iterator[SocketHolder]:
    h = SocketHolder()
    yield h
    h.close()


async def test_socket_activated_workers_both_serve_reload_and_a_stalled_one_is_replaced(
        sim_process: SimProcessFactory, holder: SocketHolder, tmp_path: Path) -> None:
    """systemd's socket, two workers, embedded Redis: READY=1 only once both workers are ready; requests
    on many connections reach both (each answer names its worker); SIGHUP reaches both (an API key
    added is asked for by each); a worker whose loop stalls (SIGSTOP) is killed and started again under
    the same index, counted in ``routerd_workers_restarts_total``, and the other serves meanwhile;
    ``/metrics`` from either worker is both workers' page, each sample labelled with its worker; the daemon
    SIGKILLed, its workers drain and exit."""
    sim = await sim_process(model="m", ttft_ms=2, itl_ms=2)
    cfg = base_config(tmp_path, http={"port": free_port()},  # not where it serves: systemd's socket is
                      daemon={"workers": 2, "worker_watchdog_s": 1.5},
                      redis={"enabled": True, "url": "embedded", "consumer": "t"},
                      fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}])
    del cfg["control"]  # no secret configured: the workers trust the daemon by its <state_dir>/secret
    path = tmp_path / "routerd.toml"
    path.write_text(to_toml(cfg))
    notify = _Notify(tmp_path / "notify.sock")
    log_path = tmp_path / "routerd.log"
    with log_path.open("wb") as out:
        proc = holder.spawn([sys.executable, "-m", "routerd", "run", "--config", str(path),
                             "--log-format", "json"],
                            env=child_env(NOTIFY_SOCKET=str(notify.path)), log=out)
    try:
        assert await eventually(lambda: "READY=1" in notify.read() or proc.poll() is not None, 90, 0.1), \
            log_path.read_text()[-4000:]
        assert proc.poll() is None, log_path.read_text()[-4000:]
        ready_at = [i for i, line in enumerate(_log_lines(log_path))
                    if line.get("event") == "routerd_ready" and "worker" not in line]
        worker_ready = [i for i, line in enumerate(_log_lines(log_path))
                        if line.get("event") == "worker_ready"]
        assert len(worker_ready) == 2
        assert max(worker_ready) < ready_at[0]
        listening = [line for line in _log_lines(log_path) if line.get("event") == "http_listening"]
        assert {line["worker"] for line in listening} == {0, 1}
        assert all(line["url"] == holder.url for line in listening)

        # The kernel spreads the connections over both: whichever worker waits in accept() takes the
        # next, so a busy machine can leave one worker unscheduled through a whole sample; samples are
        # taken until one reaches both (bounded), every answer a 200 from a worker.
        seen: dict[str, int] = {}
        for _ in range(20):
            sample = await _who_answers(holder.url, 30)
            assert set(sample) <= {"200:w0", "200:w1"}, sample
            for k, n in sample.items():
                seen[k] = seen.get(k, 0) + n
            if set(seen) == {"200:w0", "200:w1"}:
                break
            await asyncio.sleep(0.2)
        assert set(seen) == {"200:w0", "200:w1"}, seen

        cfg["http"]["api_keys"] = ["sk-workers-test"]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(to_toml(cfg))
        tmp.replace(path)
        proc.send_signal(signal.SIGHUP)

        async def both_refuse() -> bool:
            return set(await _who_answers(holder.url, 24)) == {"401:w0", "401:w1"}

        for _ in range(100):  # a sample that reaches both workers, each refusing the keyless request
            if await both_refuse():
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("after SIGHUP, no sample of connections found both workers refusing a keyless call")
        key = {"Authorization": "Bearer sk-workers-test"}

        stalled = _worker_pids(log_path)[1]
        os.kill(stalled, signal.SIGSTOP)
        assert await eventually(lambda: _worker_pids(log_path)[1] != stalled, 30, 0.1), \
            log_path.read_text()[-4000:]
        assert not _alive(stalled)  # killed and reaped by the daemon
        assert any(line.get("event") == "worker_stalled" and line.get("worker") == 1
                   for line in _log_lines(log_path))
        while set(await _who_answers(holder.url, 24, headers=key)) != {"200:w0", "200:w1"}:
            assert proc.poll() is None
            await asyncio.sleep(0.2)  # the replacement serves again once it is up
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for _ in range(10):  # whichever worker answers gives both pages, each sample named by worker
                async with s.get(f"{holder.url}/metrics") as r:
                    assert r.status == 200
                    text = await r.text()
                assert 'routerd_workers_restarts_total{worker="1"} 1.0' in text, text[-3000:]
                assert 'routerd_workers_restarts_total{worker="0"} 0.0' in text
                assert "routerd_workers_pages_missing 0.0" in text
                served = {w: bool(re.search(r'routerd_requests_total\{[^}]*code="200"[^}]*worker="' + w + '"',
                                            text)) for w in "01"}
                assert served == {"0": True, "1": True}, text[-3000:]

        workers = list(_worker_pids(log_path).values())
        proc.kill()  # the daemon SIGKILLed: its workers drain and exit rather than serve on, orphaned
        await asyncio.to_thread(proc.wait, 10)
        assert await eventually(lambda: not any(_alive(pid) for pid in workers), 30, 0.1), \
            log_path.read_text()[-4000:]
        gone = [line for line in _log_lines(log_path) if line.get("event") == "routerd_stopped"]
        assert {line.get("worker") for line in gone} == {0, 1}  # each drained and stopped itself
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)
        notify.sock.close()


# -- the queue across a worker's death, and the drain ---------------------------------------------------

async def _stream(url: str, into: dict[str, Any]) -> None:
    """One streamed completion on a connection of its own: its worker, events and whether it ended."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        body = {"model": "m", "prompt": "hello there", "max_tokens": 80, "stream": True}
        async with s.post(f"{url}/v1/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=60)) as r:
            into["worker"] = r.headers.get("X-Routerd-Worker")
            into["status"] = r.status
            events: list[bytes] = []
            into["events"] = events
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line.strip())


async def test_a_killed_worker_reclaims_its_own_jobs_and_sigterm_drains_every_worker(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: SimProcessFactory,
        redis_server: RedisServer) -> None:
    """Queue jobs in flight on a worker when it is SIGKILLed: its replacement, consuming under the same
    name (``t-w<i>``), finds them pending and runs them (or the other worker does once the victim's
    name lapsed; the idle-claim is far off) — and every job ends with one ``ok`` result, the engine
    completing each exactly once. Then streams open on both workers at SIGTERM finish whole, and the
    daemon exits 0 once both drained."""
    sim = await sim_process(model="m", ttft_ms=5, itl_ms=20, max_num_seqs=64)
    cfg = routerd_config(daemon={"workers": 2, "drain_timeout_s": 20.0},
                         redis={"enabled": True, "url": redis_server.url, "consumer": "t",
                                "reclaim_idle_ms": 600_000},
                         fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}])
    rp = routerd_process(cfg)
    client = QueueClient.from_url(redis_server.url)
    redis = aioredis.Redis.from_url(redis_server.url)
    try:
        bodies = [{"model": "m", "prompt": f"job {i}", "max_tokens": 100} for i in range(24)]
        jobs = await client.submit_many(bodies)

        async def pending(consumer: str) -> int:
            rows = await redis.xpending_range("routerd:requests", "routerd", min="-", max="+", count=100,
                                              consumername=consumer)
            return len(rows)

        held, index = 0, 0
        for _ in range(200):  # whichever worker read them first (one read takes up to read_batch)
            counts = [await pending("t-w0"), await pending("t-w1")]
            held, index = max(counts), counts.index(max(counts))
            if held >= 2:
                break
            await asyncio.sleep(0.05)
        assert held >= 2, rp.log()
        victim = _worker_pids(rp.log_path)[index]
        os.kill(victim, signal.SIGKILL)
        assert await eventually(lambda: _worker_pids(rp.log_path)[index] != victim, 30, 0.1), rp.log()

        results = await client.wait_many(jobs, timeout=45)
        assert {r.status for r in results.values()} == {"ok"}, [r.error for r in results.values()]
        assert len(results) == len(jobs)
        assert await pending("t-w0") == 0
        assert await pending("t-w1") == 0
        assert await redis.xlen("routerd:dead") == 0
        # By the victim's replacement (its own name's jobs), or — if it took longer to start than the
        # victim's name lives (a loaded host) — by the other worker once that name lapsed; never by an
        # idle claim (how=reclaimed), which is far off.
        ways = {(index, "recovered"), (1 - index, "taken_over")}
        reclaimed = [line for line in _log_lines(rp.log_path) if line.get("event") == "queue_job_reclaimed"
                     and (line.get("worker"), line.get("how")) in ways]
        assert len(reclaimed) >= held, rp.log()
        stats = await sim.stats()
        assert stats["completed"] == len(jobs), stats  # each job completed once; the cut ones aborted

        await _drain_streams(rp)
    finally:
        await client.aclose()
        await redis.aclose()


async def test_a_daemon_started_again_at_once_runs_none_of_its_orphans_jobs_again(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: SimProcessFactory,
        redis_server: RedisServer) -> None:
    """A workers daemon SIGKILLed under queue load and started again at once on the same config: its
    orphaned workers drain the jobs they hold under ``t-w0``/``t-w1`` while the new workers, under the
    same names, read nothing until each orphan let go. The orphans drain whole (the parent's death
    signal coming again is no second stop). Every job ends with one ``ok`` result, and the engine ran
    each exactly once."""
    # A second a job at full speed; slowed 100 times from the start, so that the jobs the first daemon's
    # workers read are still running when it is killed and their orphans' drain outlasts the new daemon's
    # start-up, however loaded the machine; at full speed again once the newcomers met their orphans.
    sim = await sim_process(model="m", ttft_ms=5, itl_ms=8, max_num_seqs=64)
    await sim.set_faults(slow_factor=100.0)
    # A starved machine's late scrapes and heartbeats must not end jobs (each retry a run more): only a
    # second run by the newcomers is counted here.
    cfg = routerd_config(daemon={"workers": 2, "drain_timeout_s": 90.0},
                         routing={"scrape_interval_s": 0.5, "stale_after_s": 60.0, "scrape_timeout_s": 10.0},
                         health={"heartbeat_timeout_s": 30.0, "failure_threshold": 10,
                                 "progress_timeout_s": 120.0},
                         redis={"enabled": True, "url": redis_server.url, "consumer": "t",
                                "reclaim_idle_ms": 600_000, "read_batch": 16},
                         fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url],
                                  "max_num_seqs": 32}])  # each worker holds a part: both hold some
    first = routerd_process(cfg)
    client = QueueClient.from_url(redis_server.url)
    redis = aioredis.Redis.from_url(redis_server.url)
    try:
        jobs = await client.submit_many([{"model": "m", "prompt": f"job {i}", "max_tokens": 125}
                                         for i in range(96)])

        async def holding() -> set[int]:
            """The workers holding jobs (whichever read them)."""
            return {i for i in (0, 1) if len(await redis.xpending_range(
                "routerd:requests", "routerd", min="-", max="+", count=10, consumername=f"t-w{i}")) >= 3}

        for _ in range(600):
            if held := await holding():
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(first.log())
        orphans = _worker_pids(first.log_path)
        first.proc.kill()
        await asyncio.to_thread(first.proc.wait, 10)
        for pid in orphans.values():  # the parent's death signal again, as Linux may send it (once per
            with contextlib.suppress(ProcessLookupError):  # reparenting): not a second stop to them
                os.kill(pid, signal.SIGTERM)
        second = routerd_process(cfg)  # at once, while the orphans drain

        def met() -> set[int]:
            """The new workers that found their name held by its orphan, or (as before) ran its jobs."""
            return {int(line["worker"]) for line in _log_lines(second.log_path)
                    if line.get("event") in ("queue_consumer_name_busy", "queue_job_reclaimed")}

        assert await eventually(lambda: met() >= held, 120, 0.1), second.log()
        await sim.clear_faults()

        results = await client.wait_many(jobs, timeout=90)
        assert {r.status for r in results.values()} == {"ok"}, [r.error for r in results.values()]
        assert len(results) == len(jobs)
        stats = await sim.stats()
        assert (stats["completed"], stats["aborted"]) == (len(jobs), 0), stats  # each job ran once
        waited = {line.get("worker") for line in _log_lines(second.log_path)
                  if line.get("event") == "queue_consumer_name_busy"}
        assert waited >= held, second.log()  # each new worker waited for its orphan
        assert not [line for line in _log_lines(first.log_path) if line.get("event") == "drain_interrupted"]
        assert await eventually(lambda: not any(_alive(pid) for pid in orphans.values()), 60, 0.1)
        for i in (0, 1):
            assert await redis.xpending_range("routerd:requests", "routerd", min="-", max="+", count=10,
                                              consumername=f"t-w{i}") == []
    finally:
        await client.aclose()
        await redis.aclose()


async def _drain_streams(rp: RouterdProcess) -> None:
    streams: list[dict[str, Any]] = []
    tasks: list[asyncio.Task[None]] = []
    for _ in range(40):  # until both workers hold a stream (the kernel picks the worker per connection)
        into: dict[str, Any] = {}
        streams.append(into)
        tasks.append(asyncio.create_task(_stream(rp.url, into)))
        await asyncio.sleep(0.05)
        if {s.get("worker") for s in streams if s.get("events")} >= {"0", "1"}:
            break
    assert {s.get("worker") for s in streams if s.get("events")} >= {"0", "1"}, streams
    workers = _worker_pids(rp.log_path)
    rp.signal(signal.SIGTERM)
    rp.wait_notify("STOPPING=1", timeout=10)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(s["status"] == 200 and s["events"][-1] == b"data: [DONE]" for s in streams), \
        [s.get("events", [])[-2:] for s in streams]
    assert all(b'"error"' not in e for s in streams for e in s["events"])
    assert await asyncio.to_thread(rp.wait_exit, 60) == 0, rp.log()
    assert not any(_alive(pid) for pid in workers.values())
    drained = [line for line in _log_lines(rp.log_path) if line.get("event") == "drain_finished"]
    assert {line.get("worker") for line in drained} == {0, 1, None}, drained


# -- a stall of the daemon itself -------------------------------------------------------------------------

async def test_a_stall_of_the_daemon_itself_kills_no_worker_and_a_stalled_worker_still_is(
        routerd_process: RouterdFactory, routerd_config: Any, sim_process: SimProcessFactory,
        redis_server: RedisServer) -> None:
    """The daemon's own loop held up for 1.5 × ``worker_watchdog_s`` (SIGSTOP, as a loaded host or a long
    pause does) — first alone, its workers pinging on into their pairs; then frozen with its workers (a
    frozen cgroup, a paused VM), waking before them. Neither time is a worker judged by what the daemon
    could not hear: both keep their pids, and a stream in flight through one ends with ``[DONE]``. A
    worker that then stalls for real is still killed and started again."""
    watchdog_s = 2.0
    sim = await sim_process(model="m", ttft_ms=5, itl_ms=100)  # few chunks: a loaded machine keeps pace
    cfg = routerd_config(daemon={"workers": 2, "worker_watchdog_s": watchdog_s},
                         redis={"enabled": True, "url": redis_server.url, "consumer": "t"},
                         fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}])
    rp = routerd_process(cfg)
    daemon = rp.proc.pid
    workers = _worker_pids(rp.log_path)
    assert len(workers) == 2, rp.log()
    async with aiohttp.ClientSession() as s:
        stream = await open_stream(s, rp.url, "m", max_tokens=100)  # 10 s at the least: through the stalls
        os.kill(daemon, signal.SIGSTOP)  # the daemon alone: its workers' pings wait on the pairs
        await asyncio.sleep(1.5 * watchdog_s)
        os.kill(daemon, signal.SIGCONT)
        await asyncio.sleep(watchdog_s)  # a stall misread as the workers' is punished on the first pass
        assert _stalled(rp.log_path) == [], rp.log()
        for pid in (daemon, *workers.values()):  # all frozen: no worker pings meanwhile
            os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(1.5 * watchdog_s)
        os.kill(daemon, signal.SIGCONT)  # the daemon wakes first, its workers a little later
        await asyncio.sleep(0.25)
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):  # (killed meanwhile: the assertion says so)
                os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(watchdog_s)
        assert _stalled(rp.log_path) == [], rp.log()
        assert _worker_pids(rp.log_path) == workers
        assert all(_alive(pid) for pid in workers.values())
        events = await stream.finish(60)
        assert events[-1] == b"data: [DONE]", events[-3:]
        assert all(b'"error"' not in e for e in events), ([e for e in events if b'"error"' in e], rp.log())

    os.kill(workers[0], signal.SIGSTOP)  # a real stall after the daemon's own: still caught
    assert await eventually(lambda: _worker_pids(rp.log_path)[0] != workers[0], 30, 0.1), rp.log()
    assert await eventually(lambda: not _alive(workers[0]), 10, 0.1)
    assert _stalled(rp.log_path) == [0]


# -- the pieces, in-process --------------------------------------------------------------------------

async def test_a_workers_page_has_its_siblings_and_counts_the_one_that_did_not_answer(tmp_path: Path) -> None:
    """Two of three workers up: the page each gives holds both (a family once, each sample labelled with
    its worker), and the third is counted missing rather than holding the scrape."""
    from routerd.ingress.worker_pages import WorkerPages

    def page(i: int) -> Callable[[], bytes]:
        return lambda: (b"# HELP routerd_requests_total Requests\n# TYPE routerd_requests_total counter\n"
                        b'routerd_requests_total{code="200"} %d\n' % (10 + i))

    async with WorkerPages(0, 3, tmp_path, page(0)) as w0, WorkerPages(1, 3, tmp_path, page(1)) as w1:
        for pages in (w0, w1):
            text = (await pages.page()).decode()
            assert text.count("# TYPE routerd_requests_total counter") == 1
            assert 'routerd_requests_total{code="200",worker="0"} 10.0' in text
            assert 'routerd_requests_total{code="200",worker="1"} 11.0' in text
            assert "routerd_workers_pages_missing 1.0" in text
    assert not await asyncio.to_thread(lambda: list(tmp_path.glob("w*.sock")))  # each removed its own


def test_bind_sockets_listens_on_one_port_for_every_address() -> None:
    from routerd.ingress.listener import bind_sockets

    sockets = bind_sockets("localhost", 0)
    try:
        ports = {s.getsockname()[1] for s in sockets}
        assert len(ports) == 1
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) for s in sockets)
        with socket.create_connection(("localhost", ports.pop()), timeout=2):
            pass  # the kernel accepts into the backlog: inherited by the workers, served by them
    finally:
        for s in sockets:
            s.close()
