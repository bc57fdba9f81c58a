"""The fleet state shared through Redis (routerd/peers/): the controller publishes, followers follow.

Two registries in one test process on a real redis-server: one :class:`FleetStateSync` publishes while its
flag says it controls, the other follows; the flag stands in for the control lease.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import structlog

from routerd.config import RedisConfig
from routerd.peers.fleet_state import FleetState, FleetStateSync, Published
from routerd.peers.sealed import FLEET_STATE, Seals
from routerd.redis_conn import redis_client
from routerd.redis_keys import RedisKeys
from routerd.registry import Instance, InstanceState, Registry
from routerd.telemetry import Metrics, Telemetry
from routerd.trust import Trust
from tests.fixtures.helpers import eventually
from tests.fixtures.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)

KEYS = RedisKeys()
SEALS = Seals(Trust(b"the tests' shared secret", source="test"))  # what every process here holds


class Flag:
    """Stands in for the control lease: whether this process controls the fleets now."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self) -> bool:
        return self.on


@contextlib.asynccontextmanager
async def client_of(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = redis_client(server.url, RedisConfig(op_timeout_s=2.0))
    try:
        yield client
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def view_running(server: RedisServer, registry: Registry, controls: Callable[[], bool], *,
                       ident: str, fingerprint: str = "fp", token: Callable[[], int] = lambda: 0,
                       replicas: dict[str, int] | None = None, **kw: Any) -> AsyncIterator[FleetStateSync]:
    async with client_of(server) as client:
        view = FleetStateSync(registry, client, KEYS, ident=ident, fingerprint=fingerprint, controls=controls,
                         seals=kw.pop("seals", SEALS), token=token, replicas=lambda: dict(replicas or {}),
                         op_timeout_s=2.0, **kw)
        task = asyncio.create_task(view.run())
        try:
            yield view
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def launched(fleet: str, n: int, *, state: InstanceState = InstanceState.READY,
             generation: int = 1) -> Instance:
    return Instance(id=f"{fleet}:{n}", fleet=fleet, url=f"http://127.0.0.1:{9000 + n}", state=state,
                    generation=generation, pid=1000 + n, node="node-a", capacity_hint=8, launch_capacity=16,
                    resources={"cpu_percent": 12.5}, health="ok", last_heartbeat=1.7e9)


FIELDS = ("fleet", "url", "state", "state_reason", "generation", "restarts", "pid", "node", "capacity_hint",
          "launch_capacity", "static", "started_at", "resources", "health", "last_heartbeat")


def fields(registry: Registry) -> dict[str, tuple[Any, ...]]:
    return {i.id: tuple(getattr(i, f) for f in FIELDS) for i in registry}


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    if not await eventually(cond, timeout, step=0.02):
        raise AssertionError(f"timed out waiting for {what}")


async def test_a_follower_mirrors_the_controllers_instances_and_keeps_its_own_fields(
        redis_server: RedisServer) -> None:
    ctl, fol = Registry(), Registry()
    ctl.ensure_fleet("g")
    for n in range(2):
        ctl.add(launched("g", n))
    async with view_running(redis_server, ctl, Flag(True), ident="a", replicas={"g": 2}) as pub, \
            view_running(redis_server, fol, Flag(False), ident="b") as sub:
        await until(lambda: fields(fol) == fields(ctl), "the follower to have the controller's instances")
        assert fol.ready_count("g") == 2
        assert "g" in fol.fleets()
        assert sub.replicas("g") == 2
        assert pub.replicas("g") is None
        followed = fol.get("g:0")
        assert followed is not None
        followed.inflight = 3  # this process's own: the view never touches it
        followed.scrape_errors_total = 4  # this process's own too: a counter on /metrics
        ended: list[str] = []
        followed.watch_lost(ended.append)

        # Drained on the controller: out of rotation here at once (a notice, not the poll).
        inst = ctl.get("g:1")
        assert inst is not None
        ctl.set_state(inst, InstanceState.DRAINING, "drained by admin")
        await until(lambda: fol.ready_count("g") == 1, "the drain to be followed", timeout=1.0)
        assert fields(fol) == fields(ctl)

        # A restart with a new engine: a new Instance here too, and what ran on the old one ended.
        ctl.add(launched("g", 0, state=InstanceState.STARTING, generation=2))
        await until(lambda: fol.get("g:0") is not followed, "the new generation to be followed")
        assert ended
        assert fol.get("g:0").inflight == 0
        assert fol.get("g:0").scrape_errors_total == 4  # under the same labels it never goes back

        # Fields that change without a registry change (heartbeats, restarts) come with the next refresh.
        new = ctl.get("g:0")
        assert new is not None
        new.restarts, new.last_heartbeat = 1, 1.8e9
        await until(lambda: fields(fol) == fields(ctl), "a refresh to carry the restart count")

        # Scaled down: removed here too; scaled up: added.
        ctl.remove("g:1")
        ctl.add(launched("g", 2))
        await until(lambda: sorted(i.id for i in fol) == ["g:0", "g:2"], "the fleet's new members")
        assert fields(fol) == fields(ctl)


async def test_a_failed_instance_ends_the_followers_calls_on_it(redis_server: RedisServer) -> None:
    ctl, fol = Registry(), Registry()
    ctl.add(launched("g", 0))
    async with view_running(redis_server, ctl, Flag(True), ident="a"), \
            view_running(redis_server, fol, Flag(False), ident="b"):
        await until(lambda: fol.ready_count("g") == 1, "the instance followed")
        ended: list[str] = []
        followed = fol.get("g:0")
        assert followed is not None
        followed.watch_lost(ended.append)
        inst = ctl.get("g:0")
        assert inst is not None
        ctl.set_state(inst, InstanceState.UNHEALTHY, "heartbeat: stalled")
        inst.lose("instance g:0 failed its heartbeats (stalled)")  # as the controller's monitor does
        await until(lambda: bool(ended), "the follower's calls on it ended")
        assert fol.get("g:0") is followed
        assert followed.state_reason == "heartbeat: stalled"


async def test_an_instance_out_of_rotation_but_not_failed_keeps_the_followers_calls_on_it(
        redis_server: RedisServer) -> None:
    """A static instance whose scrapes went stale leaves rotation on the controller while what runs on it
    goes on: a follower (a worker, a replica) takes it out of rotation too, and ends nothing — it ends its
    calls when the controller ended its own (a heartbeat failure). Followers once ended every stream on
    an instance that merely left rotation: a loaded machine's late scrapes cut workers' streams."""
    ctl, fol = Registry(), Registry()
    ctl.add(Instance(id="s:static0", fleet="s", url="http://127.0.0.1:9", state=InstanceState.READY,
                     static=True))
    async with view_running(redis_server, ctl, Flag(True), ident="a"), \
            view_running(redis_server, fol, Flag(False), ident="b"):
        await until(lambda: fol.ready_count("s") == 1, "the instance followed")
        ended: list[str] = []
        followed = fol.get("s:static0")
        inst = ctl.get("s:static0")
        assert followed is not None
        assert inst is not None
        followed.watch_lost(ended.append)
        ctl.set_state(inst, InstanceState.UNHEALTHY, "no successful /metrics scrape for 1.0s")
        await until(lambda: followed.state is InstanceState.UNHEALTHY, "out of rotation on the follower")
        ctl.set_state(inst, InstanceState.READY, "answers /health")
        await until(lambda: followed.state is InstanceState.READY, "back in rotation on the follower")
        assert ended == []
        ctl.set_state(inst, InstanceState.UNHEALTHY, "heartbeat: timeout")
        inst.lose("instance s:static0 failed its heartbeats (timeout)")
        await until(lambda: bool(ended), "the follower's calls on it ended")
        assert ended == ["instance s:static0: heartbeat: timeout"]


async def test_without_a_controller_a_follower_keeps_the_last_state_and_says_so(
        redis_server: RedisServer) -> None:
    ctl, fol = Registry(), Registry()
    ctl.add(launched("g", 0))
    async with view_running(redis_server, fol, Flag(False), ident="b", stale_after_s=0.6) as sub:
        metrics = Metrics(Telemetry(), [sub.collector()])
        async with view_running(redis_server, ctl, Flag(True), ident="a", expire_ms=300):
            await until(lambda: fol.ready_count("g") == 1, "the instance followed")
            assert not sub.stale()
            assert sub.status()["controller"] == "a"
        # The controller is gone and its state expired: the engines still serve, readiness holds.
        await until(lambda: sub.stale(), "the follower to call its state stale")
        assert fol.ready_count("g") == 1
        assert sub.status()["stale"] is True
        assert sub.age_s() > 0.6
        age = gauge(metrics, "routerd_view_age_seconds")
        assert age > 0.6
        # A controller back: fresh again, and its state applied.
        async with view_running(redis_server, ctl, Flag(True), ident="c"):
            await until(lambda: not sub.stale() and sub.status()["controller"] == "c", "fresh state")
            assert gauge(metrics, "routerd_view_age_seconds") < 0.6


def gauge(metrics: Metrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_a_deposed_controller_cannot_overwrite_its_successor(redis_server: RedisServer) -> None:
    old, new = Registry(), Registry()
    old.add(launched("g", 0))
    new.add(launched("g", 0))
    new.add(launched("g", 1))
    async with client_of(redis_server) as client:
        def view(registry: Registry, token: int, ident: str) -> FleetStateSync:
            return FleetStateSync(registry, client, KEYS, ident=ident, fingerprint="fp",
                                  controls=lambda: True, seals=SEALS, token=lambda: token)
        assert await view(new, 7, "new").publish() > 0
        assert await view(old, 6, "old").publish() == -1
        raw = await client.hget(KEYS.fleet_state(), "state")
        published = msgspec.msgpack.decode(SEALS.open(FLEET_STATE, raw), type=Published)
        state = msgspec.msgpack.decode(published.state, type=FleetState)
        assert state.controller == "new"
        assert len(state.instances) == 2
        # Versions only grow, whoever publishes (a follower tells new from old by them).
        first = await view(new, 7, "new").publish()
        assert await view(new, 8, "newer").publish() == first + 1


async def test_one_view_publishes_while_it_controls_and_follows_otherwise(redis_server: RedisServer) -> None:
    a, b = Registry(), Registry()
    a.add(launched("g", 0))
    b.add(launched("h", 0))
    flag_a, flag_b = Flag(True), Flag(False)
    # Tokens as the lease gives them: a later term's is higher (with equal tokens, b's first states
    # would be older than a's own last one, which a may read back once it follows, and be refused).
    async with view_running(redis_server, a, flag_a, ident="a", token=lambda: 1), \
            view_running(redis_server, b, flag_b, ident="b", token=lambda: 2) as vb:
        await until(lambda: sorted(i.id for i in b) == ["g:0"], "b to follow a")
        # Control moves to b: b publishes what it has; a follows it.
        flag_a.on, flag_b.on = False, True
        b.add(launched("h", 1))
        # It follows within a publish period; the bound is generous for a loaded machine. (Its CI timeouts
        # were b's last read of a's state landing after b took control and removing h:1: see the next test.)
        await until(lambda: sorted(i.id for i in a) == ["g:0", "h:1"], "a to follow b", timeout=15.0)
        assert vb.status()["role"] == "controller"


async def test_a_read_in_flight_when_control_comes_here_is_not_applied(redis_server: RedisServer) -> None:
    """The previous controller's state, read just before this process took control, would remove what
    was added here since (seen in CI at load: the new controller published without it, and a follower
    never got it)."""
    a, b = Registry(), Registry()
    a.add(launched("g", 0))
    flag_b = Flag(False)
    async with client_of(redis_server) as client:
        pub = FleetStateSync(a, client, KEYS, ident="a", fingerprint="fp", controls=lambda: True,
                             seals=SEALS, token=lambda: 1)
        sub = FleetStateSync(b, client, KEYS, ident="b", fingerprint="fp", controls=flag_b, seals=SEALS,
                             token=lambda: 2)
        await pub.publish()
        assert await sub.follow()
        reading = asyncio.create_task(sub.follow())
        await asyncio.sleep(0)  # the read is sent; control comes here before its answer
        flag_b.on = True
        b.add(launched("h", 1))
        assert await reading is False
        assert sorted(i.id for i in b) == ["g:0", "h:1"]


async def test_a_follower_with_another_fleet_config_says_so(redis_server: RedisServer) -> None:
    ctl, fol = Registry(), Registry()
    ctl.add(launched("g", 0))
    with structlog.testing.capture_logs() as logs:
        async with view_running(redis_server, ctl, Flag(True), ident="a", fingerprint="one"), \
                view_running(redis_server, fol, Flag(False), ident="b", fingerprint="two") as sub:
            metrics = Metrics(Telemetry(), [sub.collector()])
            await until(lambda: sub.mismatch(), "the mismatch noticed")
            assert gauge(metrics, "routerd_view_config_mismatch") == 1.0
            assert sub.status()["config_mismatch"] is True
            assert fol.ready_count("g") == 1  # the controller's fleets are followed all the same
            await asyncio.sleep(1.2)  # several refreshes: warned once, not at each
    warnings = [e for e in logs if e["event"] == "fleet_config_mismatch"]
    assert len(warnings) == 1
    assert warnings[0]["controller_fingerprint"] == "one"


async def test_a_pinned_count_holds_until_the_file_changes_the_fleets_count(
        redis_server: RedisServer) -> None:
    from routerd.config import FleetConfig
    from routerd.peers.replicas import ReplicaStore

    def fleet(name: str, replicas: int) -> FleetConfig:
        return FleetConfig(name=name, model=name, engine="sim", replicas=replicas)

    async with client_of(redis_server) as client:
        store = ReplicaStore(client, KEYS, seals=SEALS)
        await store.set(fleet("g", 1), 3)
        await store.set(fleet("h", 1), 2)
        await store.set(fleet("gone", 1), 2)
        assert await store.load([fleet("g", 1), fleet("h", 1)]) == {"g": 3, "h": 2}
        # The file now says 4 for h (its count changed since the pin): the file wins, the pin goes.
        assert await store.load([fleet("g", 1), fleet("h", 4)]) == {"g": 3}
        assert sorted(await client.hkeys(KEYS.replicas())) == [b"g"]
        await store.unset("g")
        assert await store.load([fleet("g", 1)]) == {}


def test_routerd_status_says_whose_state_it_follows_and_what_is_wrong_with_it() -> None:
    from routerd.status import render

    follower = {"role": "follower", "ident": "b", "controller": "a", "version": 12, "age_s": 4.2,
                "stale": True, "fingerprint": "two", "controller_fingerprint": "one", "config_mismatch": True}
    first = render({"fleets": {}, "view": follower}).splitlines()[0]
    assert first.startswith("view: b follows a (version 12, 4.2s old)")
    assert "STALE" in first
    assert "CONFIG MISMATCH: fleet config two here, one on the controller" in first
    controller = {**follower, "role": "controller", "stale": False, "config_mismatch": False}
    assert render({"fleets": {}, "view": controller}).splitlines()[0] == \
        "view: b controls the fleets (publishing version 12)"
    assert render({"fleets": {}}).splitlines()[0].startswith("INSTANCE")


async def test_redis_going_away_is_waited_out(redis_server: RedisServer) -> None:
    ctl, fol = Registry(), Registry()
    ctl.add(launched("g", 0))
    async with view_running(redis_server, ctl, Flag(True), ident="a") as pub, \
            view_running(redis_server, fol, Flag(False), ident="b", stale_after_s=0.5) as sub:
        await until(lambda: fol.ready_count("g") == 1, "the instance followed")
        redis_server.kill()
        await until(lambda: sub.stale(), "the follower to call its state stale")
        assert fol.ready_count("g") == 1  # routing goes on over the last state
        redis_server.start()
        ctl.add(launched("g", 1))
        await until(lambda: fol.ready_count("g") == 2 and not sub.stale(), "the view back", timeout=10)
        assert pub.version > 0


async def test_a_local_change_to_a_followers_registry_is_undone_by_the_next_refresh(
        redis_server: RedisServer) -> None:
    ctl, fol = Registry(), Registry()
    ctl.add(launched("g", 0))
    async with view_running(redis_server, ctl, Flag(True), ident="a"), \
            view_running(redis_server, fol, Flag(False), ident="b"):
        await until(lambda: fol.ready_count("g") == 1, "the instance followed")
        # A reload re-adds the follower's own static instance; the controller's state did not change.
        fol.add(Instance(id="g:static0", fleet="g", url="http://127.0.0.1:1", static=True))
        await until(lambda: sorted(i.id for i in fol) == ["g:0"], "the controller's instances again")


async def test_a_reload_that_makes_a_followers_fleet_config_differ_is_warned_about(
        redis_server: RedisServer) -> None:
    from routerd.config import Config
    from routerd.peers.fleet_state import config_fingerprint

    ctl, fol = Registry(), Registry()
    ctl.add(launched("g", 0))
    same = config_fingerprint(Config())
    with structlog.testing.capture_logs() as logs:
        async with view_running(redis_server, ctl, Flag(True), ident="a", fingerprint=same), \
                view_running(redis_server, fol, Flag(False), ident="b", fingerprint=same) as sub:
            await until(lambda: fol.ready_count("g") == 1, "the instance followed")
            assert not sub.mismatch()
            sub.update_config(msgspec.convert({"fleets": [{"name": "g", "model": "m"}]}, Config))
            await until(lambda: any(e["event"] == "fleet_config_mismatch" for e in logs), "the warning")
            assert sub.mismatch()


def test_the_published_config_fingerprint_is_not_a_hash_of_a_fleets_secrets() -> None:
    """The fingerprint is published in Redis: a static fleet's key (or a URL password) does not change
    it, so it cannot be searched offline; what decides launches still does."""
    from routerd.config import parse
    from routerd.peers.fleet_state import config_fingerprint

    def fingerprint(url: str, **extra: object) -> str:
        return config_fingerprint(parse({"fleets": [{"name": "s", "model": "m", "engine": "static",
                                                     "urls": [url], **extra}]}, environ={}))

    keyed = fingerprint("http://127.0.0.1:9", api_key="sk-engine-key-1")
    assert fingerprint("http://127.0.0.1:9", api_key="sk-engine-key-2") == keyed
    assert fingerprint("http://127.0.0.1:10", api_key="sk-engine-key-1") != keyed
    assert fingerprint("http://u:pw1@127.0.0.1:9") == fingerprint("http://u:pw2@127.0.0.1:9")


async def test_a_new_term_starts_from_the_counts_it_took_over_not_from_its_own_first_publication(
        redis_server: RedisServer) -> None:
    """The follower that takes control may publish before its fleet manager begins its term, with the
    file's counts (nothing scaled yet): the counts the term starts from stay the ones it took over — a
    fleet the last controller scaled to zero is not woken by the change (issue 26)."""
    term = {"token": 1}
    follower_controls = Flag(False)
    async with view_running(redis_server, Registry(), follower_controls, ident="b",
                            token=lambda: term["token"], replicas={"zz": 1}) as sub:
        async with view_running(redis_server, Registry(), Flag(True), ident="a", token=lambda: 1,
                                replicas={"zz": 0}):
            await until(lambda: sub.published_replicas() == {"zz": 0}, "the follower seeing zz at zero")
        term["token"] = 2  # "a" is gone; "b" takes control
        follower_controls.on = True
        assert await sub.publish() > 0  # its first publication, before its fleet manager began
        assert sub.state is not None
        assert sub.state.replicas == {"zz": 1}
        assert sub.published_replicas() == {"zz": 0}
