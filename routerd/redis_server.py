"""Redis as a dependency: embedded mode (routerd runs its own redis-server), and where the command-line
tools find it. Clients come from routerd/redis_conn.py.

``redis.url = "embedded"`` is for one machine: routerd starts ``redis-server`` with an append-only
file in ``<state_dir>/redis``, bound to 127.0.0.1 and a unix socket (no TCP port at all when the
socket path fits), restarts it if it dies, and stops it with SIGTERM so the AOF is flushed. The child
gets SIGTERM too if routerd itself is SIGKILLed (PR_SET_PDEATHSIG), so no orphan keeps the port and
the next start replays the same AOF: queued jobs survive routerd, Redis, or both dying. It runs in a
session of its own, so a terminal's Ctrl-C reaches routerd only: the drain still has its Redis, which
is stopped after it (routerd/_proc.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis.asyncio as aioredis
import redis.exceptions

from . import log
from ._aio import cancel_and_wait, wait_for, where
from ._net import free_port
from ._proc import die_with_parent
from .config import Config, RedisConfig

_log = log.get("routerd.redis")
_MAX_UNIX_PATH = 100  # sun_path is 108 bytes; keep a margin
LOCAL_REDIS = "redis://127.0.0.1:6379/0"  # where the command-line tools look without a URL or config
# What a Redis call raises when the server is not there (down, unreachable, too slow): waited out.
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, TimeoutError)


def embedded_url(directory: str | Path) -> str | None:
    """The URL an embedded redis-server in ``directory`` was last started on (None if never)."""
    try:
        return (Path(directory) / "url").read_text().strip() or None
    except OSError:
        return None


@dataclass(frozen=True, kw_only=True)
class RedisTarget:
    """Where a command-line tool finds routerd's Redis, and how it logs in."""

    url: str
    redis: RedisConfig  # its password, stream names, time-outs and TLS
    cfg: Config | None = None  # the config it came from, if any


def redis_target(url: str, config_path: str | None) -> RedisTarget:
    """``routerd submit`` and ``routerd usage``: the URL given (``--redis``, ``$ROUTERD_REDIS_URL``), else
    the config's (the embedded server's last URL for ``"embedded"``), else localhost; the user,
    password, TLS files and cluster setting the config's ``[redis]`` holds, the ``ROUTERD_REDIS_*``
    variables over them (``ROUTERD_REDIS_PASSWORD``, ``ROUTERD_REDIS_SSL_CERTFILE``…), those variables
    alone without a config.

    The config is read by :func:`routerd.config.load_for_tool` (its API keys left out).
    Raises :class:`routerd.config.ConfigError`."""
    from . import config

    if not config_path:  # [redis] from the ROUTERD_REDIS_* variables alone
        redis_env = {k: v for k, v in os.environ.items() if k.startswith("ROUTERD_REDIS_")}
        if url:
            redis_env["ROUTERD_REDIS_URL"] = url
        return RedisTarget(url=url or LOCAL_REDIS, redis=config.parse({}, environ=redis_env).redis)
    cfg = config.load_for_tool(config_path)
    if not url:
        url = cfg.redis.url
        if url == "embedded":
            url = embedded_url(config.state_dir(cfg) / "redis") or ""
    return RedisTarget(url=url or LOCAL_REDIS, redis=cfg.redis, cfg=cfg)


