"""The frozen configuration tree, its TOML loader, env overrides and validation.

Everything routerd reads from its config file lives here as frozen msgspec Structs. Nobody mutates a
config: SIGHUP loads a new tree and the daemon swaps it in, so a component holding the old one keeps
a consistent view. Validation errors carry the key path (``$.fleets[1].replicas``) so an operator can
fix a file without reading code.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from . import redact

# Every number has both bounds, so that whatever passes is a value the code can use: a TOML `inf`, a
# 1e-300 s period (a spinning loop, an overflowing floor()) or an int past 2**64 (msgpack, Redis) would
# pass a bare `> 0` and fail later, in a request or a loop — or end the daemon (issue 18).
Fraction = Annotated[float, Meta(ge=0, le=1)]
Seconds = Annotated[float, Meta(ge=0.001, le=86_400)]  # a timeout or delay: 1 ms .. 1 day
MaybeSeconds = Annotated[float, Meta(ge=0, le=86_400)]  # the same, where 0 means "none"
Interval = Annotated[float, Meta(ge=0.01, le=3_600)]  # a loop's period: 10 ms .. 1 hour
Count = Annotated[int, Meta(ge=1, le=1_000_000)]  # a bound on requests, attempts, slots, ...
MaybeCount = Annotated[int, Meta(ge=0, le=1_000_000)]  # the same, where 0 means "none"
Replicas = Annotated[int, Meta(ge=0, le=1024)]
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]

EXIT_CONFIG = 78  # EX_CONFIG from sysexits.h; systemd's RestartPreventExitStatus=78 keys on it.


class DaemonConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Process-wide settings: where state lives, how long a drain may take."""

    state_dir: str = ".routerd"
    drain_timeout_s: Seconds = 30.0
    stop_engines_on_exit: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    file_sd_path: str = ""  # "" → <state_dir>/file_sd/engines.json


class HttpConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    api_keys: list[str] = []
    admin_api_key: str = ""
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 16 * 1024 * 1024  # 1 KiB .. 1 GiB
    # Client bounds (routerd/ingress/_connections.py); a reload applies them to new connections/requests.
    keepalive_timeout_s: Seconds = 75.0  # an idle kept-alive connection is closed after this
    client_header_timeout_s: Seconds = 10.0  # from connect (or a request's first byte) to full headers
    client_body_timeout_s: Seconds = 60.0  # from full headers to the full body, else 408
    client_write_timeout_s: Seconds = 30.0  # a client that reads nothing this long loses its request
    max_connections: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000  # beyond it: 503 + Retry-After


class RedisConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str = "redis://127.0.0.1:6379/0"
    password: str = ""
    stream: str = "routerd:requests"
    group: str = "routerd"
    dead_stream: str = "routerd:dead"
    consumer: str = ""  # "" → "<hostname>" (stable per machine, so a restart reclaims its own jobs)
    enabled: bool = True
    read_batch: Annotated[int, Meta(ge=1, le=10_000)] = 64
    block_ms: Annotated[int, Meta(ge=1, le=60_000)] = 1000
    reclaim_idle_ms: Annotated[int, Meta(ge=100, le=86_400_000)] = 30_000  # 0.1 s .. 1 day
    reclaim_interval_s: Interval = 5.0
    max_deliveries: Annotated[int, Meta(ge=1, le=1000)] = 5
    result_ttl_s: Annotated[int, Meta(ge=1, le=31_622_400)] = 86_400  # up to 366 days
    # per-day usage counters (routerd usage) expire after this
    usage_retention_days: Annotated[int, Meta(ge=1, le=36_600)] = 400
    # With [[tenants]]: jobs read beyond what the fleets run, so that fair share sees every tenant's
    # waiting work in the one stream (~2 KB of memory each while they wait).
    read_ahead_jobs: MaybeCount = 1000
    reply_maxlen: Annotated[int, Meta(ge=1, le=1_000_000_000)] = 10_000
    op_timeout_s: Seconds = 5.0
    ssl_ca_certs: str = ""


class RayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    address: str = ""
    namespace: str = "routerd"
    num_cpus: Annotated[int, Meta(ge=0, le=100_000)] = 0  # local head only; 0 → the machine's cores
    num_gpus: Annotated[int, Meta(ge=0, le=100_000)] = 0  # local head only; declared GPUs (Ray accepts
    # ones that do not exist)
    resources: dict[str, Annotated[float, Meta(ge=0, le=1e9)]] = {}
    connect_timeout_s: Seconds = 30.0
    # Ask the cluster's autoscaler (ray.autoscaler.sdk.request_resources) for what autoscaled fleets want;
    # off when another program on the cluster owns that request (each call replaces the last).
    request_resources: bool = True


class RoutingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str = "cache_aware"
    scrape_interval_s: Interval = 0.2
    scrape_timeout_s: Seconds = 1.0
    stale_after_s: Seconds = 2.0
    max_attempts: Annotated[int, Meta(ge=1, le=100)] = 3
    retry_backoff_ms: Annotated[int, Meta(ge=0, le=60_000)] = 20
    connect_timeout_s: Seconds = 2.0
    first_byte_timeout_s: Seconds = 600.0
    read_timeout_s: Seconds = 600.0
    circuit_failure_threshold: Count = 3
    circuit_cooldown_s: Seconds = 5.0
    # A stream whose engine fails after it started is continued on another instance at most this many
    # times (routerd/resume.py); 0: never — it ends with the terminal error event.
    max_resumes: Annotated[int, Meta(ge=0, le=100)] = 3
    # The request view and prefix index (routerd/routing/request.py, prefix_index.py): a prompt is cut
    # into blocks of about this many tokens (4 bytes each), hashed up to prefix_hash_max_tokens.
    prefix_block_tokens: Annotated[int, Meta(ge=4, le=4096)] = 128
    prefix_hash_max_tokens: Annotated[int, Meta(ge=0, le=1_048_576)] = 32_768  # 0: no prefix index
    prefix_index_max_blocks: Annotated[int, Meta(ge=1, le=100_000_000)] = 1_000_000  # all instances
    sessions_max: Annotated[int, Meta(ge=1, le=100_000_000)] = 100_000  # sessions remembered (LRU)
    # cache_aware: an instance draws requests by what it holds (prefix, session) only while its load
    # stays within this factor of the fleet's mean load (plus one request) and nothing waits there.
    affinity_load_factor: Annotated[float, Meta(ge=1.0, le=100.0)] = 1.5


class AdmissionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-fleet bounds for the one scheduler that serves both ways in."""

    max_inflight_per_instance: Count = 256
    max_queued: MaybeCount = 1024
    waiting_room_s: MaybeSeconds = 5.0
    aging_s: Seconds = 10.0
    # Requests routerd lets wait inside each engine beyond its capacity (max-num-seqs): a fleet admits
    # Σ over ready instances of min(max_inflight_per_instance, capacity + this). Unset: 0 when
    # [[tenants]] are configured (fair share and priorities are decided here, not in the engine's FIFO
    # queue), else no bound beyond max_inflight_per_instance.
    engine_queue_per_instance: MaybeCount | None = None
    # With [[tenants]]: a tenant below its share waiting on a full fleet takes a slot back from a
    # non-streamed queue job of the tenant furthest above its share (aborted, run again later).
    preempt_queue_jobs: bool = True


class HealthConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    heartbeat_interval_s: Interval = 0.5
    heartbeat_timeout_s: Seconds = 3.0
    failure_threshold: Annotated[int, Meta(ge=1, le=1000)] = 3
    progress_timeout_s: Seconds = 10.0
    restart_backoff_initial_s: Seconds = 1.0
    restart_backoff_max_s: Seconds = 60.0
    startup_timeout_s: Seconds = 900.0
    warmup: bool = True


class AutoscaleConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[fleets.autoscale]``: the fleet's replica count floats between the bounds, driven by what routerd
    measures (routerd/fleet/autoscale.py says how); ``replicas`` is then only the count a fresh start
    launches."""

    min_replicas: Replicas = 0  # 0: an idle fleet stops its last engine and starts one on demand
    max_replicas: Annotated[int, Meta(ge=1, le=1024)]
    scale_down_delay_s: Seconds = 300.0  # over-provisioned or idle this long before one replica goes
    scale_up_delay_s: MaybeSeconds = 2.0  # a shortfall must last this long before replicas are added
    target_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.7  # requests per instance / max_num_seqs
    target_wait_s: Seconds = 1.0  # expected wait for a slot (before the first token) to keep under
    target_kv_usage: Annotated[float, Meta(gt=0, le=1)] = 0.85  # mean KV-cache use to keep under
    drain_timeout_s: Seconds = 600.0  # a replica being scaled down may finish its requests this long


class FleetConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Name
    model: Annotated[str, Meta(min_length=1)]
    engine: str = "sim"  # "vllm" | "sim" | "static" | a launcher plugin's name
    replicas: Replicas = 1
    tensor_parallel_size: Annotated[int, Meta(ge=1, le=1024)] = 1
    pipeline_parallel_size: Annotated[int, Meta(ge=1, le=1024)] = 1
    num_cpus_per_instance: Annotated[float, Meta(ge=0, le=100_000)] = 1.0
    # None → tensor × pipeline parallel size
    num_gpus_per_instance: Annotated[int, Meta(ge=0, le=100_000)] | None = None
    engine_args: dict[str, Any] = {}
    env: dict[str, str] = {}
    urls: list[str] = []
    max_num_seqs: Count = 256  # capacity used to normalise load when the engine does not say
    autoscale: AutoscaleConfig | None = None  # None: a fixed count of ``replicas``
    # Across Ray nodes (routerd/fleet/spread.py): "any" = where Ray finds room; "spread" = one replica
    # per node while nodes without one have room, then doubling up; "strict_spread" = never two on one
    # node (a replica with no such node stays pending, saying so).
    placement: Literal["any", "spread", "strict_spread"] = "any"


class TenantConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[tenants]]``: who sends work, what share of a saturated fleet it gets, what it may send.

    Requests whose key maps to no tenant (and keyless ones when no key is configured) belong to
    ``default``; a ``[[tenants]]`` entry named ``default`` sets that tenant's weight and limits.
    """

    name: Name
    api_keys: list[str] = []  # "sk-…" | "sha256:<hex of the key's SHA-256>" | "env:VAR" (routerd/apikeys.py)
    weight: Annotated[float, Meta(gt=0, le=1_000_000)] = 1.0  # share of a saturated fleet's slots
    # 0 = no limit; shared by every routerd on the same Redis. The bounds keep a bucket's arithmetic in
    # the integers a double holds exactly (Redis' Lua) and in msgpack's.
    requests_per_minute: Annotated[int, Meta(ge=0, le=1_000_000_000)] = 0
    tokens_per_minute: Annotated[int, Meta(ge=0, le=1_000_000_000_000)] = 0  # prompt + completion; 0 = none
    max_concurrent: MaybeCount = 0  # requests in flight at once (this routerd, all fleets); 0 = no limit
    fleets: list[Name] = []  # the fleets (by name) it may use; empty = all
    # a queue job's `priority` is lowered to this; None = no ceiling
    max_priority: Annotated[int, Meta(ge=-1_000_000_000, le=1_000_000_000)] | None = None


class TracingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[tracing]``: OpenTelemetry spans over OTLP/HTTP (:mod:`routerd.tracing`); off by default.

    A key left at its default gives way to the standard ``OTEL_*`` variable for it (README, "Tracing").
    """

    endpoint: str = ""  # OTLP/HTTP base URL (…:4318) or its /v1/traces; "" = off unless OTEL_* names one
    protocol: Literal["http/protobuf"] = "http/protobuf"
    sample_ratio: Fraction = 1.0  # of traces routerd starts; a client's sampled flag is followed
    service_name: Annotated[str, Meta(min_length=1)] = "routerd"
    max_queue_spans: Annotated[int, Meta(ge=1, le=1_000_000)] = 2048  # beyond it spans are dropped, counted
    export_timeout_s: Seconds = 10.0  # one export to the collector, retries included
    shutdown_timeout_s: Seconds = 5.0  # at stop: what is queued gets this long to leave


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    daemon: DaemonConfig = DaemonConfig()
    http: HttpConfig = HttpConfig()
    redis: RedisConfig = RedisConfig()
    ray: RayConfig = RayConfig()
    routing: RoutingConfig = RoutingConfig()
    admission: AdmissionConfig = AdmissionConfig()
    health: HealthConfig = HealthConfig()
    fleets: list[FleetConfig] = []
    tenants: list[TenantConfig] = []
    tracing: TracingConfig = TracingConfig()

    def fleet(self, name: str) -> FleetConfig | None:
        return next((f for f in self.fleets if f.name == name), None)

    def fleet_for_model(self, model: str) -> FleetConfig | None:
        return next((f for f in self.fleets if f.model == model), None)


