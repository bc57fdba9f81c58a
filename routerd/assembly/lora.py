"""The LoRA bundle: LoRA adapters as models (issue 30), with a fleet that serves them (engine_args
``enable-lora``).

The catalog (the config's adapters and the run-time ones), who holds which (:class:`AdapterSlots`,
kept true to the engines by its loop), the run-time adapters kept in Redis (routerd/peers/adapters.py),
the admin routes' side (routerd/ingress/adapter_admin.py) and placement by demand
(routerd/fleet/adapters.py, while this process controls). Built in every role, before the peers (whose
admin relay carries out adapter calls on the controller) and the data plane (whose router routes an
adapter's request to where it is, and whose ingress lists and checks adapters).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..config import Config
from ..dataplane.upstream import engine_bearers
from .core import Core, Loops

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..fleet.adapters import AdapterPlacer
    from ..ingress.adapter_admin import AdapterAdmin
    from ..ingress.http import HttpIngress
    from ..peers.adapters import AdapterStore
    from ..peers.admin_relay import AdminRelay
    from ..peers.fleet_state import FleetStateSync
    from ..peers.load import SharedLoad
    from ..registry import Instance
    from ..routing.adapters import AdapterCatalog, AdapterSlots


class Lora:
    """The catalog, the slots, the run-time store, the admin side and the placer of one process."""

    def __init__(self, core: Core) -> None:
        from ..fleet.adapters import AdapterPlacer
        from ..ingress.adapter_admin import AdapterAdmin
        from ..peers.adapters import AdapterStore, StoredAdapter
        from ..redis_keys import RedisKeys
        from ..routing.adapters import Adapter, AdapterCatalog, AdapterSlots

        cfg, self.core = core.cfg, core
        self._bearers: dict[str, str] = {}
        self.catalog: AdapterCatalog = AdapterCatalog(cfg)
        # loads carry the engines' key, as the request path sends it (dataplane.upstream.engine_bearers)
        self.slots: AdapterSlots = AdapterSlots(core.registry, self.catalog, core.session, clock=core.clock,
                                                bearer=self._bearer)
        redis = core.redis
        self.store: AdapterStore = AdapterStore(
            redis.ops() if redis is not None else None,
            RedisKeys.from_config(cfg.redis) if redis is not None else None,
            seals=core.sealed if redis is not None else None, op_timeout_s=cfg.redis.op_timeout_s)

        def changed(entries: dict[str, StoredAdapter]) -> None:
            self.catalog.set_runtime(Adapter(name=n, fleet=e.fleet, path=e.path, source="admin")
                                     for n, e in entries.items())

        self.store.on_change = changed
        # Placement runs where the fleets are controlled (the daemon of workers, too): it measures every
        # process's demand, which the others' shared load carries (see with_peers)
        self.placer: AdapterPlacer = AdapterPlacer(self.slots, core.controlling(), clock=core.clock)
        self.admin: AdapterAdmin = AdapterAdmin(cfg, core.registry, self.slots, self.store)
        self._set_bearers(cfg)

    @classmethod
    def for_config(cls, core: Core) -> Lora | None:
        """The bundle when a fleet of ``core.cfg`` serves adapters (engine_args enable-lora), else None."""
        return cls(core) if any(f.lora_slots() for f in core.cfg.fleets) else None

    def adapter_of(self, fleet: str, model: str) -> tuple[str, str] | None:
        """(name, path) of the adapter ``model`` names when it is one of ``fleet``'s (its blocks' key)."""
        a = self.catalog.get(model)
        return (a.name, a.path) if a is not None and a.fleet == fleet else None

    def with_peers(self, relay: AdminRelay, view: FleetStateSync, load: SharedLoad | None) -> None:
        """Only the controller loads and unloads (fenced by its lease), and only it asks the engines
        what they hold: it publishes its record in the fleet state, which the others route from; while
        this process does not control, a request's load is asked of it through the admin relay (op
        ``adapter_load``). Every process's adapter traffic goes with its shared load: the controller
        places by all of it, and no process evicts an adapter another has requests on."""
        slots = self.slots
        view.lora_of, view.on_lora = slots.record, slots.follow
        if load is not None:
            load.lora_of, load.on_lora = slots.demand, slots.elsewhere

        async def remote(inst: Instance, adapter: str, evict: str | None) -> tuple[int, str]:
            body = json.dumps({"adapter": adapter, "evict": evict}).encode()
            answer = await relay.call("adapter_load", inst.id, body, wait_s=slots.load_timeout(inst.fleet))
            return answer.status, answer.body.decode(errors="replace")

        slots.remote, slots.controls = remote, relay.controls

    def attach(self, http: HttpIngress) -> None:
        """The ingress knows the adapters: /v1/models, a request's fleet, /admin/fleets."""
        http.adapters, http.adapter_slots = self.catalog, self.slots

    def _bearer(self, fleet: str) -> str:
        return self._bearers.get(fleet, "")

    def _set_bearers(self, cfg: Config) -> None:
        trust = self.core.trust
        self._bearers = engine_bearers(cfg.fleets, trust.engine_api_key if trust is not None else "")

    def loops(self) -> Loops:
        return {"adapters": self.slots.run(), "adapter_store": self.store.run(),
                "adapter_placement": self.placer.run()}

    async def apply(self, cfg: Config) -> None:
        self.catalog.update_config(cfg)
        self.admin.cfg = cfg
        self._set_bearers(cfg)

    def collectors(self) -> list[Collector]:
        from ..routing.adapter_metrics import AdaptersCollector

        return [AdaptersCollector(self.slots)]

