"""Every Redis client of a routerd process comes from here: one :class:`RedisConn` per process, built
from ``[redis]`` by the assembly and handed to each component that needs Redis.

How routerd connects — the URL, the ACL user and password (``ROUTERD_REDIS_USERNAME``,
``ROUTERD_REDIS_PASSWORD``; a userinfo in the URL wins over them), TLS for ``rediss://`` — is decided
in :func:`connection_options` alone, and the pools live in :class:`RedisConn` alone: this is the place
for another way to reach Redis (Sentinel, client certificates).

With ``[redis] sentinels`` (:func:`via_sentinels`) every pool is a Sentinel-managed one
(:func:`sentinel_pool`): each new connection asks the sentinels for ``service_name``'s master, a
connection to a master that died or was demoted is dropped, and the next command reaches the promoted
replica — so every client routerd holds follows the master through a failover by itself. While there
is no master (the sentinels have not yet agreed on a new one) a command fails as it would with Redis
down (:data:`routerd.redis_server.REDIS_DOWN`), and each component waits that out as it does today.

Clients are handed out by what they do, because a connection's socket timeout must cover the longest
read it issues — so a dead server is noticed within ``op_timeout_s`` past it, rather than never:

- :meth:`RedisConn.ops`: short commands (the lease, tenants' limits and usage, shared measures, replica
  counts): ``op_timeout_s``;
- :meth:`RedisConn.blocking`: reads that wait up to ``block_ms`` (the queue consumer's ``XREADGROUP``,
  the admin relay's ``XREAD``/``BLPOP``): ``op_timeout_s`` + ``block_ms``.

Clients whose timeouts are the same share one connection pool (with the defaults, the queue's reads and
the peers' share one; short commands another); closing such a client returns its connection and leaves
the pool to the process (:meth:`RedisConn.aclose`, at the end of the assembly). Where nothing owns the
pools — a producer, a command-line tool, a test that builds one component — ``pooled=False`` gives
each client a pool of its own, closed with it (:func:`redis_client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from . import log
from ._aio import timeout
from .config import RedisConfig
from .redis_cluster import RETRY, SlotConnection, SlotMaster, SlotSSLConnection, tag_slot
from .redis_faults import RedisFaults, WatchedConnection, WatchedSSLConnection

_log = log.get("routerd.redis")

_CHECK_S = 1.0  # a producer's pool asks the sentinels where the master is at most this often
_CHECK_FAILED_S = 10.0  # ... and after no sentinel answered, this often
_CLOSE_S = 2.0  # closing a pool's sockets at the end: bounded, the server may be gone


def connection_options(cfg: RedisConfig, url: str, *, block_ms: int) -> dict[str, Any]:
    """The connection keywords for ``url`` under ``cfg``, for a client whose longest read blocks
    ``block_ms``."""
    kwargs: dict[str, Any] = {
        "socket_timeout": cfg.op_timeout_s + block_ms / 1000,
        "socket_connect_timeout": cfg.op_timeout_s,
        "retry_on_timeout": False,
    }
    if cfg.username:
        kwargs["username"] = cfg.username
    if cfg.password:
        kwargs["password"] = cfg.password
    if url.startswith("rediss://"):
        kwargs.update(tls_options(cfg))
    return kwargs


def tls_options(cfg: RedisConfig) -> dict[str, Any]:
    """``rediss://``: the CA to trust ("" = the system's) and the client certificate and key, if any."""
    options = {"ssl_ca_certs": cfg.ssl_ca_certs, "ssl_certfile": cfg.ssl_certfile,
               "ssl_keyfile": cfg.ssl_keyfile}
    return {k: v for k, v in options.items() if v}


def _pool(url: str, cfg: RedisConfig, options: dict[str, Any],
          faults: RedisFaults) -> aioredis.ConnectionPool:
    """A pool of connections watched by ``faults``: to the URL's server, or with ``cluster`` to the
    master of the deployment's slot (routerd/redis_cluster.py)."""
    kwargs: dict[str, Any] = {**options, **parse_url(url)}  # the URL wins, as from_url has it
    given = kwargs.pop("connection_class", None)
    if given not in (None, aioredis.SSLConnection):  # unix://: a local socket, no TLS, no cluster
        return aioredis.ConnectionPool(connection_class=given, **kwargs)
    tls = given is aioredis.SSLConnection
    kwargs["faults"] = faults
    if not cfg.cluster:
        return aioredis.ConnectionPool(
            connection_class=WatchedSSLConnection if tls else WatchedConnection, **kwargs)
    seed = (kwargs.pop("host", "127.0.0.1"), int(kwargs.pop("port", 6379)))
    asking = {k: v for k, v in kwargs.items() if k != "db"}
    slots = SlotMaster(seed, tag_slot(cfg.stream), WatchedSSLConnection if tls else WatchedConnection,
                       asking, cfg.op_timeout_s)
    return aioredis.ConnectionPool(connection_class=SlotSSLConnection if tls else SlotConnection,
                                   slot_master=slots, retry=RETRY, **kwargs)
