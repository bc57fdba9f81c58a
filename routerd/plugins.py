"""Plugin seams: routing policies (sync, pure) and engine launchers (async), found by entry point.

Built-ins live in ``plugins/routerd_builtin`` and register under the same entry-point groups a third
party would use, so there is one loading path. An unknown name fails at start-up listing what is
installed.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from .config import Config

POLICY_GROUP = "routerd.policies"
LAUNCHER_GROUP = "routerd.launchers"


class RequestView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a policy may know about the request being routed (built once per request, read-only).

    ``prompt_tokens`` is the prompt's tokens as the engines count them where routerd can count them —
    a token-id prompt, or a fleet whose engines routerd keys (their tokenizer and chat template:
    ``engine_prompt_tokens`` is then set) — else an estimate: chat messages rendered canonically (role,
    then content, per message) and counted at the fleet's learned tokens per byte
    (:mod:`routerd.routing.request` says how, and how wrong it can be).
    ``block_keys`` are chained hashes of the rendered prompt's full blocks of ``block_tokens`` (about)
    tokens each, hashed up to ``routing.prefix_hash_max_tokens``: key *i* stands for the whole prefix up
    to the end of block *i*, so two prompts share key *i* exactly when they share that prefix.
    """

    fleet: str
    endpoint: str  # the route's path: "/v1/chat/completions", "/v1/embeddings"… (routerd.surface)
    prompt_tokens: int = 0
    prompt_bytes: int = 0  # UTF-8 bytes of the canonical text the estimate counts (0: token ids, exact)
    max_tokens: int | None = None  # max_tokens (or chat's max_completion_tokens) when the body sets it
    block_keys: tuple[int, ...] = ()
    block_tokens: float = 0.0  # estimated tokens per block
    session: str | None = None  # X-Session-Id, else the body's `user`, else a queue job's `session`
    priority: int = 0  # routerd's priority (a queue job's; HTTP: 0); larger is served first
    # The block keys the engines will compute (their tokenizer, their hash;
    # routerd.routing.engine_cache.block_keys)
    # when the fleet has a keyer, over blocks of engine_block_tokens tokens; else empty
    engine_keys: tuple[int, ...] = ()
    engine_block_tokens: int = 0
    # the prompt's tokens by the engines' tokenizer (set with engine_keys); 0: not counted
    engine_prompt_tokens: int = 0
    # the LoRA adapter the request names as its model (routerd.routing.adapters); None: the base model
    adapter: str | None = None

    @property
    def exact_tokens(self) -> bool:
        """Whether ``prompt_tokens`` is the engines' own count (token ids, or their tokenizer's), not an
        estimate from the prompt's bytes."""
        return self.engine_prompt_tokens > 0 or (self.prompt_bytes == 0 and self.prompt_tokens > 0)


class Candidate(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a policy may know about one routable instance (a read-only view built per request).

    ``ttft_s`` is the router's estimate of this request's time to first token there: ``wait_s`` plus
    the prefill of the prompt tokens the instance is not predicted to hold,
    ``(prompt_tokens - cached_tokens) / prefill_tokens_per_s``.
    """

    id: str
    load: float  # normalised: estimated queue / capacity + KV usage (blind to speed)
    inflight: int  # routerd's requests in flight to it (every routerd process sharing one Redis)
    queue: float  # estimated requests the engine holds (scrape + in-flight delta)
    capacity: int  # requests it runs at once (launch spec, engine, learned or config)
    kv_usage: float
    stale: bool  # last scrape older than routing.stale_after_s (or none yet)
    wait_s: float = 0.0  # expected seconds before this request's prefill would start there
    prefill_tokens_per_s: float = 4000.0  # learned (uncached prompt tokens per second of prefill)
    matched_blocks: int = 0  # leading blocks of the request the prefix index says it holds
    cached_tokens: float = 0.0  # those blocks in tokens (at most prompt_tokens - 1)
    ttft_s: float = 0.0  # estimated time to first token: wait_s + uncached prefill
    session: bool = False  # the request's session was last routed here (and the instance is the same)
    # A new request would not start at once there (its slots are full), or it carries well over its
    # share of the fleet's load (routing.affinity_load_factor): what holds it (prefix, session) no
    # longer draws requests to it.
    saturated: bool = False


@runtime_checkable
class RoutingPolicy(Protocol):
    """Choose one of ``candidates`` (never empty) for ``request``. Sync and free of I/O: it runs on
    every request; randomness only from ``rng`` (the router's, seeded in tests)."""

    name: str

    def choose(self, request: RequestView, candidates: Sequence[Candidate],
               rng: random.Random) -> Candidate: ...


@runtime_checkable
class ExplainingPolicy(RoutingPolicy, Protocol):
    """A policy that can also say which of its rules made a choice: ``explain`` returns what ``choose``
    would, with the rule's name (``"session"``, ``"lowest_ttft"``, …), which the decision records and the
    request's log line shows. Optional: a policy with ``choose`` alone is logged as ``policy_choice``."""

    def explain(self, request: RequestView, candidates: Sequence[Candidate],
                rng: random.Random) -> tuple[Candidate, str]: ...


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
    else:
        try:
            load_policy(cfg.routing.policy)
        except PluginNotFound as e:
            problems.append(f"$.routing.policy: {e}")
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


def load_policy(name: str) -> RoutingPolicy:
    """The routing policy ``name``, checked to take ``choose(request, candidates, rng)``: a policy
    written for the older ``choose(candidates, rng)`` fails here, when the config names it, with what
    to change — not on the first request."""
    policy = load(POLICY_GROUP, name)
    try:
        params = inspect.signature(policy.choose).parameters
    except (AttributeError, TypeError, ValueError) as e:
        raise PluginNotFound(f"policy {name!r} has no usable choose(): {e}") from None
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in positional):
        raise PluginNotFound(f"policy {name!r} implements choose(candidates, rng); routerd calls "
                             "choose(request, candidates, rng) (routerd.plugins.RoutingPolicy)")
    return policy  # type: ignore[no-any-return]  # an entry point's object, checked above

