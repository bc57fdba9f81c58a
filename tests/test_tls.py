"""HTTPS on routerd's own listener (``[http] tls_cert``, ``tls_key``) and ``routerd status`` without the
admin key on its command line. A real ``routerd run`` with two workers (each wraps the socket it was
handed in TLS itself) and a self-signed certificate made here with ``openssl``."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest

from routerd import config
from routerd.status import main as status_main
from tests.fixtures.daemon import RouterdFactory, base_config
from tests.fixtures.dataplane import PlaneFactory, SimFactory
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory

ADMIN_KEY = "admin-key-T1s9"


def self_signed(directory: Path, name: str = "routerd") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


async def _status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``routerd status`` in this process (its own event loop in a thread): what it printed."""
    code = await asyncio.to_thread(status_main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_https_listener_in_every_worker_and_status_without_the_key_on_argv(
        tmp_path: Path, routerd_process: RouterdFactory, redis_server: RedisServer,
        sim_process: SimProcessFactory, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = self_signed(tmp_path)
    sim = await sim_process(model="m", ttft_ms=1, itl_ms=1)
    cfg = base_config(tmp_path, daemon={"workers": 2},
                      redis={"enabled": True, "url": redis_server.url, "block_ms": 200},
                      http={"tls_cert": str(cert), "tls_key": str(key), "admin_api_key": ADMIN_KEY},
                      fleets=[{"name": "f", "model": "m", "engine": "static", "urls": [sim.url]}])
    rp = await asyncio.to_thread(routerd_process, cfg)
    https = rp.url.replace("http://", "https://")
    trusted = ssl.create_default_context(cafile=str(cert))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for _ in range(20):  # a fresh connection each: whichever worker accepts it must speak TLS
            async with s.post(f"{https}/v1/completions", ssl=trusted, headers={"Connection": "close"},
                              json={"model": "m", "prompt": "over tls", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
        # plain HTTP on the TLS port gets no HTTP answer
        with pytest.raises(aiohttp.ClientError):
            async with s.get(f"{rp.url}/healthz") as r:
                await r.read()
        # a client that does not trust the certificate refuses it
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with s.get(f"{https}/healthz") as r:
                await r.read()

    # routerd status finds the key in the config (and the https URL from its [http]), in a file, or in
    # $ROUTERD_ADMIN_KEY: never on its own command line
    for var in ("ROUTERD_URL", "ROUTERD_ADMIN_KEY", "ROUTERD_HTTP_ADMIN_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()
    code, out, err = await _status(capsys, "--config", str(rp.config_path), "--cacert", str(cert))
    assert (code, err) == (0, ""), err
    assert "f:static0" in out
    code, out, err = await _status(capsys, "--url", https, "--cacert", str(cert))
    assert code == 69  # no key: the daemon says 401
    assert "401" in err


async def test_status_takes_the_admin_key_from_a_file_or_the_environment_not_argv(
        tmp_path: Path, sims: SimFactory, dataplane: PlaneFactory, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--admin-key K`` put the key in the process list (``ps``), where every user of the machine
    reads it; ``$ROUTERD_ADMIN_KEY`` and ``--admin-key-file`` are the ways now, ``--admin-key`` warns."""
    plane = await dataplane([(await sims()).url], http={"admin_api_key": ADMIN_KEY})
    for var in ("ROUTERD_URL", "ROUTERD_ADMIN_KEY", "ROUTERD_HTTP_ADMIN_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    code, out, err = await _status(capsys, "--url", plane.url, "--admin-key-file", str(key_file))
    assert (code, err) == (0, ""), err
    assert "f:static0" in out
    monkeypatch.setenv("ROUTERD_ADMIN_KEY", ADMIN_KEY)
    code, out, err = await _status(capsys, "--url", plane.url)
    assert (code, err) == (0, ""), err
    monkeypatch.delenv("ROUTERD_ADMIN_KEY")
    code, out, err = await _status(capsys, "--url", plane.url, "--admin-key", ADMIN_KEY)
    assert code == 0
    assert "--admin-key is visible to every user of this machine" in err
    code, out, err = await _status(capsys, "--url", plane.url, "--admin-key-file", str(tmp_path / "none"))
    assert code == 78
    assert "none" in err


async def _served_certificate(url: str) -> bytes:
    """The DER certificate the server at ``url`` presents (no SNI: an address, as most clients)."""
    host, _, port = url.removeprefix("https://").rpartition(":")
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), ssl=insecure), 10)
    try:
        der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    return der


async def test_a_reload_serves_a_renewed_certificate_and_keeps_the_old_one_if_the_new_is_broken(
        tmp_path: Path, sims: SimFactory, dataplane: PlaneFactory) -> None:
    cert, key = self_signed(tmp_path)
    plane = await dataplane([(await sims()).url], http={"tls_cert": str(cert), "tls_key": str(key)})
    assert plane.url.startswith("https://")
    first = cert.read_text()
    assert await _served_certificate(plane.url) == ssl.PEM_cert_to_DER_cert(first)
    self_signed(tmp_path)  # renewed in place, as certbot does
    renewed = cert.read_text()
    assert renewed != first
    await plane.dp.apply(plane.dp.http.cfg)  # what SIGHUP does, with the same paths
    assert await _served_certificate(plane.url) == ssl.PEM_cert_to_DER_cert(renewed)
    key.write_text("not a key")
    await plane.dp.apply(plane.dp.http.cfg)
    assert await _served_certificate(plane.url) == ssl.PEM_cert_to_DER_cert(renewed)


def test_check_config_refuses_half_a_tls_setup_and_unreadable_files(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    other_cert, _ = self_signed(tmp_path, "other")

    def problems(**http: str) -> list[str]:
        try:
            config.parse({"http": http}, environ={})
        except config.ConfigError as e:
            return e.problems
        return []

    assert problems(tls_cert=str(cert), tls_key=str(key)) == []
    assert problems(tls_cert=str(cert)) == [
        "$.http.tls_key: tls_cert is set; HTTPS needs both (PEM files), or neither"]
    assert problems(tls_key=str(key)) == [
        "$.http.tls_cert: tls_key is set; HTTPS needs both (PEM files), or neither"]
    missing = tmp_path / "nope.key"
    assert problems(tls_cert=str(cert), tls_key=str(missing)) == [
        f"$.http.tls_key: cannot read {missing}: No such file or directory"]
    (mismatch,) = problems(tls_cert=str(other_cert), tls_key=str(key))
    assert mismatch.startswith(f"$.http.tls_cert: {other_cert} with {key}: not a PEM certificate and its "
                               "private key")
    (garbage,) = problems(tls_cert=str(key), tls_key=str(key))  # a key where the certificate goes
    assert "not a PEM certificate" in garbage
