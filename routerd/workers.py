"""Workers: one daemon, N request-path processes on its listening socket (``[daemon] workers``).

One Python process relays about 20,000 streamed tokens/s on the one core it can use (issue 20); the
request path is what grows with the traffic, so that is what is multiplied. The daemon (the *parent*)
owns the listening socket — bound by itself or passed by systemd — and the fleet work (Redis when
embedded, Ray, the fleet manager, the control lease); it accepts no connection itself. Each *worker*
is ``python -m routerd run --config … --worker SPEC``: a fresh interpreter (never a ``fork()`` of a
process with threads, Ray and an event loop) that inherits the socket (``pass_fds``), accepts on it —
the kernel spreads connections over the processes blocked in ``accept`` — and consumes the queue as
``<consumer>-w<i>``: a worker started again under the same index finds its own pending jobs.

The parent and worker *i* talk over one ``AF_UNIX`` datagram pair in sd_notify's own words: the worker's
:class:`~routerd.sdnotify.Notifier` writes ``READY=1``, ``WATCHDOG=1``, ``STOPPING=1`` to it as it
would to systemd (:func:`worker_notifier`), and the parent (:class:`Workers`) reads them. So
``READY=1`` to systemd waits for every worker's, and the watchdog covers the workers: a worker whose
loop stops pinging for ``daemon.worker_watchdog_s`` is killed and started again, as is one that exits;
the silence counted is only what the parent could have heard — the pings waiting on the pair are read
before a worker is judged, and after a stall of the parent's own loop (a loaded host, a long pause,
SIGSTOP: it saw nothing meanwhile) the count starts again (issue 26). Each start after the first is
counted (``routerd_workers_restarts_total``, told to the worker on its command line). The other way
the parent says what the signals it got mean for the workers — ``STOP=1`` (drain, each as one routerd
does; the parent exits once all did), ``FORCE=1`` (a second stop signal: end now), ``RELOAD=1`` — as
words rather than signals. Each worker runs in a session of its own, so a terminal's Ctrl-C (sent to
the whole foreground process group) reaches the parent alone, which drains the workers in order; a
worker that gets a signal itself anyway still drains once, not twice. A worker whose parent is gone
drains and exits (it gets SIGTERM when the parent dies, and sees its parent change besides).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from . import _aio, log
from ._proc import die_with_parent
from .config_schema import EXIT_CONFIG

_log = log.get("routerd.workers")

STOP, FORCE, RELOAD = b"STOP=1", b"FORCE=1", b"RELOAD=1"  # what the parent tells its workers

_BACKOFF_INITIAL_S = 0.5  # a worker that exits is started again after this, doubling ...
_BACKOFF_MAX_S = 30.0  # ... up to this
_BACKOFF_RESET_S = 60.0  # a worker that ran this long starts again at the initial backoff
_POLL_S = 0.25  # how often the workers' pings are checked
_KILL_WAIT_S = 5.0  # a killed worker is reaped within this


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is told on its command line: its index, how many times it was started before, the
    descriptor of its end of the notify pair, those of the listening sockets it serves on, and its
    parent's pid."""

    index: int
    restarts: int
    notify_fd: int
    listen_fds: tuple[int, ...]
    parent_pid: int = 0

    def arg(self) -> str:
        fds = ":".join(map(str, self.listen_fds))
        return f"{self.index},{self.restarts},{self.notify_fd},{fds},{self.parent_pid}"

    @classmethod
    def parse(cls, arg: str) -> WorkerSpec:
        """The ``--worker`` argument back (ValueError if it is not one: it is the parent's, not a user's)."""
        index, restarts, notify_fd, fds, parent_pid = arg.split(",")
        return cls(int(index), int(restarts), int(notify_fd),
                   tuple(int(fd) for fd in fds.split(":") if fd), int(parent_pid))

    def die_with_parent(self) -> None:
        """This worker gets SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), and drains.

        Set here, first thing in the worker, rather than between fork and exec: a ``preexec_fn`` makes
        the parent fork its whole address space (Ray imported) and held its event loop about 0.19 s per
        worker started; without one, Python spawns with ``vfork``. A parent that died before this ran
        is not its parent any more: then the worker ends at once."""
        die_with_parent()
        if self.parent_pid and os.getppid() != self.parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    def collector(self) -> Collector:
        """``routerd_workers_restarts_total`` on this worker's ``/metrics``: times it was started again."""
        return _RestartsCollector(self.index, self.restarts)

    def sockets(self) -> list[socket.socket]:
        """The inherited listening sockets, taken over (not inherited again by what this worker starts)."""
        out = []
        for fd in self.listen_fds:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            out.append(sock)
        return out


