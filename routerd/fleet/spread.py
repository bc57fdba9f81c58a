"""Where a new placement group may go: a fleet's replicas spread across Ray nodes, never onto a lost node.

Each instance has a placement group of its own (one STRICT_PACK bundle, routerd/fleet/naming.py), so
Ray's SPREAD and STRICT_SPREAD — which spread the bundles *of one group* — say nothing about two
instances. routerd spreads them itself: a group is created with Ray's label selector on the default
``ray.io/node-id`` label, ``!in(<nodes to avoid>)``. ``fleets.placement`` says what to avoid:

- ``any``: lost nodes only (routerd/fleet/nodes.py); Ray picks among the rest.
- ``spread``: also the nodes holding another replica of the fleet — as long as some other node has the
  bundle's resources free right now; when none has, the replica doubles up rather than waits. When room
  comes back (a node joins) the fleet spreads again: one doubled-up replica at a time is moved (retired
  after its requests finished, then placed anew), and only while every other replica is ready — so a
  second node loss does not take several replicas at once, at the cost of one replica's start-up.
- ``strict_spread``: always also the nodes holding another replica. With fewer suitable nodes than
  replicas the rest wait, pending with that reason, and are placed when a node joins.

Replicas of a spread fleet are placed one at a time (:meth:`Spreader.placing`), each holding the lock
until its group is placed and its node claimed, so two never pick the same free node at once. While a
group waits, its constraint is computed again every few seconds (routerd/fleet/engine.py); when it
changed — a node was lost, a replica went away — the waiting group is replaced by one with the new one.
A change of ``placement`` applies to placements from then on; running instances are not moved.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from .nodes import NodeWatch
from .ray_cluster import RayCluster


@dataclass(frozen=True, slots=True)
class Where:
    """The nodes a new placement group must avoid, and why (shown while it waits)."""

    avoid: frozenset[str] = frozenset()
    why: str = ""


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) >= v for k, v in bundle.items())


def where(mode: str, bundle: Mapping[str, float], replica_nodes: set[str], lost: frozenset[str],
          free: Mapping[str, Mapping[str, float]]) -> Where:
    """Pure: what a new group of a fleet with ``placement = mode`` must avoid, given the nodes its other
    replicas are on, the lost nodes and (for ``spread``) each live node's free resources."""
    lost_why = f"not on lost node(s) {_short(lost)}" if lost else ""
    if mode == "any" or not replica_nodes:
        return Where(lost, lost_why)
    spread = frozenset(replica_nodes) | lost
    if mode == "strict_spread":
        return Where(spread, f"strict_spread: needs a node without another replica of the fleet "
                             f"(replicas on {_short(frozenset(replica_nodes))})")
    if any(_fits(bundle, avail) for node, avail in free.items() if node not in spread):
        return Where(spread, f"spread: on a node without another replica (replicas on "
                             f"{_short(frozenset(replica_nodes))})")
    return Where(lost, "spread: no node without a replica has room; doubling up"
                 + (f", {lost_why}" if lost_why else ""))


def crowded(claims: Mapping[int, str], bundle: Mapping[str, float], lost: frozenset[str],
            free: Mapping[str, Mapping[str, float]]) -> list[int]:
    """Pure: the replicas of a ``spread`` fleet to move — all but the first on each node holding several
    — when some live node holding none has the bundle's resources free; else none."""
    by_node: dict[str, list[int]] = {}
    for index, node in sorted(claims.items()):
        if node not in lost:
            by_node.setdefault(node, []).append(index)
    extra = [i for indices in by_node.values() for i in indices[1:]]
    if extra and any(_fits(bundle, avail) for node, avail in free.items()
                     if node not in by_node and node not in lost):
        return extra
    return []


def _short(nodes: frozenset[str]) -> str:
    return ", ".join(sorted(n[:12] for n in nodes)) or "-"


class Spreader:
    """Which node each launched instance's placement group is on, and where the next one may go.

    ``claim``/``release`` are called as groups are placed, adopted and removed; ``where`` is asked by
    ``EngineOps.place``. ``placement_of(fleet)`` reads the fleet's current ``placement`` (the config
    can be reloaded).
    """

    def __init__(self, cluster: RayCluster, nodes: NodeWatch | None,
                 placement_of: Callable[[str], str]) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.placement_of = placement_of
        self._claims: dict[str, dict[int, str]] = {}  # fleet → index → node id
        self._locks: dict[str, asyncio.Lock] = {}

    def claim(self, fleet: str, index: int, node_id: str) -> None:
        if node_id:
            self._claims.setdefault(fleet, {})[index] = node_id

    def release(self, fleet: str, index: int) -> None:
        self._claims.get(fleet, {}).pop(index, None)

    def nodes_in_use(self) -> set[str]:
        """Every node holding one of routerd's placement groups (the ones the node watch probes)."""
        return {n for by_index in self._claims.values() for n in by_index.values()}

    def instances_on(self, node_id: str) -> list[tuple[str, int]]:
        return [(fleet, index) for fleet, by_index in self._claims.items()
                for index, node in by_index.items() if node == node_id]

    @contextlib.asynccontextmanager
    async def placing(self, fleet: str) -> AsyncIterator[None]:
        """Held while one replica of a spread fleet is placed (a no-op for ``any``)."""
        if self.placement_of(fleet) == "any":
            yield
            return
        lock = self._locks.setdefault(fleet, asyncio.Lock())
        async with lock:
            yield

    async def crowded(self, fleet: str, bundle: Mapping[str, float]) -> list[int]:
        """The replicas of a ``spread`` fleet to move to a node of their own now (see :func:`crowded`)."""
        claims = self._claims.get(fleet, {})
        if self.placement_of(fleet) != "spread" or len(set(claims.values())) == len(claims):
            return []
        # Every lost node, claimed or not: Ray lists one it has not declared dead yet with free resources.
        lost = frozenset(n for n in claims.values() if self.nodes is not None and self.nodes.gone(n))
        lost |= self.nodes.avoid() if self.nodes is not None else frozenset()
        return crowded(claims, bundle, lost, await self.cluster.available_per_node())

    async def where(self, fleet: str, index: int, bundle: Mapping[str, float]) -> Where:
        """What instance ``index`` of ``fleet`` must avoid now."""
        mode = self.placement_of(fleet)
        lost = self.nodes.avoid() if self.nodes is not None else frozenset()
        others = {node for i, node in self._claims.get(fleet, {}).items()
                  if i != index and not (self.nodes is not None and self.nodes.gone(node))}
        free: Mapping[str, Mapping[str, float]] = {}
        if mode == "spread" and others:
            free = await self.cluster.available_per_node()
        return where(mode, bundle, others, lost, free)
