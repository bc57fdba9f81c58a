"""The one builder (routerd/assembly/): a start-up that fails half-way undoes what it did."""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path

import pytest
import structlog

from routerd.assembly import Role, assemble
from routerd.config import parse
from routerd.registry import Registry


async def test_a_start_up_that_fails_half_way_undoes_what_it_did(tmp_path: Path) -> None:
    """The HTTP port is taken: the last step fails, and the embedded Redis started before it is
    stopped again (as every earlier step's undo runs) — nothing is left running."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        cfg = parse({"daemon": {"state_dir": str(tmp_path)},
                     "http": {"host": "127.0.0.1", "port": taken.getsockname()[1]},
                     "redis": {"url": "embedded"},
                     "fleets": [{"name": "f", "model": "m", "engine": "static",
                                 "urls": ["http://127.0.0.1:9"]}]}, environ={})
        steps: list[str] = []
        with structlog.testing.capture_logs() as logs, pytest.raises(OSError, match="address already in use"):
            async with assemble(cfg, Registry(), port=None, status=steps.append):
                pytest.fail("the listener could not have been bound")
    assert steps == ["redis", "http"]  # static fleets only: no Ray step
    started = next(e for e in logs if e["event"] == "embedded_redis_started")
    assert any(e["event"] == "embedded_redis_stopped" for e in logs)
    gone = Path(f"/proc/{started['pid']}")
    for _ in range(100):  # reaped by its stop; poll rather than assume how soon
        if not await asyncio.to_thread(gone.exists):
            break
        await asyncio.sleep(0.05)
    assert not await asyncio.to_thread(gone.exists)


async def test_the_daemon_of_workers_builds_no_data_plane(tmp_path: Path) -> None:
    """The parent of workers takes fleet control, the peers and engine watching, and serves no request:
    no listener, no queue consumer, no admission — its workers have them — but it registers the static
    engines it watches and carries out the admin calls its workers relay."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    cfg = parse({"daemon": {"state_dir": str(tmp_path), "workers": 2},
                 "http": {"host": "127.0.0.1", "port": 0}, "redis": {"url": "embedded"},
                 "fleets": [{"name": "f", "model": "m", "engine": "static",
                             "urls": ["http://127.0.0.1:9"]}]}, environ={})
    async with assemble(cfg, Registry(), role=Role.PARENT) as parent:
        assert parent.dataplane is None
        assert parent.kv is None
        assert parent.url == ""
        assert [i.id for i in parent.registry.instances("f")] == ["f:static0"]
        loops = parent.loops()
        for coro in loops.values():
            coro.close()  # never started: what it would run is the point
        assert "admin_relay" in loops
        assert not {"queue", "admission", "upstream", "tenancy"} & set(loops)
