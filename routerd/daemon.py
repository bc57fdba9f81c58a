"""The daemon: process life — signals, drain, reload, sd_notify and the watchdog.

Every component comes from the one builder (:func:`routerd.assembly.assemble`: the bundles of this
process's role), entered on the daemon's one ``AsyncExitStack``; their long loops run in its one
``asyncio.TaskGroup`` (style.md §2), and they stop through :meth:`routerd.assembly.Routerd.shutdown`,
the same ordered stop the tests and the benchmarks use.
Signal handlers only set events (uvicorn's pattern): TERM/INT → drain, a second one → exit now; HUP →
reload.

Start-up order is what systemd's ``READY=1`` promises: Redis (embedded or reachable), Ray connected and
fleets adopted or launched, the HTTP listener bound, the queue consumer running — then READY.

With ``[daemon] workers`` > 1 the daemon is the parent of N workers (routerd/workers.py): it takes the
listening socket, starts Redis, Ray and the fleets (no data plane: it serves no request), then the
workers, and says READY once every worker did; TERM drains the workers (then the parent ends its own),
HUP reloads it and them. A worker is this same class with ``worker=`` its
:class:`~routerd.workers.WorkerSpec`: it serves on the parent's socket, notifies the parent instead of
systemd, and drains when its parent is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from . import _aio, log, redact
from . import config as config_mod
from .config import Config
from .redact import Redactor
from .registry import Registry
from .sdnotify import Notifier
from .state_lock import EXIT_LOCKED, StateDirLocked, StateLock
from .stop_deadline import StopDeadline
from .workers import (
    FORCE,
    RELOAD,
    STOP,
    Workers,
    WorkerSpec,
    ping_interval_s,
    read_words,
    worker_consumer,
    worker_link,
)

if TYPE_CHECKING:  # imported where built: the components pull in aiohttp, redis and Ray
    from .assembly import Role, Routerd

_logger = log.get("routerd.daemon")

# Settings that are bound at start-up; a reload that changes them is applied except for these.
_RESTART_ONLY = (
    ("http", "host"), ("http", "port"), ("http", "tls_cert"), ("http", "tls_key"), ("redis", "url"),
    ("redis", "stream"), ("redis", "group"), ("redis", "dead_stream"), ("redis", "consumer"),
    ("redis", "username"), ("redis", "password"), ("redis", "ssl_ca_certs"), ("redis", "ssl_certfile"),
    ("redis", "ssl_keyfile"), ("redis", "cluster"),
    ("redis", "enabled"), ("ray", "address"), ("ray", "namespace"), ("daemon", "state_dir"),
    ("daemon", "file_sd_path"), ("daemon", "log_level"), ("daemon", "workers"),
)


# Stopping: every step after the drain has its own bound; these are the bounds of the whole.
_STOP_GRACE_S = 30.0  # past drain_timeout_s: closing streams, ending tasks, closing Redis and HTTP
_ENGINES_STOP_S = 90.0  # more, with daemon.stop_engines_on_exit (each engine gets a graceful stop)
_FORCED_STOP_S = 3.0  # after a second TERM/INT
_TASKS_STOP_S = 15.0  # for the daemon's own tasks (watchdog, workers) to end once cancelled


class Daemon:
    """One routerd process: ``await Daemon(path, cfg).run()`` returns the exit code."""

    def __init__(self, config_path: Path, cfg: Config, *, notifier: Notifier | None = None,
                 redactor: Redactor | None = None, worker: WorkerSpec | None = None) -> None:
        self.config_path = config_path
        self.worker = worker  # this process is worker ``worker.index`` of a parent daemon
        cfg = self._own(cfg)
        # A worker's sd_notify words go to its parent, which says STOP/FORCE/RELOAD on the same pair.
        if worker is not None:
            worker.die_with_parent()  # a SIGKILLed daemon's workers drain and exit
        self._link = worker_link(worker) if worker is not None else None
        if self._link is not None:
            notifier = notifier or Notifier(sock=self._link,
                                            watchdog_interval_s=ping_interval_s(cfg.daemon.worker_watchdog_s))
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self.workers: Workers | None = None  # the parent's workers (``[daemon] workers`` > 1)
        self._parent_pid = worker.parent_pid if worker is not None and worker.parent_pid else os.getppid()
        self.redactor = redactor  # told the secrets of each config loaded by reload
        self.registry = Registry()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._reload = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.stop_deadline = StopDeadline()
        self.routerd: Routerd | None = None  # every component, from the one builder (_startup)
        self._stuck = 0  # the routerd's loops that did not end when cancelled

    # signals ---------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """TERM/INT: drain, bounded as a whole by :class:`StopDeadline`; a second one: exit now (the
        drain is cut short, and whatever is still stopping after ``_FORCED_STOP_S`` is abandoned)."""
        if self._stop.is_set():
            if self.worker is not None and os.getppid() != self._parent_pid:
                # The parent's death signal again, not an operator's second stop: Linux sends
                # PR_SET_PDEATHSIG at each reparenting of an orphan — once per thread of the dying
                # parent it passes through — so one SIGKILL of a daemon can bring its workers several
                # SIGTERMs. Cut short, their drain would give the jobs they run to their successors to
                # run again (issue 26). The drain stays bounded by drain_timeout_s.
                return
            _logger.warning("second_stop_signal_exiting_now")
            if self.workers is not None:
                self.workers.tell(FORCE)  # each exits now too
            self._force.set()
            self.stop_deadline.arm(_FORCED_STOP_S, "second stop signal")
        else:
            self._stop.set()
            d = self.cfg.daemon
            self.stop_deadline.arm(d.drain_timeout_s + _STOP_GRACE_S
                                   + (_ENGINES_STOP_S if d.stop_engines_on_exit else 0.0),
                                   "the stop outlasted its bound")

    def request_reload(self) -> None:
        self._reload.set()

    def _parent_says(self) -> None:
        """A worker: its parent's word. STOP begins the drain unless a signal already did (one sent to the
        worker itself); FORCE ends it now."""
        assert self._link is not None
        for word in read_words(self._link):
            if word == STOP and not self._stop.is_set():
                self.request_stop()
            elif word == FORCE and not self._force.is_set():
                if not self._stop.is_set():
                    self.request_stop()
                self.request_stop()
            elif word == RELOAD:
                self.request_reload()

    def _own(self, cfg: Config) -> Config:
        """``cfg`` as this process runs it: a worker consumes the queue under its own stable name (a
        worker started again reclaims its own jobs)."""
        if self.worker is None:
            return cfg
        consumer = worker_consumer(cfg.redis.consumer_name, self.worker.index)
        return msgspec.structs.replace(cfg, redis=msgspec.structs.replace(cfg.redis, consumer=consumer))

    @property
    def role(self) -> Role:
        from .assembly import Role

        if self.worker is not None:
            return Role.WORKER
        return Role.PARENT if config_mod.worker_count(self.cfg) > 1 else Role.ONE

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        if self._link is not None:
            loop.add_reader(self._link.fileno(), self._parent_says)

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if self._link is not None:
            loop.remove_reader(self._link.fileno())

    # lifecycle -------------------------------------------------------------------------------
    async def run(self) -> int:
        """The daemon's life; first of all it takes its state dir (routerd/state_lock.py), which a
        worker shares with its parent."""
        if self.worker is not None:
            return await self._run()
        lock = StateLock(config_mod.state_dir(self.cfg))
        try:
            lock.acquire()
        except StateDirLocked as e:
            _logger.error("state_dir_in_use", state_dir=str(e.path.parent), lock=str(e.path),
                          holder_pid=e.pid, exit_code=EXIT_LOCKED, message=str(e))
            self.notifier.status(f"not started: {e}")
            self.notifier.close()
            return EXIT_LOCKED
        try:
            return await self._run()
        finally:
            lock.release()

    async def _run(self) -> int:
        self._install_signals()
        try:
            async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as tg:
                await self._startup(stack, tg)
                if self.workers is not None and not await self._workers_ready():
                    code = config_mod.EXIT_CONFIG if self.workers.config_failed else 0
                else:
                    self.notifier.ready(self.status_line())
                    assert self.routerd is not None
                    redis_url = self.routerd.redis_url
                    _logger.info("routerd_ready", http=self.routerd.url or None,
                                 fleets=[f.name for f in self.cfg.fleets],
                                 redis=redact.url(redis_url) if redis_url else None,
                                 workers=self.workers.pids() if self.workers is not None else None)
                    await self._main_loop()
                    code = config_mod.EXIT_CONFIG if self.workers and self.workers.config_failed else 0
                await self._shutdown()
                await self._end_tasks()
        finally:
            self._remove_signals()
            self.notifier.close()
        _logger.info("routerd_stopped")
        return code

    def _spawn(self, tg: asyncio.TaskGroup, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._tasks.append(tg.create_task(coro, name=name))

    async def _startup(self, stack: contextlib.AsyncExitStack, tg: asyncio.TaskGroup) -> None:
        """Every component from the one builder, started in dependency order (undone by ``stack``);
        its loops in ``tg``."""
        from .assembly import Role, assemble
        from .ingress.listener import bind_sockets, systemd_sockets

        role = self.role
        # Socket activation: taken first, so no child started below sees LISTEN_FDS or holds the socket.
        # A worker serves on its parent's; the parent of workers binds its own if systemd gave none.
        sockets = self.worker.sockets() if self.worker is not None else systemd_sockets()
        systemd_fds = bool(sockets) and self.worker is None
        if role is Role.PARENT and not sockets:
            sockets = bind_sockets(self.cfg.http.host, self.cfg.http.port)
        collectors = [self.worker.collector()] if self.worker is not None else []
        # ray.init installs its own (abseil) SIGTERM handler, which logs and re-raises; ours must win so
        # that SIGTERM drains instead of killing the process: taken back as soon as Ray is connected.
        self.routerd = routerd = await stack.enter_async_context(assemble(
            self.cfg, self.registry, sockets=sockets,
            status=self._starting, ray_connected=self._install_signals, built=self._built, role=role,
            collectors=collectors, worker=self.worker.index if self.worker is not None else None))
        routerd.start(tg)
        self._spawn(tg, self._watchdog(), "watchdog")
        if role is Role.PARENT:
            self._starting("workers")
            env = dict(os.environ)
            if self.cfg.redis.url == "embedded":  # the workers use the parent's redis-server
                env["ROUTERD_REDIS_URL"] = routerd.redis_url
            self.workers = Workers(str(self.config_path), sockets, count=config_mod.worker_count(self.cfg),
                                   stall_s=self.cfg.daemon.worker_watchdog_s, env=env)
            for sock in sockets:  # the workers hold them now; ours would only keep a stopped socket open
                stack.callback(sock.close)
            _logger.info("workers_listening", addresses=[str(s.getsockname()) for s in sockets],
                         workers=self.workers.count, socket_activated=bool(systemd_fds))
            self._spawn(tg, self.workers.run(), "workers")

    async def _workers_ready(self) -> bool:
        """Until every worker said READY=1; False when a stop came first or a worker's config is bad."""
        workers = self.workers
        assert workers is not None
        waits = {asyncio.ensure_future(workers.wait_ready()), asyncio.ensure_future(self._stop.wait()),
                 asyncio.ensure_future(workers.failed.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return not self._stop.is_set() and not workers.failed.is_set()

    def _built(self, routerd: Routerd) -> None:
        self.routerd = routerd  # known before the fleets and the listener start: a failed start-up too

    def _starting(self, step: str) -> None:
        self.notifier.status(f"starting: {step}")

    async def _main_loop(self) -> None:
        stop = asyncio.create_task(self._stop.wait())
        try:
            while not self._stop.is_set() and not (self.workers and self.workers.failed.is_set()):
                reload = asyncio.create_task(self._reload.wait())
                done, _ = await asyncio.wait({stop, reload}, timeout=5.0,
                                             return_when=asyncio.FIRST_COMPLETED)
                if reload in done:
                    self._reload.clear()
                    try:
                        if await self.reload() and self.workers is not None:
                            self.workers.tell(RELOAD)  # each re-reads the file itself
                    except Exception:  # a loop boundary: a failed reload must not end the daemon
                        _logger.exception("reload_failed", path=str(self.config_path))
                        self.notifier.ready("reload failed; see the log")
                else:
                    reload.cancel()
                self.notifier.status(self.status_line())
        finally:
            stop.cancel()

    async def _watchdog(self) -> None:
        """Pings systemd from the event loop itself: a stuck loop stops the pings and systemd restarts us."""
        interval = self.notifier.watchdog_interval_s
        if interval is None:
            return
        while True:
            self.notifier.watchdog()
            if self.worker is not None and os.getppid() != self._parent_pid and not self._stop.is_set():
                _logger.error("worker_parent_gone", parent_pid=self._parent_pid, action="draining")
                self.request_stop()
            await asyncio.sleep(interval)

    # drain -----------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        """Stop intake, let in-flight work finish up to drain_timeout_s, end the rest, then keep the
        engines running (or stop them with ``daemon.stop_engines_on_exit``). Each step is bounded."""
        cfg = self.cfg
        self.notifier.stopping()
        _logger.info("drain_started", timeout_s=cfg.daemon.drain_timeout_s)
        started = time.monotonic()
        routerd = self.routerd
        assert routerd is not None, "_shutdown() runs after _startup()"
        if self.workers is not None:  # each worker drains as one routerd does; Redis outlives them
            await self.workers.stop(cfg.daemon.drain_timeout_s + _STOP_GRACE_S)
        # The one ordered stop, the tests' and the benchmarks' too (routerd/assembly/routerd.py).
        self._stuck = await routerd.shutdown(drain_timeout_s=max(0.0, started + cfg.daemon.drain_timeout_s
                                                                 - time.monotonic()),
                                             stop_engines=cfg.daemon.stop_engines_on_exit, force=self._force)
        _logger.info("drain_finished", took_s=round(time.monotonic() - started, 3))

    async def _end_tasks(self) -> None:
        """Cancel the daemon's own tasks (the routerd's loops ended with its stop). One that does not
        end makes the process exit now: the TaskGroup would wait for it forever."""
        stuck = self._stuck + len(await _aio.cancel_and_wait(self._tasks, _TASKS_STOP_S))
        if stuck:
            self.stop_deadline.fire(f"{stuck} task(s) did not end when cancelled")

    # reload ----------------------------------------------------------------------------------
    async def reload(self) -> bool:
        """Re-read the config file and apply what changed; an invalid file keeps the old config."""
        self.notifier.reloading()
        try:
            new = self._own(await asyncio.to_thread(_load, self.config_path))  # file I/O: off the loop
        except config_mod.ConfigError as e:
            problems = e.problems
            _logger.error("reload_rejected", path=str(self.config_path), problems=problems)
            self.notifier.ready(f"reload rejected: {problems[0]}")
            return False
        if self.redactor is not None:  # before anything logs a value of the new config
            self.redactor.learn(config_mod.secret_values(new))
        for section, key in _RESTART_ONLY:
            old_v, new_v = getattr(getattr(self.cfg, section), key), getattr(getattr(new, section), key)
            if old_v != new_v:
                _logger.warning("reload_needs_restart", key=f"{section}.{key}",
                                running=redact.shown(key, old_v), configured=redact.shown(key, new_v))
        from .assembly import launches

        new = _keep_restart_only(self.cfg, new)
        old = self.cfg
        self.cfg = new
        if self.routerd is not None:
            await self.routerd.apply(new)
        if launches(new) and not launches(old):
            _logger.warning("reload_needs_restart", key="fleets", reason="first launched fleet needs Ray")
        _logger.info("reloaded", fleets=[f.name for f in new.fleets], policy=new.routing.policy)
        self.notifier.ready(self.status_line())
        return True

    def status_line(self) -> str:
        parts = [self.workers.status()] if self.workers is not None else []
        for fleet in self.cfg.fleets:
            ready = self.registry.ready_count(fleet.name)
            total = len(self.registry.instances(fleet.name))
            parts.append(f"{fleet.name} {ready}/{total} ready")
        return "; ".join(parts) or "no fleets"


def _load(path: str | Path) -> Config:
    """The config file, valid and naming only installed plugins, else :class:`ConfigError` (exit 78)."""
    from . import plugins

    cfg = config_mod.load(path)
    problems = plugins.check(cfg)
    if problems:
        raise config_mod.ConfigError(problems)
    return cfg


def _keep_restart_only(old: Config, new: Config) -> Config:
    """The new config with the bound-at-start-up keys of the old one (those need a restart)."""
    sections: dict[str, Any] = {}
    for section, key in _RESTART_ONLY:
        current = sections.get(section, getattr(new, section))
        sections[section] = msgspec.structs.replace(current, **{key: getattr(getattr(old, section), key)})
    return msgspec.structs.replace(new, **sections)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="routerd run", description="Run the routerd daemon.")
    parser.add_argument("--config", required=True, help="TOML config file")
    parser.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the parent's, for a worker it starts
    args = parser.parse_args(argv)
    worker = WorkerSpec.parse(args.worker) if args.worker else None
    try:
        cfg = _load(args.config)
    except config_mod.ConfigError as e:
        for p in e.problems:
            print(p)
        return config_mod.EXIT_CONFIG
    from .tracing import otlp_endpoint

    redactor = log.setup(cfg.daemon.log_level,
                         json=None if args.log_format == "auto" else args.log_format == "json",
                         secrets=config_mod.secret_values(cfg),
                         trace_ids=bool(otlp_endpoint(cfg.tracing, os.environ)))
    if worker is not None:  # every line it writes names the worker (the tasks inherit the context)
        log.bind_request_id(worker=worker.index)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # uvloop is optional off Linux
        runner = asyncio.run
    daemon = Daemon(Path(args.config).resolve(), cfg, redactor=redactor, worker=worker)
    try:
        code: int = runner(daemon.run())
    except Exception:  # the outermost boundary: log it whole, let systemd restart us
        _logger.exception("routerd_failed")
        return 1
    finally:
        # Stopped: what is left is the interpreter's teardown, whose collections walk every object of
        # the ~700 modules imported — 1 s on a loaded machine, 5 s with a dozen routerds stopping at
        # once on two cores, past the drain's bound. Frozen objects are never walked; the rest of a
        # normal exit (atexit handlers, threads joined, streams flushed) is unchanged.
        gc.freeze()
    return code
