"""The control lease on a real Redis: one holder at a time, tokens that only grow, a partitioned
holder that stops before anyone else starts, a restarted replica taking its own lease back at once —
and the fences it guards (the engine actor's token, the Ray cluster's mutating calls)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import redis
import redis.asyncio

from routerd.config import ConfigError, ControlConfig, RedisConfig, parse
from routerd.fleet.actor import EngineActor, FencedOut
from routerd.fleet.ray_cluster import RayCluster
from routerd.peers.lease import _MARGIN, ControlLease, NotController
from routerd.plugins import LaunchSpec
from routerd.redis_conn import RedisConn
from routerd.redis_keys import RedisKeys
from routerd.status import render
from tests.fixtures.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)


class PausableProxy:
    """A TCP proxy in front of Redis whose forwarding can be paused: one process's connection to Redis
    blocked (a partition), while every other client still reaches it (``CLIENT PAUSE`` would pause all)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.open = asyncio.Event()
        self.open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def __aenter__(self) -> PausableProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:  # the server behind it is gone (killed by the test): refused, as it would be
            writer.close()
            return
        for src, dst in ((reader, up_w), (up_r, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self.open.wait()  # paused: bytes are held, as on a partitioned link
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()


def lease(ident: str, url: str, lease_s: float) -> ControlLease:
    return ControlLease(ident, redis=RedisConn(url, RedisConfig(url=url, op_timeout_s=1.0), pooled=False),
                        cfg=ControlConfig(lease_s=lease_s))


@contextlib.asynccontextmanager
async def running(*leases: ControlLease) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(x.run()) for x in leases]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for x in leases:
            await x.release()


async def until(cond: object, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]  # a zero-argument predicate
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def test_one_holder_at_a_time_and_each_term_a_higher_token(redis_server: RedisServer) -> None:
    a, b = lease("host-a", redis_server.url, 5.0), lease("host-b", redis_server.url, 5.0)
    await a.step()
    await b.step()
    assert a.controls
    assert not b.controls
    a.check()
    with pytest.raises(NotController) as e:
        b.check()
    assert e.value.holder is not None
    assert e.value.holder.ident == "host-a"
    assert e.value.status == 503
    assert b.status()["controller"]["ident"] == "host-a"
    first = a.token
    assert abs(first - time.time() * 1000) < 5000  # tokens start at the server's clock in ms
    await a.release()  # a clean stop hands over at once, not after lease_s
    assert not a.controls
    await b.step()
    assert b.controls
    assert b.token > first
    assert (a.acquisitions, a.losses, b.acquisitions) == (1, 1, 1)
    await b.release()


async def test_a_renewed_lease_is_kept_and_a_lapsed_one_taken(redis_server: RedisServer) -> None:
    a, b = lease("host-a", redis_server.url, 0.6), lease("host-b", redis_server.url, 0.6)
    async with running(a):
        await until(lambda: a.controls, 5)
        token = a.token
        async with running(b):
            end = time.monotonic() + 1.5  # several lease periods
            while time.monotonic() < end:
                assert a.controls
                assert not b.controls
                await asyncio.sleep(0.02)
            assert a.token == token
    # a's loop ended without a release (as if its process died): b takes it once the TTL lapses
    c = lease("host-b", redis_server.url, 0.6)
    async with running(c):
        await until(lambda: c.controls, 5)
        assert c.token > token


async def _handover(a: ControlLease, b: ControlLease, since: float, limit_s: float) -> tuple[float, float]:
    """Watch control pass from ``a`` to ``b`` (every 2 ms, never both at once, within ``limit_s`` of
    ``since``): when ``a`` stopped and when ``b`` started."""
    stopped: float | None = None
    while True:
        now = time.monotonic()
        assert not (a.controls and b.controls), "both controlled at once"
        if stopped is None and not a.controls:
            stopped = now
        if b.controls:
            assert stopped is not None
            return stopped, now
        assert now - since < limit_s, "b never took control"
        await asyncio.sleep(0.002)


async def test_a_partitioned_controller_stops_before_the_other_starts(redis_server: RedisServer) -> None:
    async with PausableProxy(redis_server.port) as proxy:
        a, b = lease("host-a", proxy.url, 0.9), lease("host-b", redis_server.url, 0.9)
        async with running(a):
            await until(lambda: a.controls, 5)
            async with running(b):
                await asyncio.sleep(0.3)
                proxy.open.clear()  # a's Redis connection blocked; b still reaches Redis
                paused = time.monotonic()
                stopped, started = await _handover(a, b, paused, 5)
                assert stopped < started
                # a stops within one lease of its last renew, b starts once the key has lapsed in Redis
                assert stopped - paused <= 0.9 + 0.1
                proxy.open.set()
                await asyncio.sleep(1.0)  # a reaches Redis again: it stays a follower
                assert b.controls
                assert not a.controls
                assert a.holder is not None
                assert a.holder.ident == "host-b"


async def test_controls_turns_false_at_the_deadline_without_the_loop(redis_server: RedisServer) -> None:
    """Nothing renews (no run()): controls flips by the clock alone, and wait_changed returns then."""
    a = lease("host-a", redis_server.url, 0.4)
    before = time.monotonic()
    await a.step()
    after = time.monotonic()
    assert a.controls
    # The deadline is counted from the send time of the command that set the key's 0.4 s, less a
    # margin: it passes before the key expires in Redis. (Not a bound on how long the wait took: a busy
    # machine wakes the waiter late, which says nothing about the deadline.)
    sent = a._deadline - 0.4 * (1 - _MARGIN)
    assert before <= sent <= after
    await a.wait_changed(5.0)
    assert not a.controls
    assert time.monotonic() >= a._deadline  # flipped by the clock, at the deadline
    with pytest.raises(NotController):
        a.check()
    await a.release()


async def test_tokens_keep_growing_over_a_redis_that_lost_its_data(redis_server: RedisServer) -> None:
    a = lease("host-a", redis_server.url, 5.0)
    await a.step()
    await a.release()
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()  # a Redis restarted without its data
    finally:
        client.close()
    b = lease("host-b", redis_server.url, 5.0)
    await b.step()
    assert b.controls
    assert b.token > a.token  # an engine actor that saw a's token still takes b's
    await b.release()


async def test_the_same_replica_restarted_takes_its_lease_at_once(redis_server: RedisServer) -> None:
    old = lease("host-a", redis_server.url, 30.0)
    await old.step()
    assert old.controls
    await asyncio.sleep(0.01)  # the new process starts later
    new = lease("host-a", redis_server.url, 30.0)  # same consumer name, a new incarnation
    other = lease("host-b", redis_server.url, 30.0)
    await other.step()
    assert not other.controls  # a different replica waits for the lease
    await new.step()
    assert new.controls
    assert new.token > old.token
    await old.step()  # the old incarnation's renew finds the lease gone: it stops, and never takes it back
    assert not old.controls
    await old.step()
    assert not old.controls
    assert new.controls
    for x in (new, old, other):
        await x.release()


async def test_a_worker_never_takes_the_lease(redis_server: RedisServer) -> None:
    worker = ControlLease("host-a-w0", redis=RedisConn(redis_server.url, RedisConfig(), pooled=False),
                          candidate=False)
    await worker.step()
    assert not worker.controls  # even with nobody holding it
    a = lease("host-a", redis_server.url, 5.0)
    await a.step()
    await worker.step()
    assert worker.holder is not None
    assert worker.holder.ident == "host-a"
    for x in (a, worker):
        await x.release()


async def test_sole_control_without_redis() -> None:
    sole = ControlLease("alone")
    assert sole.controls
    assert abs(sole.token - time.time() * 1000) < 5000  # its start time: above earlier leases' tokens
    sole.check()
    await sole.wait_changed(0.01)
    assert sole.controls


async def test_the_engine_actor_refuses_an_older_token(tmp_path: Path) -> None:
    spec = LaunchSpec(fleet="f", index=0, engine="sim", model="m", engine_args={}, env={}, num_cpus=0.1,
                      num_gpus=0)
    actor = EngineActor(msgspec.json.encode(spec), 1, str(tmp_path), "127.0.0.1", 5)
    with pytest.raises(FencedOut):
        await actor.stop(1.0, 4)
    await actor.stop(1.0, 7)  # a newer controller's call passes, and raises the bar
    with pytest.raises(FencedOut):
        await actor.restart_engine(1.0, 5)
    assert (await actor.info())["token"] == 7


async def test_an_engine_restarted_meanwhile_is_not_restarted_twice(tmp_path: Path) -> None:
    """Two asks to restart the same generation (the old controller's, then the new one's after it
    adopted the dead engine): one restart."""
    spec = LaunchSpec(fleet="g", index=0, engine="sim", model="m", engine_args={"ttft-ms": 5})
    actor = EngineActor(msgspec.json.encode(spec), 1, str(tmp_path), "127.0.0.1", 1)
    await actor.start(1)
    try:
        first = await actor.restart_engine(1.0, 1, 1)
        again = await actor.restart_engine(1.0, 2, 1)  # the new controller still saw generation 1
        assert first["generation"] == again["generation"] == 2
        assert first["pid"] == again["pid"]
        assert (await actor.restart_engine(1.0, 2, 2))["generation"] == 3  # a restart of what runs
    finally:
        await actor.stop(2.0, 2)


async def test_the_ray_cluster_mutates_nothing_outside_a_term(redis_server: RedisServer) -> None:
    a, b = lease("host-a", redis_server.url, 5.0), lease("host-b", redis_server.url, 5.0)
    await a.step()
    await b.step()
    cluster = RayCluster("127.0.0.1:1", "ns", owns_connection=False, local_head=True, fence=b.check)
    with pytest.raises(NotController):
        await cluster.kill(object())  # refused before any Ray call (there is no Ray here)
    with pytest.raises(NotController):
        await cluster.remove_placement_group(object())
    with pytest.raises(NotController):
        await cluster.request_resources([])
    await a.release()
    await b.release()


def test_status_says_who_controls() -> None:
    control = {"controller": {"ident": "host-a", "token": 7, "since": 990.0, "incarnation": "1-ab"},
               "this": "host-b", "controls": False, "lease_s": 5.0}
    text = render({"fleets": {}, "control": control}, now=1000.0)
    assert text.splitlines()[0] == "control: host-a token=7 since 10.0s ago; this routerd: host-b (follows)"


def test_lease_s_is_bounded_and_set_from_the_environment() -> None:
    with pytest.raises(ConfigError) as e:
        parse({"control": {"lease_s": 0.1}}, environ={})
    assert any(p.startswith("$.control.lease_s") for p in e.value.problems), e.value.problems
    assert parse({}, environ={"ROUTERD_CONTROL_LEASE_S": "2.5"}).control.lease_s == 2.5
    assert parse({}, environ={}).control.lease_s == 5.0


# -- across a failover: a promoted replica that lacks the last writes ------------------------------

@contextlib.asynccontextmanager
async def master_and_lagging_replica(tmp_path: Path, healthy: int = 0) -> AsyncIterator[
        tuple[RedisServer, RedisServer, PausableProxy]]:
    """A master, and a replica that reaches it through a proxy: pausing the proxy makes the replica lag
    (the master still counts it connected), as an asynchronous replica can when its master dies. Plus
    ``healthy`` replicas connected directly, which never lag."""
    (tmp_path / "master").mkdir()
    master = RedisServer(tmp_path / "master", extra_args=("--repl-diskless-sync-delay", "0"))
    master.start()
    servers = [master]
    try:
        async with PausableProxy(master.port) as link:
            for i, port in enumerate([link.port] + [master.port] * healthy):
                (tmp_path / f"replica{i}").mkdir()
                servers.append(RedisServer(tmp_path / f"replica{i}",
                                           extra_args=("--replicaof", "127.0.0.1", str(port))))
                servers[-1].start()
            probe = redis.asyncio.Redis(port=master.port, socket_timeout=2)
            try:
                end = time.monotonic() + 20
                while len((await probe.execute_command("ROLE"))[2]) < 1 + healthy:
                    assert time.monotonic() < end, "the replicas never synced"
                    await asyncio.sleep(0.05)
            finally:
                await probe.aclose()
            yield master, servers[1], link
    finally:
        for server in servers:
            server.kill()


async def promote(server: RedisServer) -> None:
    client = redis.asyncio.Redis(port=server.port, socket_timeout=2)
    try:
        await client.execute_command("REPLICAOF", "NO", "ONE")
    finally:
        await client.aclose()


async def test_a_failover_to_a_replica_without_the_last_renew_never_gives_two_controllers(
        tmp_path: Path) -> None:
    """The holder's renewals stop reaching one of two replicas (the other has them all); the master is
    SIGKILLed and the lagging one promoted (Sentinel may pick either), and the other routerd's client
    follows it there. The holder's term ends before the lease lapses on the promoted replica — it counted
    only what every replica had — so the other never controls at the same time, and its token is
    higher."""
    async with master_and_lagging_replica(tmp_path, healthy=1) as (master, replica, link), \
            PausableProxy(master.port) as follow:  # b's way to "the master", wherever it is
        a, b = lease("host-a", master.url, 3.0), lease("host-b", follow.url, 3.0)
        async with running(a, b):
            await until(lambda: a.controls, 10)
            await until(lambda: b.holder is not None and b.holder.ident == "host-a", 10)
            link.open.clear()  # from now on the replica sees nothing
            renewed = a._deadline
            await until(lambda: a._deadline != renewed or a._unreplicated, 5)  # a renew the replica lacks
            master.kill()
            follow.target = replica.port
            await promote(replica)
            stopped, started = await _handover(a, b, time.monotonic(), 15)
            assert stopped < started
            assert b.token > a.token
            assert not a.controls


async def test_a_take_starts_above_every_token_its_taker_saw(tmp_path: Path) -> None:
    """A term the replica never had (its counter and clock far behind the master's): a replica that
    read that holder takes a token above it on the promoted replica."""
    async with master_and_lagging_replica(tmp_path) as (master, replica, link), \
            PausableProxy(master.port) as follow:
        link.open.clear()
        client = redis.asyncio.Redis(port=master.port)
        try:  # the master's counter far ahead (many terms, or a clock ahead): the replica lacks it
            counter = RedisKeys.from_config(RedisConfig()).control_token()
            await client.set(counter, int(time.time() * 1000) + 10**9)
        finally:
            await client.aclose()
        a, b = lease("host-a", master.url, 3.0), lease("host-b", follow.url, 3.0)
        await a.step()
        assert not a.controls  # its take reached no replica: it is no term of control
        assert a.holder is not None
        ahead = a.holder.token
        assert ahead > time.time() * 1000 + 10**8
        await b.step()
        assert b.seen == ahead
        master.kill()
        follow.target = replica.port
        await promote(replica)
        end = time.monotonic() + 10
        while not b.controls:
            assert time.monotonic() < end, "b never took control"
            await b.step()
            await asyncio.sleep(0.05)
        assert b.token > ahead
        await b.release()
        await a.release()


async def test_a_term_goes_above_the_token_an_engine_holds(redis_server: RedisServer,
                                                           tmp_path: Path) -> None:
    """An engine holds a token from a term Redis lost: the new controller raises its own above it,
    keeping the lease, and the engine takes its commands; Redis hands out higher tokens from then on."""
    lost = int(time.time() * 1000) + 10**9
    spec = LaunchSpec(fleet="f", index=0, engine="sim", model="m", engine_args={}, env={}, num_cpus=0.1,
                      num_gpus=0)
    actor = EngineActor(msgspec.json.encode(spec), 1, str(tmp_path), "127.0.0.1", lost)
    b = lease("host-b", redis_server.url, 5.0)
    await b.step()
    assert b.controls
    with pytest.raises(FencedOut):
        await actor.stop(1.0, b.token)
    assert await b.raise_above((await actor.info())["token"])
    assert b.token > lost
    await actor.stop(1.0, b.token)
    await b.step()  # the raised value is the lease's: renewing it keeps control
    assert b.controls
    c = lease("host-c", redis_server.url, 5.0)
    await c.step()
    assert c.holder is not None
    assert (c.holder.ident, c.holder.token) == ("host-b", b.token)
    await b.release()
    await c.step()
    assert c.token > b.token
    await c.release()


async def test_a_term_that_lapsed_unobserved_is_counted_ended_before_the_next(
        redis_server: RedisServer) -> None:
    """Nothing ran between the take and its deadline (a start-up slower than the lease): the next step
    takes a new term, and reports the old one ended first — a log of terms has no term that silently
    changed its token."""
    a = lease("host-a", redis_server.url, 0.3)
    await a.step()
    first = a.token
    await asyncio.sleep(0.35)  # past the deadline, with nothing watching
    await a.step()
    assert a.controls
    assert a.token > first
    assert (a.acquisitions, a.losses) == (2, 1)
    await a.release()