class _RestartsCollector(Collector):
    def __init__(self, index: int, restarts: int) -> None:
        self._index, self._restarts = str(index), restarts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("routerd_workers_restarts", "Times this worker was started again "
                                     "after it exited or stalled", labels=["worker"])
        family.add_metric([self._index], self._restarts)
        yield family


def ping_interval_s(watchdog_s: float) -> float:
    """How often a worker pings its parent: four pings to each ``daemon.worker_watchdog_s``."""
    return watchdog_s / 4


def worker_consumer(name: str, index: int) -> str:
    """Worker ``index``'s queue consumer name, from the daemon's (``RedisConfig.consumer_name``): stable
    across its restarts, so it reclaims its own jobs."""
    return f"{name}-w{index}"


def worker_link(spec: WorkerSpec) -> socket.socket:
    """The worker's end of its pair with the parent: its sd_notify words go out on it (a
    :class:`~routerd.sdnotify.Notifier` over it), the parent's :data:`STOP`, :data:`FORCE` and
    :data:`RELOAD` come in."""
    os.set_inheritable(spec.notify_fd, False)
    sock = socket.socket(fileno=spec.notify_fd)
    sock.setblocking(False)
    return sock


def read_words(sock: socket.socket) -> list[bytes]:
    """Every word waiting on ``sock`` (none when nothing is, or the other end is gone)."""
    words: list[bytes] = []
    while True:
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return words
        except OSError:
            return words
        if not data:
            return words
        words += data.split(b"\n")


@dataclass(eq=False)
class _Worker:
    """The parent's record of worker ``index``: its current process and what it last said."""

    index: int
    proc: asyncio.subprocess.Process | None = None
    sock: socket.socket | None = None  # the parent's end of the notify pair
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ever_ready: bool = False
    last_ping: float = 0.0
    restarts: int = 0
    started: float = 0.0