class ConfigError(Exception):
    """An invalid config: ``problems`` lists every one, each starting with its key path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


_ENV_PREFIX = "ROUTERD_"
# [[arrays of tables]], not sections: each entry converted as its struct
_ARRAYS: dict[str, type[msgspec.Struct]] = {"fleets": FleetConfig, "tenants": TenantConfig}


def _env_overrides(raw: dict[str, Any], environ: Mapping[str, str]) -> list[str]:
    """Apply ``ROUTERD_<SECTION>_<KEY>`` variables onto the raw TOML dict; return problems."""
    problems: list[str] = []
    sections = {f: getattr(Config(), f) for f in Config.__struct_fields__ if f not in _ARRAYS}
    for var, value in environ.items():
        if not var.startswith(_ENV_PREFIX):
            continue
        rest = var[len(_ENV_PREFIX):].lower()
        section = next((s for s in sections if rest.startswith(s + "_")), None)
        if section is None:
            continue
        key = rest[len(section) + 1:]
        if key not in type(sections[section]).__struct_fields__:
            problems.append(f"${var}: no key {key!r} in section [{section}]")
            continue
        raw.setdefault(section, {})[key] = _env_value(value, getattr(sections[section], key))
    return problems


def _env_value(value: str, default: Any) -> Any:
    """Coerce an env string by the type of the default; lists are comma-separated."""
    if isinstance(default, bool):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    if isinstance(default, list):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(default, int):
        try:
            return int(value)
        except ValueError:
            return value
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            return value
    return value


_PATH_RE = re.compile(r"at `(\$[^`]*)`")
_HOST_PORT_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):\d{1,5}")


def _fleet_problems(fleets: list[tuple[int, FleetConfig]]) -> list[str]:
    """Cross-field checks on the fleets that converted (so they run even when others did not)."""
    problems: list[str] = []
    seen_names: dict[str, int] = {}
    seen_models: dict[str, int] = {}
    for i, f in fleets:
        where = f"$.fleets[{i}]"
        if f.name in seen_names:
            problems.append(f"{where}.name: duplicate fleet name {f.name!r} "
                            f"(also $.fleets[{seen_names[f.name]}])")
        seen_names.setdefault(f.name, i)
        if f.model in seen_models:
            problems.append(f"{where}.model: model {f.model!r} is served by "
                            f"$.fleets[{seen_models[f.model]}] already")
        seen_models.setdefault(f.model, i)
        if f.engine == "static":
            if not f.urls:
                problems.append(f"{where}.urls: a static fleet needs at least one URL")
            for j, u in enumerate(f.urls):
                if not re.match(r"^https?://[^/\s]+", u):
                    problems.append(f"{where}.urls[{j}]: expected an http(s) URL, got {redact.url(u)!r}")
        elif f.urls:
            problems.append(f"{where}.urls: only static fleets take urls (engine = {f.engine!r})")
        if f.engine == "static" and f.placement != "any":
            problems.append(f"{where}.placement: a static fleet's instances are its urls; routerd does "
                            "not place them")
        a = f.autoscale
        if a is not None and f.engine == "static":
            problems.append(f"{where}.autoscale: a static fleet's instances are its urls; it cannot scale")
        if a is not None and a.min_replicas > a.max_replicas:
            problems.append(f"{where}.autoscale.max_replicas: must be >= min_replicas ({a.min_replicas})")
        problems += _capacity_problems(where, f.engine_args)
        problems += _kv_event_problems(where, f)
        if "disable-log-stats" in f.engine_args or "disable_log_stats" in f.engine_args:
            problems.append(f"{where}.engine_args.disable-log-stats: routerd routes on vllm: "
                            "metrics; this flag turns them off")
    return problems


def _kv_event_problems(where: str, f: FleetConfig) -> list[str]:
    """The engine args routerd itself reads for KV-event routing (routerd/routing/engine_events.py)."""
    args, at = f.engine_args, f"{where}.engine_args"
    problems = []
    on = args.get("kv-events", args.get("kv_events"))
    if on is not None and not isinstance(on, bool):
        problems.append(f"{at}.kv-events: expected true or false, got {on!r}")
    size = args.get("block-size", args.get("block_size"))
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 4096):
        problems.append(f"{at}.block-size: expected an integer from 1 to 4096, got {size!r}")
    if f.engine != "static":
        return problems
    if on is True and not isinstance(args.get("tokenizer"), str):
        problems.append(f"{at}.tokenizer: a static fleet routed by its engines' KV events needs the "
                        "model directory whose tokenizer they use (or \"sim\")")
    seed = args.get("hash-seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | str)):
        problems.append(f"{at}.hash-seed: expected the engines' PYTHONHASHSEED, got {seed!r}")
    sources = args.get("kv-event-sources")
    if sources is None:
        return problems
    if not isinstance(sources, list) or len(sources) > len(f.urls):
        return [*problems, f"{at}.kv-event-sources: expected a list of at most one table per URL"]
    for j, src in enumerate(sources):
        if not _kv_source_ok(src):
            problems.append(f"{at}.kv-event-sources[{j}]: expected {{endpoint = \"tcp://host:port\", "
                            "replay_endpoint = \"tcp://host:port\", topic = \"\"}}")
    return problems


def _kv_source_ok(src: Any) -> bool:
    return (isinstance(src, dict) and isinstance(src.get("endpoint"), str)
            and src["endpoint"].startswith(("tcp://", "ipc://"))
            and isinstance(src.get("replay_endpoint", ""), str | None)
            and isinstance(src.get("topic", ""), str))


def _capacity_problems(where: str, engine_args: dict[str, Any]) -> list[str]:
    """The one engine arg routerd reads itself (routerd.speed.spec_capacity) has the bounds of
    ``max_num_seqs``."""
    problems = []
    for key in ("max-num-seqs", "max_num_seqs", "--max-num-seqs"):
        v = engine_args.get(key)
        if v is not None and not (isinstance(v, int | str) and not isinstance(v, bool)
                                  and str(v).isdigit() and 1 <= int(v) <= 1_000_000):
            problems.append(f"{where}.engine_args.{key}: routerd reads it as the engine's capacity: "
                            f"expected an integer from 1 to 1000000, got {v!r}")
    return problems


def _semantic_problems(cfg: Config) -> list[str]:
    problems: list[str] = []
    h = cfg.health
    if h.restart_backoff_max_s < h.restart_backoff_initial_s:
        problems.append("$.health.restart_backoff_max_s: must be >= restart_backoff_initial_s")
    if cfg.ray.address and not _HOST_PORT_RE.fullmatch(cfg.ray.address):
        # Caught here (exit 78) rather than as a ValueError deep in start-up that systemd restarts forever.
        problems.append(f"$.ray.address: expected host:port of the Ray GCS (\"\" = routerd's own head), "
                        f"got {redact.url(cfg.ray.address)!r}")
    return problems


def parse(raw: dict[str, Any], environ: Mapping[str, str] | None = None) -> Config:
    """Turn a raw TOML dict (plus env overrides) into a Config, or raise ConfigError with every problem."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    problems = _env_overrides(raw, os.environ if environ is None else environ)
    problems += _structural_problems(raw)
    fleets = raw.get("fleets")
    if isinstance(fleets, list):
        converted: list[tuple[int, FleetConfig]] = []
        for i, f in enumerate(fleets):
            try:
                converted.append((i, msgspec.convert(f, FleetConfig)))
            except msgspec.ValidationError:
                continue
        problems += _fleet_problems(converted)
    if problems:
        raise ConfigError(problems)
    cfg = msgspec.convert(raw, Config)
    problems = _semantic_problems(cfg)
    cfg, key_problems = _resolve_keys(cfg, os.environ if environ is None else environ)
    problems += key_problems + _tenant_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _resolve_keys(cfg: Config, environ: Mapping[str, str]) -> tuple[Config, list[str]]:
    """``env:VAR`` API keys replaced by their values (read once, at load); every key form checked."""
    from .apikeys import KeyFormError, key_digest, resolve_env

    problems: list[str] = []

    def resolved(keys: list[str], where: str) -> list[str]:
        out = []
        for i, spec in enumerate(keys):
            try:
                key = resolve_env(spec, environ)
                key_digest(key)
            except KeyFormError as e:
                problems.append(f"{where}[{i}]: {e}")
                continue
            out.append(key)
        return out

    http = msgspec.structs.replace(cfg.http, api_keys=resolved(cfg.http.api_keys, "$.http.api_keys"))
    tenants = [msgspec.structs.replace(t, api_keys=resolved(t.api_keys, f"$.tenants[{i}].api_keys"))
               for i, t in enumerate(cfg.tenants)]
    return msgspec.structs.replace(cfg, http=http, tenants=tenants), problems


