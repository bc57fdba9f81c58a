"""What LoRA placement (routerd/fleet/adapters.py) and the routing side's record of who holds which
adapter (routerd/routing/adapters.py) exchange: one fleet as the planner sees it, and one move; and the
record the controller publishes of who holds which (:class:`LoraRecord`, in the fleet state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


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


class HeldAdapters(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's record of one instance's adapters, as the fleet state carries it: the engine
    generation it is of, the adapters held (least recently used first), those being loaded there, and
    those the controller's own requests use or wait for there (``busy``: a load that has just ended
    has its request one step from being sent, before any shared load could say so — not idle)."""

    generation: int = 0
    held: list[str] = []
    loading: list[str] = []
    busy: list[str] = []


class LoraRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's LoRA placement, published in the fleet state (routerd/peers/fleet_state.py) for
    followers and workers to route from: each ready instance's adapters (by instance id) and the
    adapters whose path did not load (name → why)."""

    instances: dict[str, HeldAdapters] = {}
    failed: dict[str, str] = {}


class AdapterDemand(msgspec.Struct, frozen=True, array_like=True):
    """One process's adapter traffic, exchanged with its shared load (routerd/peers/load.py) so that
    the controller places by every process's demand and every process knows which adapters are busy:
    requests in flight (instance → adapter → count), requests routed so far (fleet → adapter → count)
    and requests waiting for a load (fleet → count)."""

    inflight: dict[str, dict[str, int]] = {}
    requests: dict[str, dict[str, int]] = {}
    waiting: dict[str, int] = {}