def via_sentinels(cfg: RedisConfig, url: str) -> bool:
    """Whether ``url`` is reached through ``cfg.sentinels``: they are set and the URL names no server of
    its own (``redis:///0``; the default URL counts as none). A tool given ``--redis`` with a host
    talks to that server alone."""
    return bool(cfg.sentinels) and (url == RedisConfig().url or not urlsplit(url).hostname)


def sentinel_manager(cfg: RedisConfig, url: str) -> Sentinel:
    """The sentinels of ``cfg``, asked for the master with their own user and password, and TLS when
    ``url`` is ``rediss://`` (a deployment with TLS has it on its sentinels too). One attempt per
    sentinel and per question: the next sentinel is the retry."""
    options = connection_options(cfg, url, block_ms=0)
    kwargs: dict[str, Any] = {"socket_timeout": cfg.op_timeout_s, "socket_connect_timeout": cfg.op_timeout_s,
                              "retry": Retry(NoBackoff(), 0)}
    if cfg.sentinel_username:
        kwargs["username"] = cfg.sentinel_username
    if cfg.sentinel_password:
        kwargs["password"] = cfg.sentinel_password
    if urlsplit(url).scheme == "rediss":
        kwargs["ssl"] = True
        kwargs.update({k: v for k, v in options.items() if k.startswith("ssl_")})
    return _Sentinels([_host_port(s) for s in cfg.sentinels], sentinel_kwargs=kwargs)


