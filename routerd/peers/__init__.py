"""The peers: what several routerd processes (replicas on several hosts, workers of one) share through
Redis, and nothing else.

- ``lease``: the control lease — exactly one process at a time controls the fleets (launch, adopt,
  restart, scale); its fencing token guards every Ray mutation;
- ``fleet_state``: the fleet state the controller publishes and the others follow
  (:class:`~.fleet_state.FleetStateSync`);
- ``replicas``: replica counts set at run time, which the next controller starts from;
- ``admin_relay``: admin calls made on a follower, carried out by the controller;
- ``wake``: a fleet scaled to zero, woken by a request on any process;
- ``measures``: what every process measures and the others must see (:class:`~.measures.SharedMeasures`):
  in-flight requests per instance (``load``), the engines' scrapes — made once per interval in total,
  by the controller (``scrapes``) — and a session's instance (``sessions``);
- ``outage``: a loop's Redis outage logged once each way;
- ``sealed``: every record one process writes for another to act on, sealed with the deployment's secret.

Every key comes from :mod:`routerd.redis_keys`; every loop is its caller's.
"""

from .lease import ControlLease, Holder, NotController
from .load import SharedLoad
from .measures import SharedMeasures
from .scrapes import SharedScrapes
from .sessions import SharedSessions

__all__ = [
           "ControlLease",
           "Holder",
           "NotController",
           "SharedLoad",
           "SharedMeasures",
           "SharedScrapes",
           "SharedSessions",
]
