"""The control lease: exactly one routerd process at a time controls the fleets.

Several routerd on one Redis and one Ray cluster (replicas, README "Several routerd") all route; only
the holder of this lease launches, adopts, restarts, rolls, scales and retires engines. Two that both
did fought over every restart without end (issue 20), so the lease is built to make "both control"
impossible rather than unlikely:

* **Taking it.** One script does ``SET <ns>:control:lease <value> NX PX <ttl>`` with a fencing token
  from ``INCR <ns>:control:token``, atomically — so tokens only grow, and each term of control has its
  own. The value names the holder: ``"<token> <json of Holder>"`` (ident, incarnation, start time).
* **Keeping it.** Renewed every ``lease_s / 3`` by a script that extends the key only while it still
  holds our value.
* **Losing it first.** This process's own deadline is the *send* time of its last successful renew (or
  take) + ``lease_s`` − a margin of ``lease_s / 10``. Redis counts the key's expiry from when it received
  that command, which is later, so the deadline passes strictly before another process can take the key.
  When the deadline passes, :attr:`ControlLease.controls` is False at once — it is computed from the
  clock, not set by a loop — whatever Redis answers later; :meth:`ControlLease.check` raises
  :class:`NotController` from then on. A partitioned controller therefore stops before anyone starts.
* **The same replica restarted** (systemd, a crash): a process whose ident — ``redis.consumer``, default
  the hostname — equals the holder's, from an older incarnation, takes the lease at once with a new
  token instead of waiting out the dead one's. Two live processes must therefore never share a consumer
  name; if they do, the newer one takes the lease once and keeps it (the older one never takes it back
  from a newer incarnation).

Without Redis (or for a process that is alone by construction) the lease is *sole*: it controls from
the start, nothing to renew; its token is its start time in ms. A token taken in Redis is never below
the server's clock in ms either, so tokens keep growing across a Redis that lost its data, or a switch
from a routerd without Redis to replicas with it.

**Across a failover** (Sentinel promoting a replica, README "Redis in production"). Replication is
asynchronous: a promoted replica can lack the last take, renew or ``INCR``, so a lease could be granted
again while its holder still controls, and a token could go back. Three rules keep one controller and
tokens that only grow:

* **A term exists once the replicas have it.** Every take, renew and raise is sent in one pipeline with
  ``ROLE`` before it (the replicas online) and ``WAIT <that many>`` after it. The local deadline is
  extended only when every replica online acknowledged the write, or when the master had none (then the
  lease is as safe as that one server). Whichever replica Sentinel promotes holds our lease with an
  expiry at or past our deadline: nobody takes it there while we still control. A replica that lags
  past the ``WAIT`` leaves the term unrenewed: the controller stops at its deadline rather than risk two.
* **A take starts above every token its taker has seen** (its own terms, every holder it read): the
  script takes ``max(INCR, server ms, highest seen + 1)``, so a promoted replica whose counter or clock
  is behind still hands out a higher token to any replica that watched the lease.
* **A term starts above every token its engines hold.** Adopting the fleets, the controller reads each
  engine actor's highest token; one at or above its own (a term lost with a replica that was not
  promoted, a Redis with its clock behind) makes it :meth:`ControlLease.raise_above` it, within the
  term, before it sends a command — the engines then take the new controller's commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import _aio, log
from ..config import ControlConfig, RedisConfig
from ..errors import RouterdError
from ..redis_conn import RedisConn
from ..redis_keys import RedisKeys

_log = log.get("routerd.control")

# KEYS: lease, token. ARGV: holder json, ttl ms, the value we may replace ("" = only an absent key),
# the highest token the taker has seen. A token is never below the Redis server's clock in ms: a Redis
# that lost its data (or a routerd that ran without Redis, whose token is its start time) never leaves
# an engine actor holding a higher one; nor at or below a token the taker saw (a promoted replica whose
# counter or clock is behind).
_TAKE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[3] then return {0, cur, redis.call('PTTL', KEYS[1])} end
local token = redis.call('INCR', KEYS[2])
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local floor = math.max(ms - 1, tonumber(ARGV[4]) or 0)
if token <= floor then
  token = floor + 1
  redis.call('SET', KEYS[2], string.format('%d', token))
end
local value = string.format('%d', token) .. ' ' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {1, value}
"""
# KEYS: lease. ARGV: our value, ttl ms. (Also a batch's run lease: routerd/batches/lease.py.)
RENEW_IF_HELD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS: lease, token. ARGV: our value, the token to go above, our holder json. A new token for the term
# we hold (same expiry): the value it returns is ours from then on; nil when we do not hold it.
_RAISE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local token = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[2])
if token <= floor then
  token = floor + 1
  redis.call('SET', KEYS[2], string.format('%d', token))
