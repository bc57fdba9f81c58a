"""The shared view: what several routerd processes (replicas on several hosts, workers of one) share
through Redis, and nothing else.

``control`` is the lease that lets exactly one process at a time control the fleets (launch, adopt,
restart, scale; its fencing token guards every Ray mutation).
"""

from .control import ControlLease, Holder, NotController

__all__ = ["ControlLease", "Holder", "NotController"]
