"""What a launched instance is called and what it asks of Ray: pure functions of the config.

Instance ``<fleet>:<n>`` is the detached actor ``routerd:<fleet>:<n>`` in the configured namespace,
inside the detached placement group ``routerd:<namespace>:<fleet>:<n>``; adoption finds both by these
names, so they are part of the contract with engines launched by an earlier routerd.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..config import FleetConfig
from ..plugins import LaunchSpec

NAME_RE = re.compile(r"^routerd:(?P<fleet>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<index>\d+)$")


def instance_id(fleet: str, index: int) -> str:
    """The registry id of launched instance ``index`` of ``fleet``."""
    return f"{fleet}:{index}"


def actor_name(fleet: str, index: int) -> str:
    """The Ray actor name of launched instance ``index`` (matched by ``NAME_RE``)."""
    return f"routerd:{fleet}:{index}"


def pg_prefix(namespace: str) -> str:
    """The name prefix of every placement group routerd owns in ``namespace``."""
    return f"routerd:{namespace}:"


def pg_name(namespace: str, fleet: str, index: int) -> str:
    """The placement group name of launched instance ``index``."""
    return f"{pg_prefix(namespace)}{fleet}:{index}"


def spec_for(fleet: FleetConfig, index: int, ray_address: str = "",
             otel: Mapping[str, str] | None = None) -> LaunchSpec:
    """The LaunchSpec of instance ``index``: what adoption compares against the actor's record.
    ``otel``: where the engine sends its spans when routerd traces (``routerd.tracing.engine_env``);
    the fleet's own ``env`` wins."""
    env = {**(otel or {}), **fleet.env}
    if _ray_backend(fleet):
        env.setdefault("RAY_ADDRESS", ray_address)
    return LaunchSpec(fleet=fleet.name, index=index, model=fleet.model, engine=fleet.engine,
                      tensor_parallel_size=fleet.tensor_parallel_size,
                      pipeline_parallel_size=fleet.pipeline_parallel_size,
                      num_cpus=fleet.num_cpus_per_instance, num_gpus=_gpus(fleet),
                      engine_args=dict(fleet.engine_args), env=env)


def _ray_backend(fleet: FleetConfig) -> bool:
    args = fleet.engine_args
    backend = args.get("distributed-executor-backend", args.get("distributed_executor_backend", ""))
    return str(backend) == "ray"


def _gpus(fleet: FleetConfig) -> float:
    if fleet.num_gpus_per_instance is not None:
        return float(fleet.num_gpus_per_instance)
    return 0.0 if _ray_backend(fleet) else float(fleet.tensor_parallel_size * fleet.pipeline_parallel_size)


def bundle_for(spec: LaunchSpec) -> dict[str, float]:
    """The one placement-group bundle that holds everything the instance's actor needs."""
    bundle = {"CPU": spec.num_cpus, "GPU": spec.num_gpus}
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
