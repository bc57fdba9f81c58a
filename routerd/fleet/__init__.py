"""Fleets: the engines routerd launches on Ray, and the static ones it only watches.

``naming`` (what an instance and its Ray objects are called) → ``engine`` (one actor + placement group:
place, start, restart, probe, dispose) → ``supervisor`` (one instance's life, the only writer of its
state) → ``manager`` (reconcile, adopt, roll, retire, scale). ``actor`` is the code that runs inside
Ray, ``ray_cluster`` the connection to it, ``health`` the heartbeat tracker and monitor shared with
``static`` (fleets at configured URLs).
"""

from .actor import EngineActor
from .engine import EngineOps, Placement
from .health import ActorProbe, HealthMonitor, HealthTracker, ProbeResult, in_rotation
from .manager import FleetManager
from .naming import actor_name, bundle_for, spec_for
from .ray_cluster import LocalHead, RayCluster, RayConnectError
from .static import STATIC, StaticHealth, static_instances
from .supervisor import Slot, Supervisor

__all__ = [
    "STATIC",
    "ActorProbe",
    "EngineActor",
    "EngineOps",
    "FleetManager",
    "HealthMonitor",
    "HealthTracker",
    "LocalHead",
    "Placement",
    "ProbeResult",
    "RayCluster",
    "RayConnectError",
    "Slot",
    "StaticHealth",
    "Supervisor",
    "actor_name",
    "bundle_for",
    "in_rotation",
    "spec_for",
    "static_instances",
]
