"""No secret leaves the daemon: a real ``routerd run`` with a Redis password (a real redis-server with
``requirepass``), a static engine URL with user:password, API keys and an admin key is exercised —
requests both ways in, reloads good and bad, ``/admin/fleets``, ``routerd status``, ``/metrics``, the
file_sd file, ``check-config`` — and then every log line, reply, output and file it wrote is searched
for every secret. The engine sits behind a proxy that demands HTTP basic auth, so the credentials in
its URL must still be sent."""

from __future__ import annotations

import asyncio
import base64
import collections
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from routerd.client import QueueClient
from tests.fixtures.daemon import RouterdFactory, RouterdProcess, base_config, to_toml
from tests.fixtures.helpers import starts
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory

REDIS_PW = "redis-pw-Q7x2"
REDIS_PW_2 = "redis-pw-second-K9"
ENGINE_USER = "engine-user"
ENGINE_PW = "engine-pw-Z4m8"
ENGINE_PW_BAD = "engine-pw-bad-R2"
API_KEY = "client-key-A1b2"
API_KEY_2 = "client-key-second-C3"
ADMIN_KEY = "admin-key-D4e5"
WRONG_KEY = "wrong-client-key-F6"  # what a client sent: not a secret of ours, but not to be logged
SECRETS = [REDIS_PW, REDIS_PW_2, ENGINE_PW, ENGINE_PW_BAD, API_KEY, API_KEY_2, ADMIN_KEY, WRONG_KEY]


@dataclass
class AuthProxy:
    """An engine behind HTTP basic auth: 401 without the right credentials, else passed through."""

    target: str
    expected: str
    url: str = ""
    seen: collections.Counter[str] = field(default_factory=collections.Counter)
    runner: web.AppRunner | None = None
    session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != self.expected:
            self.seen["denied"] += 1
            return web.Response(status=401)
        self.seen[request.path] += 1
        assert self.session is not None
        async with self.session.request(request.method, self.target + request.path_qs,
                                        data=await request.read(),
                                        headers={"Content-Type": request.content_type}) as up:
            resp = web.StreamResponse(status=up.status,
                                      headers={"Content-Type": up.headers.get("Content-Type", "text/plain")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


@pytest.fixture
@starts("redis")
def redis_with_password(tmp_path: Path) -> Iterator[RedisServer]:
    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(d, extra_args=("--requirepass", REDIS_PW))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def engine_behind_auth(sim_process: SimProcessFactory) -> AsyncIterator[AuthProxy]:
    sim = await sim_process(model="m", itl_ms=2)
    token = base64.b64encode(f"{ENGINE_USER}:{ENGINE_PW}".encode()).decode()
    proxy = AuthProxy(target=sim.url, expected=f"Basic {token}")
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def _run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routerd", *argv, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, **(env or {})})
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def _wait_log(rp: RouterdProcess, event: str, count: int, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while rp.log_path.read_text(errors="replace").count(f'"event":"{event}"') < count:
        assert loop.time() < end, f"no {event} in the log:\n{rp.log()}"
        await asyncio.sleep(0.1)


async def _exercise_requests(session: aiohttp.ClientSession, url: str, key: str) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "m", "prompt": "hello", "max_tokens": 5}
    async with session.post(f"{url}/v1/completions", json=body, headers=auth) as r:
        assert r.status == 200, await r.text()
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}, headers=auth) as r:
        assert r.status == 200
        assert (await r.text()).endswith("data: [DONE]\n\n")
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {WRONG_KEY}"}) as r:
        assert r.status == 401
        assert WRONG_KEY not in await r.text()


