"""The restart round of ``routerd bench failover``: ``routerd run`` restarted under a steady request rate.

What ``systemctl restart routerd`` does to clients, measured with and without socket activation.
:class:`SocketHolder` plays systemd's part (``systemd/routerd.socket``): it binds the listening socket
once and starts each ``routerd run`` with it as fd 3, ``LISTEN_FDS=1`` and ``LISTEN_PID`` set to the
child's own pid, as systemd does. :class:`RateLoad` sends requests open-loop at a fixed rate — a new
one every ``1/rate`` seconds whatever the previous ones do, as independent clients would — over
keep-alive connections, and counts refused connections, failed requests and each request's latency.
The restart is the one systemd does: SIGTERM, wait for the exit, start the next process.

The test of socket activation (tests/test_socket_activation.py) uses the same pieces on a static fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from ._common import quantile, stop_process, wait_http

# dup2 the held socket to fd 3 and exec routerd in the same process, so LISTEN_PID is routerd's own pid.
_SHIM = ("import os, sys\n"
         "fd = int(sys.argv[1])\n"
         "if fd != 3:\n"
         "    os.dup2(fd, 3)\n"
         "    os.close(fd)\n"
         "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='routerd.socket')\n"
         "os.execvp(sys.argv[2], sys.argv[2:])\n")


class SocketHolder:
    """A listening socket that outlives the processes serving on it, as ``routerd.socket`` does."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backlog: int = 4096) -> None:
        self.sock = socket.create_server((host, port), backlog=backlog)
        bound_host, bound_port = self.sock.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self.port = int(bound_port)

    def spawn(self, argv: list[str], *, env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start ``argv`` with the socket as its fd 3 and the ``LISTEN_*`` variables set."""
        fd = self.sock.fileno()
        return subprocess.Popen([sys.executable, "-c", _SHIM, str(fd), *argv], pass_fds=(fd,), env=env,
                                stdout=log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        self.sock.close()


@dataclass
class RateLoad:
    """Open-loop requests at ``rate_per_s`` (every ``stream_every``-th one streamed) until stopped."""

    url: str
    model: str
    rate_per_s: float = 100.0
    max_tokens: int = 8
    stream_every: int = 5
    timeout_s: float = 60.0
    ok: int = 0
    refused: int = 0  # the connection was refused: nothing listened
    failed: int = 0  # anything else that was not a whole 200 answer (a stream: ended by [DONE], no error)
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few, each with when it was sent
    started: float = field(default_factory=time.monotonic)

    async def run(self, stop: asyncio.Event) -> None:
        tasks: set[asyncio.Task[None]] = set()
        connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue behind the client's own pool
        async with aiohttp.ClientSession(connector=connector) as session:
            n = 0
            next_at = time.monotonic()
            while not stop.is_set():
                task = asyncio.create_task(self.request(session, stream=n % self.stream_every == 0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
                next_at += 1.0 / self.rate_per_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=self.timeout_s + 5.0)

    async def request(self, session: aiohttp.ClientSession, *, stream: bool) -> None:
        """One request, counted."""
        body = {"model": self.model, "prompt": "restart", "max_tokens": self.max_tokens, "stream": stream}
        t0 = time.monotonic()
        try:
            async with session.post(f"{self.url}/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                data = await resp.read()
            whole = resp.status == 200 and (not stream or (data.rstrip().endswith(b"data: [DONE]")
                                                           and b'"error"' not in data))
            if whole:
                self.ok += 1
                self.latencies_s.append(time.monotonic() - t0)
            else:
                self._fail(t0, f"{resp.status}: {data[-160:]!r}")
        except aiohttp.ClientConnectorError as e:
            if isinstance(e.os_error, ConnectionRefusedError):
                self.refused += 1
            else:
                self._fail(t0, repr(e))
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self._fail(t0, repr(e))

    def _fail(self, sent_at: float, why: str) -> None:
        self.failed += 1
        if len(self.errors) < 10:
            self.errors.append(f"sent at {sent_at - self.started:.3f} s, failed at "
                               f"{time.monotonic() - self.started:.3f} s: {why}")

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {"ok": self.ok, "refused": self.refused, "failed": self.failed, "errors": self.errors,
                "latency_p50_s": round(quantile(lat, 0.5), 4) if lat else None,
                "latency_p99_s": round(quantile(lat, 0.99), 4) if lat else None,
                "latency_max_s": round(lat[-1], 4) if lat else None}


def routerd_argv(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "routerd", "run", "--config", str(config_path), "--log-format", "json"]


def start_routerd(config_path: Path, env: dict[str, str], log_path: Path,
                  holder: SocketHolder | None) -> subprocess.Popen[bytes]:
    """``routerd run`` serving on ``holder``'s socket (socket activation), or binding its own port;
    its output goes to ``log_path``."""
    argv = routerd_argv(config_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        if holder is not None:
            return holder.spawn(argv, env=env, log=log)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


async def restart_under_load(config_path: Path, url: str, model: str, *, holder: SocketHolder | None,
                             env: dict[str, str], log_dir: Path, rate_per_s: float = 100.0,
                             restarts: int = 1, before_s: float = 2.0, after_s: float = 2.0,
                             long_streams: int = 0, long_tokens: int = 200,
                             last_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start routerd, load it at ``rate_per_s``, restart it ``restarts`` times (SIGTERM, exit, start the
    next, wait until it logs ready, ``after_s`` of load), stop.

    ``url`` is where clients connect (the holder's, or the config's own port). Before each SIGTERM
    ``long_streams`` streams of ``long_tokens`` tokens are opened: the drain must finish them.
    ``last_env`` is the last process's environment (a benchmark sets ``stop_engines_on_exit`` there).
    Returns the load's counts and latencies, the long streams' and each restart's timings.
    """
    n = 1
    proc = await asyncio.to_thread(start_routerd, config_path, env, log_dir / "routerd-1.log", holder)
    timings: list[dict[str, float]] = []
    try:
        await wait_http(f"{url}/readyz", timeout=120.0, proc=proc)
        load = RateLoad(url, model, rate_per_s=rate_per_s)
        stop = asyncio.Event()
        driver = asyncio.create_task(load.run(stop))
        long = RateLoad(url, model, max_tokens=long_tokens)
        long_session = aiohttp.ClientSession()
        in_flight: list[asyncio.Task[None]] = []
        try:
            await asyncio.sleep(before_s)
            for _ in range(restarts):
                in_flight += [asyncio.create_task(long.request(long_session, stream=True))
                              for _ in range(long_streams)]
                await asyncio.sleep(0.2)  # they reached routerd and are streaming
                t_term = time.monotonic()
                rc = await asyncio.to_thread(stop_process, proc, 60.0)
                exited_s = time.monotonic() - t_term
                n += 1
                next_env = last_env if n > restarts and last_env else env
                proc = await asyncio.to_thread(start_routerd, config_path, next_env,
                                               log_dir / f"routerd-{n}.log", holder)
                await logged(log_dir / f"routerd-{n}.log", "routerd_ready", proc, timeout_s=120.0)
                timings.append({"term_at_s": round(t_term - load.started, 3), "exit_code": rc,
                                "term_to_exit_s": round(exited_s, 3),
                                "term_to_ready_s": round(time.monotonic() - t_term, 3)})
                await asyncio.sleep(after_s)
        finally:
            stop.set()
            await driver
            if in_flight:
                await asyncio.wait(in_flight, timeout=long.timeout_s)
            await long_session.close()
    finally:
        await asyncio.to_thread(stop_process, proc, 60.0)
    return {"socket_activated": holder is not None, "rate_per_s": rate_per_s, "restarts": timings,
            **load.summary(),
            "long_streams": {"opened": long_streams * restarts, "whole": long.ok, "errors": long.errors}}


async def restart_rounds(address: str, state_dir: str, *, rate_per_s: float, restarts: int,
                         control: bool = True) -> dict[str, Any]:
    """The benchmark's round: ``routerd run`` over a 2-replica simulated fleet on the Ray cluster at
    ``address`` (adopted again by each new process), restarted ``restarts`` times under ``rate_per_s``
    with the socket held as ``routerd.socket`` holds it; with ``control`` once more binding its own
    port, for the refusals socket activation avoids."""
    from routerd._net import free_port

    out: dict[str, Any] = {}
    runs: list[tuple[str, SocketHolder | None]] = [("socket_activated", SocketHolder())]
    if control:
        runs.append(("bound", None))
    for name, holder in runs:
        port = holder.port if holder is not None else free_port()
        url = holder.url if holder is not None else f"http://127.0.0.1:{port}"
        run_dir = Path(state_dir) / f"restart-{name}"
        config_path = run_dir / "routerd.toml"
        await asyncio.to_thread(_write_config, config_path, address, port, run_dir)
        try:
            out[name] = await restart_under_load(
                config_path, url, "sim-restart", holder=holder, env=child_env(), log_dir=run_dir,
                rate_per_s=rate_per_s, restarts=restarts if holder is not None else 1, long_streams=2,
                last_env=child_env(ROUTERD_DAEMON_STOP_ENGINES_ON_EXIT="true"))
        finally:
            if holder is not None:
                holder.close()
    return out


def _write_config(path: Path, address: str, port: int, state: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""[daemon]
state_dir = "{state}"
drain_timeout_s = 30

[http]
host = "127.0.0.1"
port = {port}

[redis]
enabled = false

[ray]
address = "{address}"
namespace = "routerd-bench-restart-{os.getpid()}"

[[fleets]]
name = "restart"
model = "sim-restart"
engine = "sim"
replicas = 2
num_cpus_per_instance = 0.5
max_num_seqs = 64
engine_args = {{ "max-num-seqs" = 64, "ttft-ms" = 10, "itl-ms" = 5 }}
""")


async def logged(log_path: Path, event: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait until ``routerd run`` (JSON logs) logged ``event`` — for the second process its ``/readyz``
    would answer only after the requests queued in front of it, so the log says when it is ready."""
    needle = f'"event":"{event}"'.encode()
    deadline = time.monotonic() + timeout_s
    while needle not in await asyncio.to_thread(log_path.read_bytes):
        if proc.poll() is not None:
            raise RuntimeError(f"routerd exited with {proc.returncode} before {event}; see {log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {event} from routerd within {timeout_s}s; see {log_path}")
        await asyncio.sleep(0.02)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a ``routerd run`` child: ours, Ray's traps set, no inherited LISTEN_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **extra)
    return env


def table_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The restart round's lines of the ``routerd bench failover`` table."""
    rows: list[tuple[str, str, str]] = []
    for name, title in (("socket_activated", "restart, socket-activated"), ("bound", "restart, own bind")):
        run = r.get(name)
        if run is None:
            continue
        gaps = "  ".join(f"{x['term_to_ready_s']:.2f}" for x in run["restarts"])
        rows += [
            (f"{title}: refused connections / failed requests", f"{run['refused']} / {run['failed']} "
             f"(of {run['ok'] + run['refused'] + run['failed']} at {run['rate_per_s']:.0f}/s)",
             "0 / 0" if name == "socket_activated" else "-"),
            ("  SIGTERM → next routerd ready (s); worst latency (s)",
             f"{gaps};  {run['latency_max_s']}", "-"),
            ("  streams open at SIGTERM finished whole", f"{run['long_streams']['whole']} of "
             f"{run['long_streams']['opened']}", "all"),
        ]
    return rows
