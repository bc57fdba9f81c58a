"""The KV-routing bundle: the engines' own cache views (routerd/routing/engine_cache/), for the fleets
whose engines publish KV events and whose tokens routerd can compute; long prompts keyed in a process
of their own. Built before the data plane, whose router scores instances by these views.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import log
from ..config import Config
from .core import Core, Loops

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..routing.engine_cache.block_keys import EngineKeyer
    from ..routing.engine_cache.keying_process import KeyingProcess
    from ..routing.engine_cache.subscriptions import EngineEvents

_log = log.get("routerd.assembly")


class KvRouting:
    """One subscription per engine rank of ``keyers``' fleets, and the keying process."""

    def __init__(self, core: Core, keyers: dict[str, tuple[EngineKeyer, int | None, bytes]]) -> None:
        from ..routing.engine_cache.keying_process import KeyingProcess
        from ..routing.engine_cache.subscriptions import EngineEvents, static_sources

        _log.info("kv_events_routing", fleets=sorted(keyers))
        self.keyers = keyers
        self.events: EngineEvents = EngineEvents(core.registry, core.session, fleets=list(keyers),
                                                 sources=static_sources(core.cfg.fleets))
        self.keying: KeyingProcess = KeyingProcess({fleet: k.spec for fleet, (k, _, _) in keyers.items()})

    @classmethod
    def for_config(cls, core: Core) -> KvRouting | None:
        """The bundle for ``core.cfg``'s fleets that publish KV events; None when none does."""
        from ..routing.engine_cache.subscriptions import fleet_keyers

        keyers = fleet_keyers(core.cfg.fleets)
        return cls(core, keyers) if keyers else None

    def loops(self) -> Loops:
        return {"kv_events": self.events.run()}

    async def apply(self, cfg: Config) -> None:
        return None  # the fleets that publish are the start-up's (a restart picks up new ones)

    def collectors(self) -> list[Collector]:
        from ..routing.engine_cache.subscriptions import EngineEventsCollector

        return [EngineEventsCollector(self.events)]
