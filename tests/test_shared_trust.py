"""Shared records are authenticated (issue 27): what anyone who can write to routerd's Redis writes by
hand — an admin call, a wake, a fleet state naming an instance URL of their choosing, a replica count —
is refused, counted and never acted on; replicas that do not hold the same secret refuse to follow each
other and say why. Real ``routerd run`` processes, a real redis-server, real sim engines.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from routerd import assembly
from routerd.config import RedisConfig
from routerd.peers.admin_relay import AdminAnswer, AdminCall, AdminRelay
from routerd.peers.fleet_state import FleetStateSync
from routerd.peers.load import LoadRecord
from routerd.peers.replicas import file_of
from routerd.peers.scrapes import ScrapeRecord
from routerd.peers.sealed import ADMIN_ANSWER, ADMIN_CALL, FLEET_STATE, Seals
from routerd.peers.sessions import SessionRecord, digest
from routerd.redis_conn import redis_client
from routerd.redis_keys import RedisKeys
from routerd.registry import Registry
from routerd.snapshot import LoadSnapshot
from routerd.status import render
from routerd.trust import Trust
from routerd_bench.scale_replicas import log_events
from tests.fixtures.daemon import RouterdFactory, RouterdProcess
from tests.fixtures.helpers import eventually
from tests.fixtures.ray_cluster import RayTestCluster
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory
from tests.test_fleet import SIM_ARGS, make_cfg
from tests.test_fleet_view import launched
from tests.test_shared_view import config as shared_view_config
from tests.test_shared_view import plane

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

KEYS = RedisKeys()  # the default stream routerd:requests: routerd:admin:calls, routerd:fleet:state, …


def replica(routerd_config: Any, tmp_path: Path, name: str, redis_url: str, urls: list[str],
            **sections: dict[str, Any]) -> dict[str, Any]:
    """One replica's config: its own state dir and consumer name; a static fleet ``f`` over ``urls``."""
    cfg: dict[str, Any] = routerd_config(
        daemon={"state_dir": str(tmp_path / name)},
        redis={"enabled": True, "url": redis_url, "consumer": name, "block_ms": 200},
        routing={"scrape_interval_s": 0.1},
        fleets=[{"name": "f", "model": "m", "engine": "static", "urls": urls}], **sections)
    return cfg


