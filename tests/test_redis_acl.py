"""Least-privilege Redis: the users ``routerd redis-acl`` prints, loaded into a real redis-server.

routerd runs as its user (two processes: the controller and a follower, so the control lease, the
published fleet state, the admin relay, queue jobs and shared rate limits all go through Redis) and is
never refused a command (``ACL LOG`` stays empty of its user); a producer's client works as the
producer user and is refused (``NOPERM``) everything but the request stream and its own jobs' keys.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from routerd.client import QueueClient
from routerd.config import RedisConfig, parse
from routerd.redis_acl import acl_file
from routerd.redis_keys import RedisKeys
from tests.fixtures.daemon import RouterdFactory, base_config, to_toml
from tests.fixtures.helpers import routerd_cli
from tests.fixtures.redis_server import AclRedisFactory
from tests.fixtures.sim import SimProcessFactory

ROUTERD_PW = "routerd-pw-Acl1"
PRODUCER_PW = "producer-pw-Acl2"
KEYS = RedisKeys()


async def _refused(call: Callable[[], Any]) -> str:
    """The NOPERM error ``call`` gets (the test fails if it is allowed)."""
    with pytest.raises(redis.exceptions.NoPermissionError) as e:
        await call()
    return str(e.value)


def _denied(log: list[Any], user: str) -> list[Any]:
    return [entry for entry in log if entry.get("username") == user]


async def test_routerd_and_a_producer_work_with_the_printed_acl_and_the_producer_gets_nothing_else(
        tmp_path: Path, acl_redis_server: AclRedisFactory, routerd_process: RouterdFactory,
        sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m", ttft_ms=1, itl_ms=1)

    def cfg(consumer: str, redis_url: str) -> dict[str, Any]:
        return base_config(
            tmp_path / consumer,
            redis={"enabled": True, "url": redis_url, "username": "routerd", "consumer": consumer,
                   "block_ms": 200, "reclaim_idle_ms": 1000, "reclaim_interval_s": 0.25},
            http={"admin_api_key": "adm-key-Acl3"},
            fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}],
            tenants=[{"name": "team", "api_keys": ["sk-team-Acl4"], "requests_per_minute": 3}])

    # the rules, as an operator gets them: from the config, the routerd user's password hashed in
    written = tmp_path / "for-acl.toml"
    written.write_text(to_toml(cfg("r1", "redis://127.0.0.1:1/0")))
    code, acl, err = await routerd_cli("redis-acl", "--config", str(written),
                                env={"ROUTERD_REDIS_PASSWORD": ROUTERD_PW})
    assert code == 0, err
    assert ROUTERD_PW not in acl
    routerd_line, producer_line = acl.splitlines()
    server = acl_redis_server(f"{routerd_line}\n{producer_line} >{PRODUCER_PW}\n")
    admin = aioredis.Redis.from_url(server.url, socket_timeout=10)
    env = {"ROUTERD_REDIS_PASSWORD": ROUTERD_PW}
    first = await asyncio.to_thread(routerd_process, cfg("r1", server.url), env=env)
    second = await asyncio.to_thread(routerd_process, cfg("r2", server.url), env=env)
    producer = QueueClient.from_url(server.url, username="producer", password=PRODUCER_PW,
                                    id_prefix="producer-")
    raw: Any = producer.redis
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            # fleet control: one of the two holds the lease, the other follows its published state
            async def controls() -> list[bool]:
                out = []
                for rp in (first, second):
                    async with s.get(f"{rp.url}/admin/fleets",
                                     headers={"Authorization": "Bearer adm-key-Acl3"}) as r:
                        out.append(bool((await r.json())["control"]["controls"]))
                return out

            deadline = asyncio.get_running_loop().time() + 30
            while sorted(await controls()) != [False, True]:
                assert asyncio.get_running_loop().time() < deadline, await controls()
                await asyncio.sleep(0.2)
            follower = second if (await controls())[0] else first
            # an admin call on the follower is relayed to the controller through Redis, and answered
            for op in ("drain", "undrain"):
                async with s.post(f"{follower.url}/admin/instances/f:static0/{op}",
                                  headers={"Authorization": "Bearer adm-key-Acl3"}) as r:
                    assert r.status == 200, await r.text()
            # shared rate limits: 3 a minute over both processes
            statuses = []
            for i in range(5):
                async with s.post(f"{(first, second)[i % 2].url}/v1/completions",
                                  headers={"Authorization": "Bearer sk-team-Acl4"},
                                  json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                    statuses.append(r.status)
            assert sorted(statuses) == [200, 200, 200, 429, 429]
            # stored conversations (conversations/store.py): made on one process, changed on the other
            team = {"Authorization": "Bearer sk-team-Acl4"}
            async with s.post(f"{first.url}/v1/conversations", headers=team,
                              json={"items": [{"role": "user", "content": "a"}]}) as r:
                assert r.status == 200, await r.text()
                conv = (await r.json())["id"]
            async with s.post(f"{second.url}/v1/conversations/{conv}/items", headers=team,
                              json={"items": [{"role": "user", "content": "b"}]}) as r:
                added = (await r.json())["first_id"]
            async with s.delete(f"{first.url}/v1/conversations/{conv}/items/{added}", headers=team) as r:
                assert r.status == 200, await r.text()
            async with s.get(f"{second.url}/v1/conversations/{conv}/items", headers=team) as r:
                assert [i["content"] for i in (await r.json())["data"]] == ["a"]
            async with s.delete(f"{second.url}/v1/conversations/{conv}", headers=team) as r:
                assert r.status == 200, await r.text()

        # the producer's client: submit, wait, status, cancel — as the producer user
        job = await producer.submit({"model": "m", "prompt": "as a producer", "max_tokens": 3})
        assert job.id.startswith("producer-")
        result = await producer.wait(job, timeout=30)
        assert result.status == "ok", result
        assert (await producer.status(job)).state == "done"
        streamed = await producer.submit({"model": "m", "prompt": "streamed", "max_tokens": 3,
                                          "stream": True})
        items = [item async for item in producer.chunks(streamed, timeout=30)]
        assert len(items) > 1
        await producer.cancel(streamed)
        await raw.delete(job.reply_to, streamed.reply_to)  # it cleans up its own reply streams
        # routerd submit, as the producer user (the password from the environment, not argv)
        code, out, err = await routerd_cli("submit", "--model", "m", "--wait", "from the command line", env={
            "ROUTERD_REDIS_URL": server.url, "ROUTERD_REDIS_USERNAME": "producer",
            "ROUTERD_REDIS_PASSWORD": PRODUCER_PW, "ROUTERD_ID_PREFIX": "producer-"})
        assert code == 0, out + err
        assert '"status":"ok"' in out

        # a reply_to routerd's user may not write: that job alone is dead-lettered (its result kept in
        # its done record), the job read beside it is served
        stray = await producer.submit({"model": "m", "prompt": "stray", "max_tokens": 2},
                                      reply_to="elsewhere:replies")
        beside = await producer.submit({"model": "m", "prompt": "beside it", "max_tokens": 2})
        assert (await producer.wait(beside, timeout=30)).status == "ok"
        deadline = asyncio.get_running_loop().time() + 30
        while (stray_result := await producer.result(stray.id)) is None:
            assert asyncio.get_running_loop().time() < deadline, "the stray job got no result"
            await asyncio.sleep(0.1)
        assert stray_result.status == "error"
        assert stray_result.error is not None
        assert "not a key routerd's Redis user may write" in stray_result.error["message"]

        # everything else is refused to the producer
        other = "other-0001"
        refusals = [
            await _refused(lambda: raw.xadd(KEYS.admin_calls(), {"call": b"x"})),
            await _refused(lambda: raw.hgetall(KEYS.fleet_state())),
            await _refused(lambda: raw.hset(KEYS.fleet_state(), "state", b"x")),
            await _refused(lambda: raw.hset(KEYS.replicas(), "f", b"9")),
            await _refused(lambda: raw.get(KEYS.control_lease())),
            await _refused(lambda: raw.hgetall(KEYS.ratelimit("team"))),
            await _refused(lambda: raw.delete(KEYS.ratelimit("team"))),
            await _refused(lambda: raw.hgetall(KEYS.usage("2026-01-01"))),
            await _refused(lambda: raw.xrange(KEYS.stream)),  # other producers' prompts
            await _refused(lambda: raw.xreadgroup("routerd", "me", {KEYS.stream: ">"})),
            await _refused(lambda: raw.xread({KEYS.reply(other): "0-0"})),  # another's reply stream
            await _refused(lambda: raw.delete(KEYS.reply(other))),
            await _refused(lambda: raw.get(KEYS.done(other))),
            await _refused(lambda: raw.set(KEYS.done(job.id), b"forged")),  # even its own result
            await _refused(lambda: raw.set(KEYS.cancel(other), b"1")),
            await _refused(lambda: raw.xadd(KEYS.dead, {"x": b"1"})),
            await _refused(lambda: raw.publish("routerd:fleet:changed", b"1")),
            await _refused(lambda: raw.keys("*")),
        ]
        assert all("NOPERM" in r or "permission" in r for r in refusals), refusals
        # nothing routerd did was refused, in either process, but the stray job's reply_to
        denied = _denied(await admin.acl_log(count=500), "routerd")
        assert [(d["reason"], d["object"]) for d in denied] == [("key", "elsewhere:replies")], denied
    finally:
        await producer.aclose()
        await admin.aclose()


def test_rules_escape_glob_characters_and_cover_streams_outside_the_namespace() -> None:
    cfg = RedisConfig(stream="app[1]:jobs", dead_stream="dead-letters")
    text = acl_file(cfg, routerd_user="rd", producer_user="p1", producer_prefix="team*a-",
                    reply_patterns=("results:*",))
    routerd_line, producer_line = text.splitlines()
    assert routerd_line.startswith("user rd reset on resetchannels -@all +select ")
    assert routerd_line.endswith(r" ~app\[1\]:* ~dead-letters ~results:* &app\[1\]:*")
    assert producer_line.endswith(
        r" %W~app\[1\]:jobs ~app\[1\]:reply:team\*a-* %R~app\[1\]:done:team\*a-* ~app\[1\]:job:team\*a-*"
        r" %W~app\[1\]:cancel:team\*a-* ~results:* &app\[1\]:cancel")
    # [redis] cluster: the tagged names, and CLUSTER SLOTS to find the slot's master
    on_cluster = acl_file(parse({"redis": {"cluster": True}}, environ={}).redis, routerd_user="rd",
                          producer_user="p1", producer_prefix="p1-")
    for line in on_cluster.splitlines():
        assert " +cluster|slots " in line, line
    assert on_cluster.splitlines()[0].endswith(" ~{routerd}:* &{routerd}:*")
    assert " %W~{routerd}:requests ~{routerd}:reply:p1-* " in on_cluster.splitlines()[1]
    assert "cluster" not in text
    hashed = acl_file(RedisConfig(), routerd_user="rd", producer_user="p1", producer_prefix="p1-",
                      routerd_password="s3cret-pw")
    assert "s3cret-pw" not in hashed
    assert "#" + hashlib.sha256(b"s3cret-pw").hexdigest() in hashed.splitlines()[0]
    for bad, why in (({"routerd_user": "r d"}, "letters, digits"), ({"producer_user": "rd"}, "must differ"),
                     ({"producer_prefix": ""}, "empty or holds white space"),
                     ({"producer_prefix": "a b"}, "empty or holds white space")):
        with pytest.raises(ValueError, match=why):
            acl_file(RedisConfig(), **{"routerd_user": "rd", "producer_user": "p1", "producer_prefix": "x-",
                                       **bad})
