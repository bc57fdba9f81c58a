"""sd_notify datagrams and the Prometheus file_sd target file."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

from routerd.file_sd import FileSdWriter, targets
from routerd.registry import Instance, InstanceState, Registry
from routerd.sdnotify import Notifier


def test_notifier_sends_datagrams(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(2)
    try:
        n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "4000000"})
        assert n.enabled
        assert n.watchdog_interval_s == 2.0
        assert n.ready("2/2 fleets ready")
        assert server.recv(4096).decode().split("\n") == ["READY=1", "STATUS=2/2 fleets ready"]
        n.watchdog()
        assert server.recv(4096) == b"WATCHDOG=1"
        n.reloading()
        msg = server.recv(4096).decode()
        assert msg.startswith("RELOADING=1\nMONOTONIC_USEC=")
        n.stopping()
        assert server.recv(4096) == b"STOPPING=1"
        n.close()
    finally:
        server.close()


def test_notifier_is_a_noop_outside_systemd() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.watchdog_interval_s is None
    assert n.ready() is False


def test_watchdog_for_another_pid_is_ignored(tmp_path: Path) -> None:
    n = Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None


async def test_file_sd_follows_instances(tmp_path: Path) -> None:
    reg = Registry()
    path = tmp_path / "sd" / "engines.json"
    writer = FileSdWriter(reg, path)
    task = asyncio.create_task(writer.run())
    try:
        a = reg.add(Instance(id="small:0", fleet="small", url="http://127.0.0.1:8001"))
        await _until(lambda: path.exists() and len(json.loads(path.read_text())) == 1)
        reg.add(Instance(id="big:0", fleet="big", url="http://127.0.0.1:8002", generation=3))
        await _until(lambda: len(json.loads(path.read_text())) == 2)
        groups = json.loads(path.read_text())
        assert groups[0] == {"targets": ["127.0.0.1:8002"],
                             "labels": {"fleet": "big", "instance": "big:0", "generation": "3",
                                        "__scheme__": "http"}}
        reg.set_state(a, InstanceState.STOPPED)
        await _until(lambda: [g["labels"]["instance"] for g in json.loads(path.read_text())] == ["big:0"])
        reg.remove("big:0")
        await _until(lambda: json.loads(path.read_text()) == [])
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp files left
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_targets_carry_no_credentials() -> None:
    """A static engine URL with user:password is scraped with them, but the world-readable file gets
    host:port only."""
    reg = Registry()
    reg.add(Instance(id="s:static0", fleet="s", url="https://scraper:engine-pw@10.0.0.7:8443"))
    assert targets(reg) == [{"targets": ["10.0.0.7:8443"],
                             "labels": {"fleet": "s", "instance": "s:static0", "generation": "0",
                                        "__scheme__": "https"}}]


def test_targets_skip_instances_without_url() -> None:
    reg = Registry()
    reg.add(Instance(id="x:0", fleet="x", url=""))
    assert targets(reg) == []


async def _until(cond: object, timeout: float = 3.0) -> None:
    assert callable(cond)
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
