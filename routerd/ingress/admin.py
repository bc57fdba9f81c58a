"""Admin routes that act on engines: restart or drain one instance, change a fleet's replica count.

``GET /admin/fleets`` (the read side) belongs to the HTTP ingress; these are the write side, added to
the same application by the daemon with ``add_admin_routes(app, fleet_manager, admin_key)``. With an
admin key set, each call needs ``Authorization: Bearer <key>``; without one they answer only on loopback
(the default config binds 127.0.0.1), so a misconfigured public listener cannot restart engines.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from ..errors import BadRequest, NotFound, RouterdError, Unauthorized

if TYPE_CHECKING:
    from ..fleet import FleetManager

_MAX_REPLICAS = 1024


class _Replicas(msgspec.Struct, forbid_unknown_fields=True):
    replicas: int


class _Drain(msgspec.Struct, forbid_unknown_fields=True):
    timeout_s: float = 30.0


def _error(err: RouterdError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def _authorize(request: web.Request, admin_key: str) -> None:
    if admin_key:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), admin_key.encode()):
            raise Unauthorized("missing or invalid admin API key")
        return
    try:
        loopback = request.remote is not None and ipaddress.ip_address(request.remote).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise Unauthorized("admin routes without http.admin_api_key answer on loopback only")


async def _body(request: web.Request, typ: type[Any]) -> Any:
    raw = await request.read()
    try:
        return msgspec.json.decode(raw or b"{}", type=typ)
    except msgspec.DecodeError as e:
        raise BadRequest(f"invalid body: {e}") from e


Handler = Callable[[web.Request], Awaitable[Any]]


def add_admin_routes(app: web.Application, fleet_manager: FleetManager,
                     admin_key: str | Callable[[], str]) -> None:
    """``POST /admin/instances/{id}/restart``, ``POST /admin/instances/{id}/drain`` (``{"timeout_s"}``),
    ``POST /admin/fleets/{fleet}/replicas`` (``{"replicas": n}``). Instance ids look like ``small:0``.

    ``admin_key`` may be a callable so a reload that changes the key applies to these routes too."""
    key = admin_key if callable(admin_key) else (lambda: admin_key)

    def route(handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
        """Authorize, run, and map routerd's errors (and a missing instance or fleet) to JSON."""
        async def wrapped(request: web.Request) -> web.Response:
            try:
                _authorize(request, key())
                return web.json_response(await handler(request))
            except KeyError as e:
                return _error(NotFound(f"no launched instance or fleet {e.args[0]!r}"))
            except RouterdError as e:
                return _error(e)
        return wrapped

    async def restart(request: web.Request) -> Any:
        return {"restarting": await fleet_manager.restart_instance(request.match_info["instance"])}

    async def drain(request: web.Request) -> Any:
        body: _Drain = await _body(request, _Drain)
        result = await fleet_manager.drain_instance(request.match_info["instance"], max(0.0, body.timeout_s))
        return {"draining": result}

    async def replicas(request: web.Request) -> Any:
        body: _Replicas = await _body(request, _Replicas)
        if not 0 <= body.replicas <= _MAX_REPLICAS:
            raise BadRequest(f"replicas must be 0..{_MAX_REPLICAS}", param="replicas")
        return await fleet_manager.set_replicas(request.match_info["fleet"], body.replicas)

    app.router.add_post("/admin/instances/{instance}/restart", route(restart))
    app.router.add_post("/admin/instances/{instance}/drain", route(drain))
    app.router.add_post("/admin/fleets/{fleet}/replicas", route(replicas))
