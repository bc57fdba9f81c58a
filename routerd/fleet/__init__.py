"""Fleets: the engines routerd launches on Ray, and the static ones it only watches.

``naming`` (what an instance and its Ray objects are called) → ``engine`` (one actor + placement group:
place, start, restart, probe, dispose) → ``supervisor`` (one instance's life, the only writer of its
state) → ``manager`` (reconcile, adopt, roll, retire, scale). ``actor`` is the code that runs inside
Ray, ``ray_cluster`` the connection to it, ``health`` the heartbeat tracker and monitor shared with
``static`` (fleets at configured URLs). ``nodes`` is routerd's own heartbeat of the Ray nodes its engines
run on, ``spread`` where a new placement group may go (spread over nodes, never onto a lost one).
``autoscale`` decides how many replicas an autoscaled fleet wants (pure), ``autoscaler`` feeds it signals
and carries out its decisions through the manager. All of it acts only in a term of the control lease
(routerd/peers/lease.py): every Ray mutation is fenced by it, and the manager starts and stops with it.
"""

from .actor import EngineActor
from .autoscaler import Autoscaler, FleetCollector
from .engine import EngineOps, Placement
from .health import ActorProbe, HealthMonitor, HealthTracker, ProbeResult, in_rotation
from .manager import FleetManager
from .naming import actor_name, bundle_for, spec_for
from .nodes import NodeWatch
from .ray_cluster import LocalHead, NodeInfo, RayCluster, RayConnectError
from .scaling_policy import ScaleDecision, ScalingPolicy, Signals
from .spread import Spreader, Where
from .static import STATIC, StaticHealth, static_instances
from .supervisor import Slot, Supervisor

__all__ = [
    "STATIC",
    "ActorProbe",
    "Autoscaler",
    "EngineActor",
    "EngineOps",
    "FleetCollector",
    "FleetManager",
    "HealthMonitor",
    "HealthTracker",
    "LocalHead",
    "NodeInfo",
    "NodeWatch",
    "Placement",
    "ProbeResult",
    "RayCluster",
    "RayConnectError",
    "ScaleDecision",
    "ScalingPolicy",
    "Signals",
    "Slot",
    "Spreader",
    "StaticHealth",
    "Supervisor",
    "Where",
    "actor_name",
    "bundle_for",
    "in_rotation",
    "spec_for",
    "static_instances",
]
