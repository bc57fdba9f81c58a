"""Admin routes that act on engines: restart or drain one instance, change a fleet's replica count.

``GET /admin/fleets`` (the read side) belongs to the HTTP ingress; these are the write side, added to
the same application by the daemon with ``add_admin_routes(app, fleet_manager, admin_key)``. With an
admin key set, each call needs ``Authorization: Bearer <key>``; without one they answer only on loopback
(the default config binds 127.0.0.1), so a misconfigured public listener cannot restart engines.
"""

from __future__ import annotations

import hmac
import ipaddress
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


def add_admin_routes(app: web.Application, fleet_manager: FleetManager, admin_key: str) -> None:
    """``POST /admin/instances/{id}/restart``, ``POST /admin/instances/{id}/drain`` (``{"timeout_s"}``),
    ``POST /admin/fleets/{fleet}/replicas`` (``{"replicas": n}``). Instance ids look like ``small:0``."""

    async def restart(request: web.Request) -> web.Response:
        try:
            _authorize(request, admin_key)
            iid = request.match_info["instance"]
            try:
                result = await fleet_manager.restart_instance(iid)
            except KeyError:
                raise NotFound(f"no launched instance {iid!r}") from None
        except RouterdError as e:
            return _error(e)
        return web.json_response({"restarting": result})

    async def drain(request: web.Request) -> web.Response:
        try:
            _authorize(request, admin_key)
            body: _Drain = await _body(request, _Drain)
            iid = request.match_info["instance"]
            try:
                result = await fleet_manager.drain_instance(iid, max(0.0, body.timeout_s))
            except KeyError:
                raise NotFound(f"no launched instance {iid!r}") from None
        except RouterdError as e:
            return _error(e)
        return web.json_response({"draining": result})

    async def replicas(request: web.Request) -> web.Response:
        try:
            _authorize(request, admin_key)
            body: _Replicas = await _body(request, _Replicas)
            if not 0 <= body.replicas <= _MAX_REPLICAS:
                raise BadRequest(f"replicas must be 0..{_MAX_REPLICAS}", param="replicas")
            fleet = request.match_info["fleet"]
            try:
                result = await fleet_manager.set_replicas(fleet, body.replicas)
            except KeyError:
                raise NotFound(f"no launched fleet {fleet!r}") from None
        except RouterdError as e:
            return _error(e)
        return web.json_response(result)

    app.router.add_post("/admin/instances/{instance}/restart", restart)
    app.router.add_post("/admin/instances/{instance}/drain", drain)
    app.router.add_post("/admin/fleets/{fleet}/replicas", replicas)

