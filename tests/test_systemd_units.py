"""The unit files pass `systemd-analyze verify` and carry the settings an operator relies on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from routerd.config import EXIT_CONFIG
from routerd.state_lock import EXIT_LOCKED

ROOT = Path(__file__).resolve().parent.parent
UNITS = ["routerd.service", "routerd.socket", "ray-head.service", "ray-worker.service"]


def _unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((ROOT / "systemd" / name).read_text())
    return parser


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", UNITS)
def test_unit_verifies(tmp_path: Path, name: str) -> None:
    # The units point at /opt/routerd/.venv; verify checks that ExecStart exists, so point it at ours.
    # The units name each other (routerd.service requires routerd.socket): all of them go side by side.
    venv = Path(sys.prefix)
    for unit in UNITS:
        text = (ROOT / "systemd" / unit).read_text().replace("/opt/routerd/.venv", str(venv))
        (tmp_path / unit).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)],
                            capture_output=True, text=True, timeout=60, check=False)
    own = [line for line in (result.stdout + result.stderr).splitlines() if name in line]
    assert result.returncode == 0, result.stdout + result.stderr
    assert not own, own


def test_routerd_unit_settings() -> None:
    svc = _unit("routerd.service")["Service"]
    assert svc["Type"] == "notify"
    assert int(svc["WatchdogSec"]) > 0
    assert svc["Restart"] == "on-failure"
    # a bad config, or a state dir another routerd holds: neither gets better by restarting
    assert set(svc["RestartPreventExitStatus"].split()) == {str(EXIT_CONFIG), str(EXIT_LOCKED)}
    assert svc["LimitNOFILE"] == "65536"
    assert svc["User"] == "routerd"
    assert svc["ExecReload"].endswith("-HUP $MAINPID")
    # The drain must finish before systemd escalates to SIGKILL.
    example = (ROOT / "config" / "production.example.toml").read_text()
    drain = float(example.split("drain_timeout_s = ")[1].split()[0])
    assert int(svc["TimeoutStopSec"]) > drain


def test_ray_runs_in_its_own_units() -> None:
    head = _unit("ray-head.service")["Service"]
    worker = _unit("ray-worker.service")
    assert "--block" in head["ExecStart"]
    assert "--head" in head["ExecStart"]
    assert "--block" in worker["Service"]["ExecStart"]
    assert "ExecStartPre" in worker["Service"]  # waits for the head before joining
    unit = _unit("routerd.service")["Unit"]
    assert "ray-head.service" in unit["After"]
    assert "redis-server.service" in unit["After"]
    # routerd must not be bound to Ray: stopping it never stops the engines.
    assert "BindsTo" not in unit
    assert "ray" not in unit.get("Requires", "")


def test_the_socket_unit_holds_the_listener_across_restarts() -> None:
    """routerd.socket owns the listening socket (socket activation), so a restart of routerd.service
    refuses no connection; the service is started with it and only with it."""
    sock = _unit("routerd.socket")
    assert sock["Socket"]["ListenStream"]
    assert sock["Socket"].get("Accept", "no") == "no"  # one routerd for all connections, not one each
    assert sock["Socket"]["Service"] == "routerd.service"
    assert int(sock["Socket"]["Backlog"]) >= 1024  # connections wait here while routerd restarts
    assert sock["Install"]["WantedBy"] == "sockets.target"
    svc = _unit("routerd.service")
    assert svc["Service"]["Sockets"] == "routerd.socket"
    assert svc["Unit"]["Requires"] == "routerd.socket"
    assert "routerd.socket" in svc["Unit"]["After"]
