"""The data-plane bundle: everything a request goes through, from either way in to an engine.

Routing, tenancy, admission, the engine calls, the one dispatch over them, the HTTP ingress and its
listener, and the queue consumer (with Redis). In every role that serves (not the daemon of workers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import Config, FleetConfig
from ..dataplane.admission import Admission
from ..dataplane.dispatch import Dispatch
from ..dataplane.upstream import Upstream
from ..ingress.http import HttpIngress
from ..ingress.listener import HttpListener
from ..routing import RequestViews, Router
from ..telemetry import queue_collector, registry_collector
from ..tenants.service import Tenancy
from .core import Core, Loops

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..conversations.flow import Responses
    from ..fleet import FleetManager
    from ..ingress.queue import QueueIngress
    from ..peers import SharedMeasures
    from ..peers.fleet_state import FleetStateSync
    from .fleets import FleetControl
    from .kv import KvRouting
    from .lora import Lora
    from .peers import Peers


class DataPlane:
    """The request path of one process, built over the bundles below it."""

    def __init__(self, core: Core, *, measures: SharedMeasures | None, peers: Peers | None,
                 fleet: FleetControl | None, kv: KvRouting | None, lora: Lora | None = None) -> None:
        cfg, self.core = core.cfg, core
        clock, rng, tracing, telemetry = core.clock, core.rng, core.tracing, core.telemetry
        fleets = fleet.fleets if fleet is not None else None
        views = RequestViews(cfg.routing, keyers=kv.keyers if kv else None, keying=kv.keying if kv else None,
                             learned_block_size=kv.events.fleet_block_size if kv else None,
                             adapter_of=lora.adapter_of if lora else None)
        self.router = Router.from_config(core.registry, cfg.routing, rng=rng, clock=clock, views=views,
                                         engine_cache=kv.events if kv else None,
                                         shared_sessions=measures.sessions if measures else None,
                                         adapters=lora.slots if lora else None)
        self.tenancy = Tenancy(cfg, core.redis, clock=clock, rng=rng)
        local = fleets.autoscaler if fleets is not None else None
        elastic = peers.elastic(local) if peers is not None else local
        self.admission = Admission(core.registry, cfg.admission, clock=clock, elastic=elastic,
                                   shares=self.tenancy.shares())
        trust = core.trust
        self.upstream = Upstream(self.router, cfg.routing, telemetry, tracing=tracing, rng=rng, clock=clock,
                                 engine_api_key=trust.engine_api_key if trust is not None else "")
        self.upstream.update_fleets(cfg.fleets)
        self.dispatch = Dispatch(views=self.router.views, admission=self.admission, engine=self.upstream,
                                 tenancy=self.tenancy, telemetry=telemetry, tracing=tracing, clock=clock)
        # issue 29: a Responses turn made whole from routerd's store, recorded as its answer passes; its
        # chain's next turn goes where this one was served (routerd/conversations/)
        responses = _responses(core, self.router)
        self.dispatch.hooks["/v1/responses"] = responses
        fleet_state = peers.fleet_state if peers is not None else None
        self.queue: QueueIngress | None = None
        if core.redis is not None:
            from ..ingress.queue import QueueIngress

            self.queue = QueueIngress.from_config(
                cfg, redis=core.redis, dispatch=self.dispatch, admission=self.admission,
                tenancy=self.tenancy, tracing=tracing, serves=fleet_state.serves if fleet_state else None)
        self.http = HttpIngress(cfg, core.registry, dispatch=self.dispatch, admission=self.admission,
                                router=self.router, tenancy=self.tenancy, telemetry=telemetry,
                                metrics=core.metrics, tracing=tracing, clock=clock, elastic=elastic,
                                control=core.control.status, **_http_view(fleet_state, fleets),
                                redis_health=core.redis.health if core.redis is not None else None)
        if lora is not None:
            lora.attach(self.http)
        self.listener = HttpListener(self.http)
        _conversation_routes(self.http, responses, self.tenancy)  # issue 29

    def loops(self) -> Loops:
        """Each runs until cancelled; the upstream's closes its engine connections then, the tenancy's
        its Redis client. The queue's is the owner's to start (:meth:`Routerd.start`)."""
        loops: Loops = {"admission": self.admission.run(), "tenancy": self.tenancy.run(),
                        "upstream": self.upstream.run()}
        if self.queue is not None:
            loops["queue"] = self.queue.run()
        return loops

    async def apply(self, cfg: Config) -> None:
        """Tenants before admission, which takes their shares."""
        self.router.update_config(cfg.routing)
        self.tenancy.update_config(cfg)
        self.admission.update_config(cfg.admission, self.tenancy.shares())
        self.upstream.update_config(cfg.routing)
        self.upstream.update_fleets(cfg.fleets)
        self.http.update_config(cfg)
        self.listener.reload_tls()
        if self.queue is not None:
            self.queue.update_config(cfg)

    def collectors(self) -> list[Collector]:
        out = [registry_collector(self.core.registry, self.admission.stats, self.core.clock),
               self.tenancy.collector(self.admission.tenant_stats)]
        if self.queue is not None:
            out.append(queue_collector(self.queue))
        return out


def _http_view(view: FleetStateSync | None, fleets: FleetManager | None) -> dict[str, Any]:
    """What the HTTP ingress reads of the fleets beyond its registry: the replica counts, the fleets
    there are (the controller's, while following), the orphaned engines and the view's status."""
    out: dict[str, Any] = {"desired_replicas": _desired(view, fleets)}
    if view is not None:
        out["view_status"] = view.status
        out["view_untrusted"] = view.untrusted
        out["serves"] = view.serves
    if view is not None or fleets is not None:
        def orphaned() -> list[dict[str, Any]]:
            followed = view.followed_orphans() if view is not None else None
            if followed is not None:
                return followed
            return fleets.orphan_list() if fleets is not None else []
        out["orphaned"] = orphaned
    return out


def _desired(view: FleetStateSync | None, fleets: FleetManager | None) -> Callable[[FleetConfig], int] | None:
    """A launched fleet's replica count in ``/admin/fleets``: the controller's (followed), else this
    process's fleet manager's, else the file's."""
    if view is None and fleets is None:
        return None

    def desired(fleet: FleetConfig) -> int:
        followed = view.replicas(fleet.name) if view is not None else None
        if followed is not None:
            return followed
        return fleets.desired(fleet) if fleets is not None else fleet.replicas
    return desired


def _conversation_routes(http: HttpIngress, responses: Responses, tenancy: Tenancy) -> None:
    """The stored routes (``GET``/``DELETE /v1/responses/{id}``…, ``/v1/conversations``) on the ingress."""
    from ..conversations import ConversationRoutes
    from ..ingress.auth import authenticate

    http.conversation_routes = lambda app: ConversationRoutes(responses.store).add_to(
        app, lambda r: authenticate(r, tenancy.directory).name)


def _responses(core: Core, router: Router) -> Responses:
    """The ``/v1/responses`` flow (issue 29) over routerd's store: the shared Redis, else memory."""
    from ..conversations import MemoryStore, RedisStore, Store
    from ..conversations.flow import Responses
    from ..redis_keys import RedisKeys

    cfg, registry = core.cfg, core.registry
    store: Store = MemoryStore(cfg.responses) if core.redis is None else RedisStore(
        core.redis.ops(), RedisKeys.from_config(cfg.redis), cfg.responses,
        op_timeout_s=cfg.redis.op_timeout_s)

    def generation_of(instance_id: str) -> int:
        inst = registry.get(instance_id)
        return inst.generation if inst is not None else 0

    return Responses(store, generation_of=generation_of, served=router.served)
