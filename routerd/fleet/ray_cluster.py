"""The connection to Ray: an explicit address, or routerd's own local head that outlives routerd.

Why a separate ``ray start --head --block`` process for the local default: a cluster started by a
driver's own ``ray.init()`` dies with that driver, detached actors included, so engines could never
survive a routerd restart. The head is started in its own session (it must outlive routerd — the one
place routerd deliberately starts something without a parent-death signal), its address and pid are
recorded in ``<state_dir>/ray/head.json``, and a restarted routerd finds it there again.

Traps handled here (measured on Ray 2.60): token auth turns itself on unless ``RAY_AUTH_MODE=disabled``
(set for the head and the driver); ``address="auto"`` picks the newest cluster on the machine (we never
use it); ``ray.init`` to a dead GCS blocks for minutes (bounded by ``connect_timeout_s`` and Ray's own
GCS wait settings); unix socket paths must stay under 108 bytes (a long state dir gets a short temp dir
under /tmp, named from a hash of the state dir so it is found again); ``ray.init``/``ray.get_actor`` are
blocking, so they run in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import log
from .._aio import wait_for
from .._net import free_port
from ..config import RayConfig

_logger = log.get("routerd.raycluster")

_MAX_TEMP_DIR_LEN = 40  # Ray adds ~60 bytes (session_<date>_<pid>/sockets/plasma_store) below it


class RayConnectError(RuntimeError):
    """Ray could not be reached or started within the configured timeout."""


def ray_env() -> dict[str, str]:
    """Environment for every Ray process routerd starts or drives (auth off, no usage stats)."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def short_temp_dir(state_dir: Path) -> Path:
    """``<state_dir>/ray`` if short enough for Ray's socket paths, else a stable short dir under /tmp."""
    preferred = state_dir / "ray"
    if len(str(preferred)) <= _MAX_TEMP_DIR_LEN:
        return preferred
    digest = hashlib.sha1(str(state_dir).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"rd-{digest}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (pid 1 here does not reap) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# What every ``ray start`` routerd (and its tests and benchmarks) runs leaves out: usage stats, the
# dashboard agent's fixed port, and the log monitor. The log monitor sends every worker's output to the
# drivers; routerd's driver asks for none (log_to_driver=False; the engines' logs stay in the session's
# files), and an idle one polled those files for ~2 % of a core (18 s of CPU in a 15-min test run). A
# head also gets ``--include-dashboard=false``.
NODE_ARGS = ("--dashboard-agent-listen-port=0", "--include-log-monitor=false", "--disable-usage-stats")


def ray_binary() -> str:
    """The ``ray`` CLI of this interpreter's environment (workers must run the same Python)."""
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else "ray"


class LocalHead:
    """routerd's own ``ray start --head --block``: found again through its state file, else started."""

    def __init__(self, cfg: RayConfig, state_dir: Path) -> None:
        self.cfg = cfg
        self.state_file = state_dir / "ray" / "head.json"
        self.temp_dir = short_temp_dir(state_dir)
        self.log_file = state_dir / "ray" / "head.log"

    def find(self) -> str | None:
        """The address of a still-running head recorded by an earlier routerd, or None."""
        try:
            rec = json.loads(self.state_file.read_text())
            pid, host, port = int(rec["pid"]), str(rec["host"]), int(rec["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if _pid_alive(pid) and _port_open(host, port):
            return f"{host}:{port}"
        return None

    def start(self, timeout_s: float) -> str:
        """Start a head bound to 127.0.0.1 with the declared resources; wait until its GCS answers."""
        host = "127.0.0.1"
        port = free_port(host)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        num_cpus = self.cfg.num_cpus or (os.cpu_count() or 1)
        argv = [ray_binary(), "start", "--head", "--block", "--port", str(port),
                "--node-ip-address", host, "--num-cpus", str(num_cpus), "--num-gpus", str(self.cfg.num_gpus),
                "--include-dashboard=false", *NODE_ARGS,
                "--ray-client-server-port", str(free_port(host)), "--temp-dir", str(self.temp_dir)]
        if self.cfg.resources:
            argv += ["--resources", json.dumps(self.cfg.resources)]
        # Detached on purpose (a new session, reparented away from routerd through a shell that exits at
        # once): the head and the detached engines in it must outlive routerd, and routerd must not hold
        # a child process object it will never wait for.
        out = subprocess.run(["/bin/sh", "-c", '"$@" </dev/null >>"$ROUTERD_RAY_LOG" 2>&1 & echo $!', "sh",
                              *argv], env={**ray_env(), "ROUTERD_RAY_LOG": str(self.log_file)},
                             capture_output=True, text=True, start_new_session=True, timeout=10, check=True)
        pid = int(out.stdout.strip())
        deadline = time.monotonic() + timeout_s
        while not _port_open(host, port):
            if not _pid_alive(pid):
                raise RayConnectError(f"ray start exited; see {self.log_file}")
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGTERM)
                raise RayConnectError(f"local Ray head did not open {host}:{port} in {timeout_s}s")
            time.sleep(0.1)
        self.state_file.write_text(json.dumps({"pid": pid, "host": host, "port": port,
                                               "temp_dir": str(self.temp_dir)}))
        _logger.info("ray_head_started", address=f"{host}:{port}", pid=pid, temp_dir=str(self.temp_dir),
                     num_cpus=num_cpus, num_gpus=self.cfg.num_gpus, log=str(self.log_file))
        return f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One Ray node as its GCS lists it (:meth:`RayCluster.nodes`; watched by :mod:`routerd.fleet.nodes`)."""

    node_id: str  # hex, as in the ``ray.io/node-id`` label
    host: str
    port: int  # the raylet's node manager port
    alive: bool  # per Ray's GCS
    resources: dict[str, float] = field(default_factory=dict)


class RayCluster:
    """routerd's driver connection to one Ray cluster (``connect`` once, ``close`` at exit).

    Closing disconnects the driver only: the cluster and its detached engines stay up, which is what
    lets a restarted routerd adopt them.
    """

    def __init__(self, address: str, namespace: str, *, owns_connection: bool, local_head: bool,
                 fence: Callable[[], None] = lambda: None) -> None:
        """``fence()`` runs before every call that changes the cluster (create or kill an actor, create
        or remove a placement group, ask for resources) and raises when this process may not: the
        control lease's ``check`` (routerd/peers/lease.py)."""
        self.address = address
        self.namespace = namespace
        self._owns_connection = owns_connection
        self.local_head = local_head
        self.fence = fence

    @classmethod
    async def connect(cls, cfg: RayConfig, state_dir: Path,
                      fence: Callable[[], None] = lambda: None) -> RayCluster:
        """Connect to ``cfg.address``, or find/start the local head in ``state_dir``; bounded by a timeout."""
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Without these, ray.init to a dead GCS retries for minutes; with them it fails in seconds.
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(max(1, int(cfg.connect_timeout_s / 3))))
        os.environ.setdefault("RAY_py_gcs_connect_timeout_s", str(max(2, int(cfg.connect_timeout_s / 2))))
        local = not cfg.address
        address: str = cfg.address
        if local:
            head = LocalHead(cfg, state_dir)
            found = await asyncio.to_thread(head.find)
            if found is None:
                found = await asyncio.to_thread(head.start, cfg.connect_timeout_s)
            else:
                _logger.info("ray_head_found", address=found)
            address = found
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + cfg.connect_timeout_s
        # A dead address fails here, quickly; ray.init itself would retry for minutes.
        while not await asyncio.to_thread(_port_open, host.strip("[]"), int(port), 1.0):
            if time.monotonic() > deadline:
                raise RayConnectError(f"no Ray GCS answers at {address!r} (waited {cfg.connect_timeout_s}s)")
            await asyncio.sleep(0.5)
        try:
            owns = await wait_for(_in_daemon_thread(_init, address, cfg.namespace),
                                          max(1.0, deadline - time.monotonic()))
        except TimeoutError as e:
            raise RayConnectError(f"ray.init({address!r}) did not finish in {cfg.connect_timeout_s}s") from e
        except ConnectionError as e:
            raise RayConnectError(f"cannot connect to Ray at {address!r}: {e}") from e
        _logger.info("ray_connected", address=address, namespace=cfg.namespace, local_head=local)
        return cls(address, cfg.namespace, owns_connection=owns, local_head=local, fence=fence)

    def is_local(self) -> bool:
        """True for routerd's own head or a cluster addressed on loopback: engines then bind 127.0.0.1."""
        host = self.address.rsplit(":", 1)[0]
        return self.local_head or host in ("127.0.0.1", "localhost", "::1", "[::1]")

    async def close(self) -> None:
        """Disconnect the driver (never stops the cluster: engines must outlive routerd)."""
        if self._owns_connection:
            import ray

            await asyncio.to_thread(ray.shutdown)
            self._owns_connection = False

    async def resources(self) -> tuple[dict[str, float], dict[str, float]]:
        """(total, available) resources of the cluster right now."""
        import ray

        def read() -> tuple[dict[str, float], dict[str, float]]:
            total = ray.cluster_resources()  # type: ignore[no-untyped-call]  # ray is untyped
            return dict(total), dict(ray.available_resources())  # type: ignore[no-untyped-call]

        return await wait_for(asyncio.to_thread(read), 10.0)

    async def call(self, fn: Any, *args: Any, timeout: float = 10.0) -> Any:
        """Run one blocking Ray API call (get_actor, list_named_actors, PG table) off the loop, bounded."""
        return await wait_for(asyncio.to_thread(fn, *args), timeout)


    # Ray operations the fleet manager needs, each off the loop and bounded ----------------------
    async def named_actors(self) -> list[str]:
        """Names of the live named actors in our namespace."""
        import ray.util

        names = await self.call(ray.util.list_named_actors, False)
        return [str(n) for n in names]

    async def get_actor(self, name: str) -> Any | None:
        import ray

        try:
            return await self.call(lambda: ray.get_actor(name, namespace=self.namespace))
        except ValueError:
            return None

    async def create_actor(self, cls: type, name: str, bundle: dict[str, float], pg: Any,
                           *args: Any) -> Any:
        """A detached, never-auto-restarted actor of ``cls`` in bundle 0 of ``pg`` (restarts are ours)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def create() -> Any:
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0,
                                                        placement_group_capture_child_tasks=False)
            self.fence()  # at the last moment: the call itself runs in a thread, after awaits
            return ray.remote(cls).options(
                name=name, namespace=self.namespace, lifetime="detached", max_restarts=0,
                max_task_retries=0, num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
                scheduling_strategy=strategy).remote(*args)

        return await self.call(create)

    async def kill(self, actor: Any) -> None:
        import ray

        self.fence()
        with contextlib.suppress(Exception):  # already dead is fine: the goal is "not running"
            await self.call(lambda: ray.kill(actor, no_restart=True))

    async def placement_group(self, name: str, bundle: dict[str, float],
                              avoid: frozenset[str] = frozenset()) -> Any:
        """The detached STRICT_PACK placement group ``name`` (reused if it exists, else created on a node
        not in ``avoid``: node ids, through Ray's label selector on ``ray.io/node-id``)."""
        import ray.util

        def get_or_create() -> Any:
            with contextlib.suppress(ValueError):
                return ray.util.get_placement_group(name)
            self.fence()
            selector = [{"ray.io/node-id": f"!in({','.join(sorted(avoid))})"}] if avoid else None
            return ray.util.placement_group([bundle], strategy="STRICT_PACK", name=name, lifetime="detached",
                                            bundle_label_selector=selector)

        return await self.call(get_or_create)

    async def placement_group_ready(self, pg: Any) -> None:
        """Once ``pg`` is placed. Its ``ready()`` reference is made off the loop: a process's first one
        held the event loop for 0.2 s (measured here; 1.2 s under load, longer than a short control
        lease's renew margin — the launch then lost the lease it launched under)."""
        ref = await self.call(pg.ready)
        await ref

    async def placement_group_node(self, pg: Any) -> str:
        """The node id a placed group's bundle is on ("" while it is not placed)."""
        import ray.util

        def read() -> str:
            table = ray.util.placement_group_table(pg)
            return str(next(iter(table.get("bundles_to_node_id", {}).values()), "") or "")

        node: str = await self.call(read)
        return node

    async def nodes(self) -> list[NodeInfo]:
        """Ray's node table (dead nodes included)."""
        import ray

        def read() -> list[NodeInfo]:
            return [NodeInfo(node_id=str(n["NodeID"]), host=str(n["NodeManagerAddress"]),
                             port=int(n["NodeManagerPort"]), alive=bool(n["Alive"]),
                             resources={k: float(v) for k, v in n.get("Resources", {}).items()
                                        if not k.startswith("node:")})
                    for n in ray.nodes()]  # type: ignore[no-untyped-call]  # ray is untyped

        nodes: list[NodeInfo] = await self.call(read)
        return nodes

    async def available_per_node(self) -> dict[str, dict[str, float]]:
        """Free resources of each live node right now (Ray's developer API; a few ms)."""
        from ray._private import state

        free: dict[str, dict[str, float]] = await self.call(state.available_resources_per_node)
        return free

    async def remove_placement_group(self, pg: Any) -> None:
        import ray.util

        self.fence()
        with contextlib.suppress(Exception):  # already removed
            await self.call(ray.util.remove_placement_group, pg)

    async def request_resources(self, bundles: list[dict[str, float]]) -> None:
        """Ask the cluster's autoscaler to make room for ``bundles`` at once (``ray.autoscaler.sdk``).

        Each call replaces the previous request (``[]`` withdraws it); a cluster without an autoscaler
        records it and adds nothing."""
        def request() -> None:
            from ray.autoscaler.sdk import request_resources  # its first import is slow: off the loop

            request_resources(bundles=bundles)

        self.fence()
        await self.call(request)

    async def placement_groups(self) -> list[tuple[str, str, Any]]:
        """(name, state, handle) of every not-removed named placement group in the cluster."""
        import ray.util
        from ray.util.placement_group import PlacementGroup

        def read() -> list[tuple[str, str, Any]]:
            out: list[tuple[str, str, Any]] = []
            for pg_id, rec in ray.util.placement_group_table().items():
                if rec.get("name") and rec.get("state") != "REMOVED":
                    out.append((str(rec["name"]), str(rec["state"]),
                                PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))))
            return out

        pgs: list[tuple[str, str, Any]] = await self.call(read)
        return pgs


def _in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """Run a blocking call that may never return (ray.init to a half-dead GCS) in a daemon thread, so
    giving up on it with a timeout does not leave routerd unable to exit (the loop's executor would
    wait for the thread at shutdown)."""
    import threading

    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001  # handed to the awaiting coroutine
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop may be gone if the caller gave up long ago
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=target, name="ray-init", daemon=True).start()
    return fut


def _init(address: str, namespace: str) -> bool:
    """ray.init unless this process is already connected to the same cluster; True if we connected."""
    import ray

    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        current = getattr(ray._private.worker.global_worker.node, "gcs_address", "")
        if current == address and ctx.namespace == namespace:
            return False
        raise RayConnectError(f"this process is already connected to Ray at {current!r} "
                              f"(namespace {ctx.namespace!r}); cannot also use {address!r}")
    with contextlib.redirect_stdout(sys.stderr):
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    return True
