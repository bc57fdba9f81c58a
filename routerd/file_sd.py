"""Prometheus ``file_sd`` JSON of every engine instance, so one static job scrapes launched engines.

Ray launches engines on free ports that change on every restart; Ray's own Prometheus discovery does
not know they exist. routerd knows, so it writes the target list itself, atomically (temp file + fsync +
rename, so Prometheus never reads half a file), each time the registry changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from . import log
from .registry import InstanceState, Registry

_LISTED = {InstanceState.STARTING, InstanceState.READY, InstanceState.DRAINING}
_encode = msgspec.json.Encoder().encode
_logger = log.get("routerd.file_sd")


def targets(registry: Registry) -> list[dict[str, Any]]:
    """One target group per instance: ``host:port`` plus ``fleet``, ``instance`` and ``generation`` labels."""
    groups: list[dict[str, Any]] = []
    for inst in sorted(registry, key=lambda i: i.id):
        if inst.state not in _LISTED or not inst.url:
            continue
        parts = urlsplit(inst.url)
        # host:port only: a static URL's user:password must not land in a world-readable file
        # (Prometheus takes scrape credentials from its job's basic_auth, not from the target).
        target = parts.netloc.rpartition("@")[2]
        if not target:
            continue
        groups.append({
            "targets": [target],
            "labels": {
                "fleet": inst.fleet,
                "instance": inst.id,  # overrides Prometheus' host:port default: stable across restarts
                "generation": str(inst.generation),
                "__scheme__": parts.scheme or "http",
            },
        })
    return groups


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class FileSdWriter:
    """Rewrites the file whenever the registry's target list changes (and only then)."""

    def __init__(self, registry: Registry, path: Path) -> None:
        self._registry = registry
        self.path = path
        self._last: bytes | None = None

    async def write_if_changed(self) -> bool:
        data = _encode(targets(self._registry)) + b"\n"
        if data == self._last:
            return False
        await asyncio.to_thread(write_atomic, self.path, data)
        self._last = data
        return True

    async def run(self) -> None:
        version = -1
        while True:
            try:
                await self.write_if_changed()
            except OSError as e:
                _logger.warning("file_sd_write_failed", path=str(self.path), error=str(e))
            version = await self._registry.wait_changed(version, timeout=5.0)
