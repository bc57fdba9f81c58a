"""The shared view: what several routerd processes (replicas on several hosts, workers of one) share
through Redis, and nothing else.

``control`` is the lease that lets exactly one process at a time control the fleets (launch, adopt,
restart, scale; its fencing token guards every Ray mutation); the fleet state the controlling process
publishes and the others follow (:mod:`.fleet_state`), replica counts set at run time
(:mod:`.replicas`), admin calls carried to the controller (:mod:`.admin_relay`). Every key comes from
:mod:`routerd.keys`; every loop is its caller's.
"""

from .control import ControlLease, Holder, NotController

__all__ = ["ControlLease", "Holder", "NotController"]