def _tenant_problems(cfg: Config) -> list[str]:
    """Tenant names unique, their fleets configured, no key given to two tenants."""
    from .apikeys import KeyFormError, key_digest

    problems: list[str] = []
    names: dict[str, int] = {}
    owners: dict[bytes, int] = {}
    fleets = {f.name for f in cfg.fleets}
    for i, t in enumerate(cfg.tenants):
        where = f"$.tenants[{i}]"
        if t.name in names:
            problems.append(f"{where}.name: duplicate tenant name {t.name!r} "
                            f"(also $.tenants[{names[t.name]}])")
        names.setdefault(t.name, i)
        problems += [f"{where}.fleets: no fleet named {f!r} (fleets: {', '.join(sorted(fleets)) or 'none'})"
                     for f in t.fleets if f not in fleets]
        for j, key in enumerate(t.api_keys):
            try:
                d = key_digest(key)
            except KeyFormError:
                continue  # reported by _resolve_keys
            if owners.setdefault(d, i) != i:
                problems.append(f"{where}.api_keys[{j}]: the same key is given to $.tenants[{owners[d]}]")
    return problems


def _structural_problems(raw: dict[str, Any]) -> list[str]:
    """Convert section by section (and fleet by fleet) so that every bad part is reported, not the first."""
    problems: list[str] = []
    for key, value in raw.items():
        if key in _ARRAYS:
            if not isinstance(value, list):
                problems.append(f"$.{key}: expected an array of tables ([[{key}]])")
                continue
            for i, entry in enumerate(value):
                problems += _convert_problems(entry, _ARRAYS[key], f"$.{key}[{i}]")
        elif key in Config.__struct_fields__:
            problems += _convert_problems(value, type(getattr(Config(), key)), f"$.{key}")
        else:
            problems.append(f"$.{key}: unknown section (known: {', '.join(Config.__struct_fields__)})")
    return problems


