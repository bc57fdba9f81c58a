"""Redis over TLS with client certificates, as a least-privilege ACL user: routerd (its lease, queue,
rate limits and usage), the producers' client, ``routerd submit`` and ``routerd usage``, against a real
redis-server with ``tls-auth-clients yes`` and the users ``routerd redis-acl`` prints. And what an
operator sees when it goes wrong: a failed handshake, a right the user lacks — one log line, a reason
in ``/readyz``, and a routerd that keeps running."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import msgspec
import redis.asyncio as aioredis

from routerd.client import QueueClient
from routerd.config import RedisConfig
from routerd.redis_acl import ROUTERD_COMMANDS, acl_file
from tests.fixtures.daemon import RouterdFactory, RouterdProcess, base_config
from tests.fixtures.helpers import routerd_cli
from tests.fixtures.redis_tls import TlsFiles, TlsRedisFactory
from tests.fixtures.sim import SimProcessFactory

ROUTERD_PW = "routerd-pw-Tls1"
PRODUCER_PW = "producer-pw-Tls2"
T = TypeVar("T")


def _users() -> str:
    """routerd's and a producer's users as ``routerd redis-acl`` prints them (passwords hashed in), and
    ``lacking``: routerd's rules without XAUTOCLAIM (the queue's reclaim)."""
    text = acl_file(RedisConfig(), routerd_user="routerd", producer_user="producer",
                    producer_prefix="producer-", routerd_password=ROUTERD_PW, producer_password=PRODUCER_PW)
    routerd_line = text.splitlines()[0]
    assert "xautoclaim" in ROUTERD_COMMANDS
    lacking = routerd_line.replace("user routerd ", "user lacking ", 1).replace(" +xautoclaim", "")
    return text + lacking + "\n"


async def _wait(get: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout: float) -> T:
    """``get()`` again until ``ok`` of it, or fail the test after ``timeout`` seconds; its last value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not ok(got := await get()):
        assert asyncio.get_running_loop().time() < deadline, f"still {got!r} after {timeout} s"
        await asyncio.sleep(0.1)
    return got


async def _readyz(s: aiohttp.ClientSession, rp: RouterdProcess) -> tuple[int, dict[str, Any]]:
    async with s.get(f"{rp.url}/readyz") as r:
        return r.status, await r.json()


async def test_routerd_a_producer_and_the_tools_work_over_tls_with_client_certificates_as_acl_users(
        tmp_path: Path, tls_files: TlsFiles, tls_redis_server: TlsRedisFactory,
        routerd_process: RouterdFactory, sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m", ttft_ms=1, itl_ms=1)
    server = tls_redis_server(_users())
    tls = {"ssl_ca_certs": str(tls_files.ca), "ssl_certfile": str(tls_files.client_cert),
           "ssl_keyfile": str(tls_files.client_key)}
    cfg = base_config(
        tmp_path / "r1",
        redis={"enabled": True, "url": server.tls_url, "username": "routerd", "consumer": "r1",
               "block_ms": 200, **tls},
        fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}],
        tenants=[{"name": "team", "api_keys": ["sk-team-Tls3"], "requests_per_minute": 2}])
    rp = await asyncio.to_thread(routerd_process, cfg, env={"ROUTERD_REDIS_PASSWORD": ROUTERD_PW})
    plain = aioredis.Redis.from_url(server.url, socket_timeout=10)  # default, on the plain port
    producer = QueueClient.from_url(server.tls_url, username="producer", password=PRODUCER_PW,
                                    id_prefix="producer-", ssl_ca_certs=str(tls_files.ca),
                                    ssl_certfile=str(tls_files.client_cert),
                                    ssl_keyfile=str(tls_files.client_key))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            await _wait(lambda: _readyz(s, rp), lambda got: got[0] == 200, timeout=30)
            async with s.get(f"{rp.url}/admin/fleets") as r:  # loopback: no admin key needed
                assert (await r.json())["control"]["controls"] is True  # the lease, over TLS
            statuses = []
            for _ in range(3):  # the tenant's limit, kept in Redis
                async with s.post(f"{rp.url}/v1/completions", json={"model": "m", "prompt": "hi"},
                                  headers={"Authorization": "Bearer sk-team-Tls3"}) as r:
                    statuses.append(r.status)
            assert statuses == [200, 200, 429]

        # the queue, through the producers' client with its own certificate
        job = await producer.submit({"model": "m", "prompt": "over tls", "max_tokens": 3})
        assert (await producer.wait(job, timeout=30)).status == "ok"
        # routerd submit: the URL, user and TLS files from the environment
        code, out, err = await routerd_cli("submit", "--model", "m", "--wait", "from the command line", env={
            "ROUTERD_REDIS_URL": server.tls_url, "ROUTERD_REDIS_USERNAME": "producer",
            "ROUTERD_REDIS_PASSWORD": PRODUCER_PW, "ROUTERD_ID_PREFIX": "producer-",
            "ROUTERD_REDIS_SSL_CA_CERTS": str(tls_files.ca),
            "ROUTERD_REDIS_SSL_CERTFILE": str(tls_files.client_cert),
            "ROUTERD_REDIS_SSL_KEYFILE": str(tls_files.client_key)})
        assert code == 0, out + err
        assert '"status":"ok"' in out

        # routerd usage, from the daemon's config (its TLS files and user), as routerd's user
        async def usage() -> list[dict[str, Any]]:
            code, out, err = await routerd_cli("usage", "--config", str(rp.config_path), "--json",
                                        env={"ROUTERD_REDIS_PASSWORD": ROUTERD_PW})
            assert code == 0, out + err
            rows: list[dict[str, Any]] = msgspec.json.decode(out)["rows"]
            return rows

        rows = await _wait(usage, lambda rows: any(r["tenant"] == "team" for r in rows), timeout=30)
        assert sum(r["requests"] for r in rows if r["tenant"] == "team") == 2

        # nothing routerd did was refused
        assert [e for e in await plain.acl_log(count=500) if e.get("username") == "routerd"] == []
        # and a client without a certificate is not let in
        bare = aioredis.Redis.from_url(server.tls_url, username="producer", password=PRODUCER_PW,
                                       ssl_ca_certs=str(tls_files.ca), socket_timeout=5)
        try:
            await _wait(lambda: _refused_ping(bare), bool, timeout=10)
        finally:
            await bare.aclose()
    finally:
        await producer.aclose()
        await plain.aclose()


