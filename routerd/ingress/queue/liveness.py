"""Which queue consumers are alive: each holds its name in Redis while it lives, so that the others take
over a dead one's pending jobs at once rather than after ``reclaim_idle_ms`` (issue 26).

The holder of a consumer name keeps ``<ns>:consumer:<name>`` (:meth:`routerd.redis_keys.RedisKeys.consumer`):
its
own value, with a TTL of :data:`TTL_S` renewed every :data:`RENEW_S`, from before its first read or
claim until its drain ended, when it deletes it. A consumer reads, recovers and claims nothing while
another process holds its name (two processes under one name would run each other's jobs again): it
waits until the holder lets go, its key expires, or — at once — the value names a process of this host
that is gone (a crash or SIGKILL: the restarted process finds its jobs at once, as before). The value
is ``"<random> <boot id>/<pid namespace> <pid> <hostname>"``, so a process of another host or container
is never taken for dead by a missing pid here.

So the key is there exactly while some process may run jobs under the name. Every name that ever held it
is listed in the hash :meth:`routerd.redis_keys.RedisKeys.consumer_names`; a listed name whose key is gone is
dead,
and :func:`take_over` claims its pending entries with no idle time (checked and claimed in one script:
a holder coming back takes its key before it claims anything, so it never finds a job of its own
claimed meanwhile). A name never listed — a consumer of a routerd without this record, during a rolling
upgrade — is left to ``reclaim_idle_ms``. A holder cut off from Redis or held up for ``TTL_S`` loses its
name, as a controller loses its lease: the price of knowing a death within seconds.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from ... import _aio, log
from ...redis_keys import RedisKeys
from ...redis_server import REDIS_DOWN

_log = log.get("routerd.queue")

TTL_S = 10.0  # a holder cut off from Redis (or whose loop is held up) this long loses its name …
RENEW_S = 2.0  # … renewed this often: a stall of up to TTL_S - RENEW_S is not a death
_TAKE_MAX = 1000  # entries claimed from dead consumers per pass (Lua's unpack has a limit)

# KEYS: the name's key, the names hash. ARGV: our value, ttl ms, the name. Take or renew: 1 renewed,
# 2 taken (it was free), else the other holder's value.
_HOLD = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[1])
if cur then return 1 end
return 2
"""
# KEYS: the name's key. ARGV: our value, the (dead local) holder's value found, ttl ms.
_REPLACE = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: the stream, the names hash, then each candidate's name key. ARGV: group, our name, how many at
# most, then each candidate's name. Claims (one delivery more each) the pending entries of the listed
# names whose key is gone; a dead name with nothing left pending leaves the list.
_TAKE_OVER = """
local out = {}
local left = tonumber(ARGV[3])
for i = 4, #ARGV do
  if left <= 0 then break end
  local name = ARGV[i]
  if redis.call('EXISTS', KEYS[i - 1]) == 0 and redis.call('HEXISTS', KEYS[2], name) == 1 then
    local rows = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', left, name)
    if #rows == 0 then
      redis.call('HDEL', KEYS[2], name)
    else
      local ids = {}
      for j, row in ipairs(rows) do ids[j] = row[1] end
      for _, e in ipairs(redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(ids))) do
        if e then out[#out + 1] = e end
      end
      left = left - #rows
    end
  end
end
return out
"""


def _read(path: str) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text().strip()
    return ""


def _text(reply: Any) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)


