"""Admin routes that act on engines: drain or undrain one instance, restart a launched one, change a
fleet's replica count.

``GET /admin/fleets`` (the read side) belongs to the HTTP ingress; these are the write side, added to
the same application by the daemon with ``add_admin_routes(app, fleet_manager, static, admin_key)`` —
static-only too (no Ray, no fleet manager). Every admin route, read or write, goes through
:func:`routerd.ingress.auth.check_admin`: with an admin key set, a call needs
``Authorization: Bearer <key>``; without one it answers only a loopback peer (the default config binds
127.0.0.1), so a misconfigured public listener neither shows nor restarts engines.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol

import msgspec
from aiohttp import web

from ..config import Config
from ..errors import BadRequest, NotFound, RouterdError, error_json
from ..peers.admin_relay import AdminAnswer, AdminCall, AdminRelay
from ..registry import Instance, Registry
from .adapter_admin import AdapterAdmin
from .auth import check_admin

_MAX_DRAIN_WAIT_S = 3600.0  # the drain call holds its HTTP connection while it waits
_RELAYED_CALL_S = 10.0  # a relayed call the controller took, but a drain: its answer comes within this


class _Replicas(msgspec.Struct, forbid_unknown_fields=True):
    replicas: int


class _Drain(msgspec.Struct, forbid_unknown_fields=True):
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=_MAX_DRAIN_WAIT_S)] = 30.0


def _body(raw: bytes, typ: type[Any]) -> Any:
    try:
        return msgspec.json.decode(raw or b"{}", type=typ)
    except msgspec.DecodeError as e:
        raise BadRequest(f"invalid body: {e}") from e
    except (UnicodeDecodeError, RecursionError):  # bytes that are not UTF-8, JSON nested too deep
        raise BadRequest("invalid body: not UTF-8 JSON of a sane depth") from None


class FleetControl(Protocol):
    """What these routes ask of fleet control (:class:`routerd.fleet.FleetManager` is it): the ingress
    depends on this, not on the fleet package, so a data plane needs no fleet code to be built. Each
    raises KeyError for an unknown instance or fleet."""

    async def restart_instance(self, instance_id: str) -> dict[str, Any]: ...

    async def drain_instance(self, instance_id: str, timeout_s: float) -> dict[str, Any]: ...

    async def set_replicas(self, fleet: str, replicas: int) -> dict[str, Any]: ...

    async def unset_replicas(self, fleet: str) -> dict[str, Any]: ...

    def max_replicas(self, fleet: str) -> tuple[int, str]: ...

    def wake(self, fleet: str) -> dict[str, Any]: ...

    async def remove_orphan(self, instance_id: str) -> dict[str, Any]: ...


class StaticControl(Protocol):
    """What these routes ask of the static fleets' monitor (:class:`routerd.fleet.StaticHealth`)."""

    cfg: Config
    registry: Registry

    def instance(self, instance_id: str) -> Instance | None: ...

    def drain(self, inst: Instance) -> None: ...

    def undrain(self, inst: Instance) -> None: ...