async def _refused_ping(client: aioredis.Redis) -> bool:
    try:
        await client.ping()
    except (aioredis.ConnectionError, OSError):
        return True
    return False


async def test_a_failed_handshake_and_a_missing_right_are_logged_once_and_said_by_readyz(
        tmp_path: Path, tls_files: TlsFiles, tls_redis_server: TlsRedisFactory,
        routerd_process: RouterdFactory, sim_process: SimProcessFactory) -> None:
    sim = await sim_process(model="m", ttft_ms=1, itl_ms=1)
    server = tls_redis_server(_users())
    client_cert = {"ssl_certfile": str(tls_files.client_cert), "ssl_keyfile": str(tls_files.client_key)}

    def cfg(name: str, **redis: Any) -> dict[str, Any]:
        return base_config(tmp_path / name, redis={
            "enabled": True, "url": server.tls_url, "consumer": name, "block_ms": 200,
            "reclaim_interval_s": 0.2, **client_cert, **redis},
            fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}])

    # a CA that did not sign the server's certificate; a user without XAUTOCLAIM (the queue's reclaim)
    untrusting = await asyncio.to_thread(
        routerd_process, cfg("untrusting", username="routerd", ssl_ca_certs=str(tls_files.other_ca)),
        wait_ready=False, env={"ROUTERD_REDIS_PASSWORD": ROUTERD_PW})
    lacking = await asyncio.to_thread(
        routerd_process, cfg("lacking", username="lacking", ssl_ca_certs=str(tls_files.ca)),
        wait_ready=False, env={"ROUTERD_REDIS_PASSWORD": ROUTERD_PW})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async def reason(rp: RouterdProcess) -> str:
            try:
                status, body = await _readyz(s, rp)
            except aiohttp.ClientError:
                return ""  # not listening yet
            assert status == 503 or "redis" not in body
            return str(body.get("redis", ""))

        tls_reason = await _wait(lambda: reason(untrusting), bool, timeout=60)
        assert "TLS handshake" in tls_reason, tls_reason
        assert "CERTIFICATE_VERIFY_FAILED" in tls_reason, tls_reason
        acl_reason = await _wait(lambda: reason(lacking), bool, timeout=60)
        assert "XAUTOCLAIM on routerd:requests" in acl_reason, acl_reason
        assert "NOPERM" in acl_reason, acl_reason
        # it keeps retrying (the queue's reads and reclaims), and says so once
        await _wait(lambda: _count(server.client(), "lacking"), lambda n: n >= 3, timeout=30)
    for rp in (untrusting, lacking):
        assert rp.proc.poll() is None, rp.log()  # running: no crash, no restart loop
    assert untrusting.log().count("redis_refused_tls") == 1, untrusting.log()
    assert lacking.log().count("redis_refused_command") == 1, lacking.log()


async def _count(client: Any, user: str) -> int:
    """How many times Redis refused ``user`` (``ACL LOG``'s count of its entry)."""
    entries = await asyncio.to_thread(client.acl_log, 100)
    return sum(int(e.get("count", 1)) for e in entries if e.get("username") == user)
