"""The Ray actor that holds one engine instance: its resources, its process, its logs — and no orphans.

The fleet manager creates one detached ``EngineActor`` per instance inside that instance's placement
group, so the actor *holds* the instance's CPUs/GPUs for as long as it lives; the engine it supervises
is a plain child process (``vllm serve`` cannot reuse an actor's placement group — see routerd.fleet.manager).

No orphans, by three independent means: the engine runs in its own process group (so a stop reaches
vLLM's EngineCore and worker grandchildren too), it gets ``PR_SET_PDEATHSIG=SIGKILL`` (so if the actor
dies — SIGKILL, ``ray.kill``, OOM — the engine dies with it; Ray's own process-group clean-up does not
reach a child in another group), and after every stop the actor scans ``/proc`` for anything left in
the group and kills it. The class is plain Python (wrapped with ``ray.remote`` by the fleet manager),
so its process handling is testable without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from .. import plugins, redact
from .._net import free_port
from ..plugins import Launcher, LaunchPlan, LaunchSpec

PR_SET_PDEATHSIG = 1
# Where a launched engine finds its API key: vLLM reads it (--api-key on argv would show in `ps` to every
# user of the node; a process's environment is readable only by its owner and root), the sim too.
API_KEY_ENV = "VLLM_API_KEY"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _child_setup(parent_pid: int) -> None:
    """Runs in the forked child before exec: die with the parent (thread), even if it already died."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died between fork and prctl: the signal would never come
        os._exit(1)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 = state)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(") ", 1)[1].split()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def _node_ip_and_id() -> tuple[str, str]:
    try:
        import ray

        if ray.is_initialized():
            # Ray rewrites a 127.0.0.1 node address to the host's reachable IP (resolve_ip_for_localhost).
            ip = ray._private.worker.global_worker.node_ip_address
            return str(ip), str(ray.get_runtime_context().get_node_id())
    except ImportError:
        pass
    return "127.0.0.1", ""


def api_key_id(key: str) -> str:
    """A short public name of an engine API key ("" for none): which key an engine runs with can be
    told and compared (adoption, status) without the key itself leaving the actor."""
    return hashlib.sha256(b"routerd/engine-key-id/v1\0" + key.encode()).hexdigest()[:12] if key else ""


class FencedOut(RuntimeError):
    """A mutating call carried a lower fencing token than one this actor has seen: it comes from a
    routerd whose term of control has ended (routerd/peers/lease.py), and is refused."""


