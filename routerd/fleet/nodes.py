"""Whether the Ray nodes routerd's engines run on are still there: routerd's own node heartbeat.

Why routerd's own: Ray's GCS declares a node dead only after its health checks have failed for about
15 s (``RAY_health_check_*``: 5 misses 3 s apart; a silent host waits out 10 s timeouts too), far
beyond routerd's heartbeat bounds — and until then Ray still counts the node's free resources and may
place a replacement there. So routerd connects to the raylet of every node that holds one of its
engines (the node manager port Ray publishes) each ``heartbeat_interval_s``, within the probe deadline
its engine heartbeats use (``heartbeat_timeout_s / failure_threshold``): ``failure_threshold`` failures
in a row, or Ray itself saying the node is dead, make the node *lost* — within ``heartbeat_timeout_s``
plus one interval, like a hung engine. The fleet manager then takes that node's instances out of
rotation at once (their requests are ended, so streams resume elsewhere) and new placement groups avoid
the node (routerd/fleet/spread.py). A lost node that answers again while Ray still counts it alive (a
healed partition) is used again; one Ray declared dead stays gone (Ray never schedules there again). A
machine that rejoins comes back as a new Ray node — new capacity, and pending instances are placed on it.

A raylet that accepts connections but is wedged is not caught here; the engine heartbeats of its
instances catch what matters of it. :class:`NodeTracker` is the pure part (no I/O, injected clock);
:class:`NodeWatch` drives it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from .. import log
from ..config import HealthConfig
from .health import probe_deadline
from .ray_cluster import NodeInfo, RayCluster

_logger = log.get("routerd.nodes")

TABLE_REFRESH_S = 2.0  # Ray's node table is read this often (and when a watched node is not in it)


class NodeTracker:
    """Which nodes routerd considers lost, from raylet probes and Ray's node table. Pure."""

    def __init__(self, failure_threshold: int) -> None:
        self.failure_threshold = failure_threshold
        self.table: dict[str, NodeInfo] = {}
        self.misses: dict[str, int] = {}
        self.lost: dict[str, str] = {}  # node id → why

    def observe_table(self, nodes: list[NodeInfo]) -> list[tuple[str, str]]:
        """A fresh node table: (node, why) for each node newly lost because Ray declared it dead (the
        dead nodes of the first table are history, not news)."""
        first = not self.table
        self.table = {n.node_id: n for n in nodes}
        newly: list[tuple[str, str]] = []
        for n in nodes:
            if not n.alive and n.node_id not in self.lost:
                self.lost[n.node_id] = "Ray declared the node dead"
                if not first:
                    newly.append((n.node_id, self.lost[n.node_id]))
        return newly

    def record(self, node_id: str, ok: bool, error: str = "") -> tuple[str, str] | None:
        """One raylet probe; (node, why) when this made the node lost."""
        if ok:
            self.misses[node_id] = 0
            info = self.table.get(node_id)
            if node_id in self.lost and info is not None and info.alive:
                del self.lost[node_id]  # a healed partition: Ray never gave up on it
            return None
        self.misses[node_id] = self.misses.get(node_id, 0) + 1
        if self.misses[node_id] >= self.failure_threshold and node_id not in self.lost:
            self.lost[node_id] = f"raylet unreachable ({error or 'no answer'}) {self.misses[node_id]} times"
            return node_id, self.lost[node_id]
        return None

    def gone(self, node_id: str) -> bool:
        """Lost to routerd, or dead to Ray. A node not in the table yet (just joined) is not gone."""
        info = self.table.get(node_id)
        return node_id in self.lost or (info is not None and not info.alive)

    def avoid(self) -> frozenset[str]:
        """Lost nodes Ray may still place on (it never places on the ones it declared dead)."""
        return frozenset(n for n in self.lost if (info := self.table.get(n)) is None or info.alive)


LostFn = Callable[[str, str], None]
"""``on_lost(node_id, why)``: called once when a node becomes lost."""


class NodeWatch:
    """Probes the raylet of every node ``watched()`` names, on a jittered ``heartbeat_interval_s``."""

    def __init__(self, cluster: RayCluster, cfg: HealthConfig, watched: Callable[[], set[str]],
                 on_lost: LostFn, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.tracker = NodeTracker(cfg.failure_threshold)
        self._watched = watched
        self._on_lost = on_lost
        self._clock = clock
        self._rng = rng or random.Random()
        self._table_read_at = -TABLE_REFRESH_S

    def update_config(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self.tracker.failure_threshold = cfg.failure_threshold

    def gone(self, node_id: str) -> bool:
        return bool(node_id) and self.tracker.gone(node_id)

    def avoid(self) -> frozenset[str]:
        return self.tracker.avoid()

    async def run(self) -> None:
        """Probe and read the node table until cancelled; a failed round is logged, not fatal."""
        while True:
            started = self._clock()
            try:
                await self.check_once()
            except Exception:  # a loop boundary: the next round tries again
                _logger.exception("node_watch_failed")
            jitter = self._rng.uniform(0.8, 1.2)
            await asyncio.sleep(max(0.0, self.cfg.heartbeat_interval_s * jitter - (self._clock() - started)))

    async def check_once(self) -> None:
        """One round: the node table when due (or a watched node is missing from it), then one probe
        of every watched node Ray lists, concurrently, each within the probe deadline."""
        watched = self._watched()
        if self._clock() - self._table_read_at >= TABLE_REFRESH_S or not watched <= set(self.tracker.table):
            self._table_read_at = self._clock()
            for node_id, why in self.tracker.observe_table(await self.cluster.nodes()):
                self._lost(node_id, why)
        targets = [self.tracker.table[n] for n in watched if n in self.tracker.table
                   and self.tracker.table[n].alive]
        results = await asyncio.gather(*(self._probe(n) for n in targets))
        for node, error in zip(targets, results, strict=True):
            newly = self.tracker.record(node.node_id, error is None, error or "")
            if newly is not None:
                self._lost(*newly)

    def _lost(self, node_id: str, why: str) -> None:
        _logger.warning("node_lost", node=node_id[:12], why=why,
                        host=self.tracker.table[node_id].host if node_id in self.tracker.table else "")
        self._on_lost(node_id, why)

    async def _probe(self, node: NodeInfo) -> str | None:
        """None if the raylet accepted a connection within the deadline, else what happened."""
        try:
            async with asyncio.timeout(probe_deadline(self.cfg)):
                _, writer = await asyncio.open_connection(node.host, node.port)
        except TimeoutError:
            return "timeout"
        except OSError as e:
            return type(e).__name__
        writer.close()  # nothing was sent: the raylet just sees a connection come and go
        return None
