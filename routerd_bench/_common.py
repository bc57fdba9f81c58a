"""Shared pieces of the data-plane benchmarks: processes, one timed request, statistics, tables.

Engines and routerd each run in their own process (``routerd sim-engine …`` and
``python -m routerd_bench._common plane …``), so routerd's event loop competes with nothing of the
benchmark's own: the load generator's client work is not counted as routerd's latency, and routerd's
CPU time can be read from ``/proc`` to express its capacity per core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from routerd._net import free_port
from routerd._table import print_table as print_table  # the benchmarks print with the runtime's table
from routerd.config import Config

# ``[control] secret`` of every routerd a benchmark or a test starts beside another one with its own state
# dir: replicas must share a secret to trust each other's records (routerd/trust.py); not a real secret.
SHARED_SECRET = "routerd-benchmarks-and-tests-shared-secret"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(x)}' for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(cfg: dict[str, Any]) -> str:
    """A small TOML writer for the configs the benchmarks and the tests write: sections of scalars (lists and
    inline tables too), plus ``[[fleets]]`` and ``[[tenants]]``."""
    lines: list[str] = []
    arrays = ("fleets", "tenants")
    for section, body in cfg.items():
        if section in arrays:
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
        lines.append("")
    for array in arrays:
        for entry in cfg.get(array, []):
            lines.append(f"[[{array}]]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
            lines.append("")
    return "\n".join(lines)


def quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (``q`` in 0..1) of ``xs``; NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(xs: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/p50/p90/p99/max of seconds ``xs``, in milliseconds by default."""
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {"n": len(xs), "mean": round(sum(xs) / len(xs) * scale, 3),
            "p50": round(quantile(xs, 0.5) * scale, 3), "p90": round(quantile(xs, 0.9) * scale, 3),
            "p99": round(quantile(xs, 0.99) * scale, 3), "max": round(max(xs) * scale, 3)}


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {path}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {url} exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with asyncio.timeout(1.0), s.get(url) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM and wait, as systemd's stop does (SIGKILL only past ``timeout_s``); the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


class Processes:
    """Child processes of one benchmark run, terminated together (each is one we started)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = tempfile.TemporaryDirectory(prefix="routerd-bench-")

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.tmp.cleanup()

    def _spawn(self, argv: list[str], log_path: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv``; its output goes to ``log_path`` when given (its JSON log, to be read after),
        else nowhere."""
        if log_path is None:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            with log_path.open("wb") as out:  # the child holds its own descriptor
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def spawn_sim(self, model: str, **sim_args: Any) -> tuple[str, subprocess.Popen[bytes]]:
        """Start ``routerd sim-engine`` with SimConfig fields as flags; returns its base URL."""
        port = free_port()
        argv = [sys.executable, "-m", "routerd", "sim-engine", "--host", "127.0.0.1", "--port", str(port),
                "--model", model, "--log-level", "warning"]
        for k, v in sim_args.items():
            flag = k.replace("_", "-")
            argv += [f"--{flag}" if v else f"--no-{flag}"] if isinstance(v, bool) else [f"--{flag}", str(v)]
        return f"http://127.0.0.1:{port}", self._spawn(argv)

    async def sim(self, model: str, **sim_args: Any) -> str:
        url, proc = self.spawn_sim(model, **sim_args)
        await wait_http(url + "/health", proc=proc)
        return url

    def spawn_plane(self, cfg: dict[str, Any], capacities: dict[str, int] | None = None,
                    log_level: str = "info",
                    log_path: Path | None = None) -> tuple[str, subprocess.Popen[bytes]]:
        """Start a routerd data plane for ``cfg`` (a raw config dict) in its own process (its log
        lines to ``log_path`` when given)."""
        port = free_port()
        cfg = {**cfg, "http": {**cfg.get("http", {}), "host": "127.0.0.1", "port": port}}
        path = Path(self.tmp.name) / f"plane-{port}.json"
        path.write_text(json.dumps({"config": cfg, "capacities": capacities or {}}))
        proc = self._spawn([sys.executable, "-m", "routerd_bench._common", "plane", str(path),
                            "--log-level", log_level], log_path)
        return f"http://127.0.0.1:{port}", proc

    async def vllm_router(self, engines: list[str], policy: str = "power_of_two") -> str:
        """Start the Rust vLLM Router (PyPI ``vllm-router``) in front of ``engines``; returns its URL.

        It is a peer measured in the same run on the same engines; raises LookupError when it is not
        installed (``pip install vllm-router``) so a benchmark can say so and go on without it.
        """
        binary = find_vllm_router()
        if binary is None:
            raise LookupError("vllm-router is not installed (pip install vllm-router)")
        port = free_port()
        # Its own health checker and retries stay at their defaults; its logs go to a temp dir.
        self._spawn([binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                     "--log-level", "error", "--log-dir", self.tmp.name,
                     "--prometheus-port", str(free_port()), "--worker-urls", *engines])
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/health", timeout=60.0, proc=self.procs[-1])
        return url

    async def plane(self, cfg: dict[str, Any], capacities: dict[str, int] | None = None,
                    log_level: str = "info",
                    log_path: Path | None = None) -> tuple[str, subprocess.Popen[bytes]]:
        url, proc = self.spawn_plane(cfg, capacities, log_level, log_path)
        await wait_http(url + "/readyz", proc=proc)
        return url, proc