class Workers:
    """The parent's side: start ``count`` workers on ``sockets``, keep them running, pass signals on.

    ``run()`` is the supervising loop (one task per worker, in the caller's TaskGroup, until cancelled);
    :meth:`wait_ready` returns once every worker said ``READY=1``; :meth:`stop` drains them all."""

    def __init__(self, config_path: str, sockets: Sequence[socket.socket], *, count: int,
                 stall_s: float, env: Mapping[str, str], clock: Callable[[], float] = time.monotonic) -> None:
        self.config_path = config_path
        self.sockets = list(sockets)
        self.count = count
        self.stall_s = stall_s
        self.env = dict(env)  # the workers' environment: Redis URL and consumer overrides among it
        self._clock = clock
        self._workers = [_Worker(i) for i in range(count)]
        self._stopping = False
        self._listening_since = clock()  # the end of the parent's last stall: silence counts from here
        self.config_failed = False  # a worker exited EX_CONFIG: the config is bad, starting again won't help
        self.failed = asyncio.Event()  # ... and the daemon stops with it

    # the parent's view -----------------------------------------------------------------------
    def ready_count(self) -> int:
        return sum(1 for w in self._workers if w.ready.is_set())

    def pids(self) -> list[int | None]:
        return [w.proc.pid if w.proc is not None else None for w in self._workers]

    def status(self) -> str:
        return f"workers {self.ready_count()}/{self.count} ready"

    async def wait_ready(self) -> None:
        """Until every worker said READY=1 (each one started again as often as it must)."""
        await asyncio.gather(*(w.ready.wait() for w in self._workers))

    # supervision -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep every worker running until cancelled (a stop first calls :meth:`stop`)."""
        try:
            async with asyncio.TaskGroup() as tg:
                for w in self._workers:
                    tg.create_task(self._keep(w), name=f"worker-{w.index}")
                tg.create_task(self._watchdog(), name="workers-watchdog")
        finally:
            for w in self._workers:  # cancelled without a stop (a failed start-up): none outlives us
                if w.proc is not None and w.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        w.proc.kill()
                self._close(w)

    async def _keep(self, w: _Worker) -> None:
        backoff = _BACKOFF_INITIAL_S
        while not self._stopping:
            await self._spawn(w)
            assert w.proc is not None
            rc = await w.proc.wait()
            self._close(w)
            if self._stopping:
                return
            ran_s = self._clock() - w.started
            if rc == EXIT_CONFIG and not w.ever_ready:
                _log.error("worker_config_invalid", worker=w.index, rc=rc)
                self.config_failed = True
                self.failed.set()
                return
            if ran_s >= _BACKOFF_RESET_S:
                backoff = _BACKOFF_INITIAL_S
            _log.error("worker_exited", worker=w.index, rc=rc, pid=w.proc.pid if w.proc else None,
                       ran_s=round(ran_s, 3), restart_in_s=backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
            w.restarts += 1

    async def _spawn(self, w: _Worker) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        parent_end.setblocking(False)
        fds = [s.fileno() for s in self.sockets]
        spec = WorkerSpec(w.index, w.restarts, child_end.fileno(), tuple(fds), os.getpid())
        try:
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "routerd", "run", "--config", self.config_path, "--worker", spec.arg(),
                pass_fds=(*fds, child_end.fileno()), env=self.env, stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True)  # a terminal's Ctrl-C is the parent's: it tells each worker STOP
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        w.sock = parent_end
        w.ready.clear()
        w.started = w.last_ping = self._clock()
        asyncio.get_running_loop().add_reader(parent_end.fileno(), self._read, w)
        _log.info("worker_started", worker=w.index, pid=w.proc.pid, restarts=w.restarts)

    def _read(self, w: _Worker) -> None:
        """What worker ``w`` said: any datagram is a sign of life; ``READY=1`` its readiness."""
        if w.sock is None:
            return
        words = read_words(w.sock)
        if words:
            w.last_ping = self._clock()
            if b"READY=1" in words and not w.ready.is_set():
                w.ready.set()
                w.ever_ready = True
                _log.info("worker_ready", worker=w.index, pid=w.proc.pid if w.proc else None,
                          took_s=round(self._clock() - w.started, 3))

    async def _watchdog(self) -> None:
        """Kill every ready worker silent for ``stall_s`` (its exit then starts it again), until a stop.

        Silent for what the parent could hear: the pings already waiting on each pair are read first (a
        loop that wakes from a stall may run this before it polls the sockets, as uvloop does), and a
        pass that woke late by a worker's ping interval or more says the parent's own loop was held up:
        a worker's pings sent meanwhile may be lost (a full pair drops them) or not sent at all (the
        whole service frozen with it), so each worker's silence counts again from the end of that
        stall. A worker that really stalls is still killed ``stall_s`` after it. A shorter lateness
        cannot hide a ping, so a loop held up often but briefly does not keep the watchdog from biting.
        """
        while not self._stopping:
            late_s = await _aio.overslept(_POLL_S, self._clock)
            if late_s >= ping_interval_s(self.stall_s):
                self._listening_since = self._clock()
                _log.warning("workers_watchdog_restarted", late_s=round(late_s, 3),
                             why="the daemon's own loop was held up: the workers' silence counts from now")
            for w in self._workers:
                self._judge(w)

    def _judge(self, w: _Worker) -> None:
        proc = w.proc
        if proc is None or proc.returncode is not None or not w.ready.is_set() or self._stopping:
            return
        self._read(w)
        silent_s = self._clock() - max(w.last_ping, self._listening_since)
        if silent_s > self.stall_s:
            _log.error("worker_stalled", worker=w.index, pid=proc.pid, silent_s=round(silent_s, 3),
                       action="killed, and started again")
            w.ready.clear()  # judged once: its exit is what _keep waits for
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _close(self, w: _Worker) -> None:
        w.ready.clear()
        if w.sock is not None:
            with contextlib.suppress(ValueError, OSError):  # the loop may be closing
                asyncio.get_running_loop().remove_reader(w.sock.fileno())
            w.sock.close()
            w.sock = None

    # signals ---------------------------------------------------------------------------------
    def tell(self, word: bytes) -> None:
        """Say ``word`` (:data:`STOP`, :data:`FORCE`, :data:`RELOAD`) to every running worker."""
        for w in self._workers:
            if w.sock is not None and w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(OSError):  # a full pair or a worker just gone: it is restarted
                    w.sock.send(word)

    def begin_stop(self) -> None:
        """No worker is started again from now on; each is told to drain (as one routerd does)."""
        self._stopping = True
        self.tell(STOP)

    async def stop(self, timeout_s: float) -> bool:
        """Drain every worker: TERM, then wait up to ``timeout_s`` for all to exit; any left is killed.
        True when every worker exited by itself with 0."""
        self.begin_stop()
        procs = [w.proc for w in self._workers if w.proc is not None]
        clean = True
        try:
            async with asyncio.timeout(timeout_s):
                codes = await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            clean = False
            _log.error("workers_stop_timed_out", timeout_s=timeout_s,
                       left=[p.pid for p in procs if p.returncode is None])
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_KILL_WAIT_S):
                    await asyncio.gather(*(p.wait() for p in procs))
        else:
            if any(codes):
                clean = False
                _log.error("workers_stopped_with_errors", codes=codes)
        _log.info("workers_stopped", workers=self.count, clean=clean)
        return clean
