"""Socket activation: routerd serves on the socket systemd passes (LISTEN_FDS), and a restart under load
refuses no connection and fails no request, because the socket outlives the process.

The restart test plays systemd's part with :class:`routerd_bench.restart.SocketHolder` (bind once, pass
fd 3 to each ``routerd run``) — the same pieces ``routerd bench failover`` measures with; the first
test uses systemd's own ``systemd-socket-activate`` to check the protocol against the real thing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from routerd._net import free_port
from routerd.assembly import running
from routerd.ingress.listener import systemd_sockets
from routerd.registry import Registry
from routerd_bench.restart import SocketHolder, child_env, restart_under_load
from tests.fixtures.daemon import base_config, to_toml
from tests.fixtures.dataplane import SimFactory, plane_config
from tests.fixtures.helpers import eventually
from tests.fixtures.sim import SimProcessFactory

pytestmark = pytest.mark.timeout(150)


def test_listen_fds_of_another_process_are_not_taken() -> None:
    """sd_listen_fds(3): the descriptors are ours only when LISTEN_PID is our pid; the variables go
    either way, so no child of routerd mistakes them for its own."""
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "routerd.socket", "PATH": "/bin"}
    assert systemd_sockets(env) == []
    assert env == {"PATH": "/bin"}


async def test_a_handover_serves_open_connections_closing_each_and_leaves_new_ones_queued(
        sims: SimFactory) -> None:
    """Draining a listener on an inherited socket: a request on a kept-alive connection is served (not
    503) and its answer says ``Connection: close``; a new connection is not refused but waits in the
    accept queue, and the next listener on the same socket answers it."""
    eng = await sims(max_num_seqs=8)
    cfg = plane_config([eng.url])
    held = socket.create_server(("127.0.0.1", 0))  # systemd's copy, kept across both "processes"
    url = f"http://127.0.0.1:{held.getsockname()[1]}"
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    connector = aiohttp.TCPConnector(limit=1)  # one connection, kept alive and reused
    registry = Registry()
    async with running(cfg, registry, sockets=[socket.socket(fileno=os.dup(held.fileno()))]) as dp, \
            aiohttp.ClientSession(connector=connector) as client:
        listener = dp.serving.listener
        assert dp.url == url
        assert await eventually(lambda: registry.ready_count("f") == 1, 10)
        async with client.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers.get("Connection", "").lower() != "close"
            await r.read()
        await listener.stop_intake()
        async with client.post(f"{url}/v1/completions", json=body) as r:  # the same connection
            assert r.status == 200, await r.text()
            assert r.headers.get("Connection", "").lower() == "close"
            await r.read()
        port = held.getsockname()[1]
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
        request = json.dumps(body).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
        with pytest.raises(TimeoutError):  # queued, not refused, not answered by the draining one
            await asyncio.wait_for(reader.readline(), 0.5)
        await listener.close_streams("routerd is shutting down")
    async with running(cfg, Registry(), sockets=[socket.socket(fileno=os.dup(held.fileno()))]):
        status = await asyncio.wait_for(reader.readline(), 10)
        assert status.startswith(b"HTTP/1.1 200"), status
        writer.close()
    held.close()


def _static_config(tmp_path: Path, sim_url: str, port: int) -> Path:
    cfg = base_config(tmp_path, http={"port": port}, daemon={"drain_timeout_s": 10.0},
                      fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim_url]}])
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "routerd.toml"
    path.write_text(to_toml(cfg))
    return path


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd not installed")
async def test_systemd_socket_activate_starts_routerd_on_the_first_connection(
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    """systemd binds, the first connection starts routerd, and that connection — held in the accept
    queue while routerd starts — is answered by it; routerd never binds a port of its own."""
    sim = await sim_process(model="m", ttft_ms=5, itl_ms=2)
    port = free_port()
    config = _static_config(tmp_path, sim.url, free_port())  # http.port is NOT where it will serve
    log_path = tmp_path / "routerd.log"
    proc = await asyncio.to_thread(_socket_activate, port, config, log_path)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi", "max_tokens": 4}
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=60)) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["text"]
        lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        listening = [line for line in lines if line.get("event") == "http_listening"]
        assert listening, lines[-20:]
        assert listening[0]["socket_activated"] is True
        assert listening[0]["url"] == f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)


def _socket_activate(port: int, config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """``systemd-socket-activate`` listening on ``port`` (routerd not started until a connection)."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(["systemd-socket-activate", "-l", f"127.0.0.1:{port}", "-E", "PYTHONPATH",
                                 "-E", "RAY_AUTH_MODE=disabled", sys.executable, "-m", "routerd", "run",
                                 "--config", str(config), "--log-format", "json"],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env())
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(log_path.read_text()) from None
            time.sleep(0.05)


async def test_restart_under_load_refuses_no_connection_and_fails_no_request(
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    """~100 req/s (every 5th streamed) through a SIGTERM + start of routerd: with the socket held across
    the restart nothing is refused or failed, and the streams open at the SIGTERM finish whole (the
    drain); the same restart with routerd binding its own port refuses connections."""
    sim = await sim_process(model="m", ttft_ms=5, itl_ms=5, max_num_seqs=128)
    holder = SocketHolder()
    try:
        config = _static_config(tmp_path / "activated", sim.url, holder.port)
        activated = await restart_under_load(config, holder.url, "m", holder=holder, env=child_env(),
                                             log_dir=tmp_path / "activated", rate_per_s=100.0,
                                             long_streams=3, long_tokens=300)
    finally:
        holder.close()
    print("socket activated:", activated)
    assert activated["refused"] == 0, activated["errors"]
    assert activated["failed"] == 0, activated["errors"]
    assert activated["ok"] >= 300, activated  # the load really ran across the restart
    assert activated["long_streams"]["whole"] == 3, activated["long_streams"]

    port = free_port()
    config = _static_config(tmp_path / "bound", sim.url, port)
    bound = await restart_under_load(config, f"http://127.0.0.1:{port}", "m", holder=None, env=child_env(),
                                     log_dir=tmp_path / "bound", rate_per_s=100.0, after_s=0.5)
    print("binding its own port:", bound)
    assert bound["refused"] > 0, bound  # what the held socket prevents