end
local value = string.format('%d', token) .. ' ' .. ARGV[3]
redis.call('SET', KEYS[1], value, 'KEEPTTL')
return value
"""
# KEYS: lease. ARGV: our value.
RELEASE_IF_HELD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# The part of the lease a controller gives up at its end: it stops this long before Redis could pass the
# lease on (clock rate differences between hosts are far below it).
_MARGIN = 0.1
_SCRIPTS = {"take": _TAKE, "renew": RENEW_IF_HELD, "release": RELEASE_IF_HELD, "raise": _RAISE}
_NO_ANSWER = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, TimeoutError)
_WARN_EVERY_S = 10.0


def _replicas(role: Any) -> int:
    """Replicas connected to the master, from its ``ROLE`` reply (0 from a replica or anything else)."""
    if isinstance(role, list | tuple) and len(role) >= 3 and role[0] in (b"master", "master"):
        return len(role[2])
    return 0


class NotController(RouterdError):
    """This process may not mutate the fleets now: it does not hold the control lease (or its term
    ended). ``holder`` is the last holder this process saw, if any. On an admin route: 503, naming it."""

    status, type = 503, "ServiceUnavailableError"

    def __init__(self, ident: str, holder: Holder | None) -> None:
        self.ident = ident
        self.holder = holder
        who = f"{holder.ident!r} (token {holder.token})" if holder is not None else "not known yet"
        super().__init__(f"routerd {ident!r} does not control the fleets now; the controller is {who}")


class Holder(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds the lease, as its value says (the token is the value's first word)."""

    ident: str
    incarnation: str  # one process's life: a restarted replica has the same ident, a new incarnation
    started_ms: int  # wall clock of that process's start: a newer incarnation may take over at once
    since_ms: int = 0  # wall clock of the take
    token: int = 0

    @classmethod
    def parse(cls, value: bytes | str) -> Holder | None:
        raw = value.decode() if isinstance(value, bytes) else value
        token, _, body = raw.partition(" ")
        try:
            holder = _decode(body)
            return msgspec.structs.replace(holder, token=int(token))
        except (ValueError, msgspec.DecodeError):
            return None

    def status(self) -> dict[str, Any]:
        return {"ident": self.ident, "token": self.token, "since": self.since_ms / 1000 or None,
                "incarnation": self.incarnation}


_decode = msgspec.json.Decoder(Holder).decode
_encode = msgspec.json.Encoder().encode