async def test_no_secret_in_any_log_reply_output_or_file(
        tmp_path: Path, routerd_process: RouterdFactory, redis_with_password: RedisServer,
        engine_behind_auth: AuthProxy) -> None:
    redis_url = f"redis://:{REDIS_PW}@127.0.0.1:{redis_with_password.port}/0"
    engine_url = f"http://{ENGINE_USER}:{ENGINE_PW}@{engine_behind_auth.url.removeprefix('http://')}"
    cfg = base_config(
        tmp_path,
        redis={"enabled": True, "url": redis_url, "block_ms": 200},
        http={"api_keys": [API_KEY]},
        fleets=[{"name": "s", "model": "m", "engine": "static", "urls": [engine_url]}],
    )
    # the admin key the way the README says to pass secrets: the environment
    env = {"ROUTERD_HTTP_ADMIN_API_KEY": ADMIN_KEY}
    rp = await asyncio.to_thread(routerd_process, cfg, env=env)
    shown: dict[str, str] = {}  # everything the daemon (or its CLI) showed, by where
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await _wait_ready(session, rp.url)
        await _exercise_requests(session, rp.url, API_KEY)
        # the credentials in the URL reach the engine as basic auth: routing, scrapes, health all work
        assert engine_behind_auth.seen["/v1/completions"] >= 2
        assert engine_behind_auth.seen["/metrics"] > 0
        assert engine_behind_auth.seen["/health"] > 0
        assert engine_behind_auth.seen["denied"] == 0

        async with QueueClient.from_url(redis_url) as queue:
            job = await queue.submit({"model": "m", "prompt": "from the queue", "max_tokens": 4},
                                     endpoint="/v1/completions")
            result = await queue.wait(job, timeout=30)
            assert result.status == "ok", result

        async with session.get(f"{rp.url}/admin/fleets", headers=admin) as r:
            assert r.status == 200
            shown["admin_fleets"] = await r.text()
        fleets = (await _json(session, f"{rp.url}/admin/fleets", admin))["fleets"]
        assert fleets["s"]["instances"][0]["url"] == (
            f"http://{ENGINE_USER}:***@{engine_behind_auth.url.removeprefix('http://')}")
        async with session.get(f"{rp.url}/metrics") as r:
            shown["metrics"] = await r.text()

        code, shown["status"] = await _run("status", "--url", rp.url, env=env)
        assert code == 0
        assert "s:static0" in shown["status"]
        assert f"{ENGINE_USER}:***@" in shown["status"]
        code, shown["status_json"] = await _run("status", "--url", rp.url, "--json", env=env)
        assert code == 0

        # a good reload: a second API key, and a changed Redis URL (needs a restart: logged, not applied)
        good = {**cfg, "http": {**cfg["http"], "api_keys": [API_KEY, API_KEY_2]},
                "redis": {**cfg["redis"], "url": f"redis://:{REDIS_PW_2}@127.0.0.1:"
                                                 f"{redis_with_password.port}/0"}}
        rp.rewrite_config(good)
        rp.signal(signal.SIGHUP)
        await _wait_log(rp, "reloaded", 1)
        await _exercise_requests(session, rp.url, API_KEY_2)
        code, shown["check_config_good"] = await _run("check-config", str(rp.config_path))
        assert code == 0

        # a bad reload: a malformed engine URL with credentials, a key of the wrong type
        bad = {**good, "fleets": [{"name": "s", "model": "m", "engine": "static",
                                   "urls": [f"ftp://{ENGINE_USER}:{ENGINE_PW_BAD}@127.0.0.1:1"]}],
               "http": {**good["http"], "api_keys": API_KEY_2}}
        bad_path = tmp_path / "bad.toml"
        bad_path.write_text(to_toml(bad))
        rp.rewrite_config(bad)
        rp.signal(signal.SIGHUP)
        await _wait_log(rp, "reload_rejected", 1)
        code, shown["check_config_bad"] = await _run("check-config", str(bad_path))
        assert code == 78
        assert "urls[0]" in shown["check_config_bad"]
        await _exercise_requests(session, rp.url, API_KEY_2)  # the old config still serves

    rp.signal(signal.SIGTERM)
    assert await asyncio.to_thread(rp.wait_exit, 30) == 0
    rp.read_notify(0.2)
    shown["sd_notify"] = "\n".join(rp.messages)
    log = rp.log_path.read_text(errors="replace")
    assert '"event":"routerd_ready"' in log
    assert f"redis://:***@127.0.0.1:{redis_with_password.port}" in log
    assert '"event":"reload_needs_restart"' in log
    shown["log"] = log
    files = await asyncio.to_thread(_files, Path(cfg["daemon"]["state_dir"]))
    assert "file_sd/engines.json" in files
    shown.update({f"file {name}": text for name, text in files.items()})

    leaks = [(where, secret) for where, text in shown.items() for secret in SECRETS if secret in text]
    assert leaks == [], leaks


