"""What LoRA placement (routerd/fleet/adapters.py) and the routing side's record of who holds which
adapter (routerd/routing/adapters.py) exchange: one fleet as the planner sees it, and one move."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Move:
    """One placement step: ``load`` or ``unload`` ``adapter`` on ``instance``."""

    kind: str
    instance: str
    adapter: str


@dataclass(frozen=True)
class FleetPlacement:
    """What the planner sees of one fleet: slots per instance, the adapters (name → pinned), each
    ready instance's adapters (least recently used first) and which of them have requests in flight,
    each adapter's request rate, its demand (requests in flight fleet-wide, smoothed: what it asks of
    the engines now) and the demand one copy serves before the adapter wants another (``per_copy``,
    requests; 0: one copy each)."""

    slots: int
    adapters: dict[str, bool]
    held: dict[str, list[str]]
    busy: dict[str, set[str]] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    demand: dict[str, float] = field(default_factory=dict)
    per_copy: float = 0.0
