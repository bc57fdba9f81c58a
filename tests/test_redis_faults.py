"""What Redis refuses a routerd, told apart from an outage and from a job's bad ``reply_to``: the
reason ``/readyz`` gives, how long it holds, and the one log line (injected clock, no Redis needed;
tests/test_redis_tls.py sees the same against a real TLS server)."""

from __future__ import annotations

import ssl

import pytest
import redis.exceptions
import structlog

from routerd.config import RedisConfig
from routerd.redis_conn import RedisConn
from routerd.redis_faults import RedisFaults, command_and_key
from tests.fixtures.redis_server import AclRedisFactory


def test_the_command_and_key_a_refusal_names() -> None:
    assert command_and_key([b"HSET", b"routerd:job:1", b"state", b"x"]) == ("HSET", "routerd:job:1")
    assert command_and_key(["EVALSHA", "abc", "2", "routerd:done:1", "r:1"]) == ("EVALSHA", "routerd:done:1")
    assert command_and_key(["EVALSHA", "abc", "0", "packed"]) == ("EVALSHA", "")
    assert command_and_key(["XREADGROUP", "GROUP", "g", "c", "COUNT", "5", "STREAMS", "routerd:requests",
                            ">"]) == ("XREADGROUP", "routerd:requests")
    assert command_and_key(["SCRIPT", "LOAD", "return 1"]) == ("SCRIPT LOAD", "")
    assert command_and_key(["XGROUP", "CREATE", "routerd:requests", "g", "$"]) == ("XGROUP CREATE",
                                                                                    "routerd:requests")
    assert command_and_key(None) == ("", "")  # not known


def test_a_refusal_is_said_once_kept_while_it_recurs_and_dropped_a_minute_after() -> None:
    now = [1000.0]
    faults = RedisFaults(owns=lambda key: key.startswith("routerd:"), clock=lambda: now[0])
    refused = redis.exceptions.NoPermissionError(
        "this user has no permissions to run the 'xautoclaim' command")
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            faults.refused("h:1", ["XAUTOCLAIM", "routerd:requests", "g", "c", "0"], refused)
            now[0] += 10
        # a producer's reply_to is the job's fault: neither logged here nor a reason to be unready
        faults.refused("h:1", ["XADD", "elsewhere:replies", "*", "result", "x"], refused)
    assert [e["event"] for e in logs] == ["redis_refused_command"]
    assert logs[0]["command"] == "XAUTOCLAIM"
    assert logs[0]["key"] == "routerd:requests"
    assert faults.problem() == ("Redis refused routerd's user XAUTOCLAIM on routerd:requests: NOPERM this "
                                "user has no permissions to run the 'xautoclaim' command")
    now[0] += 61  # the right was given: no refusal for a minute
    assert faults.problem() == ""


def test_a_failed_handshake_or_login_holds_until_a_connection_succeeds_and_an_outage_is_not_one() -> None:
    faults = RedisFaults()
    with structlog.testing.capture_logs() as logs:
        faults.connect_failed("h:1", redis.exceptions.ConnectionError("Connection refused"))
        assert faults.problem() == ""  # an outage
        handshake = redis.exceptions.ConnectionError("Error connecting")
        handshake.__cause__ = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED]")
        for _ in range(3):
            faults.connect_failed("h:1", handshake)
        assert faults.problem().startswith("TLS handshake with h:1 failed:")
        faults.connected("h:1")
        assert faults.problem() == ""
        faults.connect_failed("h:1", redis.exceptions.AuthenticationError("invalid username-password pair"))
        assert faults.problem() == "Redis at h:1 refused the login: invalid username-password pair"
    assert [e["event"] for e in logs] == ["redis_refused_tls", "redis_accepted", "redis_refused_login"]


async def test_a_refusal_inside_a_pipeline_or_transaction_names_its_command_and_key(
        acl_redis_server: AclRedisFactory) -> None:
    """A real Redis: the user may not HINCRBY; the refusal comes back among other commands' answers."""
    server = acl_redis_server("user rd on >pw-Fa1 resetchannels -@all +select +ping +set +get +hello +multi "
                              "+exec +discard ~routerd:*\n")
    faults = RedisFaults(owns=lambda key: key.startswith("routerd:"))
    conn = RedisConn(server.url, RedisConfig(username="rd", password="pw-Fa1"), faults=faults)
    r = conn.ops()
    try:
        assert await r.set("routerd:a", b"1")
        pipe = r.pipeline(transaction=False)
        pipe.set("routerd:b", b"1")
        pipe.hincrby("routerd:usage:2026-01-01", "t|f|requests", 1)
        pipe.get("routerd:a")
        replies = await pipe.execute(raise_on_error=False)
        assert isinstance(replies[1], redis.exceptions.NoPermissionError)
        assert replies[2] == b"1"
        assert faults.problem().startswith(
            "Redis refused routerd's user HINCRBY on routerd:usage:2026-01-01: NOPERM"), faults.problem()
        tx = r.pipeline(transaction=True)
        tx.set("routerd:c", b"1")
        tx.expire("routerd:c", 10)
        with pytest.raises(redis.exceptions.ResponseError):
            await tx.execute()
        assert faults.problem().startswith("Redis refused routerd's user EXPIRE on routerd:c: NOPERM")
        assert faults.problem().endswith(" (and 1 more)")  # the HINCRBY, still recent
    finally:
        await r.aclose()
        await conn.aclose()
