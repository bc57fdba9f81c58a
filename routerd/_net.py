"""The one port helper every part of routerd (and its tests, benchmarks and scripts) asks."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (an IPv6 address when ``host`` has a colon).

    Free *now* only: another process may take it before the caller binds it, so whoever listens on it
    must cope with EADDRINUSE (retry, or fail loudly)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