async def get(s: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with s.get(url) as r:
        return r.status, await r.json()


async def rejected(s: aiohttp.ClientSession, rp: RouterdProcess, kind: str, why: str) -> float:
    """``routerd_shared_rejected_total{kind,why}`` of ``rp`` (0 when it has no such series)."""
    async with s.get(f"{rp.url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f'routerd_shared_rejected_total{{kind="{kind}",why="{why}"}} '):
            return float(line.split()[1])
    return 0.0


async def until(cond: Any, what: str, rp: RouterdProcess, timeout: float = 30.0) -> None:
    """Wait for the async ``cond()`` (an answer missing meanwhile counts as not yet)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if await cond():
                return
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError):
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; log:\n{rp.log()}")


async def instance_state(s: aiohttp.ClientSession, rp: RouterdProcess) -> str:
    _, view = await get(s, f"{rp.url}/admin/fleets")
    return str(view["fleets"]["f"]["instances"][0]["state"])


async def test_a_forged_admin_call_or_wake_is_refused_counted_and_not_carried_out(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    sim = await sim_process(model="m")
    rp = routerd_process(replica(routerd_config, tmp_path, "a", redis_server.url, [sim.url]))
    forged = {"call": msgspec.msgpack.encode({"id": "forged-1", "op": "drain", "target": "f:static0",
                                              "origin": "forged"})}
    wake = {"call": msgspec.msgpack.encode({"id": "forged-2", "op": "wake", "target": "f",
                                            "origin": "forged"})}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        await until(lambda: _is(instance_state(s, rp), "ready"), "the instance ready", rp)
        r = redis_server.client()
        r.xadd(KEYS.admin_calls(), forged)  # exactly what issue 27 found carried out
        r.xadd(KEYS.admin_calls(), wake)
        await until(lambda: _ge(rejected(s, rp, "admin_call", "unsigned"), 2), "both calls refused", rp)
        assert await instance_state(s, rp) == "ready"  # not drained
        async with s.post(f"{rp.url}/v1/completions",
                          json={"model": "m", "prompt": "hi", "max_tokens": 2}) as c:
            assert c.status == 200, await c.text()  # clients still served
        assert not r.exists(KEYS.admin_reply("forged-1"))
        assert not r.exists(KEYS.admin_reply("forged-2"))
        assert not r.exists(KEYS.admin_claim("forged-1"))  # not even claimed: refused before
    assert log_events(rp.log_path, "admin_call_relayed") == []
    refusals = log_events(rp.log_path, "shared_record_refused")
    assert [(e["kind"], e["why"]) for e in refusals] == [("admin_call", "unsigned")]  # once per kind, why


async def test_a_forged_fleet_state_with_an_attackers_url_is_not_followed(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    sim, attacker = await sim_process(model="m"), await sim_process(model="m")
    r = redis_server.client()
    # Someone holds the control lease (as writable as the rest), so the replica started follows …
    holder = {"ident": "elsewhere", "incarnation": "x", "started_ms": 1, "since_ms": 1, "token": 1}
    r.set(KEYS.control_lease(), f"1 {json.dumps(holder)}", px=120_000)
    rp = routerd_process(replica(routerd_config, tmp_path, "b", redis_server.url, [sim.url],
                                 admission={"waiting_room_s": 0.5}))  # no instance: a quick 503
    # … and what it follows is written by hand: the replica's instance, at the attacker's URL.
    state = {"controller": "elsewhere", "fingerprint": "x", "fleets": ["f"],
             "instances": [{"id": "f:static0", "fleet": "f", "url": attacker.url, "state": "ready",
                            "static": True, "generation": 1}]}
    r.hset(KEYS.fleet_state(), mapping={"token": 1, "version": 99, "state": msgspec.msgpack.encode(state)})
    r.publish(KEYS.fleet_channel(), 99)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        await until(lambda: _ge(rejected(s, rp, "fleet_state", "unsigned"), 1), "the state refused", rp)
        async with s.post(f"{rp.url}/v1/completions",
                          json={"model": "m", "prompt": "a secret prompt", "max_tokens": 2}) as c:
            assert c.status == 503, await c.text()  # no instance it can trust
        status, body = await get(s, f"{rp.url}/readyz")
        assert status == 503, body
        assert "refused (unsigned)" in body["untrusted_view"], body
        _, view = await get(s, f"{rp.url}/admin/fleets")
        assert view["view"]["refused"] == "unsigned"
        assert all(i["url"] != attacker.url for i in view["fleets"]["f"]["instances"])
    assert (await attacker.stats())["completed"] == 0  # no prompt reached the attacker's URL


async def test_replicas_with_other_secrets_refuse_to_follow_and_say_why_and_with_one_they_follow(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    sim = await sim_process(model="m")
    a = routerd_process(replica(routerd_config, tmp_path, "a", redis_server.url, [sim.url],
                                control={"secret": "the first deployment's secret"}))
    b = routerd_process(replica(routerd_config, tmp_path, "b", redis_server.url, [sim.url],
                                control={"secret": "another deployment's secret"}), wait_ready=False)
    c = routerd_process(replica(routerd_config, tmp_path, "c", redis_server.url, [sim.url],
                                control={"secret": "the first deployment's secret"}), wait_ready=False)
    await asyncio.gather(*(asyncio.to_thread(rp.wait_notify, "READY=1", 120) for rp in (b, c)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        _, view_a = await get(s, f"{a.url}/admin/fleets")
        assert view_a["view"]["role"] == "controller"
        ours, theirs = view_a["view"]["secret_fingerprint"], None
        # The same secret: c follows a as before.
        await until(lambda: _is(_status(s, f"{c.url}/readyz"), 200), "c ready, following a", c)
        _, view_c = await get(s, f"{c.url}/admin/fleets")
        assert view_c["view"]["controller"] == "a"
        assert view_c["view"]["refused"] is None
        # Another secret: b refuses a's state and says so, with both fingerprints.
        await until(lambda: _ge(rejected(s, b, "fleet_state", "other_secret"), 1), "b refusing a's state", b)
        status, body = await get(s, f"{b.url}/readyz")
        _, view_b = await get(s, f"{b.url}/admin/fleets")
        theirs = view_b["view"]["secret_fingerprint"]
        assert status == 503, body
        assert ours in body["untrusted_view"], body
        assert theirs in body["untrusted_view"], body
        assert view_b["view"]["refused"] == "other_secret"
        assert "UNTRUSTED: the published fleet state is sealed with another secret" in render(view_b)
    refusal = next(e for e in log_events(b.log_path, "shared_record_refused") if e["kind"] == "fleet_state")
    assert (refusal["why"], refusal["fingerprint"], refusal["record_fingerprint"]) == \
        ("other_secret", theirs, ours)
    for rp in (a, b, c):  # the secret itself is nowhere in what they say
        assert "deployment's secret" not in rp.log_path.read_text()


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def _ge(value: Any, least: float) -> bool:
    return bool(await value >= least)


async def _status(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url) as r:
        return r.status


@pytest.mark.ray
@pytest.mark.timeout(180)
async def test_a_forged_replica_count_is_refused_and_not_applied(
        ray_cluster: RayTestCluster, redis_server: RedisServer, tmp_path: Path) -> None:
    fleet = {"name": "rp", "model": "sim-rp", "engine": "sim", "replicas": 0, "num_cpus_per_instance": 0.25,
             "tensor_parallel_size": 1, "engine_args": SIM_ARGS}
    cfg = make_cfg(ray_cluster, tmp_path, "forged-replicas", [fleet])
    cfg = msgspec.structs.replace(cfg, redis=RedisConfig(url=redis_server.url, consumer="a"),
                                  ray=msgspec.structs.replace(cfg.ray, connect_timeout_s=120.0))  # a busy CI
    r = redis_server.client()
    # One engine where the file says none, written by hand (with the pin's own fingerprint of the file).
    r.hset(KEYS.replicas(), "rp", msgspec.json.encode({"replicas": 1, "file": file_of(cfg.fleets[0])}))
    async with assembly.running(cfg, Registry(), stop_engines=True, consume=False) as rd:
        assert rd.fleets is not None
        assert rd.fleets.desired(cfg.fleets[0]) == 0  # the file's count: the forged one is not applied
        assert rd.registry.instances("rp") == []
        assert 'routerd_shared_rejected_total{kind="replicas",why="unsigned"} 1.0' in \
            rd.core.metrics.render().decode()
    assert not r.hexists(KEYS.replicas(), "rp")  # dropped, as an unreadable pin is


async def test_forged_load_scrapes_and_sessions_are_refused_not_applied(
        redis_server: RedisServer, sim_process: SimProcessFactory) -> None:
    """What steers routing on every process — another process's in-flight counts (a phantom process also
    shrinks every process's part of the admission bounds), the controller's scrapes, a session's
    instance — is refused when written by hand."""
    sim = await sim_process(model="m")
    cfg = shared_view_config(redis_server.url, "b", [sim.url])
    r = redis_server.client()
    async with plane(cfg) as b:
        view = b.peers.measures if b.peers is not None else None
        assert view is not None
        inst = b.registry.get("f:static0")
        assert inst is not None
        view.scrapes.is_scraper = lambda: False  # b applies the scrapes published in Redis
        r.set(KEYS.load("phantom"), msgspec.msgpack.encode(LoadRecord({"f:static0": 50})), px=60_000)
        r.sadd(KEYS.processes, "phantom")
        snapshot = LoadSnapshot(scraped_at=0.0, running=0.0, waiting=0.0, kv_usage=0.0, capacity=10_000)
        r.hset(KEYS.scrapes, "f:static0", msgspec.msgpack.encode(
            ScrapeRecord(at=time.time(), url=sim.url, inflight=0, snapshot=snapshot, period=60.0)))
        r.set(KEYS.session(digest("conversation")), msgspec.msgpack.encode(SessionRecord("f:static0", 1)))
        view.sessions.processes = lambda: 2  # a lookup is made only with others around
        assert await view.sessions.recall("conversation") is None
        exchanged = view.load.exchanges_total
        assert await eventually(lambda: view.load.exchanges_total >= exchanged + 3, 30)  # read it twice
        assert b.registry.processes == 1  # no phantom among the processes
        assert inst.inflight_elsewhere == 0
        seals = view.load.seals
        assert await eventually(lambda: seals.rejected.get(("scrape", "unsigned"), 0) >= 2, 30), \
            seals.rejected
        assert seals.rejected[("load", "unsigned")] >= 2
        assert not inst.shared_scrape
        assert inst.snapshot is None or inst.snapshot.capacity != 10_000
        assert seals.rejected[("session", "unsigned")] == 1
        assert view.sessions.lookups["found"] == 0
        assert 'routerd_shared_rejected_total{kind="session",why="unsigned"} 1.0' in \
            b.core.metrics.render().decode()


# -- genuine records written again -------------------------------------------------------------------
def redis_ms(now: Any) -> int:
    """Redis ``TIME`` in milliseconds: the clock an admin call's sealed time is on."""
    return int(now[0]) * 1000 + int(now[1]) // 1000


@pytest.fixture
def seals() -> Seals:
    """The seals every routerd process of one deployment holds (counts fresh for each test)."""
    return Seals(Trust(b"one deployment's secret", source="test"))


async def test_a_genuine_admin_call_copied_is_not_carried_out_again(
        redis_server: RedisServer, seals: Seals) -> None:
    client = redis_client(redis_server.url, RedisConfig(op_timeout_s=2.0))
    done: list[str] = []

    async def execute(c: AdminCall) -> AdminAnswer:
        done.append(c.id)
        return AdminAnswer(200, b"{}")

    controller = AdminRelay(client, KEYS, ident="ctl", controls=lambda: True, seals=seals, op_timeout_s=2.0,
                            answer_within_s=3.0)
    caller = AdminRelay(client, KEYS, ident="fol", controls=lambda: False, seals=seals, op_timeout_s=2.0)
    task = asyncio.create_task(controller.run(execute))
    try:
        assert (await caller.call("drain", "f:static0", b"", wait_s=1.0)).status == 200
        assert len(done) == 1
        (_, fields), = await client.xrange(KEYS.admin_calls())
        call = msgspec.msgpack.decode(seals.open(ADMIN_CALL, fields[b"call"]), type=AdminCall)

        async def copy() -> None:  # whoever can write the copy can delete the claim too
            await client.delete(KEYS.admin_claim(call.id))
            await client.xadd(KEYS.admin_calls(), {"call": fields[b"call"]})

        await copy()  # soon: its id was taken here already
        assert await eventually(lambda: seals.rejected.get((ADMIN_CALL, "replayed"), 0) == 1, 20)
        controller._taken.clear()  # as a new controller would have it
        await asyncio.sleep(max(0.0, (call.issued_ms + 3_000 - redis_ms(await client.time())) / 1000) + 0.2)
        await copy()  # later than its caller waited: refused by its sealed time
        assert await eventually(lambda: seals.rejected.get((ADMIN_CALL, "replayed"), 0) == 2, 20)
        assert done == [call.id]  # carried out once
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_an_older_fleet_state_written_again_is_not_followed(
        redis_server: RedisServer, seals: Seals) -> None:
    controlling, following = Registry(), Registry()
    controlling.add(launched("g", 0))
    client = redis_client(redis_server.url, RedisConfig(op_timeout_s=2.0))
    try:
        ctl = FleetStateSync(controlling, client, KEYS, ident="a", fingerprint="fp", controls=lambda: True,
                        seals=seals, token=lambda: 7)
        fol = FleetStateSync(following, client, KEYS, ident="b", fingerprint="fp", controls=lambda: False,
                        seals=seals)
        await ctl.publish()
        older = await client.hget(KEYS.fleet_state(), "state")
        assert await fol.follow()
        controlling.add(launched("g", 1))
        await ctl.publish()
        assert await fol.follow()
        assert sorted(i.id for i in following) == ["g:0", "g:1"]
        # The older state, genuinely sealed, written back under a newer version: not followed.
        await client.hset(KEYS.fleet_state(), mapping={"version": 10**6, "state": older})
        await client.publish(KEYS.fleet_channel(), 10**6)
        assert not await fol.follow()
        assert sorted(i.id for i in following) == ["g:0", "g:1"]
        assert seals.rejected[(FLEET_STATE, "replayed")] == 1
        assert fol.status()["refused"] == "replayed"
    finally:
        await client.aclose()


async def test_a_forged_admin_answer_is_refused_and_the_caller_waits_for_the_controllers(
        redis_server: RedisServer, seals: Seals) -> None:
    client = redis_client(redis_server.url, RedisConfig(op_timeout_s=2.0))
    release = asyncio.Event()

    async def execute(c: AdminCall) -> AdminAnswer:
        await release.wait()
        return AdminAnswer(200, b'{"drained": true}')

    controller = AdminRelay(client, KEYS, ident="ctl", controls=lambda: True, seals=seals, op_timeout_s=2.0)
    caller = AdminRelay(client, KEYS, ident="fol", controls=lambda: False, seals=seals, op_timeout_s=2.0)
    task = asyncio.create_task(controller.run(execute))
    try:
        answering = asyncio.create_task(caller.call("drain", "f:static0", b"", wait_s=30.0))
        assert await eventually(lambda: bool(controller._taken), 20)
        (call_id,) = controller._taken
        reply = KEYS.admin_reply(call_id)
        await client.rpush(reply, msgspec.msgpack.encode(AdminAnswer(500, b'{"forged": true}')))
        # a genuine answer, but to another call
        other = msgspec.msgpack.encode(AdminAnswer(404, b"{}"))
        await client.rpush(reply, seals.seal(ADMIN_ANSWER, other, "another call"))
        assert await eventually(lambda: seals.rejected.get((ADMIN_ANSWER, "forged"), 0) == 1, 20)
        assert seals.rejected[(ADMIN_ANSWER, "unsigned")] == 1
        assert not answering.done()
        release.set()
        answer = await answering
        assert (answer.status, answer.body) == (200, b'{"drained": true}')
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
