"""Who may call what: an API key — and the tenant it belongs to — for the OpenAI routes, the admin key
(or a loopback peer) for every admin route, read or write.

Both checks read ``Authorization: Bearer <key>`` the same way. API keys (``http.api_keys`` and each
tenant's) are looked up by their SHA-256 (:mod:`routerd.api_keys`: one dict lookup, whatever
the number of keys, and nothing learnt from its timing); the admin key is compared with
:func:`hmac.compare_digest`. Header bytes that are not UTF-8 (aiohttp keeps them as surrogate escapes)
are a wrong key, never a 500.
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from ..errors import Unauthorized
from ..tenants.directory import Directory, Tenant


def bearer(request: web.Request) -> bytes:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), or ``b""``."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() != "bearer ":
        return b""
    return auth[7:].strip().encode("utf-8", "surrogateescape")


def authenticate(request: web.Request, tenants: Directory) -> Tenant:
    """The OpenAI routes: the tenant of the request's key. When no key is configured anywhere the
    routes are open and every request is the ``default`` tenant's; else a key is required, and one
    of ``http.api_keys`` (no tenant's) is ``default``'s too."""
    if tenants.open:
        return tenants.default
    tenant = tenants.by_token(bearer(request))
    if tenant is None:
        raise Unauthorized("missing or invalid API key (expected 'Authorization: Bearer <key>')")
    return tenant


def check_admin(request: web.Request, admin_key: str) -> None:
    """The one rule for every admin route: the admin key when one is set, else a loopback peer.

    "Loopback" is the TCP peer: behind a reverse proxy on the same host every client looks local, so
    such a deployment sets ``http.admin_api_key``."""
    if admin_key:
        if not hmac.compare_digest(bearer(request), admin_key.encode()):
            raise Unauthorized("missing or invalid admin API key")
        return
    if not _loopback(request.remote):
        raise Unauthorized("admin routes without http.admin_api_key answer on loopback only")


def _loopback(remote: str | None) -> bool:
    try:
        peer = ipaddress.ip_address(remote or "")
    except ValueError:  # a Unix socket peer, or none
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped  # a dual-stack listener sees 127.0.0.1 as ::ffff:127.0.0.1
    return peer.is_loopback
