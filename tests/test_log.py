"""Logging: JSON lines for journald, stdlib loggers in the same format, the request id on every line."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import asyncio, logging
    from routerd import log
    log.setup("info", json={json})
    logger = log.get("routerd.test")

    async def handle(rid):
        log.bind_request_id(request_id=rid)
        logger.info("request_done", status=200)
        logging.getLogger("aiohttp.server").warning("from stdlib %s", "aiohttp")

    async def main():
        await asyncio.gather(handle("r1"), handle("r2"))
        logger.info("outside")
        logger.debug("hidden")
        try:
            1 / 0
        except ZeroDivisionError:
            logger.exception("boom")

    asyncio.run(main())
""")


def _run(json_mode: bool) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT.replace("{json}", str(json_mode))],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def test_json_lines_with_request_id_from_contextvars() -> None:
    lines = [json.loads(line) for line in _run(True).splitlines()]
    events = [(d["event"], d.get("request_id")) for d in lines]
    # Each request's lines carry its own id, stdlib ones included; lines outside a request carry none.
    assert ("request_done", "r1") in events
    assert ("request_done", "r2") in events
    assert ("from stdlib aiohttp", "r1") in events
    assert ("from stdlib aiohttp", "r2") in events
    assert ("outside", None) in events
    assert all(d["level"] in {"info", "warning", "error"} and "timestamp" in d for d in lines)
    assert not any(d["event"] == "hidden" for d in lines)  # below the configured level
    done = next(d for d in lines if d["event"] == "request_done")
    assert done["component"] == "routerd.test"
    assert done["status"] == 200
    boom = next(d for d in lines if d["event"] == "boom")
    assert "ZeroDivisionError" in boom["exception"]


def test_console_renderer_when_asked() -> None:
    out = _run(False)
    assert "request_done" in out
    assert not out.lstrip().startswith("{")


REDACT_SCRIPT = textwrap.dedent("""
    import logging
    from routerd import log
    redactor = log.setup("info", json={json}, secrets=["admin-key-123", "client-key-456"])
    logger = log.get("routerd.test")
    logger.info("routerd_ready", redis="redis://:redis-pw-789@127.0.0.1:6379/0")
    logger.info("checked", header="Bearer client-key-456", api_keys=["client-key-456"])
    logging.getLogger("redis").warning("cannot reach %s", "http://user:engine-pw-000@10.0.0.1:8001")
    redactor.learn(["reloaded-key-999"])
    logger.warning("reload_rejected", problems=["$.http.api_keys: reloaded-key-999"])
    try:
        raise ValueError("bad key admin-key-123 for http://u:engine-pw-000@h:1")
    except ValueError:
        logger.exception("boom")
        logging.getLogger("aiohttp.server").exception("stdlib boom")
""")
SECRETS = ["admin-key-123", "client-key-456", "redis-pw-789", "engine-pw-000", "reloaded-key-999"]