def _host() -> str:
    """Where this process's pids mean something: the boot, then the pid namespace ("" off Linux)."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    with contextlib.suppress(OSError):
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}" if boot else ""
    return ""


def _gone(value: str, host: str) -> bool:
    """True when ``value`` names a process of this host (boot and pid namespace) that no longer runs."""
    parts = value.split(" ")
    if not host or len(parts) < 4 or parts[1] != host or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it runs, as another user
        return False
    return False


class ConsumerName:
    """This process's hold on its consumer name; the consumer's read loop, renewal task and drain drive it."""

    def __init__(self, keys: RedisKeys, name: str) -> None:
        self.name = name
        self.key = keys.consumer(name)
        self._names = keys.consumer_names()
        self._host = _host()
        # unique per process life; the rest says where it runs, for _gone and the logs
        self.value = f"{secrets.token_hex(8)} {self._host or '-'} {os.getpid()} {socket.gethostname()}"
        self.held = False
        self._waiting_on = ""  # the other holder last seen, logged once

    async def take(self, client: Any, op_timeout_s: float) -> bool:
        """Hold the name if it is free (or ours, or a dead local process's); True when held."""
        ttl_ms = int(TTL_S * 1000)
        async with _aio.timeout(op_timeout_s):
            got = await client.register_script(_HOLD)(keys=[self.key, self._names],
                                                      args=[self.value, ttl_ms, self.name])
            other = "" if got in (1, 2) else _text(got)
            if other and _gone(other, self._host) and await client.register_script(_REPLACE)(
                    keys=[self.key], args=[self.value, other, ttl_ms]) == 1:
                _log.info("queue_consumer_name_taken_over", key=self.key, previous=other,
                          why="its holder, a process of this host, is gone")
                other = ""
        if not other:
            if self._waiting_on:
                _log.info("queue_consumer_name_free", key=self.key, previous=self._waiting_on)
            self.held, self._waiting_on = True, ""
            return True
        if other != self._waiting_on:
            self._waiting_on = other
            _log.warning("queue_consumer_name_busy", key=self.key, holder=other,
                         action=f"reading nothing until it lets go (at its drain's end, or {TTL_S:g} s "
                         "after its last renewal)")
        return False

    async def renew(self, client: Any, op_timeout_s: float) -> None:
        """Keep the name while held; a lapse (not renewed for ``TTL_S``) or another holder is logged."""
        if not self.held:
            return
        async with _aio.timeout(op_timeout_s):
            got = await client.register_script(_HOLD)(keys=[self.key, self._names],
                                                      args=[self.value, int(TTL_S * 1000), self.name])
        if got == 2:
            _log.error("queue_consumer_name_lapsed", key=self.key,
                       why=f"not renewed for {TTL_S:g} s: the others may have taken over jobs running here")
        elif got != 1:
            self.held = False
            _log.error("queue_consumer_name_lost", key=self.key, holder=_text(got),
                       why=f"not renewed for {TTL_S:g} s: jobs running here may run there again")

    async def release(self, client: Any, op_timeout_s: float) -> None:
        """Let the name go (the drain ended): what is left pending under it is taken over at once."""
        if not self.held:
            return
        self.held = False
        with contextlib.suppress(*REDIS_DOWN):
            async with _aio.timeout(op_timeout_s):
                await client.register_script(_RELEASE)(keys=[self.key], args=[self.value])


async def take_over(client: Any, keys: RedisKeys, me: str, count: int, op_timeout_s: float) -> list[Any]:
    """Claim for ``me`` up to ``count`` pending entries of consumers known dead (their name listed, its
    key gone), with no idle time; ``[(entry id, fields)]`` as ``XCLAIM`` gives them."""
    async with _aio.timeout(op_timeout_s):
        summary = await client.xpending(keys.stream, keys.group)
    names = [_text(c["name"]) for c in (summary or {}).get("consumers") or ()
             if int(c["pending"]) > 0 and _text(c["name"]) != me]
    if not names or count <= 0:
        return []
    async with _aio.timeout(op_timeout_s):
        reply = await client.register_script(_TAKE_OVER)(
            keys=[keys.stream, keys.consumer_names(), *(keys.consumer(n) for n in names)],
            args=[keys.group, me, min(count, _TAKE_MAX), *names])
    return [(entry, dict(zip(flat[::2], flat[1::2], strict=True)) if flat else None)
            for entry, flat in reply or ()]
