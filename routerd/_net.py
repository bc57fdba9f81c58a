"""The one port helper every part of routerd (and its tests, benchmarks and scripts) asks; the one
shape of a watcher's GET (``Fetch``: the scraper's ``/metrics``, the static heartbeats' ``/health``);
the listener's TLS context."""

from __future__ import annotations

import collections
import os
import random
import socket
import ssl
from collections.abc import Awaitable, Callable

import aiohttp

Fetch = Callable[[str, int], Awaitable[tuple[int, bytes]]]
"""``fetch(url, limit) -> (status, body)``: GET ``url`` and read its body, raising ``OSError`` (or
``aiohttp.ClientError``) past ``limit`` bytes or when the engine cannot be reached; the caller bounds
the time. The assembly gives the watchers a lean keep-alive client's
(:meth:`routerd.dataplane.engine_http.EnginePool.fetch`); :func:`session_fetch` is the same over an
aiohttp session, for a watcher built without one."""


def session_fetch(session: aiohttp.ClientSession) -> Fetch:
    """:data:`Fetch` over ``session`` (identity encoding: the body is read as the engine sent it)."""

    async def fetch(url: str, limit: int) -> tuple[int, bytes]:
        async with session.get(url, headers={"Accept-Encoding": "identity"}) as resp:
            # to EOF: content.read(n) returns only what has arrived so far, which for a page sent in
            # several chunks would be a truncated page
            parts: list[bytes] = []
            size = 0
            async for part in resp.content.iter_any():
                size += len(part)
                if size > limit:
                    raise aiohttp.ClientPayloadError(f"response body larger than {limit} bytes")
                parts.append(part)
            return resp.status, b"".join(parts)

    return fetch


# Where free_port looks first: above Ray's worker ports (10002-19999 by default) and below the kernel's
# ephemeral range (32768-60999 by default), which every outgoing connection and every bind to port 0 on
# the host draws from — a port picked there was seen taken by a Ray worker or a Redis client in the
# moment before its caller bound it (EADDRINUSE on a busy host). ROUTERD_PORT_RANGE="low-high" narrows
# it for this process and the processes it starts: a host running several suites or benchmarks at once
# gives each its own part (the tests give each pytest worker one), so that their picks cannot meet.
PORT_RANGE = (20000, 32767)
_rng = random.Random()  # its own: a caller's seeded global random (a bench's plan) is left alone
# The ports this process handed out lately: a caller picking several before it binds any (a test
# writing fifteen daemons' configs, then starting them) was given the same one twice.
_HANDED: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
_HANDED_KEEP = 4096


def _pick_range() -> tuple[int, int]:
    text = os.environ.get("ROUTERD_PORT_RANGE", "")
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        return PORT_RANGE
    return (low, high) if 1024 <= low <= high <= 65535 else PORT_RANGE


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return (32768, 60999)
    return (low, high)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (an IPv6 address when ``host`` has a colon): one of
    ``PORT_RANGE`` (or ``ROUTERD_PORT_RANGE``) outside the kernel's ephemeral range when one is free,
    else any the kernel gives; never one this process handed out in its last 4,096 picks.

    Free *now* only: another process may take it before the caller binds it, so whoever listens on it
    must cope with EADDRINUSE (retry, or fail loudly). Outside the ephemeral range only another explicit
    pick can take it, not the host's outgoing connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = _ephemeral_range()
    pick_from = _pick_range()
    for port in (_rng.randint(*pick_from) for _ in range(20)):
        # skipped: a port in the ephemeral range (a host whose range reaches down here), or handed out
        if low <= port <= high or (host, port) in _HANDED:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return _hand(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        picked: int = s.getsockname()[1]
    return _hand(host, picked)


def _hand(host: str, port: int) -> int:
    _HANDED[(host, port)] = None
    while len(_HANDED) > _HANDED_KEEP:
        _HANDED.popitem(last=False)
    return port


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    """The HTTPS listener's context (``[http] tls_cert``, ``tls_key``: PEM files; the certificate file
    may hold the chain after it). TLS 1.2 at least, HTTP/1.1 offered by ALPN. Raises OSError for a file
    that cannot be read, ssl.SSLError for one that is not a PEM certificate or key, or a key that is not
    the certificate's (or an encrypted key: routerd has no passphrase to give)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key, password=_no_password)  # never OpenSSL's prompt on the terminal
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _no_password() -> bytes:
    return b""