def _files(state: Path) -> dict[str, str]:
    """Every file the daemon wrote in its state dir, by relative path."""
    return {str(p.relative_to(state)): p.read_bytes().decode(errors="replace")
            for p in state.rglob("*") if p.is_file()}


async def _wait_ready(session: aiohttp.ClientSession, url: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        async with session.get(f"{url}/readyz") as r:
            if r.status == 200:
                return
        assert loop.time() < end, "routerd never became ready"
        await asyncio.sleep(0.1)


async def _json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Any:
    async with session.get(url, headers=headers) as r:
        return await r.json()


async def test_a_key_in_a_malformed_request_head_is_not_logged(
        routerd_process: RouterdFactory, tmp_path: Path, sim_process: SimProcessFactory) -> None:
    """A tenant's key configured as its SHA-256 is unknown to the log's redactor: sent in the query of
    a request line aiohttp cannot parse, or in a secret header's line it cannot parse, it must still
    not reach the log (the client is answered 400)."""
    import hashlib
    import socket

    sim = await sim_process(model="m")
    key = "sk-plain-tenant-key-W8q1"
    tenant = {"name": "t", "api_keys": ["sha256:" + hashlib.sha256(key.encode()).hexdigest()]}
    cfg = base_config(tmp_path, fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}],
                      tenants=[tenant])
    rp = await asyncio.to_thread(routerd_process, cfg)
    host, port = rp.url.removeprefix("http://").split(":")
    heads = [f"GET /v1/models?key={key} HTTP/1.1 junk\r\n\r\n",  # no secret-looking parameter name
             f"GET /v1/models?api_key={key}&x=1 HTTP/9\r\n\r\n",
             f"GET /v1 models?{key} HTTP/1.1\r\n\r\n",
             f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Api-Key: {key}\x01\r\n\r\n",
             f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\x01z\r\n\r\n",
             f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Api-Key {key}\r\n\r\n"]

    def send(head: str) -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.encode("latin-1"))
            return sock.recv(65536)

    for head in heads:
        assert (await asyncio.to_thread(send, head)).split(b" ", 2)[1] == b"400", head
    await _wait_log(rp, "bad_http_request", len(heads))
    log = rp.log_path.read_text(errors="replace")
    assert key not in log
    assert key[:12] not in log  # nor a part of it
    assert "?key=***" in log  # what was sent is still told, its secret masked


def test_a_password_in_a_redis_url_on_the_command_line_is_warned_about(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``routerd usage``/``submit --redis redis://:pw@…`` put the password in the process list; the
    same URL from ``$ROUTERD_REDIS_URL`` does not, and is not warned about."""
    from routerd.tenants.report import main as usage_main

    url = f"redis://:{REDIS_PW}@127.0.0.1:1/0"  # nothing listens: the command fails after the warning
    monkeypatch.delenv("ROUTERD_REDIS_URL", raising=False)
    usage_main(["--redis", url])
    err = capsys.readouterr().err
    assert "the password in --redis is visible to every user of this machine" in err
    assert REDIS_PW not in err
    monkeypatch.setenv("ROUTERD_REDIS_URL", url)
    usage_main([])
    assert "visible to every user" not in capsys.readouterr().err