class ControlLease:
    """This process's claim on fleet control; :meth:`run` takes and renews it until cancelled.

    Read :attr:`controls` (or wait for it to flip with :meth:`wait_changed`); call :meth:`check` before
    every Ray mutation; pass :attr:`token` to the engine actors (they refuse a lower one)."""

    def __init__(self, ident: str, *, redis: RedisConn | None = None,
                 cfg: ControlConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, candidate: bool = True) -> None:
        """``redis`` None: sole control (no Redis); else the lease lives in that Redis under its
        ``[redis]`` namespace. Not a ``candidate`` (a worker process): never takes the lease, only reads
        who holds it."""
        self.ident = ident
        self.candidate = candidate
        self.sole = redis is None
        self._redis = redis
        self._redis_cfg = redis.cfg if redis is not None else RedisConfig()
        self._cfg = cfg if cfg is not None else ControlConfig()
        self._keys = RedisKeys.from_config(self._redis_cfg)
        self._clock = clock
        self._wall = wall
        self.me = Holder(ident=ident, incarnation=f"{os.getpid()}-{uuid.uuid4().hex[:8]}",
                         started_ms=int(wall() * 1000))
        self._value: str | None = None  # our lease value while we hold it
        self._deadline = -1.0  # monotonic: controls until then
        self.holder: Holder | None = None  # the last holder seen (us included)
        self.token = 0
        self.seen = 0  # the highest token this process has seen (its own terms, every holder it read)
        self.acquisitions = 0
        self.losses = 0
        self._was = False  # controls, as last reported
        self._changed = asyncio.Event()
        self._client: aioredis.Redis | None = None
        self._warned = -_WARN_EVERY_S
        self._raw_current = ""  # the lease's value as last read
        self._released = False  # given up for good (the process is stopping): never taken again
        self._expires_in: float | None = None  # the holder's lease lapses in this long, as last read
        self._replicas = 0  # replicas the master had connected, as its last ROLE said
        self._unreplicated = False  # the last write no replica acknowledged (logged once until one is)
        if self.sole:
            # Alone by construction: its token is its start time, above what a lease handed out before.
            self.token = self.me.started_ms
            self.holder = msgspec.structs.replace(self.me, since_ms=self.me.started_ms, token=self.token)
            self._was = True
            self.acquisitions = 1

    # what others read ------------------------------------------------------------------------------
    @property
    def controls(self) -> bool:
        """True while this process may control the fleets: computed from the clock, so it turns False
        the moment the local deadline passes, between two turns of :meth:`run` as well."""
        return self.sole or (self._value is not None and self._clock() < self._deadline)

    def check(self) -> None:
        """Raise :class:`NotController` unless this process controls now (before every Ray mutation)."""
        if not self.controls:
            raise NotController(self.ident, self.holder)

    async def wait_changed(self, timeout: float) -> None:
        """Return when :attr:`controls` flips (or after ``timeout``)."""
        was = self.controls
        end = self._clock() + timeout
        while self.controls == was:
            left = end - self._clock()
            if left <= 0:
                return
            if was and not self.sole:  # it flips at the deadline even if run() is held up
                left = min(left, max(0.0, self._deadline - self._clock()) + 0.001)
            event = self._changed
            with contextlib.suppress(TimeoutError):
                async with _aio.timeout(left):
                    await event.wait()
        self._note()

    def status(self) -> dict[str, Any]:
        """For ``/admin/fleets`` and ``routerd status``: who controls (as this process last saw)."""
        holder = self.holder
        return {"controller": holder.status() if holder is not None else None, "this": self.ident,
                "controls": self.controls, "lease_s": None if self.sole else self._cfg.lease_s}

    def update_config(self, cfg: ControlConfig) -> None:
        """Reload: a new ``lease_s`` applies from the next renew."""
        self._cfg = cfg

    # the loop -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Take the lease when free, renew it while held — until cancelled; then close the client
        (the lease itself is given up by :meth:`release`, once fleet control has stopped)."""
        if self.sole:
            await asyncio.Event().wait()
        try:
            while True:
                await self.step()
                interval = self._cfg.lease_s / 3
                if self.controls:
                    interval = min(interval, max(0.0, self._deadline - self._clock()))
                elif self._expires_in is not None:  # try again as soon as the holder's lease lapses
                    interval = min(interval, self._expires_in + 0.005)
                await self.wait_changed(interval)
        finally:
            await self._close()

    async def step(self) -> None:
        """One turn: renew what we hold, else try to take it. Redis not answering only delays; the
        deadline decides."""
        self._note()  # a term that lapsed unobserved (a slow start-up) is logged as ended before a new one
        try:
            if self._value is not None and self.controls:
                await self._renew()
            elif not self._released:
                await self.try_acquire()
        except _NO_ANSWER as e:
            self._warn("control_lease_redis_unreachable", e)
        except redis.exceptions.RedisError as e:
            self._warn("control_lease_redis_error", e)
        except Exception:  # noqa: BLE001  # the loop boundary: a bug must not end renewing; logged
            _log.exception("control_lease_step_failed", ident=self.ident)
        self._note()

    async def try_acquire(self) -> bool:
        """One attempt to take the lease (at start-up: the daemon knows at once whether it controls)."""
        if self.sole:
            return True
        if self._released:
            return False
        if not self.candidate:
            self.holder = await self._current()
            return False
        now_wall = self._wall()
        me = msgspec.structs.replace(self.me, since_ms=int(now_wall * 1000))
        cfg = self._cfg
        expect = ""
        holder = await self._current()
        if holder is not None and self._may_replace(holder):
            expect = self._raw_current
        sent = self._clock()
        (took, value, *ttl), replicated = await self._call(
            "take", [self._keys.control_lease(), self._keys.control_token()],
            [_encode(me), int(cfg.lease_s * 1000), expect, self.seen])
        self._expires_in = int(ttl[0]) / 1000 if ttl and int(ttl[0]) >= 0 else None  # -1: no TTL
        raw = value.decode() if isinstance(value, bytes) else str(value)
        seen = Holder.parse(raw)
        self._saw(seen)
        if not int(took):
            self.holder = seen
            self._lose("held by another", seen)
            return False
        if not replicated:  # ours on the master only: a failover now could hand it out again
            self.holder = seen
            self._expires_in = None
            return False
        if holder is not None and expect and holder.incarnation != self.me.incarnation:
            _log.warning("control_lease_taken_from_same_ident", ident=self.ident, previous=holder.status(),
                         reason="the same replica (same redis.consumer) restarted; a consumer name must "
                                "belong to one live routerd")
        self._value = raw
        self._extend(sent)
        self.holder = seen
        self.token = seen.token if seen is not None else 0
        self._note()
        return True

    def _saw(self, holder: Holder | None) -> None:
        if holder is not None:
            self._saw_token(holder.token)

    def _saw_token(self, token: int) -> None:
        self.seen = max(self.seen, token)

    def _may_replace(self, holder: Holder) -> bool:
        """A holder with our ident: ourselves from a term whose deadline passed, or an older
        incarnation of this replica (restarted) — never a newer one."""
        if holder.ident != self.ident:
            return False
        if holder.incarnation == self.me.incarnation:
            return not self.controls
        return holder.started_ms <= self.me.started_ms

    async def _current(self) -> Holder | None:
        client = self._get_client()
        async with _aio.timeout(self._op_timeout()):
            pipe = client.pipeline(transaction=False)
            pipe.get(self._keys.control_lease())
            pipe.execute_command("ROLE")
            raw, role = await pipe.execute()
        self._replicas = _replicas(role)
        self._raw_current = raw.decode() if isinstance(raw, bytes) else (raw or "")
        holder = Holder.parse(raw) if raw else None
        self._saw(holder)
        return holder

    async def _renew(self) -> None:
        assert self._value is not None
        sent = self._clock()
        ok, replicated = await self._call("renew", [self._keys.control_lease()],
                                          [self._value, int(self._cfg.lease_s * 1000)])
        if not int(ok):
            self._lose("lease taken by another", None)
        elif replicated and self.controls:  # a reply after the deadline does not bring back a term
            self._extend(sent)

    async def raise_above(self, token: int) -> bool:
        """Make this term's token higher than ``token`` — one an engine actor holds (read when the fleets
        are adopted), from a term a failover lost — keeping the lease and its expiry, so the engines
        take this controller's commands. False (and control stopped) when this process does not hold
        the lease any more; True when :attr:`token` is above ``token`` now."""
        self._saw_token(token)
        if token < self.token:
            return True
        if self.sole:  # alone by construction: no Redis to agree with, and no other controller
            self.token = token + 1
            self.holder = msgspec.structs.replace(self.me, since_ms=self.me.started_ms, token=self.token)
            return True
        value = self._value
        if value is None or not self.controls:
            return False
        old = self.token
        raised, _ = await self._call("raise", [self._keys.control_lease(), self._keys.control_token()],
                                     [value, token, value.partition(" ")[2]])
        if raised is None or self._value != value:
            self._lose("lease taken by another", None)
            return False
        raw = raised.decode() if isinstance(raised, bytes) else str(raised)
        holder = Holder.parse(raw)
        self._value = raw
        self.holder = holder
        self.token = holder.token if holder is not None else token + 1
        self._saw_token(self.token)
        _log.warning("control_token_raised", ident=self.ident, token=self.token, was=old, engine_token=token,
                     why="an engine holds a token from a term Redis lost (a failover to a replica that "
                         "lacked it, or a Redis whose clock is behind)")
        return True

    async def release(self) -> None:
        """Give the lease up for good (the process is stopping, fleet control has stopped), so another
        replica takes over at once rather than after ``lease_s``. Best effort: an unanswered release
        just expires."""
        self._released = True
        value, self._value = self._value, None
        self._note()
        try:
            if value is not None and not self.sole:
                await self._call("release", [self._keys.control_lease()], [value])
                _log.info("control_released", ident=self.ident, token=self.token)
        except (*_NO_ANSWER, redis.exceptions.RedisError) as e:
            _log.warning("control_release_failed", ident=self.ident, error=repr(e))
        finally:
            await self._close()

    # helpers -------------------------------------------------------------------------------------
    def _extend(self, sent: float) -> None:
        """Control until the lease's end as counted from the *send* time of the command that set it."""
        self._deadline = sent + self._cfg.lease_s * (1 - _MARGIN)

    def _lose(self, why: str, holder: Holder | None) -> None:
        if self._value is not None:
            self._value = None
            _log.warning("control_lease_lost", ident=self.ident, token=self.token, why=why,
                         holder=holder.status() if holder is not None else None)
        self._note()

    def _note(self) -> None:
        """Report a flip of :attr:`controls` once: log, count, wake :meth:`wait_changed`."""
        now = self.controls
        if now == self._was:
            return
        self._was = now
        # When it happened (wall clock): for a deadline that passed, the deadline itself.
        at = self._wall() - (0.0 if now else max(0.0, self._clock() - self._deadline))
        if now:
            self.acquisitions += 1
            _log.info("control_acquired", ident=self.ident, token=self.token, at=round(at, 4),
                      lease_s=self._cfg.lease_s)
        else:
            self.losses += 1
            _log.warning("control_stopped", ident=self.ident, token=self.token, at=round(at, 4))
        self._changed.set()
        self._changed = asyncio.Event()

    def _warn(self, event: str, e: BaseException) -> None:
        if self._clock() - self._warned >= _WARN_EVERY_S:
            self._warned = self._clock()
            _log.warning(event, ident=self.ident, error=f"{type(e).__name__}: {e}", controls=self.controls)

    def _op_timeout(self) -> float:
        """A Redis call never outlasts a renew period, nor our deadline while we control: the loop must
        be back to report the deadline when it passes."""
        t = min(self._redis_cfg.op_timeout_s, self._cfg.lease_s / 3)
        if self.controls:
            t = min(t, self._deadline - self._clock())
        return max(t, 0.01)

    def _get_client(self) -> aioredis.Redis:
        if self._client is None:
            assert self._redis is not None, "sole control calls no Redis"
            self._client = self._redis.ops()
        return self._client

    async def _call(self, script: str, keys: list[str], args: list[Any]) -> tuple[Any, bool]:
        """Run one of the lease's scripts and wait for the replicas to have it: its reply, and whether it is
        replicated — every replica online (``ROLE``, just before) acknowledged it (none: nothing to wait
        for). ``ROLE``, ``EVAL`` and ``WAIT`` go in one pipeline, on one connection: ``WAIT``
        counts that connection's writes. (``EVAL`` rather than ``EVALSHA``: a pipeline would first
        send ``SCRIPT EXISTS``; a user who may ``SCRIPT LOAD`` and ``EVALSHA`` may ``EVAL`` as much.)"""
        client = self._get_client()
        timeout = self._op_timeout()
        wanted = self._replicas  # as last seen: the ROLE just before the write may find more
        async with _aio.timeout(timeout):
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("ROLE")
            pipe.execute_command("EVAL", _SCRIPTS[script], len(keys), *keys, *args)
            # A replica acknowledges at once (WAIT asks it to): half the call's time is plenty.
            pipe.execute_command("WAIT", wanted, max(1, int(timeout * 500)))
            role, reply, acked = await pipe.execute()
        replicas = _replicas(role)
        self._replicas = replicas
        replicated = int(acked) >= replicas
        if replicated:
            if self._unreplicated:
                self._unreplicated = False
                _log.info("control_lease_replicated", ident=self.ident, replicas=replicas)
        elif not self._unreplicated:
            self._unreplicated = True
            _log.warning("control_lease_not_replicated", ident=self.ident, replicas=replicas,
                         acknowledged=int(acked),
                         effect="a replica did not acknowledge the lease in time: it is not taken or "
                                "renewed (a failover could hand it out again), so control stops at its "
                                "deadline")
        return reply, replicated

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_NO_ANSWER):
                async with _aio.timeout(2.0):
                    await client.aclose()

    def collector(self) -> ControlCollector:
        return ControlCollector(self)


class ControlCollector:
    """``/metrics``: whether this process controls the fleets, and how often it took and lost control."""

    def __init__(self, lease: ControlLease) -> None:
        self._lease = lease

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are built per collect

    def collect(self) -> Iterator[Any]:
        lease = self._lease
        yield GaugeMetricFamily("routerd_control_is_controller", "1 while this process holds the control "
                                "lease (controls the fleets)", value=1 if lease.controls else 0)
        yield GaugeMetricFamily("routerd_control_token", "Fencing token of this process's current or "
                                "last term of control (0: never controlled)", value=lease.token)
        yield CounterMetricFamily("routerd_control_acquisitions", "Times this process took control",
                                  value=lease.acquisitions)
        yield CounterMetricFamily("routerd_control_losses", "Times this process stopped controlling "
                                  "(lease lost, not renewed in time, or released)", value=lease.losses)
