"""What Redis refuses a routerd for reasons only its operator can fix, said once and kept for ``/readyz``.

Two kinds, told apart from an outage (a server that is down or unreachable is the queue's and the
peers' business: they pause and retry, and readiness does not flap with it):

- **the connection is refused**: the TLS handshake fails (an unknown CA, a certificate the server does
  not accept, a plain server behind ``rediss://``) or the login does (a wrong password, a disabled
  user). Kept until a connection succeeds again;
- **a command is refused** (``NOPERM``): the ACL user lacks a command, or a key or channel routerd owns.
  Kept while it recurs (routerd's loops retry, so a right still missing is refused again within a
  minute); a key routerd does not own — a producer's ``reply_to`` — is that job's fault, reported on it.

Each new fault is one ``redis_refused_*`` error line naming the server, the command and the key;
:meth:`RedisFaults.problem` is the reason ``/readyz`` gives while one holds.
"""

from __future__ import annotations

import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis.exceptions
from redis.asyncio.connection import Connection, SSLConnection

from . import log

_log = log.get("routerd.redis")

REFUSED_RECENT_S = 60.0  # a refused command keeps routerd unready this long after its last refusal
_UNANSWERED = 65_536  # commands remembered per connection until answered (a label only, if it overflows)


def tls_failure(error: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a connection error, if it is one."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _text(arg: object) -> str:
    return arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)


def command_and_key(args: Sequence[object] | None) -> tuple[str, str]:
    """The command a connection sent last (``SET``, ``SCRIPT LOAD``) and its first key, as far as the
    arguments tell (``EVALSHA``'s keys follow its key count); ``("", "")`` when unknown."""
    if not args:
        return "", ""
    name = _text(args[0]).upper()
    rest = [_text(a) for a in args[1:]]
    if name in {"SCRIPT", "CLIENT", "CLUSTER", "XGROUP", "CONFIG", "ACL"} and rest:
        name, rest = f"{name} {rest[0].upper()}", rest[1:]
        if name.startswith("XGROUP") and rest:
            return name, rest[0]
        return name, ""
    if name in {"EVALSHA", "EVAL", "FCALL"}:
        return name, rest[2] if len(rest) > 2 and rest[1] != "0" else ""
    if name in {"XREAD", "XREADGROUP"} and "STREAMS" in (r.upper() for r in rest):
        at = [r.upper() for r in rest].index("STREAMS")
        return name, rest[at + 1] if at + 1 < len(rest) else ""
    if name in {"PING", "TIME", "MULTI", "EXEC", "DISCARD", "SELECT", "AUTH", "HELLO"}:
        return name, ""
    return name, rest[0] if rest else ""


class RedisFaults:
    """One process's Redis faults (see the module docstring); ``owns(key)`` says whether a key is
    routerd's own (a refusal there is a missing right, not a job's bad ``reply_to``)."""

    def __init__(self, owns: Callable[[str], bool] = lambda key: True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._owns = owns
        self._clock = clock
        self._connect = ""  # why the last connection failed, until one succeeds
        self._refused: dict[tuple[str, str], tuple[str, float]] = {}  # (command, key) → why, when

    def connect_failed(self, where: str, error: BaseException) -> None:
        """A connection to ``where`` (host:port) failed; kept if it is TLS or the login."""
        tls = tls_failure(error)
        if tls is not None:
            reason = f"TLS handshake with {where} failed: {tls}"
            event = "redis_refused_tls"
        elif isinstance(error, redis.exceptions.AuthenticationError | redis.exceptions.NoPermissionError):
            reason = f"Redis at {where} refused the login: {error}"
            event = "redis_refused_login"
        else:
            return  # an outage: not this module's business
        if reason != self._connect:
            _log.error(event, server=where, reason=reason)
            self._connect = reason

    def connected(self, where: str) -> None:
        if self._connect:
            _log.info("redis_accepted", server=where, was=self._connect)
            self._connect = ""

    def refused(self, where: str, args: Sequence[object] | None, error: BaseException) -> None:
        """Redis answered a command with NOPERM (``args``: the command, if known)."""
        command, key = command_and_key(args)
        if key and not self._owns(key):
            return
        reason = f"NOPERM {error}"  # redis-py keeps the message, not the error code
        now = self._clock()
        seen = self._refused.get((command, key))
        if seen is None or now - seen[1] > REFUSED_RECENT_S:
            _log.error("redis_refused_command", server=where, command=command or "(unknown)",
                       key=key, reason=reason)
        self._refused[(command, key)] = (reason, now)

    def problem(self) -> str:
        """Why routerd is not ready for Redis' sake, or ``""``."""
        if self._connect:
            return self._connect
        now = self._clock()
        for refused, (_, when) in list(self._refused.items()):
            if now - when > REFUSED_RECENT_S:
                del self._refused[refused]
        if not self._refused:
            return ""
        (command, key), (why, _) = max(self._refused.items(), key=lambda item: item[1][1])
        what = (command or "a command") + (f" on {key}" if key else "")
        more = f" (and {len(self._refused) - 1} more)" if len(self._refused) > 1 else ""
        return f"Redis refused routerd's user {what}: {why}{more}"


class WatchedBase(Connection):
    """A connection that tells :class:`RedisFaults` (the ``faults`` keyword) how its connects and
    commands went; it keeps the commands sent and not yet answered, a pipeline's too, so that a
    ``NOPERM`` names its command and key (Redis answers in order)."""

    def __init__(self, *, faults: RedisFaults | None = None, **kwargs: Any) -> None:
        self._faults = faults
        self._unanswered: deque[tuple[object, ...]] = deque(maxlen=_UNANSWERED)
        super().__init__(**kwargs)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    async def connect_check_health(self, check_health: bool = True,
                                   retry_socket_connect: bool = True) -> None:
        # Every connect goes through here (connect(), and a command sent on a closed connection).
        if self.is_connected:
            return
        # A command packed before the connect is sent after it: the login's own (HELLO, AUTH,
        # SELECT) are sent and answered in between.
        packed, self._unanswered = self._unanswered, deque(maxlen=_UNANSWERED)
        try:
            await super().connect_check_health(check_health, retry_socket_connect)
        except (redis.exceptions.RedisError, OSError) as e:
            if self._faults is not None:
                self._faults.connect_failed(self.where, e)
            raise
        finally:
            self._unanswered = packed
        if self._faults is not None:
            self._faults.connected(self.where)

    async def disconnect(self, *args: Any, **kwargs: Any) -> None:
        self._unanswered.clear()  # their answers are lost with the connection
        await super().disconnect(*args, **kwargs)

    def pack_command(self, *args: Any) -> list[bytes]:
        # Every command is packed here before it is sent, alone or in a pipeline (pack_commands).
        self._unanswered.append(args)
        return super().pack_command(*args)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        sent = self._unanswered.popleft() if self._unanswered else None
        try:
            return await super().read_response(*args, **kwargs)
        except redis.exceptions.NoPermissionError as e:
            if self._faults is not None:
                self._faults.refused(self.where, sent, e)
            raise


class WatchedConnection(WatchedBase):
    """``redis://``, watched."""


class WatchedSSLConnection(WatchedBase, SSLConnection):
    """``rediss://``, watched (a failed handshake is a :func:`tls_failure`)."""
