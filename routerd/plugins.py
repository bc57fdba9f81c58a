"""Plugin seams: routing policies (sync, pure) and engine launchers (async), found by entry point.

Built-ins live in ``plugins/routerd_builtin`` and register under the same entry-point groups a third
party would use, so there is one loading path. An unknown name fails at start-up listing what is
installed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from .config import Config

POLICY_GROUP = "routerd.policies"
LAUNCHER_GROUP = "routerd.launchers"


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy may know about one routable instance (a read-only view built per request)."""

    id: str
    load: float  # normalised: estimated queue / capacity + KV usage
    inflight: int  # routerd's own requests in flight to it
    queue: float  # estimated requests the engine holds (scrape + in-flight delta)
    capacity: int
    kv_usage: float
    stale: bool  # last scrape older than routing.stale_after_s (or none yet)


@runtime_checkable
class RoutingPolicy(Protocol):
    """Choose one of ``candidates`` (never empty). Sync and free of I/O: it runs on every request."""

    name: str

    def choose(self, candidates: Sequence[Candidate], rng: random.Random) -> Candidate: ...


class LaunchSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to start one engine; recorded on the actor so adoption can compare specs."""

    fleet: str
    index: int
    model: str  # the name clients send (served-model-name)
    engine: str  # launcher name
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    engine_args: dict[str, Any] = {}
    env: dict[str, str] = {}


class LaunchPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The command a launcher wants run; the engine actor owns the process (groups, no orphans)."""

    argv: list[str]
    env: dict[str, str] = {}
    startup_timeout_s: float = 900.0


@runtime_checkable
class Launcher(Protocol):
    """How to start one engine: returns the command for ``spec`` listening on ``host:port``."""

    name: str

    async def plan(self, spec: LaunchSpec, *, host: str, port: int, workdir: str) -> LaunchPlan: ...


class PluginNotFound(LookupError):
    pass


def available(group: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=group)}


def check(cfg: Config) -> list[str]:
    """Every plugin name ``cfg`` uses that is not installed, each with its key path: the routing policy
    and each launched fleet's launcher (``engine``; ``static`` needs none). ``routerd check-config``,
    ``routerd run`` (exit 78) and a reload (rejected) all ask this, so an unknown name fails before
    anything starts — not later inside an engine's Ray actor."""
    problems = []
    policies = available(POLICY_GROUP)
    if cfg.routing.policy not in policies:
        problems.append(f"$.routing.policy: unknown policy {cfg.routing.policy!r} "
                        f"(installed: {_names(policies)})")
    launchers = available(LAUNCHER_GROUP)
    for i, fleet in enumerate(cfg.fleets):
        if fleet.engine != "static" and fleet.engine not in launchers:
            problems.append(f"$.fleets[{i}].engine: unknown launcher {fleet.engine!r} "
                            f"(installed: {_names(launchers)})")
    return problems


def _names(eps: dict[str, Any]) -> str:
    return ", ".join(sorted(eps)) or "none"


def load(group: str, name: str, **kwargs: Any) -> Any:
    """Instantiate plugin ``name`` of ``group``; the error lists the installed names."""
    eps = available(group)
    if name not in eps:
        raise PluginNotFound(f"no {group} plugin named {name!r}; installed: {_names(eps)}")
    factory = eps[name].load()
    return factory(**kwargs)
