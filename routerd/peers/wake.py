"""A fleet scaled to zero, woken by a request on any process.

A request that finds a fleet at zero asks admission's :class:`~routerd.elastic.Elastic` to start an
instance, and waits. Only the controlling process starts engines, and it sees only its own requests: a
follower's (or a worker's, whose parent takes no requests at all) would wait out the waiting room and
get 503 while the fleet stayed at zero. :class:`RelayedElastic` is what admission holds on every process
of several: it answers from the local autoscaler where there is one (a follower: its ETA, standby and
status), else from the config (a worker: the fleet starts on demand when ``autoscale.min_replicas`` is 0
and none of its instances is failing), and, while another process controls, has the controller wake the
fleet through the admin relay (:meth:`AdminRelay.ask_wake`: no wait on the request path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import Config
from ..elastic import Elastic
from ..registry import InstanceState, Registry


class RelayedElastic:
    """:class:`~routerd.elastic.Elastic` for a process that may not control: local answers, relayed wakes."""

    def __init__(self, cfg: Config, registry: Registry, local: Elastic | None, *,
                 relay: Callable[[str], None], controls: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.registry = registry
        self.local = local
        self.relay = relay
        self.controls = controls

    def update_config(self, cfg: Config) -> None:
        self.cfg = cfg

    def _on_demand(self, fleet: str) -> bool:
        fcfg = self.cfg.fleet(fleet)
        return fcfg is not None and fcfg.autoscale is not None and fcfg.autoscale.min_replicas == 0

    def wake(self, fleet: str) -> float | None:
        eta = self.local.wake(fleet) if self.local is not None else None
        if (eta is not None or self._on_demand(fleet)) and not self.controls():
            self.relay(fleet)  # the controller starts it; our own autoscaler (if any) only follows
        return eta

    def standby(self, fleet: str) -> bool:
        if self.local is not None:
            return self.local.standby(fleet)
        return self._on_demand(fleet) and not any(i.state is InstanceState.UNHEALTHY
                                                  for i in self.registry.instances(fleet))

    def status(self, fleet: str) -> dict[str, Any] | None:
        return self.local.status(fleet) if self.local is not None else None
