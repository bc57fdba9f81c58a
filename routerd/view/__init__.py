"""The shared view: what several routerd processes (replicas on several hosts, workers of one) share
through Redis, and nothing else.

``control`` is the lease that lets exactly one process at a time control the fleets (launch, adopt,
restart, scale; its fencing token guards every Ray mutation); the fleet state the controlling process
publishes and the others follow (:mod:`.fleet_state`), replica counts set at run time
(:mod:`.replicas`), admin calls carried to the controller (:mod:`.admin_relay`) — a request's wake of
a fleet scaled to zero among them (:mod:`.wake`). What every process
measures and the others must see (:mod:`.shared`): in-flight requests per instance (:mod:`.load`), the
engines' scrapes — made once per interval in total, by the controller (:mod:`.scrapes`) — and a
session's instance (:mod:`.sessions`); their Redis outages are logged once each way (:mod:`.outage`).
Every record one process writes there for another to act on is sealed with the deployment's secret
(:mod:`.sealed`). Every key comes from :mod:`routerd.keys`; every loop is its caller's.
"""

from .control import ControlLease, Holder, NotController
from .load import SharedLoad
from .scrapes import SharedScrapes
from .sessions import SharedSessions
from .shared import SharedView

__all__ = ["ControlLease", "Holder", "NotController", "SharedLoad", "SharedScrapes", "SharedSessions",
           "SharedView"]