class EngineActor:
    """Supervises one engine process for instance ``spec.fleet:spec.index``.

    Methods are async so Ray runs them concurrently on one event loop: a pending ``wait_exit`` (the
    fleet manager's death sentinel) never blocks a ``probe`` or a ``stop``.

    Fencing at the resource: each mutating call (``start``, ``restart_engine``, ``stop``) carries the
    caller's control token; the actor keeps the highest it has seen and refuses a lower one with
    :class:`FencedOut`, so a call a deposed controller sent before it knew cannot undo the new one's.
    """

    def __init__(self, spec_json: bytes, generation: int, state_dir: str, engine_host: str = "",
                 token: int = 0) -> None:
        """``engine_host`` "" binds the engine to the node's IP (multi-node clusters); routerd passes
        127.0.0.1 when the cluster is local, so engines never listen beyond loopback there. ``token``:
        the control token of the routerd that creates it."""
        self.token = token
        self.spec = msgspec.json.decode(spec_json, type=LaunchSpec)
        self.spec_json = spec_json
        self.generation = generation
        self.state_dir = Path(state_dir)
        node_ip, self.node_id = _node_ip_and_id()
        self.host = engine_host or node_ip
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.started_at = 0.0
        self.log_path = ""
        self.last_stop: dict[str, Any] = {}
        self._cpu_prev: tuple[float, float] | None = None  # (wall, cpu seconds) at the last sample
        self._lock = asyncio.Lock()
        # The API key the engine requires (given with each start, never logged nor in info()): what
        # the engine it starts next runs with. "" starts an engine without one.
        self._api_key = ""

    # lifecycle -------------------------------------------------------------------------------
    def _fence(self, token: int) -> None:
        if token < self.token:
            raise FencedOut(f"control token {token} is older than {self.token}: that routerd no longer "
                            "controls the fleets")
        self.token = token

    async def start(self, token: int = 0, api_key: str = "") -> dict[str, Any]:
        """Start the engine (no-op if it runs) requiring ``api_key`` on its /v1 routes; returns
        ``info()``. Readiness is the manager's check."""
        async with self._lock:
            self._fence(token)
            if self.proc is None or self.proc.poll() is not None:
                self._api_key = api_key
                await self._spawn()
        return await self.info()

    async def restart_engine(self, grace_s: float = 5.0, token: int = 0,
                             generation: int = 0, api_key: str = "") -> dict[str, Any]:
        """Stop the engine, then start a new one (new port, generation + 1, requiring ``api_key``)
        under the same resources.

        ``generation``: the one the caller means to replace (0: whatever runs). If a live engine of
        another generation runs, someone restarted it since the caller looked — the controller that
        was restarting it when control passed — and it is not restarted twice."""
        async with self._lock:
            self._fence(token)
            if generation and generation != self.generation and self.proc is not None \
                    and self.proc.poll() is None:
                return await self.info()
            await self._stop(grace_s)
            self.generation += 1
            self._api_key = api_key
            await self._spawn()
        return await self.info()

    async def stop(self, grace_s: float = 10.0, token: int = 0) -> dict[str, Any]:
        """SIGTERM to the engine's group, SIGKILL after ``grace_s``, then prove nothing is left."""
        async with self._lock:
            self._fence(token)
            return await self._stop(grace_s)

    async def wait_exit(self, generation: int) -> int | None:
        """Returns when engine ``generation`` is gone (its exit code); the manager's death sentinel.

        Raises through Ray as ActorDiedError if the actor itself dies, which is the other half of it.
        """
        proc = self.proc
        if proc is None or self.generation != generation:
            return None  # that generation is already gone
        while proc.poll() is None:  # noqa: ASYNC110  # Popen has no awaitable exit
            await asyncio.sleep(0.1)
        return proc.returncode

    async def _spawn(self) -> None:
        launcher: Launcher = plugins.load(plugins.LAUNCHER_GROUP, self.spec.engine)
        workdir = self.state_dir / "engines" / f"{self.spec.fleet}-{self.spec.index}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(self.host)
        plan: LaunchPlan = await launcher.plan(self.spec, host=self.host, port=self.port,
                                               workdir=str(workdir))
        env = dict(os.environ)
        for key, value in plan.env.items():
            if value == "":
                env.pop(key, None)  # "" removes: Ray's OMP_NUM_THREADS=1 must not reach the engine
            else:
                env[key] = value
        if self._api_key:  # after the plan's env: the key routerd holds is the one the engine requires
            env[API_KEY_ENV] = self._api_key
        else:
            env.pop(API_KEY_ENV, None)
        self.log_path = str(workdir / f"g{self.generation}.log")
        parent = os.getpid()
        with open(self.log_path, "ab") as log:  # noqa: ASYNC230  # a local append-open, microseconds
            shown = " ".join(redact.argv(plan.argv))  # the engine's own flags may carry its API key
            log.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} {shown}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(  # noqa: ASYNC220  # fork+exec returns at once; no wait here
                plan.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=str(workdir), process_group=0, preexec_fn=functools.partial(_child_setup, parent))
        self.started_at = time.time()
        self._cpu_prev = None

    async def _stop(self, grace_s: float) -> dict[str, Any]:
        proc = self.proc
        if proc is None:
            return {"stopped": True, "returncode": None, "forced": False, "leftover": []}
        pgid = proc.pid  # process_group=0 made the engine its group's leader
        forced = False
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110  # Popen exit is polled
                await asyncio.sleep(0.05)
        if proc.poll() is None or group_members(pgid):
            forced = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        leftover: list[int] = []
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            proc.poll()
            leftover = group_members(pgid)
            if proc.returncode is not None and not leftover:
                break
            await asyncio.sleep(0.05)
        self.last_stop = {"stopped": not leftover, "returncode": proc.returncode, "forced": forced,
                          "leftover": leftover}
        return self.last_stop

    # observation -----------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """Everything status shows about this engine, plus the recorded spec adoption compares."""
        proc = self.proc
        alive = proc is not None and proc.poll() is None
        # The /proc scan and nvidia-smi (up to 2 s) run in a thread: on the actor's loop they would hold
        # up a concurrent probe past its deadline and fail a healthy engine.
        resources = await asyncio.to_thread(self.resource_use) if alive else {}
        return {
            "spec": self.spec_json.decode(),
            "generation": self.generation,
            "pid": proc.pid if proc is not None else None,
            "alive": alive,
            "returncode": None if proc is None or alive else proc.returncode,
            "host": self.host,
            "port": self.port,
            "url": f"http://{self.host}:{self.port}" if self.port else "",
            "node_id": self.node_id,
            "actor_pid": os.getpid(),
            "started_at": self.started_at,
            "log_path": self.log_path,
            "token": self.token,
            "api_key_id": api_key_id(self._api_key),
            "resources": resources,
        }

    async def probe(self, timeout_s: float) -> dict[str, Any]:
        """One heartbeat from next to the engine: is the process alive, does ``/health`` answer in time."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return {"process_alive": False, "http_status": None, "error": "exited",
                    "returncode": proc.returncode if proc is not None else None}
        url = f"http://{self.host}:{self.port}/health"
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
                await resp.read()
                return {"process_alive": True, "http_status": resp.status, "error": ""}
        except TimeoutError:
            return {"process_alive": proc.poll() is None, "http_status": None, "error": "timeout"}
        except aiohttp.ClientError as e:
            return {"process_alive": proc.poll() is None, "http_status": None,
                    "error": f"connect: {type(e).__name__}"}

    def resource_use(self) -> dict[str, Any]:
        """CPU (percent of one core since the last sample), RSS and — with nvidia-smi — GPU memory."""
        proc = self.proc
        if proc is None:
            return {}
        members = group_members(proc.pid)
        cpu_s = 0.0
        rss = 0
        for pid in members:
            fields = _stat(pid)
            if fields is None:
                continue
            cpu_s += (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime
            rss += int(fields[21]) * _PAGE
        now = time.monotonic()
        prev, self._cpu_prev = self._cpu_prev, (now, cpu_s)
        cpu_pct = None
        if prev is not None and now > prev[0]:
            cpu_pct = round(max(0.0, cpu_s - prev[1]) / (now - prev[0]) * 100, 1)
        out: dict[str, Any] = {"processes": len(members), "cpu_percent": cpu_pct,
                               "cpu_seconds": round(cpu_s, 2), "rss_bytes": rss}
        gpu = _gpu_memory(set(members))
        if gpu is not None:
            out["gpu_memory_bytes"] = gpu
        return out

    def ping(self) -> bool:
        return True


def _gpu_memory(pids: set[int]) -> int | None:
    """GPU memory used by ``pids`` according to nvidia-smi, or None where there is no NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=2.0, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total = 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids and parts[1].isdigit():
            total += int(parts[1]) * 1024 * 1024
    return total
