"""Who consumes under a name: a lease per consumer name, so that a newcomer never runs again the jobs
its predecessor is still running.

A consumer finds its own pending jobs again when it starts (:meth:`.reclaim.Reclaimer.recover_own`):
right after a crash nobody runs them any more. But the previous holder of a name can still be alive:
the orphaned workers of a SIGKILLed workers daemon drain for up to ``drain_timeout_s`` under
``<consumer>-w<i>`` while the daemon started again at once runs new workers under the same names; a
restart that does not wait for the old process's drain; two routerd given one ``redis.consumer``.
Recovering then runs every job the old holder is still running a second time on the engines (issue
26: 234 of 1,000 jobs; results stayed single, the engine work doubled).

So the holder of a name keeps ``<ns>:consumer:<name>`` (:meth:`routerd.keys.Keys.consumer`): its own
value, with a TTL of :data:`TTL_S` renewed every :data:`RENEW_S`, from before its first read until its
drain ended, when it deletes it. A newcomer reads, recovers and claims nothing under the name until it
holds the key: when the old holder let go at the end of its drain, when its key expired (it died
elsewhere, or was cut off from Redis for ``TTL_S``), or at once when the value names a process of this
host that is gone (a crash or a SIGKILL: the restarted process or worker finds its jobs at once, as
before). Reading new jobs meanwhile would be safe for those jobs, but not once the key is gone: the key
must be there exactly while some process may run jobs under the name. The value says where its
holder runs: the kernel's boot id, the pid namespace and the pid, so a process of another host or
container is never taken for dead by a missing pid here.

Orphans need no other rule: a worker whose parent died gets SIGTERM and stops reading at once (its
drain), and what it set aside, had not started, or got from a read still in flight when it stopped
stays pending under the name for the newcomer to recover once the orphan let go — those wait for the
end of its drain rather than run twice. Giving back what an orphan had not started instead would not
cover what it had: the key covers both.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from ... import _aio, log
from ...redis_server import REDIS_DOWN

_log = log.get("routerd.queue")

TTL_S = 10.0  # a holder cut off from Redis (or whose loop is held up) this long loses its name …
RENEW_S = 2.0  # … renewed this often: a stall of up to TTL_S - RENEW_S is not a death

# KEYS: the name's key. ARGV: our value, ttl ms. Take or renew: 1 when ours now, else the holder's value.
_HOLD = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: the name's key. ARGV: our value, the value found (a dead local holder's) to replace.
_REPLACE = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
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


class NameLease:
    """This process's hold on its consumer name; the consumer's read loop and drain drive it."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._host = _host()
        # "<random> <host> <pid> <hostname>": unique per process life; the rest is for _gone and the logs
        self.value = f"{secrets.token_hex(8)} {self._host or '-'} {os.getpid()} {socket.gethostname()}"
        self.held = False
        self._waiting_on = ""  # the other holder last seen, logged once

    async def take(self, client: Any, op_timeout_s: float) -> bool:
        """Hold the name if it is free (or ours, or a dead local process's); True when held."""
        ttl_ms = int(TTL_S * 1000)
        async with _aio.timeout(op_timeout_s):
            got = await client.register_script(_HOLD)(keys=[self.key], args=[self.value, ttl_ms])
            other = "" if got == 1 else _text(got)
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
        """Keep the name while held; another holder found instead is logged (it took the name from us)."""
        if not self.held:
            return
        async with _aio.timeout(op_timeout_s):
            got = await client.register_script(_HOLD)(keys=[self.key], args=[self.value, int(TTL_S * 1000)])
        if got != 1:
            self.held = False
            _log.error("queue_consumer_name_lost", key=self.key,
                       holder=_text(got),
                       why=f"not renewed for {TTL_S:g} s: jobs running here may run there again")

    async def release(self, client: Any, op_timeout_s: float) -> None:
        """Let the name go (the drain ended): a successor recovers what is left pending at once."""
        if not self.held:
            return
        self.held = False
        with contextlib.suppress(*REDIS_DOWN):
            async with _aio.timeout(op_timeout_s):
                await client.register_script(_RELEASE)(keys=[self.key], args=[self.value])