def test_no_secret_reaches_a_log_line_json_or_console() -> None:
    for json_mode in (True, False):
        out = subprocess.run([sys.executable, "-c", REDACT_SCRIPT.replace("{json}", str(json_mode))],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        # every line was written (and the tracebacks with them) ...
        for event in ("routerd_ready", "checked", "cannot reach", "reload_rejected", "boom", "stdlib boom"):
            assert event in out
        assert out.count("ValueError") >= 2
        # ... with no secret in any of them; URLs keep their user and host
        for secret in SECRETS:
            assert secret not in out, (json_mode, secret, out)
        assert "redis://:***@127.0.0.1:6379/0" in out
        assert "http://user:***@10.0.0.1:8001" in out
        if json_mode:
            lines = [json.loads(line) for line in out.splitlines()]
            checked = next(d for d in lines if d["event"] == "checked")
            assert checked["header"] == "Bearer ***"
            assert checked["api_keys"] == "***"


MODULE_LOGGERS_SCRIPT = textwrap.dedent("""
    import importlib, json, logging, pkgutil, sys, types
    import routerd
    from routerd import log
    log.setup("info", json=True)
    found = []
    for info in pkgutil.walk_packages(routerd.__path__, "routerd."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for attr in ("_log", "_logger"):
            logger = getattr(module, attr, None)
            if logger is None or isinstance(logger, types.FunctionType | types.ModuleType):
                continue
            logger.info("module_logger_probe", module=info.name)
            found.append(info.name)
    logging.getLogger("aiohttp.server").warning("stdlib_probe")
    print(json.dumps({"event": "modules", "found": found}))
""")


def test_every_line_carries_its_component() -> None:
    """Every module's logger, and a stdlib logger's line, says which component wrote it: the field an
    operator filters journald by (``structlog.get_logger(name)`` used to drop it for fleet and health)."""
    out = subprocess.run([sys.executable, "-c", MODULE_LOGGERS_SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    found = next(d["found"] for d in lines if d["event"] == "modules")
    assert {"routerd.fleet.manager", "routerd.fleet.supervisor", "routerd.fleet.engine",
            "routerd.fleet.health", "routerd.fleet.ray_cluster", "routerd.fleet.static", "routerd.daemon",
            "routerd.dataplane.upstream", "routerd.ingress.http", "routerd.sim.server"} <= set(found)
    probes = [d for d in lines if d["event"] == "module_logger_probe"]
    assert len(probes) == len(found)
    missing = [d["module"] for d in probes if not d.get("component", "").startswith("routerd.")]
    assert missing == []
    by_module = {d["module"]: d["component"] for d in probes}
    fleet_parts = ("routerd.fleet.manager", "routerd.fleet.supervisor", "routerd.fleet.engine")
    assert {by_module[m] for m in fleet_parts} == {"routerd.fleet"}  # one component, as before the split
    assert by_module["routerd.fleet.health"] == "routerd.health"
    stdlib = next(d for d in lines if d["event"] == "stdlib_probe")
    assert stdlib["component"] == "aiohttp.server"


ONE_WRITE_SCRIPT = textwrap.dedent("""
    import io, json, logging, sys
    real = sys.stdout

    class Recording(io.TextIOBase):  # what the process's stdout is asked to write, call by call
        calls = []
        def write(self, s):
            self.calls.append(s)
            return len(s)

    sys.stdout = Recording()
    from routerd import log
    log.setup("info", json=True)
    logger = log.get("routerd.test")
    logger.info("request", status=200, duration_ms=1.5)
    logger.warning("slow", ms=900)
    logging.getLogger("aiohttp.server").warning("from stdlib %s", "aiohttp")
    real.write(json.dumps(Recording.calls))
""")


def test_each_line_goes_out_in_one_write() -> None:
    """Under systemd stdout is unbuffered (PYTHONUNBUFFERED=1), so every write() is a syscall and a
    reader of the pipe may see it alone: a line and its newline must leave together, once per line."""
    out = subprocess.run([sys.executable, "-c", ONE_WRITE_SCRIPT], capture_output=True, text=True,
                         timeout=60, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}).stdout
    calls = json.loads(out)
    assert len(calls) == 3
    for call in calls:
        assert call.endswith("\n")
        assert call.count("\n") == 1
        json.loads(call)


@pytest.mark.parametrize("now", [1_763_900_000.0, 1_763_900_000.25, 1_763_900_059.5, 1_763_903_599.125])
def test_timestamps_read_as_structlogs_did(monkeypatch: pytest.MonkeyPatch, now: float) -> None:
    """The timestamp, formatted once a second now, is the text structlog's TimeStamper(fmt="iso",
    utc=True) wrote — what log pipelines parse — whole seconds (no fraction) included."""
    from routerd.log import _UtcTimestamp

    stamp = _UtcTimestamp()
    monkeypatch.setattr(time, "time", lambda: now)
    ours = stamp(None, "info", {})["timestamp"]
    theirs = datetime.datetime.fromtimestamp(now, tz=datetime.UTC).isoformat()
    assert ours == theirs.replace("+00:00", "Z")
