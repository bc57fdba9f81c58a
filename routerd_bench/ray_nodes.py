"""Ray clusters on this machine: several nodes for the node-loss round and the node-loss tests, and the
one-node head the failover and autoscale benchmarks run on by default.

Each node is its own ``ray start --block`` (the head with ``--head``, the others joining it with
``--address``), with its own declared CPUs, GPUs and a custom resource named after it, so placement
across nodes is real. Traps (measured, /work/shared/reference ray-and-redis-measured and this module's
own runs): worker nodes must join one at a time (two joining at once can take the same raylet socket
name in the shared session directory and one times out); every node needs its own ports; ``ray stop``
would stop every cluster on the machine, so nodes are stopped by SIGTERM to their ``--block`` process.

Losing a node = SIGKILL of its raylet: ``ray start --block`` then kills the node's other processes and
exits, its actors' workers die, and their engines with them (parent-death signal) — what a crashed
machine looks like to the rest of the cluster, except that its TCP peers see resets instead of silence.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routerd._net import free_port
from routerd.fleet.ray_cluster import NODE_ARGS, ray_binary, ray_env

from ._common import stop_process

_HOST = "127.0.0.1"


@dataclass
class Node:
    """One ``ray start --block`` process: its name (also a custom resource it declares) and log."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def raylet_pid(self) -> int | None:
        """The pid of this node's raylet (a child of its ``ray start``), or None once it is gone."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            return None
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    return pid
            except OSError:
                continue
        return None


class LocalRayCluster:
    """A head node plus worker nodes, each with declared resources; ``close()`` stops them all."""

    def __init__(self, *, head_cpus: int = 4, head_gpus: int = 0, start_timeout_s: float = 90.0) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths < 108 bytes
        self.port = free_port(_HOST)
        self.address = f"{_HOST}:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.nodes: dict[str, Node] = {}
        self._head_cpus, self._head_gpus = head_cpus, head_gpus

    def start(self) -> str:
        """Start the head; returns the GCS address."""
        argv = ["--head", "--port", str(self.port), "--num-cpus", str(self._head_cpus),
                "--num-gpus", str(self._head_gpus), "--include-dashboard=false",
                "--ray-client-server-port", str(free_port(_HOST)), "--temp-dir", self.temp_dir]
        self._start_node("head", argv)
        return self.address

    def add_node(self, name: str, *, num_cpus: int = 2, num_gpus: int = 0) -> Node:
        """A worker node joining the cluster, declaring ``{name: 1}`` besides its CPUs and GPUs."""
        argv = ["--address", self.address, "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
                "--resources", json.dumps({name: 1}), "--node-manager-port", str(free_port(_HOST)),
                "--object-manager-port", str(free_port(_HOST)), "--runtime-env-agent-port",
                str(free_port(_HOST)), "--dashboard-agent-grpc-port", str(free_port(_HOST)),
                "--metrics-export-port", str(free_port(_HOST)), "--min-worker-port", "0",
                "--max-worker-port", "0"]
        return self._start_node(name, argv)

    def _start_node(self, name: str, argv: list[str]) -> Node:
        log_path = Path(self.temp_dir) / f"{name}.log"
        full = [ray_binary(), "start", "--block", "--node-ip-address", _HOST, *NODE_ARGS, *argv]
        with log_path.open("wb") as log:
            # Its own session: a Ctrl-C of the test run must not reach the nodes before close() does.
            proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=ray_env(),
                                    start_new_session=True)
        node = Node(name, proc, log_path)
        self.nodes[name] = node
        deadline = time.monotonic() + self.start_timeout_s
        while b"Ray runtime started" not in log_path.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                self._stop(node)
                raise RuntimeError(f"ray node {name} did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        if name == "head":
            while not _port_open(self.port):
                time.sleep(0.05)
        return node

    def kill_raylet(self, name: str) -> int:
        """Lose node ``name``: SIGKILL its raylet (its ``ray start`` then takes the rest down)."""
        pid = self.nodes[name].raylet_pid()
        if pid is None:
            raise RuntimeError(f"node {name} has no raylet")
        os.kill(pid, signal.SIGKILL)
        return pid

    def _stop(self, node: Node) -> None:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(45)
        except subprocess.TimeoutExpired:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(10)

    def close(self) -> None:
        """Stop the worker nodes, then the head; remove the temp dir."""
        for node in self.nodes.values():  # the workers stop in parallel, the head last
            if node.name != "head" and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for name in sorted(self.nodes, key=lambda n: n == "head"):
            self._stop(self.nodes[name])
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((_HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def own_head() -> Any:
    """A throwaway one-node ``ray start --head --block`` (4 declared GPUs), stopped by SIGTERM at the end
    (failover and autoscale run on it unless given ``--ray-address``)."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    argv = [ray_binary(), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
            "--num-cpus", "8", "--num-gpus", "4", "--include-dashboard=false", *NODE_ARGS,
            "--ray-client-server-port", str(free_port()), "--temp-dir", tmp]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ray_env())
    try:
        yield f"127.0.0.1:{port}", tmp
    finally:
        stop_process(proc, 30.0)
