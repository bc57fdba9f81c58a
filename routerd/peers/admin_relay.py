"""Admin calls made on a follower, carried out by the controller.

Only the controlling process may restart, drain or scale (it alone supervises the engines). An admin
write route on a follower therefore hands its call — the operation, its target, its body, already
authorised by the follower — to the controller through Redis and answers with the controller's answer,
the same status and JSON a call on the controller gets.

The exchange is exactly-once without a consumer group: the call is appended to the stream
:meth:`routerd.redis_keys.RedisKeys.admin_calls`; the controller reads the stream and *claims* each call
(``SET NX`` on :meth:`~routerd.redis_keys.RedisKeys.admin_claim`) before it acts; a caller that has no answer
within ``answer_within_s`` tries the same claim for itself. Whoever claims first decides: the caller
answers 503 ("no controller answered"), and the controller skips the call; or the controller carries
it out and the caller waits for its answer in the list :meth:`~routerd.redis_keys.RedisKeys.admin_reply`
as long as the call may take. So a call is never carried out after its caller said it was not, and never
twice — also when control changes hands meanwhile (the new controller reads back ``answer_within_s``
and finds the earlier calls claimed or still waiting).

One call is the data plane's, not an admin's: ``wake``. A request on a follower (or a worker) that
finds a fleet scaled to zero must start an engine, and only the controller can; :meth:`ask_wake`
records it without waiting and :meth:`send_wakes` relays it, at most once per ``WAKE_EVERY_S`` per
fleet — its requests wait in admission meanwhile, as they do on the controller.

Anyone who can write to Redis can append to the stream (queue producers must reach Redis), so every
call is sealed (routerd/peers/sealed.py) and the controller carries out only calls it can open: one
written by hand, or by a routerd with another secret, is refused, counted and logged, never carried
out. The call's id and the Redis server time it was made at are inside the seal, so a copy written again
is refused as replayed: read more than ``answer_within_s`` after the call was made (Redis's clock both
times: no skew between hosts) — its caller has given up on it by then —, or, sooner, with an id this
controller has taken already (remembered here, since whoever can write a copy can delete the claim
too). An answer is sealed for its call's id: one written by anyone else, or another call's, is refused
and the caller waits on for the real one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from .. import _aio, log
from ..errors import error_json
from ..redis_keys import RedisKeys
from ..redis_server import REDIS_DOWN
from ..trust import Rejected, Why
from .sealed import ADMIN_ANSWER, ADMIN_CALL, Seals

_log = log.get("routerd.peers")

ANSWER_WITHIN_S = 5.0  # a controller reads its calls within a second; this covers a takeover too
_STREAM_MAXLEN = 1000
_REPLY_TTL_MS = 60_000
_POLL_S = 1.0  # BLPOP in slices of this many seconds, so a dead server is noticed within op_timeout_s
READ_BLOCK_MS = 1000  # the longest read it issues (XREAD of the calls, BLPOP of an answer): its client's
WAKE_EVERY_S = 1.0  # the requests waiting for a fleet at zero ask for it on every turn: one call a second
_CLOCK_SLACK_MS = 1000  # a call "made" this far after Redis's time when read: TIME's own jitter, not a copy


class AdminCall(msgspec.Struct, frozen=True, kw_only=True):
    """One admin write call: ``op`` (restart, drain, undrain, replicas, unpin), its target (an instance
    id or a fleet name), its JSON body, who sent it and how long it may take once taken."""

    id: str
    op: str
    target: str
    body: bytes = b""
    origin: str = ""
    wait_s: float = 10.0
    issued_ms: int = 0  # the Redis server's time when it was made (sealed: a copy cannot renew it)


class AdminAnswer(msgspec.Struct, frozen=True):
    status: int
    body: bytes  # JSON


_encode = msgspec.msgpack.Encoder().encode
_decode_call = msgspec.msgpack.Decoder(AdminCall).decode
_decode_answer = msgspec.msgpack.Decoder(AdminAnswer).decode

Execute = Callable[[AdminCall], Awaitable[AdminAnswer]]


def unavailable(message: str) -> AdminAnswer:
    return AdminAnswer(503, error_json(message, "ServiceUnavailableError", 503))


class AdminRelay:
    """A follower's :meth:`call`; the controller's :meth:`run` carries calls out while ``controls()``."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, *, ident: str, controls: Callable[[], bool],
                 seals: Seals, op_timeout_s: float = 5.0, answer_within_s: float = ANSWER_WITHIN_S) -> None:
        """``client``: the caller's (it closes it); ``seals``: the calls' and answers' (the process's)."""
        self.client = client
        self.keys = keys
        self.seals = seals
        self.ident = ident
        self.controls = controls
        self._wakes: set[str] = set()  # fleets to wake, not sent yet
        self._wake_asked = asyncio.Event()
        self.op_timeout_s = op_timeout_s
        self.answer_within_s = answer_within_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._taken: dict[str, int] = {}  # call id → sealed time: the calls taken, while a copy could pass

    # the follower's side ----------------------------------------------------------------------
    async def call(self, op: str, target: str, body: bytes, *, wait_s: float) -> AdminAnswer:
        """Have the controller carry out ``op``; its answer, or 503 when none answers in time.
        ``wait_s``: how long the call may run once the controller took it (a drain's ``timeout_s``)."""
        call_id = uuid.uuid4().hex
        try:
            async with _aio.timeout(self.op_timeout_s):
                c = AdminCall(id=call_id, op=op, target=target, body=body, origin=self.ident, wait_s=wait_s,
                              issued_ms=_ms(await self.client.time()))
                sealed = self.seals.seal(ADMIN_CALL, _encode(c))
                await self.client.xadd(self.keys.admin_calls(), {"call": sealed}, maxlen=_STREAM_MAXLEN,
                                       approximate=True)
            answer = await self._answer(call_id, self.answer_within_s)
            if answer is not None:
                return answer
            async with _aio.timeout(self.op_timeout_s):
                gave_up = await self.client.set(self.keys.admin_claim(c.id), f"abandoned:{self.ident}",
                                                nx=True, px=_REPLY_TTL_MS)
            if gave_up:
                _log.warning("admin_call_unanswered", op=op, target=target, waited_s=self.answer_within_s)
                return unavailable(f"no controlling routerd took this admin call within "
                                   f"{self.answer_within_s:g}s (is one running, with Redis reachable and "
                                   "the same [control] secret?); nothing was done")
            # The controller took it: its answer comes when the call is done.
            answer = await self._answer(call_id, wait_s + self.answer_within_s)
        except REDIS_DOWN as e:
            return unavailable(f"Redis did not answer while this admin call was relayed to the controller: "
                               f"{e!r}")
        if answer is None:
            return unavailable(f"the controlling routerd took this admin call but did not answer within "
                               f"{wait_s + self.answer_within_s:g}s; it may still be carried out")
        return answer

    def ask_wake(self, fleet: str) -> None:
        """A request here found ``fleet`` scaled to zero and another process controls: have the
        controller start an instance (sent by :meth:`send_wakes`; returns at once)."""
        self._wakes.add(fleet)
        self._wake_asked.set()

    async def send_wakes(self) -> None:
        """Relay the fleets :meth:`ask_wake` named, until cancelled: each as a ``wake`` call, then a
        pause of :data:`WAKE_EVERY_S` (requests still waiting ask again)."""
        while True:
            await self._wake_asked.wait()
            self._wake_asked.clear()
            fleets, self._wakes = self._wakes, set()
            for fleet in sorted(fleets):
                if self.controls():
                    continue  # ours to start: the local autoscaler has it
                try:
                    answer = await self.call("wake", fleet, b"", wait_s=0.0)
                except Exception:  # noqa: BLE001  # a loop boundary: the next request asks again
                    _log.exception("fleet_wake_relay_failed", fleet=fleet)
                    continue
                if answer.status != 200:
                    _log.warning("fleet_wake_not_relayed", fleet=fleet, status=answer.status,
                                 answer=answer.body.decode(errors="replace")[:300])
            await asyncio.sleep(WAKE_EVERY_S)

    async def _answer(self, call_id: str, within_s: float) -> AdminAnswer | None:
        reply = self.keys.admin_reply(call_id)
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            block = min(_POLL_S, left)
            async with _aio.timeout(self.op_timeout_s + block):
                got: Any = await self.client.blpop([reply], timeout=block)
            if got is None:
                continue
            try:
                return _decode_answer(self.seals.open(ADMIN_ANSWER, got[1], call_id, reply=reply))
            except Rejected:
                continue  # not the controller's answer to this call: wait on for it

    # the controller's side --------------------------------------------------------------------
    async def run(self, execute: Execute) -> None:
        """While this process controls, carry out the calls in the stream with ``execute``; until
        cancelled (calls being carried out are cancelled with it)."""
        backoff = 0.1
        last_id: str | None = None
        try:
            while True:
                if not self.controls():
                    last_id = None
                    await asyncio.sleep(0.2)
                    continue
                try:
                    if last_id is None:
                        last_id = await self._start_id()
                    last_id = await self._read(execute, last_id)
                    backoff = 0.1
                except Exception as e:  # noqa: BLE001  # a loop boundary: logged, read again
                    if isinstance(e, REDIS_DOWN):
                        if backoff == 0.1:  # once per outage
                            _log.warning("admin_relay_redis_unavailable", error=repr(e))
                    else:
                        _log.exception("admin_relay_step_failed", retry_in_s=backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _start_id(self) -> str:
        """A new controller reads back as far as a caller still waits: older calls are answered 503."""
        async with _aio.timeout(self.op_timeout_s):
            now: Any = await self.client.time()
        return f"{max(0, _ms(now) - int(self.answer_within_s * 1000))}-0"

    async def _read(self, execute: Execute, last_id: str) -> str:
        async with _aio.timeout(self.op_timeout_s + READ_BLOCK_MS / 1000):
            got: Any = await self.client.xread({self.keys.admin_calls(): last_id}, count=64,
                                               block=READ_BLOCK_MS)
        if not got:
            return last_id
        async with _aio.timeout(self.op_timeout_s):
            now_ms = _ms(await self.client.time())
        for _stream, entries in got:
            for entry_id, fields in entries:
                if not self.controls():  # lost control while reading: the next controller reads them back
                    return last_id
                last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                await self._take(execute, last_id, now_ms, fields.get(b"call", b""))
        return last_id

    async def _take(self, execute: Execute, entry_id: str, now_ms: int, raw: bytes) -> None:
        try:  # anyone with Redis access can XADD here: only sealed calls are read at all
            c = _decode_call(self.seals.open(ADMIN_CALL, raw, entry=entry_id))
        except Rejected:
            return
        except msgspec.DecodeError as e:  # sealed by a routerd of another version
            _log.warning("admin_call_undecodable", error=str(e))
            return
        age_ms, max_age_ms = now_ms - c.issued_ms, int(self.answer_within_s * 1000)
        if not -_CLOCK_SLACK_MS <= age_ms <= max_age_ms:  # its caller has answered 503 by now
            self.seals.refuse(ADMIN_CALL, Why.REPLAYED, record=raw, entry=entry_id, op=c.op, target=c.target,
                              origin=c.origin, age_s=age_ms / 1000)
            return
        for old in [i for i, at in self._taken.items() if at < now_ms - max_age_ms - _CLOCK_SLACK_MS]:
            del self._taken[old]  # past the age any copy of it is refused at
        async with _aio.timeout(self.op_timeout_s):
            taken = await self.client.set(self.keys.admin_claim(c.id), f"taken:{self.ident}", nx=True,
                                          px=_REPLY_TTL_MS + int(c.wait_s * 1000))
        if not taken:
            return  # its caller gave up (answered 503) before this controller got to it
        if c.id in self._taken:  # taken here already: a copy, its claim deleted by whoever wrote it
            self.seals.refuse(ADMIN_CALL, Why.REPLAYED, record=raw, entry=entry_id, op=c.op, target=c.target,
                              origin=c.origin)
            return
        self._taken[c.id] = c.issued_ms
        task = asyncio.create_task(self._carry_out(execute, c), name=f"admin:{c.op}:{c.target}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _carry_out(self, execute: Execute, c: AdminCall) -> None:
        try:
            answer = await execute(c)
        except Exception as e:  # noqa: BLE001  # a loop boundary: the caller gets a 500, logged whole
            _log.exception("admin_call_failed", op=c.op, target=c.target, origin=c.origin)
            answer = AdminAnswer(500, error_json(f"internal error in routerd: {e!r}", "InternalServerError",
                                                 500))
        _log.info("admin_call_relayed", op=c.op, target=c.target, origin=c.origin, status=answer.status)
        reply = self.keys.admin_reply(c.id)
        try:
            async with _aio.timeout(self.op_timeout_s):
                pipe: Any = self.client.pipeline(transaction=True)
                pipe.rpush(reply, self.seals.seal(ADMIN_ANSWER, _encode(answer), c.id))
                pipe.pexpire(reply, _REPLY_TTL_MS)
                await pipe.execute()
        except REDIS_DOWN as e:
            _log.warning("admin_answer_lost", op=c.op, target=c.target, origin=c.origin, error=repr(e))


def _ms(now: Any) -> int:
    """Redis ``TIME`` (seconds, microseconds) in milliseconds."""
    secs, micros = now
    return int(secs) * 1000 + int(micros) // 1000
