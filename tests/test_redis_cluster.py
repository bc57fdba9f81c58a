"""``[redis] cluster = true`` on a real three-master Redis Cluster: every key under one hash tag, so
the queue's Lua scripts, transactions and pipelines and the rate limiter's script run on the one master
of that slot; routerd and the producers' client find that master from any node and follow the slot
when it moves. Off, the names are today's."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from redis.crc import key_slot

from routerd.client import QueueClient
from routerd.config import parse
from routerd.redis_conn import RedisConn
from routerd.redis_keys import RedisKeys
from routerd.tenants.service import Tenancy
from tests.fixtures.helpers import routerd_cli, until
from tests.fixtures.redis_cluster import RedisCluster
from tests.fixtures.redis_server import FakeUpstream, QueueBench

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


def test_the_setting_puts_every_name_under_one_tag_and_leaves_them_alone_without_it() -> None:
    plain = parse({"redis": {"stream": "routerd:requests"}}, environ={}).redis
    assert (plain.stream, plain.dead_stream) == ("routerd:requests", "routerd:dead")
    on = parse({"redis": {"cluster": True, "dead_stream": "dead-letters"}}, environ={}).redis
    keys = RedisKeys.from_config(on)
    names = [keys.stream, keys.dead, keys.done("j"), keys.status("j"), keys.reply("j"), keys.ratelimit("t"),
             keys.usage("2026-01-01"), keys.control_lease(), keys.control_token(), keys.fleet_state(),
             keys.admin_calls(), keys.batch("b"), keys.response("r"), keys.consumer("c"), keys.processes]
    assert names[:2] == ["{routerd}:requests", "{routerd}:dead-letters"]
    assert len({key_slot(n.encode()) for n in names}) == 1, names
    # the producers' client, given the config's stream name as it is written, makes the same names
    assert RedisKeys.for_stream("routerd:requests", cluster=True).done("j") == keys.done("j")


async def test_the_queue_and_the_rate_limiter_run_on_a_cluster_and_follow_their_slot_when_it_moves(
        redis_cluster: RedisCluster) -> None:
    slot = key_slot(b"{routerd}")
    owner = redis_cluster.owner(slot)
    elsewhere = [n for n in redis_cluster.nodes if n is not owner]
    seed = elsewhere[0].url  # any node: the slot's master is asked of it
    cfg = parse({"redis": {"url": seed, "cluster": True, "consumer": "c1", "block_ms": 200,
                           "reclaim_idle_ms": 500, "reclaim_interval_s": 0.2, "op_timeout_s": 2.0},
                 "fleets": [{"name": "f", "model": "m", "engine": "sim"}],
                 "tenants": [{"name": "team", "api_keys": ["sk-t"], "requests_per_minute": 3}]}, environ={})
    bench = QueueBench(cfg, FakeUpstream())
    producer = QueueClient.from_url(seed, cluster=True)
    # two processes' rate limiters, sharing the tenant's bucket in the cluster
    conns = [RedisConn(seed, cfg.redis) for _ in range(2)]
    tenancies = [Tenancy(cfg, c) for c in conns]
    team: Any = tenancies[0].directory.get("team")
    tasks = [asyncio.create_task(t.run()) for t in tenancies]
    await bench.start()
    try:
        jobs = await producer.submit_many([BODY] * 40)
        results = await asyncio.gather(*(producer.wait(j, timeout=60) for j in jobs))
        assert [r.status for r in results] == ["ok"] * 40
        # routerd submit, the cluster setting from the environment; a reply_to in another slot is the
        # job's own fault (dead-lettered, its result kept), not the queue's
        code, out, err = await routerd_cli("submit", "--model", "m", "--wait", "hi", env={
            "ROUTERD_REDIS_URL": seed, "ROUTERD_REDIS_CLUSTER": "true"})
        assert code == 0, out + err
        assert '"status":"ok"' in out
        with pytest.raises(ValueError, match="another slot"):
            await producer.submit(BODY, reply_to="elsewhere:replies")
        stray = "stray-0001"
        await producer.redis.xadd("{routerd}:requests", {"job": msgspec.json.encode(
            {"id": stray, "endpoint": "/v1/completions", "body": BODY, "reply_to": "elsewhere:replies"})})
        await until(lambda: producer.result(stray), timeout=30, what="the stray job's result")
        stray_result = await producer.result(stray)
        assert stray_result is not None
        assert stray_result.status == "error"
        assert stray_result.error is not None
        assert "another slot" in stray_result.error["message"]
        grants = [await tenancies[i % 2].limiter.acquire(team, 0) for i in range(4)]
        assert [g.allowed for g in grants] == [True, True, True, False]
        assert all(t.limiter.shared and t.limiter.redis_errors == 0 for t in tenancies)
        # everything is in the one slot, on its master: nothing on the other nodes
        assert owner.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0
        assert owner.client().exists("{routerd}:requests", "{routerd}:ratelimit:team") == 2
        assert [n.client().dbsize() for n in elsewhere] == [0, 0]

        # resharding: the slot and its keys go to another master while routerd runs
        await asyncio.to_thread(redis_cluster.move, slot, elsewhere[1])
        assert redis_cluster.owner(slot) is elsewhere[1]
        streamed = await producer.submit({**BODY, "stream": True, "max_tokens": 3})  # its chunks' script
        jobs = await producer.submit_many([BODY] * 20)
        results = await asyncio.gather(*(producer.wait(j, timeout=60) for j in jobs))
        assert [r.status for r in results] == ["ok"] * 20
        *chunks, last = [item async for item in producer.chunks(streamed, timeout=60)]
        assert "".join(c.data["choices"][0]["text"] for c in chunks) == "t0t1t2"
        assert last.status == "ok"
        # the bucket moved with the slot: still empty, as both limiters see it once they ask Redis again
        for t in tenancies:
            await until(lambda t=t: t.limiter.shared, timeout=30, what="the limiter asks Redis again")
            assert not (await t.limiter.acquire(team, 0)).allowed
        assert elsewhere[1].client().hget("{routerd}:ratelimit:team", "r") is not None
        assert owner.client().dbsize() == 0
        # one result each, in its reply stream on the slot's new master
        replies = [n for n in elsewhere[1].client().scan_iter(match="{routerd}:reply:*", count=1000)]
        assert len(replies) == 62  # and routerd submit's, and the streamed job's
        assert sorted(elsewhere[1].client().xlen(r) for r in replies)[:-1] == [1] * 61  # one result each
    finally:
        await bench.stop()
        await producer.aclose()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            await c.aclose()

