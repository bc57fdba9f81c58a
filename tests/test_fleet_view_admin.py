"""Two routerd on one Redis, one controlling: the follower routes over the controller's fleet state,
and its admin calls are carried out by the controller (routerd/peers/admin_relay.py).

Both are built by the one builder (``assembly.running``) over a static fleet of scripted engines; a flag
stands in for the control lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog

from routerd.assembly import Routerd, running
from routerd.config import Config
from routerd.registry import InstanceState, Registry
from routerd_bench._common import SHARED_SECRET
from tests.fixtures.dataplane import STATE_DIR, EngineFactory
from tests.fixtures.helpers import eventually
from tests.fixtures.redis_server import RedisServer
from tests.test_fleet_view import Flag

pytestmark = pytest.mark.timeout(90)


def config(redis_url: str, consumer: str, urls: list[str], **fleet: Any) -> Config:
    raw: dict[str, Any] = {
        "daemon": {"state_dir": f"{STATE_DIR}-{consumer}"},
        "control": {"secret": SHARED_SECRET},  # own state dirs: one secret, or they refuse each other
        "http": {"host": "127.0.0.1", "port": 0},
        "redis": {"url": redis_url, "consumer": consumer, "op_timeout_s": 2.0},
        "routing": {"scrape_interval_s": 0.05, "scrape_timeout_s": 0.5, "stale_after_s": 1.0},
        "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": urls, "max_num_seqs": 8, **fleet}],
    }
    return msgspec.convert(raw, Config)


@contextlib.asynccontextmanager
async def pair(redis_server: RedisServer,
               urls: list[str]) -> AsyncIterator[tuple[Routerd, Routerd, Flag, Flag]]:
    """Routerd ``a`` controlling and ``b`` following, both serving; their flags flip control."""
    flag_a, flag_b = Flag(True), Flag(False)
    cfg_a, cfg_b = config(redis_server.url, "a", urls), config(redis_server.url, "b", urls)
    async with running(cfg_a, Registry(), controls=flag_a, consume=False) as a, \
            running(cfg_b, Registry(), controls=flag_b, consume=False) as b:
        yield a, b, flag_a, flag_b


async def until(cond: Any, what: str, timeout: float = 10.0) -> None:
    if not await eventually(cond, timeout, step=0.02):
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def call(client: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with client.request(method, url, json=body) as r:
        return r.status, await r.json()


async def test_a_followers_admin_calls_are_carried_out_by_the_controller(
        redis_server: RedisServer, scripted_engine: EngineFactory, client: aiohttp.ClientSession) -> None:
    urls = [(await scripted_engine()).url for _ in range(2)]
    async with pair(redis_server, urls) as (a, b, _, _):
        await until(lambda: a.registry.ready_count("f") == 2, "the controller's instances ready")
        await until(lambda: b.registry.ready_count("f") == 2, "the follower to follow them")
        async with client.get(b.url + "/readyz") as r:
            assert r.status == 200
        _, fleets = await call(client, "GET", b.url + "/admin/fleets")
        assert fleets["view"]["role"] == "follower"
        assert fleets["view"]["controller"] == "a"

        # Drained through the follower: done by the controller, answered with its answer, followed.
        status, body = await call(client, "POST", b.url + "/admin/instances/f:static0/drain",
                                  {"timeout_s": 1})
        assert status == 200
        assert body["draining"]["id"] == "f:static0"
        assert body["draining"]["drained"] is True
        inst = a.registry.get("f:static0")
        assert inst is not None
        assert inst.state is InstanceState.DRAINING
        await until(lambda: b.registry.ready_count("f") == 1, "the drain followed")
        # ...and held: the follower does not probe the engines itself (its own rotation rules would
        # put the drained instance back between two refreshes).
        states = set()
        for _ in range(50):
            states.add(b.registry.ready_count("f"))
            await asyncio.sleep(0.02)
        assert states == {1}
        status, body = await call(client, "POST", b.url + "/admin/instances/f:static0/undrain")
        assert status == 200
        assert body["undrained"]["id"] == "f:static0"
        await until(lambda: b.registry.ready_count("f") == 2, "the undrain followed")

        # What the controller refuses, the follower answers the same: status and JSON.
        for method, path, req in [("POST", "/admin/instances/nope/drain", {}),
                                  ("POST", "/admin/instances/f:static1/restart", {}),
                                  ("POST", "/admin/fleets/f/replicas", {"replicas": 1}),
                                  ("POST", "/admin/instances/f:static1/drain", {"timeout_s": "soon"}),
                                  ("DELETE", "/admin/fleets/nope/replicas", None)]:
            here = await call(client, method, a.url + path, req)
            relayed = await call(client, method, b.url + path, req)
            assert relayed == here, path
            assert here[0] in (400, 404), path


async def test_with_no_controller_an_admin_call_is_refused_and_never_done_later(
        redis_server: RedisServer, scripted_engine: EngineFactory, client: aiohttp.ClientSession) -> None:
    urls = [(await scripted_engine()).url for _ in range(2)]
    async with pair(redis_server, urls) as (a, b, flag_a, _):
        await until(lambda: b.registry.ready_count("f") == 2, "the follower to follow")
        assert b.peers.admin_relay is not None
        b.peers.admin_relay.answer_within_s = 1.0
        flag_a.on = False  # nobody controls
        started = time.monotonic()
        status, body = await call(client, "POST", b.url + "/admin/instances/f:static1/drain",
                                  {"timeout_s": 1})
        assert status == 503
        assert "no controlling routerd" in body["error"]["message"]
        assert time.monotonic() - started < 10
        async with client.get(b.url + "/readyz") as r:
            assert r.status == 200  # the follower still routes over the last state it had
        # A controller back: it reads back the calls still waiting, not the one already refused.
        flag_a.on = True
        status, body = await call(client, "POST", b.url + "/admin/instances/f:static0/drain",
                                  {"timeout_s": 0})
        assert status == 200
        await asyncio.sleep(1.5)  # past the read-back window: the refused call would have run by now
        assert [i.id for i in a.registry if i.state is InstanceState.DRAINING] == ["f:static0"]


async def test_a_call_made_during_a_takeover_is_carried_out_once(
        redis_server: RedisServer, scripted_engine: EngineFactory, client: aiohttp.ClientSession) -> None:
    urls = [(await scripted_engine()).url]
    with structlog.testing.capture_logs() as logs:
        async with pair(redis_server, urls) as (_, b, flag_a, _):
            await until(lambda: b.registry.ready_count("f") == 1, "the follower to follow")
            flag_a.on = False
            pending = asyncio.create_task(call(client, "POST", b.url + "/admin/instances/f:static0/drain",
                                               {"timeout_s": 0}))
            await asyncio.sleep(0.5)
            flag_a.on = True  # control back while the call waits
            status, body = await pending
            assert status == 200, body
            assert body["draining"]["id"] == "f:static0"
            await asyncio.sleep(0.5)
    assert len([e for e in logs if e["event"] == "admin_call_relayed"]) == 1
