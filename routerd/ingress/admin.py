"""Admin routes that act on engines: restart or drain one instance, change a fleet's replica count.

``GET /admin/fleets`` (the read side) belongs to the HTTP ingress; these are the write side, added to
the same application by the daemon with ``add_admin_routes(app, fleet_manager, admin_key)``. Every admin
route, read or write, goes through :func:`routerd.ingress.auth.check_admin`: with an admin key set, a call
needs ``Authorization: Bearer <key>``; without one it answers only a loopback peer (the default config
binds 127.0.0.1), so a misconfigured public listener neither shows nor restarts engines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol

import msgspec
from aiohttp import web

from ..errors import BadRequest, NotFound
from .auth import check_admin

_MAX_REPLICAS = 1024
_MAX_DRAIN_WAIT_S = 3600.0  # the drain call holds its HTTP connection while it waits


class _Replicas(msgspec.Struct, forbid_unknown_fields=True):
    replicas: int


class _Drain(msgspec.Struct, forbid_unknown_fields=True):
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=_MAX_DRAIN_WAIT_S)] = 30.0


async def _body(request: web.Request, typ: type[Any]) -> Any:
    raw = await request.read()
    try:
        return msgspec.json.decode(raw or b"{}", type=typ)
    except msgspec.DecodeError as e:
        raise BadRequest(f"invalid body: {e}") from e
    except (UnicodeDecodeError, RecursionError):  # bytes that are not UTF-8, JSON nested too deep
        raise BadRequest("invalid body: not UTF-8 JSON of a sane depth") from None


Handler = Callable[[web.Request], Awaitable[Any]]


class FleetControl(Protocol):
    """What these routes ask of fleet control (:class:`routerd.fleet.FleetManager` is it): the ingress
    depends on this, not on the fleet package, so a data plane needs no fleet code to be built. Each
    raises KeyError for an unknown instance or fleet."""

    async def restart_instance(self, instance_id: str) -> dict[str, Any]: ...

    async def drain_instance(self, instance_id: str, timeout_s: float) -> dict[str, Any]: ...

    async def set_replicas(self, fleet: str, replicas: int) -> dict[str, Any]: ...

    async def unset_replicas(self, fleet: str) -> dict[str, Any]: ...


def add_admin_routes(app: web.Application, fleet_manager: FleetControl,
                     admin_key: str | Callable[[], str]) -> None:
    """``POST /admin/instances/{id}/restart``, ``POST /admin/instances/{id}/drain`` (``{"timeout_s"}``),
    ``POST /admin/fleets/{fleet}/replicas`` (``{"replicas": n}``: an autoscaled fleet is pinned there) and
    ``DELETE /admin/fleets/{fleet}/replicas`` (back to the autoscaler, or to the file's count). Instance ids
    look like ``small:0``.

    ``admin_key`` may be a callable so a reload that changes the key applies to these routes too."""
    key = admin_key if callable(admin_key) else (lambda: admin_key)

    def route(handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
        """Authorize and run; a missing instance or fleet is a :class:`NotFound`. routerd's errors are
        answered in OpenAI's shape by the HTTP ingress's ``errors_as_json`` middleware, as on every
        route of the app."""
        async def wrapped(request: web.Request) -> web.Response:
            check_admin(request, key())
            try:
                return web.json_response(await handler(request))
            except KeyError as e:
                raise NotFound(f"no launched instance or fleet {e.args[0]!r}") from None
        return wrapped

    async def restart(request: web.Request) -> Any:
        return {"restarting": await fleet_manager.restart_instance(request.match_info["instance"])}

    async def drain(request: web.Request) -> Any:
        body: _Drain = await _body(request, _Drain)
        result = await fleet_manager.drain_instance(request.match_info["instance"], body.timeout_s)
        return {"draining": result}

    async def replicas(request: web.Request) -> Any:
        body: _Replicas = await _body(request, _Replicas)
        if not 0 <= body.replicas <= _MAX_REPLICAS:
            raise BadRequest(f"replicas must be 0..{_MAX_REPLICAS}", param="replicas")
        return await fleet_manager.set_replicas(request.match_info["fleet"], body.replicas)

    async def unpin(request: web.Request) -> Any:
        return await fleet_manager.unset_replicas(request.match_info["fleet"])

    app.router.add_post("/admin/instances/{instance}/restart", route(restart))
    app.router.add_post("/admin/instances/{instance}/drain", route(drain))
    app.router.add_post("/admin/fleets/{fleet}/replicas", route(replicas))
    app.router.add_delete("/admin/fleets/{fleet}/replicas", route(unpin))