class _Sentinels(Sentinel):
    """redis-py's, its "no master" error short: which name, which sentinels — not its clients' reprs,
    which every log line naming the error would otherwise carry."""

    def __init__(self, sentinels: list[tuple[str, int]], *, sentinel_kwargs: dict[str, Any]) -> None:
        super().__init__(sentinels, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
        self.addresses = ", ".join(f"{h}:{p}" for h, p in sentinels)

    async def discover_master(self, service_name: str) -> Any:
        try:
            return await super().discover_master(service_name)
        except MasterNotFoundError:
            raise MasterNotFoundError(f"no sentinel ({self.addresses}) names an available master "
                                      f"{service_name!r}") from None


def sentinel_pool(cfg: RedisConfig, url: str, manager: Sentinel, *, block_ms: int,
                  checked: bool = False) -> SentinelConnectionPool:
    """A pool of connections to ``cfg.service_name``'s master as ``manager``'s sentinels name it now,
    with ``url``'s database, user and password and :func:`connection_options`; ``checked``: one that
    asks the sentinels itself, at most every second, whether the master moved (:class:`_CheckedPool`)."""
    parts = urlsplit(url)
    options = connection_options(cfg, url, block_ms=block_ms)
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    db = parts.path.strip("/")
    options["db"] = int(db) if db.isdigit() else 0
    if parts.scheme == "rediss":
        options["ssl"] = True  # the pool's connection class: SentinelManagedSSLConnection
    if checked:
        return _CheckedPool(cfg.service_name, manager, check_timeout_s=cfg.op_timeout_s, **options)
    return SentinelConnectionPool(cfg.service_name, manager, **options)  # type: ignore[no-untyped-call]


class _CheckedPool(SentinelConnectionPool):
    """For a client no watch looks after (a producer's, a tool's): before handing out a connection, at
    most every ``_CHECK_S``, ask the sentinels where the master is; redis-py drops the idle connections
    when it moved — after a planned failover the old master still answers, and writes to it are lost
    when it is demoted. A check that fails (no sentinel answers) leaves the connections as they are and
    is tried again after ``_CHECK_FAILED_S``: the sentinels being away is no reason to fail a command."""

    def __init__(self, service_name: str, manager: Sentinel, *, check_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(service_name, manager, **kwargs)  # type: ignore[no-untyped-call]
        self._check_timeout_s = check_timeout_s
        self._next_check = 0.0

    async def get_connection(self, *args: Any, **options: Any) -> Any:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + _CHECK_S
            try:
                async with timeout(self._check_timeout_s):
                    await self.get_master_address()  # type: ignore[no-untyped-call]
            except (redis.exceptions.RedisError, OSError, TimeoutError):
                self._next_check = time.monotonic() + _CHECK_FAILED_S
        return await super().get_connection(*args, **options)  # type: ignore[no-untyped-call]


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _OwnsSentinel(aioredis.Redis):
    """A client that owns its pool and the sentinel clients behind it (``pooled=False``)."""

    manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.manager is not None:
                with contextlib.suppress(OSError, TimeoutError):
                    async with timeout(_CLOSE_S):
                        await self.manager.aclose()


class RedisConn:
    """One process's way to its Redis at ``url`` (the embedded server's, once started, or
    ``cfg.url``): clients by purpose over shared pools, closed together by :meth:`aclose`."""

    def __init__(self, url: str, cfg: RedisConfig, *, pooled: bool = True,
                 faults: RedisFaults | None = None) -> None:
        self.url = url
        self.cfg = cfg
        self.pooled = pooled  # else each client owns its pool, closed with it
        self._pools: dict[int, aioredis.ConnectionPool] = {}  # by the longest read's block, in ms
        # TLS, login and ACL refusals, for the log and /readyz (routerd/redis_faults.py)
        self.faults = faults if faults is not None else RedisFaults()
        self.sentinels = via_sentinels(cfg, url)
        self._manager: Sentinel | None = None  # the pools' sentinels (shared), made with the first
        # The daemon runs it: a master that moved while the old one still answers (a failover the
        # operator asked for) is left by every connection at once, not written to until it is demoted.
        self.watch = SentinelWatch(cfg, url, moved=self._master_moved) if self.sentinels and pooled else None

    def ops(self) -> aioredis.Redis:
        """A client for short commands, none of which blocks on the server."""
        return self._client(0)

    def blocking(self, block_ms: int | None = None) -> aioredis.Redis:
        """A client for reads that block up to ``block_ms`` (default: ``[redis] block_ms``, the queue's)."""
        return self._client(self.cfg.block_ms if block_ms is None else block_ms)

    def _client(self, block_ms: int) -> aioredis.Redis:
        if self.sentinels:
            return self._sentinel_client(block_ms)
        options = connection_options(self.cfg, self.url, block_ms=block_ms)
        if not self.pooled:
            client: aioredis.Redis = aioredis.Redis.from_pool(_pool(self.url, self.cfg, options, self.faults))
            return client
        pool = self._pools.get(block_ms)
        if pool is None:
            pool = _pool(self.url, self.cfg, options, self.faults)
            self._pools[block_ms] = pool
        return aioredis.Redis(connection_pool=pool)

    def _sentinel_client(self, block_ms: int) -> aioredis.Redis:
        if not self.pooled:
            manager = sentinel_manager(self.cfg, self.url)
            own = sentinel_pool(self.cfg, self.url, manager, block_ms=block_ms, checked=True)
            client = _OwnsSentinel(connection_pool=own)
            client.auto_close_connection_pool = True  # its own pool, closed with it
            client.manager = manager
            return client
        if self._manager is None:
            self._manager = sentinel_manager(self.cfg, self.url)
        pool = self._pools.get(block_ms)
        if pool is None:
            pool = sentinel_pool(self.cfg, self.url, self._manager, block_ms=block_ms)
            self._pools[block_ms] = pool
        return aioredis.Redis(connection_pool=pool)

    async def _master_moved(self) -> None:
        """Drop every connection, idle or in use: each reconnects to the master the sentinels name now
        (a command in flight on one fails as with Redis down, and its component retries)."""
        for pool in list(self._pools.values()):
            with contextlib.suppress(OSError, TimeoutError, redis.exceptions.RedisError):
                async with timeout(_CLOSE_S):
                    await pool.disconnect(inuse_connections=True)

    def health(self) -> tuple[str, bool]:
        """Why Redis cannot be used now ("": it can), and whether that keeps this process from being
        ready (``/readyz``): what the sentinels say, unready only for a fault it has had since it started
        (a wrong address, a name no sentinel knows: an outage later leaves the HTTP way in serving);
        else a TLS handshake or login refused, a right routerd's ACL user lacks (routerd/redis_faults.py)."""
        if self.watch is not None and self.watch.problem:
            return self.watch.problem, not self.watch.found
        problem = self.faults.problem()
        return problem, bool(problem)

    async def aclose(self) -> None:
        """Close every pool (the components that used them have stopped), and the sentinels' clients."""
        pools, self._pools = list(self._pools.values()), {}
        manager, self._manager = self._manager, None
        closing: list[aioredis.ConnectionPool | Sentinel] = list(pools)
        if manager is not None:
            closing.append(manager)
        for each in closing:
            with contextlib.suppress(OSError, TimeoutError):
                async with timeout(_CLOSE_S):
                    await each.aclose()


def redis_client(url: str, cfg: RedisConfig, *, block_ms: int | None = None) -> aioredis.Redis:
    """A client of its own for ``url`` (tools and tests), its reads blocking up to ``block_ms``
    (default ``cfg.block_ms``); a routerd's components get theirs from the process's :class:`RedisConn`."""
    return RedisConn(url, cfg, pooled=False).blocking(block_ms)


class SentinelWatch:
    """What the sentinels say of ``service_name``, asked every ``interval_s`` by :meth:`run`: one log
    line each time that changes (none answers, none knows the name, the master is down, the master is
    at host:port — a failover shows as the address changing), and :attr:`problem` for ``/readyz``."""

    def __init__(self, cfg: RedisConfig, url: str, *, interval_s: float = 1.0,
                 moved: Callable[[], Awaitable[None]] | None = None) -> None:
        self.cfg = cfg
        self.moved = moved  # called when the sentinels name a master at another address than before
        self.url = url
        self.interval_s = interval_s
        self.problem = ""  # why the master cannot be used now ("": a sentinel names it, up)
        self.found = False  # whether a sentinel has named the master since start
        self.master = ""  # host:port, as last named
        self._said = ""  # the last state logged
        self.checked = asyncio.Event()  # set once the sentinels have been asked

    async def run(self) -> None:
        """Check until cancelled."""
        manager = sentinel_manager(self.cfg, self.url)
        try:
            while True:
                try:
                    await self.check(manager)
                except Exception:  # noqa: BLE001 — the loop's boundary: an answer it could not read
                    _log.exception("redis_sentinel_check_failed")
                await asyncio.sleep(self.interval_s)
        finally:
            with contextlib.suppress(OSError, TimeoutError):
                async with timeout(_CLOSE_S):
                    await manager.aclose()

    async def check(self, manager: Sentinel) -> None:
        """Ask every sentinel (each bounded by ``op_timeout_s``) and note what they say."""
        name = self.cfg.service_name
        errors: dict[str, str] = {}
        known: set[str] = set()
        state: dict[str, Any] | None = None
        for address, client in zip(self.cfg.sentinels, manager.sentinels, strict=True):
            try:
                async with timeout(self.cfg.op_timeout_s):
                    masters: Any = await client.sentinel_masters()
            except (redis.exceptions.RedisError, OSError, TimeoutError) as e:
                errors[address] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            known.update(masters)
            if name in masters and state is None:
                state = masters[name]
        if len(errors) == len(self.cfg.sentinels):
            first = next(iter(errors.values()))  # a refused password reads differently from a closed port
            self._note("redis_sentinels_unreachable",
                       f"no sentinel answers ({', '.join(self.cfg.sentinels)}): {first}", error=True,
                       errors=errors)
        elif state is None:
            self._note("redis_sentinel_unknown_service",
                       f"no sentinel knows a master named {name!r} (they know: "
                       f"{', '.join(sorted(known)) or 'none'})", error=True, errors=errors or None)
        elif not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
            self.found = True
            self._note("redis_master_down", f"the master of {name!r} at {state['ip']}:{state['port']} is "
                       "down; the sentinels fail over to a replica", error=False)
        else:
            self.found = True
            now, was = f"{state['ip']}:{state['port']}", self.master
            if was and was != now and self.moved is not None:
                await self.moved()  # before it is said: who reads `master` finds the connections gone
            self.master = now
            self._note("redis_master", "", error=False, service_name=name, master=now,
                       **({"was": was} if was and was != now else {}))

    def _note(self, event: str, problem: str, *, error: bool, **fields: Any) -> None:
        self.problem = problem
        self.checked.set()
        said = f"{event} {problem or self.master}"
        if said == self._said:
            return
        self._said = said
        if problem:
            (_log.error if error else _log.warning)(event, reason=problem, **fields)
        else:
            _log.info(event, **fields)