def find_vllm_router() -> str | None:
    """The ``vllm-router`` binary: ``$ROUTERD_VLLM_ROUTER``, then PATH, then beside this Python."""
    for candidate in (os.environ.get("ROUTERD_VLLM_ROUTER"), shutil.which("vllm-router"),
                      str(Path(sys.executable).with_name("vllm-router"))):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


class Timing(msgspec.Struct):
    """One request as the client saw it: seconds to the first generated text and to the end."""

    ttft: float
    e2e: float
    ok: bool
    instance: str = ""  # which instance routerd chose (its X-Routerd-Instance header)
    status: int = 0  # the HTTP status; 0 when the connection failed
    # a stream's usage chunk (stream_options.include_usage): prompt tokens, and those the engine's
    # prefix cache served (prompt_tokens_details, when the engine reports it; else -1)
    prompt_tokens: int = 0
    cached_tokens: int = -1


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None  # /v1/completions
    delta: _Delta | None = None  # /v1/chat/completions


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_chunk_dec = msgspec.json.Decoder(_Chunk)


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _UsageChunk(msgspec.Struct):
    usage: _Usage | None = None


_usage_dec = msgspec.json.Decoder(_UsageChunk)


def usage_of(line: bytes) -> tuple[int, int] | None:
    """A usage chunk's prompt tokens and cached prompt tokens (-1: not reported); None for another line."""
    if not line.startswith(b"data: {") or b'"usage"' not in line:
        return None
    try:
        usage = _usage_dec.decode(line[6:]).usage
    except msgspec.DecodeError:
        return None
    if usage is None:
        return None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens is not None else -1
    return usage.prompt_tokens, cached


def carries_text(line: bytes) -> bool:
    """Whether one SSE line is an event with generated text: not chat's role chunk (empty content),
    not a usage chunk (no choices), not an error event, not ``[DONE]``.

    Time to first token is timed to this event, as ``vllm bench serve`` and a user's eyes time it; the
    first event of any kind would count chat's role chunk, which an engine or a router could send early.
    """
    if not line.startswith(b"data: {"):
        return False
    try:
        chunk = _chunk_dec.decode(line[6:])
    except msgspec.DecodeError:
        return False
    return any(c.text or (c.delta is not None and c.delta.content) for c in chunk.choices)


async def timed_request(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool,
                        headers: Mapping[str, str] | None = None) -> Timing:
    """POST ``body``; time to first token is, for a stream, the first SSE event carrying generated
    text (:func:`carries_text`), for a plain answer the whole body. A stream is ``ok`` when it answered
    200, carried text and ended with ``[DONE]`` (a stream cut with an error event is a failure)."""
    t0 = time.perf_counter()
    ttft = math.nan
    instance = ""
    status = 0
    usage: tuple[int, int] | None = None
    try:
        sent = {"Content-Type": "application/json", **(headers or {})}
        async with session.post(url, data=body, headers=sent) as r:
            if stream:
                last = b""
                async for line in r.content:
                    if math.isnan(ttft) and carries_text(line):
                        ttft = time.perf_counter() - t0
                    elif not math.isnan(ttft):
                        usage = usage_of(line) or usage
                    if line != b"\n":
                        last = line
                ok = r.status == 200 and not math.isnan(ttft) and last.startswith(b"data: [DONE]")
            else:
                await r.read()
                ttft = time.perf_counter() - t0
                ok = r.status == 200
            instance = r.headers.get("X-Routerd-Instance", "")
            status = r.status
    except (aiohttp.ClientError, OSError):
        ok = False
    prompt, cached = usage or (0, -1)
    return Timing(ttft=ttft, e2e=time.perf_counter() - t0, ok=ok, instance=instance, status=status,
                  prompt_tokens=prompt, cached_tokens=cached)


# the data-plane process ---------------------------------------------------------------------
async def _serve_plane(spec: dict[str, Any]) -> None:
    from routerd.assembly import running
    from routerd.registry import Registry

    cfg = msgspec.convert(spec["config"], Config)
    registry = Registry()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    # stopped as the daemon stops (intake, drain, close), on the benchmark's TERM
    async with running(cfg, registry, port=None, drain_timeout_s=cfg.daemon.drain_timeout_s):
        # A static fleet's capacity comes from its config; the benchmark's mixed fleet says it per URL.
        for inst in registry:
            inst.capacity_hint = int(spec["capacities"].get(inst.id, inst.capacity_hint))
        await stop.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m routerd_bench._common")
    sub = parser.add_subparsers(dest="cmd", required=True)
    plane = sub.add_parser("plane", help="run a data plane from a benchmark's JSON spec")
    plane.add_argument("spec")
    plane.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    from routerd import log

    spec = json.loads(Path(args.spec).read_text())
    log.setup(args.log_level, json=True, trace_ids=bool(spec["config"].get("tracing")))  # as the daemon
    import uvloop

    uvloop.run(_serve_plane(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
