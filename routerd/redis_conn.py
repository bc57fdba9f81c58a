"""Every Redis client of a routerd process comes from here: one :class:`RedisConn` per process, built
from ``[redis]`` by the assembly and handed to each component that needs Redis.

How routerd connects — the URL, the ACL user and password (``ROUTERD_REDIS_USERNAME``,
``ROUTERD_REDIS_PASSWORD``; a userinfo in the URL wins over them), TLS for ``rediss://`` — is decided
in :func:`connection_options` alone, and the pools live in :class:`RedisConn` alone: this is the place
for another way to reach Redis (Sentinel, client certificates).

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

import contextlib
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url

from ._aio import timeout
from .config import RedisConfig
from .redis_cluster import RETRY, SlotConnection, SlotMaster, SlotSSLConnection, tag_slot
from .redis_faults import RedisFaults, WatchedConnection, WatchedSSLConnection

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

    def ops(self) -> aioredis.Redis:
        """A client for short commands, none of which blocks on the server."""
        return self._client(0)

    def blocking(self, block_ms: int | None = None) -> aioredis.Redis:
        """A client for reads that block up to ``block_ms`` (default: ``[redis] block_ms``, the queue's)."""
        return self._client(self.cfg.block_ms if block_ms is None else block_ms)

    def _client(self, block_ms: int) -> aioredis.Redis:
        options = connection_options(self.cfg, self.url, block_ms=block_ms)
        if not self.pooled:
            client: aioredis.Redis = aioredis.Redis.from_pool(_pool(self.url, self.cfg, options, self.faults))
            return client
        pool = self._pools.get(block_ms)
        if pool is None:
            pool = _pool(self.url, self.cfg, options, self.faults)
            self._pools[block_ms] = pool
        return aioredis.Redis(connection_pool=pool)

    def health(self) -> tuple[str, bool]:
        """Why Redis cannot be used now ("": it can), and whether that keeps this process from being
        ready (``/readyz``): a TLS handshake or login refused, a right routerd's ACL user lacks
        (routerd/redis_faults.py) — what only the operator can fix, and says so."""
        problem = self.faults.problem()
        return problem, bool(problem)

    async def aclose(self) -> None:
        """Close every pool (the components that used them have stopped)."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            with contextlib.suppress(OSError, TimeoutError):
                async with timeout(_CLOSE_S):
                    await pool.aclose()


def redis_client(url: str, cfg: RedisConfig, *, block_ms: int | None = None) -> aioredis.Redis:
    """A client of its own for ``url`` (tools and tests), its reads blocking up to ``block_ms``
    (default ``cfg.block_ms``); a routerd's components get theirs from the process's :class:`RedisConn`."""
    return RedisConn(url, cfg, pooled=False).blocking(block_ms)