class EmbeddedRedis:
    """``async with EmbeddedRedis(directory) as url:`` — a supervised redis-server for the block's life.

    ``directory`` holds its AOF, socket, pid file and log; the daemon passes ``<state_dir>/redis``.
    """

    def __init__(self, directory: str | Path, *, binary: str = "redis-server",
                 appendfsync: str = "everysec", ready_timeout_s: float = 10.0,
                 restart_backoff_s: float = 0.5) -> None:
        self.dir = Path(directory).expanduser().resolve()
        self._binary = binary
        self._appendfsync = appendfsync
        self._ready_timeout_s = ready_timeout_s
        self._backoff_s = restart_backoff_s
        self._proc: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self.restarts = 0
        sock = self.dir / "redis.sock"
        self._socket = sock if len(str(sock)) <= _MAX_UNIX_PATH else None
        self._port = 0 if self._socket else free_port()
        self.url = f"unix://{sock}" if self._socket else f"redis://127.0.0.1:{self._port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    async def __aenter__(self) -> str:
        if shutil.which(self._binary) is None:
            raise FileNotFoundError(f"{self._binary} not found on PATH (apt-get install redis-server)")
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        await self._stop_stale()
        await self._start()
        self._supervisor = asyncio.create_task(self._supervise(), name="embedded-redis")
        return self.url

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._stopping = True
        try:
            # Not `await task` under suppress(CancelledError): that would also swallow a cancellation
            # of the caller arriving meanwhile. Bounded: a cancel the supervisor lost (redis-py's
            # asyncio.wait_for on Python 3.11 returns normally when its write completes as the cancel
            # arrives) is caught by its `_stopping` check, and no other wait may hold this up.
            if self._supervisor is not None and await cancel_and_wait({self._supervisor}, 15.0):
                _log.error("embedded_redis_supervisor_stuck", task=where(self._supervisor))
        finally:
            await self._terminate()  # even when cancelled: no redis-server is left behind

    def _argv(self) -> list[str]:
        argv = [self._binary, "--bind", "127.0.0.1", "--port", str(self._port),
                "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", self._appendfsync,
                "--save", "", "--daemonize", "no", "--pidfile", str(self.dir / "redis.pid"),
                "--logfile", str(self.dir / "redis.log"), "--protected-mode", "yes"]
        if self._socket is not None:
            argv += ["--unixsocket", str(self._socket), "--unixsocketperm", "700"]
        return argv

    async def _start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *self._argv(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent, start_new_session=True)
        deadline = time.monotonic() + self._ready_timeout_s
        client = aioredis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while True:
                if self._proc.returncode is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}; "
                                       f"see {self.dir / 'redis.log'}")
                try:
                    if await client.ping():
                        break
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    await self._terminate()
                    raise TimeoutError(f"redis-server did not answer within {self._ready_timeout_s}s")
                await asyncio.sleep(0.02)
        finally:
            await client.aclose()
        (self.dir / "url").write_text(self.url + "\n")  # for `routerd submit --config` to find it
        _log.info("embedded_redis_started", pid=self._proc.pid, url=self.url, dir=str(self.dir))

    async def _supervise(self) -> None:
        """Restart redis-server whenever it exits on its own; the AOF brings the data back."""
        backoff = self._backoff_s
        while True:
            assert self._proc is not None
            code = await self._proc.wait()
            if self._stopping:
                return
            _log.error("embedded_redis_exited", returncode=code, restart_in_s=backoff)
            await asyncio.sleep(backoff)
            try:
                await self._start()
                self.restarts += 1
                backoff = self._backoff_s
            except (OSError, RuntimeError, TimeoutError):
                _log.exception("embedded_redis_restart_failed")
                backoff = min(backoff * 2, 30.0)
            if self._stopping:  # asked to stop while starting, and the cancel got lost on the way
                return

    async def _terminate(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)  # redis flushes the AOF on SIGTERM
        try:
            await wait_for(proc.wait(), 10.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        _log.info("embedded_redis_stopped", pid=proc.pid)

    async def _stop_stale(self) -> None:
        """A redis-server left from an earlier run on the same dir would own the socket: stop it."""
        pid = _stale_pid(self.dir)
        if pid is None:
            return
        _log.warning("embedded_redis_stale", pid=pid)
        with contextlib.suppress(ProcessLookupError):  # it may have exited since it was found
            os.kill(pid, signal.SIGTERM)  # SIGTERM: it flushes its AOF first
        for _ in range(500):
            if not _is_redis(pid):
                return
            await asyncio.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _stale_pid(directory: Path) -> int | None:
    try:
        pid = int((directory / "redis.pid").read_text().strip())
        cwd = os.readlink(f"/proc/{pid}/cwd")  # redis-server chdirs into --dir
    except (OSError, ValueError):
        return None
    return pid if _is_redis(pid) and cwd == str(directory) else None


def _is_redis(pid: int) -> bool:
    """Alive and redis-server (a zombie has an empty cmdline: pid 1 here does not reap)."""
    try:
        return b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