def add_admin_routes(app: web.Application, fleet_manager: FleetControl | None, static: StaticControl,
                     admin_key: str | Callable[[], str], relay: AdminRelay | None = None,
                     adapters: AdapterAdmin | None = None) -> None:
    """``POST /admin/instances/{id}/restart``, ``POST /admin/instances/{id}/drain`` (``{"timeout_s"}``),
    ``POST /admin/instances/{id}/undrain`` (a static instance), ``POST /admin/fleets/{fleet}/replicas``
    (``{"replicas": n}``: an autoscaled fleet is pinned there) and ``DELETE /admin/fleets/{fleet}/replicas``
    (back to the autoscaler, or to the file's count) and ``DELETE /admin/orphans/{id}`` (stop an engine
    whose fleet is not in the controller's config, listed under ``orphaned``). Instance ids look like
    ``small:0`` (launched) or ``small:static0`` (static).

    ``fleet_manager`` is None when nothing is launched (no Ray): a static instance is still drained and
    undrained, and what applies only to launched engines answers 400 saying why. ``admin_key`` may be a
    callable so a reload that changes the key applies to these routes too. With ``relay`` (several
    routerd on one Redis), a process that does not control the fleets hands each call, once authorised
    here, to the one that does and answers with its answer (routerd/peers/admin_relay.py)."""
    key = admin_key if callable(admin_key) else (lambda: admin_key)
    actions = AdminActions(fleet_manager, static, adapters)

    def route(op: str, param: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        """Authorize and run, here or on the controller. routerd's errors are answered in OpenAI's
        shape by the HTTP ingress's ``errors_as_json`` middleware, as on every route of the app."""
        async def wrapped(request: web.Request) -> web.Response:
            check_admin(request, key())
            target, body = request.match_info[param], await request.read()
            if "name" in request.match_info:  # DELETE …/adapters/{name}: the name travels in the body
                body = json.dumps({"name": request.match_info["name"]}).encode()
            if relay is not None and not relay.controls():
                answer = await relay.call(op, target, body, wait_s=_wait_s(op, body))
                return web.Response(status=answer.status, body=answer.body, content_type="application/json")
            return web.json_response(await actions.run(op, target, body))
        return wrapped

    app.router.add_post("/admin/instances/{instance}/restart", route("restart", "instance"))
    app.router.add_post("/admin/instances/{instance}/drain", route("drain", "instance"))
    app.router.add_post("/admin/instances/{instance}/undrain", route("undrain", "instance"))
    app.router.add_post("/admin/fleets/{fleet}/replicas", route("replicas", "fleet"))
    app.router.add_delete("/admin/fleets/{fleet}/replicas", route("unpin", "fleet"))
    app.router.add_delete("/admin/orphans/{instance}", route("remove_orphan", "instance"))
    app.router.add_post("/admin/fleets/{fleet}/adapters", route("adapter_add", "fleet"))
    app.router.add_delete("/admin/fleets/{fleet}/adapters/{name}", route("adapter_remove", "fleet"))


def _wait_s(op: str, body: bytes) -> float:
    """How long a relayed call may run once the controller took it: a drain its ``timeout_s``."""
    if op == "drain":
        with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return msgspec.json.decode(body or b"{}", type=_Drain).timeout_s + _RELAYED_CALL_S
    return _RELAYED_CALL_S


class AdminActions:
    """The write routes' actions, by name: a static instance is the static fleets' monitor's, the rest
    the fleet manager's. The same code answers a call made here and one relayed from a follower
    (:meth:`execute`), so both get the same status and JSON."""

    def __init__(self, fleet_manager: FleetControl | None, static: StaticControl,
                 adapters: AdapterAdmin | None = None) -> None:
        self.fleet_manager = fleet_manager
        self.static = static
        self._ops: dict[str, Callable[[str, bytes], Awaitable[Any]]] = {
            "restart": self.restart, "drain": self.drain, "undrain": self.undrain,
            "replicas": self.replicas, "unpin": self.unpin, "wake": self.wake,
            "remove_orphan": self.remove_orphan, "adapter_add": self.adapter_add,
            "adapter_remove": self.adapter_remove, "adapter_load": self.adapter_load}
        self.adapters = adapters  # LoRA adapters at run time (routerd/ingress/adapter_admin.py)

    async def run(self, op: str, target: str, body: bytes) -> Any:
        """The action's JSON answer; raises routerd's errors (a missing instance or fleet: NotFound)."""
        action = self._ops.get(op)
        if action is None:
            raise BadRequest(f"no admin action {op!r}")
        try:
            return await action(target, body)
        except KeyError as e:
            raise NotFound(f"no instance or fleet {e.args[0]!r}") from None

    async def execute(self, call: AdminCall) -> AdminAnswer:
        """A follower's call, carried out here (the relay's controller side)."""
        try:
            result = await self.run(call.op, call.target, call.body)
        except RouterdError as e:
            return AdminAnswer(e.status, error_json(e.message, e.type, e.status, e.param))
        return AdminAnswer(200, json.dumps(result).encode())  # what web.json_response writes

    def launched(self, name: str) -> FleetControl:
        """The fleet manager; with nothing launched, every launched instance or fleet is not found."""
        if self.fleet_manager is None:
            raise KeyError(name)
        return self.fleet_manager

    def not_static_fleet(self, fleet: str) -> None:
        fcfg = self.static.cfg.fleet(fleet)
        if fcfg is not None and fcfg.engine == "static":
            raise BadRequest(f"fleet {fleet!r} is static: its instances are its configured urls "
                             "(change them in the config and reload)")

    async def restart(self, instance: str, raw: bytes) -> Any:
        if self.static.instance(instance) is not None:
            raise BadRequest(f"instance {instance!r} is static: routerd did not launch its engine and "
                             "cannot restart it (drain it, then undrain it)")
        return {"restarting": await self.launched(instance).restart_instance(instance)}

    async def drain(self, instance: str, raw: bytes) -> Any:
        body: _Drain = _body(raw, _Drain)
        inst = self.static.instance(instance)
        if inst is None:
            return {"draining": await self.launched(instance).drain_instance(instance, body.timeout_s)}
        self.static.drain(inst)
        registry = self.static.registry
        await registry.wait_idle(inst, body.timeout_s)
        return {"draining": {**inst.status(registry.clock()), "drained": inst.inflight == 0}}

    async def undrain(self, instance: str, raw: bytes) -> Any:
        inst = self.static.instance(instance)
        if inst is None:
            if self.static.registry.get(instance) is None:
                raise KeyError(instance)
            raise BadRequest(f"instance {instance!r} is launched: a drained launched instance returns to "
                             f"rotation with POST /admin/instances/{instance}/restart")
        self.static.undrain(inst)
        return {"undrained": inst.status(self.static.registry.clock())}

    async def replicas(self, fleet: str, raw: bytes) -> Any:
        body: _Replicas = _body(raw, _Replicas)
        self.not_static_fleet(fleet)
        fm = self.launched(fleet)
        limit, why = fm.max_replicas(fleet)
        if not 0 <= body.replicas <= limit:
            raise BadRequest(f"replicas must be 0..{limit} for fleet {fleet!r} ({why})", param="replicas")
        return await fm.set_replicas(fleet, body.replicas)

    async def unpin(self, fleet: str, raw: bytes) -> Any:
        self.not_static_fleet(fleet)
        return await self.launched(fleet).unset_replicas(fleet)

    async def remove_orphan(self, instance: str, raw: bytes) -> Any:
        """Stop an engine left running because its fleet is not in the controller's config."""
        return await self.launched(instance).remove_orphan(instance)

    def _adapters(self) -> AdapterAdmin:
        if self.adapters is None:
            raise BadRequest("no fleet serves LoRA adapters (engine_args enable-lora)")
        return self.adapters

    async def adapter_add(self, fleet: str, raw: bytes) -> Any:
        return await self._adapters().add(fleet, raw)

    async def adapter_remove(self, fleet: str, raw: bytes) -> Any:
        return await self._adapters().remove(fleet, raw)

    async def adapter_load(self, instance: str, raw: bytes) -> Any:
        """Not a route: a follower's or worker's request needs an adapter loaded (only the controller
        loads: AdapterSlots.remote)."""
        return await self._adapters().load(instance, raw)

    async def wake(self, fleet: str, raw: bytes) -> Any:
        """Not a route: a follower's request found ``fleet`` scaled to zero (AdminRelay.ask_wake)."""
        self.not_static_fleet(fleet)
        return self.launched(fleet).wake(fleet)