def _convert_problems(value: Any, typ: type[Any], prefix: str) -> list[str]:
    """Every error msgspec finds in one struct; unknown keys are collected first, then a type error."""
    if not isinstance(value, dict):
        return [f"{prefix}: expected a table"]
    problems = [
        f"{prefix}.{k}: unknown key (known: {', '.join(typ.__struct_fields__)})"
        for k in value
        if k not in typ.__struct_fields__
    ]
    known = {k: v for k, v in value.items() if k in typ.__struct_fields__}
    # msgspec stops at the first error; drop each offending key and retry so all are reported.
    for _ in range(len(known) + 1):
        try:
            msgspec.convert(known, typ)
            break
        except msgspec.ValidationError as e:
            msg = str(e)
            m = _PATH_RE.search(msg)
            path = m.group(1) if m else "$"
            reason = _PATH_RE.sub("", msg).strip().rstrip("-").strip()
            problems.append(f"{prefix}{path[1:]}: {reason}")
            first = path[2:].split(".")[0].split("[")[0] if path.startswith("$.") else ""
            if first in known:
                del known[first]
            else:
                break
    return problems


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Read a TOML file into a Config. Raises ConfigError (with key paths) on any problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"$: cannot read {path}: {e.strerror}"]) from e
    except UnicodeDecodeError as e:  # a ValueError: uncaught, it would end the daemon on SIGHUP
        raise ConfigError([f"$: {path} is not UTF-8 text: {e.reason} at byte {e.start}"]) from e
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"$: not valid TOML: {e}"]) from e
    return parse(raw, environ)


def state_dir(cfg: Config) -> Path:
    return Path(cfg.daemon.state_dir).expanduser().resolve()


def secret_values(cfg: Config) -> list[str]:
    """Every secret value ``cfg`` holds, for :meth:`routerd.redact.Redactor.learn`. Here, beside the
    schema, so a new secret key is listed where it is declared (and the redactor needs no config)."""
    found = [*cfg.http.api_keys, cfg.http.admin_api_key, cfg.redis.password,
             _userinfo_password(cfg.redis.url) or ""]
    found += [k for t in cfg.tenants for k in t.api_keys]  # env: forms already resolved by the loader
    for fleet in cfg.fleets:
        found += [_userinfo_password(u) or "" for u in fleet.urls]
        found += [v for k, v in fleet.env.items() if redact.secret_name(k)]
        found += [str(v) for k, v in fleet.engine_args.items() if redact.secret_name(k)]
    return [s for s in found if s]


def _userinfo_password(value: str) -> str | None:
    try:
        return urlsplit(value).password
    except ValueError:
        return None
