"""The configuration: its TOML loader, env overrides and validation, over the frozen tree of
:mod:`routerd.config_schema` (re-exported here).

Everything routerd reads from its config file is a frozen msgspec Struct. Nobody mutates a
config: SIGHUP loads a new tree and the daemon swaps it in, so a component holding the old one keeps
a consistent view. Validation errors carry the key path (``$.fleets[1].replicas``) so an operator can
fix a file without reading code.
"""

from __future__ import annotations

import os
import re
import ssl
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from . import redact
from .config_schema import (
    EXIT_CONFIG,
    AdapterConfig,
    AdmissionConfig,
    AutoscaleConfig,
    BatchesConfig,
    Config,
    ControlConfig,
    Count,
    DaemonConfig,
    FleetConfig,
    Fraction,
    HealthConfig,
    HttpConfig,
    Interval,
    MaybeCount,
    MaybeSeconds,
    Name,
    RayConfig,
    RedisConfig,
    Replicas,
    ResponsesConfig,
    RoutingConfig,
    Seconds,
    TenantConfig,
    TracingConfig,
    cluster_names,
)

__all__ = [
    "EXIT_CONFIG", "AdapterConfig", "AdmissionConfig", "AutoscaleConfig", "BatchesConfig", "Config",
    "ConfigError",
    "ControlConfig", "Count",
    "DaemonConfig", "FleetConfig", "Fraction", "HealthConfig", "HttpConfig", "Interval", "MaybeCount",
    "MaybeSeconds", "Name", "RayConfig", "RedisConfig", "Replicas", "ResponsesConfig", "RoutingConfig",
    "Seconds", "TenantConfig", "TracingConfig", "load", "parse", "secret_values", "state_dir"
]

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
        problems += _api_key_problems(where, f)
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
        problems += _adapter_problems(where, f)
        if "disable-log-stats" in f.engine_args or "disable_log_stats" in f.engine_args:
            problems.append(f"{where}.engine_args.disable-log-stats: routerd routes on vllm: "
                            "metrics; this flag turns them off")
    problems += _adapter_name_problems(fleets)
    return problems


def _adapter_problems(where: str, f: FleetConfig) -> list[str]:
    """A fleet's adapters need LoRA on its engines, and room for the pinned ones."""
    if not f.adapters:
        return []
    slots = f.lora_slots()
    if slots == 0:
        return [f"{where}.adapters: the fleet's engines serve no LoRA adapter: set engine_args "
                "enable-lora = true (and max-loras, the adapters one instance holds at once)"]
    pinned = [a.name for a in f.adapters if a.pinned]
    if len(pinned) > slots:
        return [f"{where}.adapters: {len(pinned)} adapters are pinned ({', '.join(pinned)}) but an "
                f"instance holds {slots} (engine_args max-loras)"]
    return []


def _adapter_name_problems(fleets: list[tuple[int, FleetConfig]]) -> list[str]:
    """An adapter's name is a model name clients send: unique, and no fleet's model."""
    problems: list[str] = []
    models = {f.model: i for i, f in fleets}
    seen: dict[str, str] = {}
    for i, f in fleets:
        for j, a in enumerate(f.adapters):
            where = f"$.fleets[{i}].adapters[{j}].name"
            if a.name in models:
                problems.append(f"{where}: {a.name!r} is the model of $.fleets[{models[a.name]}]: "
                                "a request naming it could mean either")
            elif a.name in seen:
                problems.append(f"{where}: adapter {a.name!r} is declared already ({seen[a.name]})")
            seen.setdefault(a.name, where)
    return problems


def _api_key_problems(where: str, f: FleetConfig) -> list[str]:
    """Who sets an engine's API key: routerd for the engines it launches (derived from the shared
    secret: a second key from the config would only be one that does not work), the operator for a
    static fleet's — and then not beside URL credentials, as one Authorization header carries one."""
    if f.engine != "static":
        owned = [f"{where}.api_key"] if f.api_key else []
        owned += [f"{where}.engine_args.{k}" for k in f.engine_args if k.replace("_", "-") == "api-key"]
        owned += [f"{where}.env.VLLM_API_KEY"] if "VLLM_API_KEY" in f.env else []
        return [f"{at}: routerd gives the engines it launches their API key (derived from [control] "
                "secret); only a static fleet is given its engines' key" for at in owned]
    if f.api_key and any("@" in u.split("://", 1)[-1].split("/", 1)[0] for u in f.urls):
        return [f"{where}.api_key: the fleet's urls carry user:password (HTTP basic auth); an engine "
                "request has one Authorization header: use one or the other"]
    return []


def _kv_event_problems(where: str, f: FleetConfig) -> list[str]:
    """The engine args routerd itself reads for KV-event routing
    (routerd/routing/engine_cache/subscriptions.py)."""
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
    problems += _tls_problems(cfg.http.tls_cert, cfg.http.tls_key) + _redis_problems(cfg.redis)
    if worker_count(cfg) > 1 and not cfg.redis.enabled:
        problems.append("$.daemon.workers: more than one worker needs Redis ([redis] enabled): the "
                        "workers share the queue and their view of the fleets through it")
    problems += _sentinel_problems(cfg.redis)
    return problems


def _sentinel_problems(r: RedisConfig) -> list[str]:
    """``[redis] sentinels`` and what contradicts it: the master's address comes from the sentinels,
    so the URL names none, and an embedded redis-server has no sentinels."""
    if not r.sentinels:
        extra = [k for k in ("service_name", "sentinel_username", "sentinel_password") if getattr(r, k)]
        return [f"$.redis.{k}: set without [redis] sentinels, which it is for" for k in extra]
    problems = [f"$.redis.sentinels[{i}]: expected \"host:port\" of a Redis Sentinel, got {s!r}"
                for i, s in enumerate(r.sentinels) if not _HOST_PORT_RE.fullmatch(s)]
    if not r.service_name:
        problems.append("$.redis.service_name: the sentinels' name of the master (their `sentinel "
                        "monitor <name> ...`) is needed with [redis] sentinels")
    if r.url == "embedded":
        problems.append("$.redis.url: \"embedded\" runs routerd's own redis-server, which no sentinel "
                        "watches: drop [redis] sentinels, or give the URL as \"redis:///0\"")
    elif r.url != RedisConfig().url:
        parts = urlsplit(r.url)
        if parts.scheme not in ("redis", "rediss") or parts.hostname:
            problems.append(f"$.redis.url: with [redis] sentinels the master's address comes from them; "
                            f"the URL gives only the scheme and database (\"redis:///0\", "
                            f"\"rediss:///0\"), got {redact.url(r.url)!r}")
    return problems


def _tls_problems(cert: str, key: str) -> list[str]:
    """Both files or neither, each readable, the key the certificate's: found by ``check-config``, not
    by the first client."""
    if not cert and not key:
        return []
    if not cert or not key:
        given, missing = ("tls_cert", "tls_key") if cert else ("tls_key", "tls_cert")
        return [f"$.http.{missing}: {given} is set; HTTPS needs both (PEM files), or neither"]
    from ._net import server_tls

    problems = [f"$.http.{name}: cannot read {path}: {e.strerror}" for name, path in
                (("tls_cert", cert), ("tls_key", key)) for e in _unreadable(path)]
    if problems:
        return problems
    try:
        server_tls(cert, key)
    except (ssl.SSLError, OSError) as e:
        return [f"$.http.tls_cert: {cert} with {key}: not a PEM certificate and its private key ({e})"]
    return []


def _redis_problems(r: RedisConfig) -> list[str]:
    """TLS files that are no use (no ``rediss://``) or unreadable, and a cluster where there is none."""
    problems: list[str] = []
    tls = {name: getattr(r, name) for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
           if getattr(r, name)}
    if tls and not r.url.startswith("rediss://"):
        problems.append(f"$.redis.{next(iter(tls))}: TLS settings need a rediss:// redis.url, not "
                        f"{redact.url(r.url)!r}")
    if r.ssl_keyfile and not r.ssl_certfile:
        problems.append("$.redis.ssl_keyfile: a client key needs its certificate (redis.ssl_certfile)")
    problems += [f"$.redis.{name}: cannot read {path}: {e.strerror}" for name, path in tls.items()
                 for e in _unreadable(path)]
    if r.cluster:
        if r.url == "embedded":
            problems.append("$.redis.cluster: the embedded redis-server is not a cluster")
        elif urlsplit(r.url).path.strip("/") not in ("", "0"):
            problems.append("$.redis.cluster: a Redis Cluster has database 0 only, and redis.url names "
                            f"{urlsplit(r.url).path.strip('/')!r}")
    return problems


def _cluster_keys(cfg: Config) -> Config:
    """On a Redis Cluster, the stream names under their namespace's hash tag (``cluster_names``), so
    that every component reading ``redis.stream`` and ``redis.dead_stream`` uses the tagged ones."""
    if not cfg.redis.cluster:
        return cfg
    stream, dead = cluster_names(cfg.redis.stream, cfg.redis.dead_stream)
    return msgspec.structs.replace(cfg, redis=msgspec.structs.replace(
        cfg.redis, stream=stream, dead_stream=dead))


def _unreadable(path: str) -> list[OSError]:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        return [e]
    return []


def worker_count(cfg: Config) -> int:
    """``daemon.workers`` as a number: ``"auto"`` is the cores this process may run on."""
    workers = cfg.daemon.workers
    if workers == "auto":
        return len(os.sched_getaffinity(0))
    return workers


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
    return _cluster_keys(cfg)


def _resolve_keys(cfg: Config, environ: Mapping[str, str]) -> tuple[Config, list[str]]:
    """``env:VAR`` API keys replaced by their values (read once, at load); every key form checked."""
    from .api_keys import KeyFormError, key_digest, resolve_env
    from .trust import MIN_SECRET_CHARS

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
    fleets = list(cfg.fleets)
    for i, f in enumerate(fleets):
        if f.api_key:
            try:
                fleets[i] = msgspec.structs.replace(f, api_key=resolve_env(f.api_key, environ))
            except KeyFormError as e:
                problems.append(f"$.fleets[{i}].api_key: {e}")
                continue
            if not fleets[i].api_key.isprintable() or " " in fleets[i].api_key:
                problems.append(f"$.fleets[{i}].api_key: one token of printable characters, no spaces "
                                "(it is sent as `Authorization: Bearer <key>`)")
    control = cfg.control
    if control.secret:
        try:
            control = msgspec.structs.replace(control, secret=resolve_env(control.secret, environ))
        except KeyFormError as e:
            problems.append(f"$.control.secret: {e}")
        else:
            if len(control.secret) < MIN_SECRET_CHARS:
                problems.append(f"$.control.secret: at least {MIN_SECRET_CHARS} characters "
                                "(e.g. `openssl rand -hex 32`)")
    return msgspec.structs.replace(cfg, http=http, tenants=tenants, fleets=fleets, control=control), problems


def _tenant_problems(cfg: Config) -> list[str]:
    """Tenant names unique, their fleets configured, no key given to two tenants."""
    from .api_keys import KeyFormError, key_digest

    problems: list[str] = []
    names: dict[str, int] = {}
    owners: dict[bytes, int] = {}
    # a tenant may be given a fleet (its model and adapters) or single adapters
    fleets = {f.name for f in cfg.fleets} | {a.name for f in cfg.fleets for a in f.adapters}
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
    return parse(_read(path), environ)


def load_for_tool(path: str | Path) -> Config:
    """A config as the command-line tools read it (``submit``, ``usage``, ``status``, ``redis-acl``):
    the client API keys, which they never use, are left out before it is checked, so a tenant's ``env:``
    key whose variable is set only in the daemon's environment does not stop them. Raises ConfigError."""
    raw = _read(path)
    for table in [raw.get("http"), *(raw.get("tenants") or [])]:
        if isinstance(table, dict):
            table.pop("api_keys", None)
    return parse(raw)


def _read(path: str | Path) -> dict[str, Any]:
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
    return raw


def state_dir(cfg: Config) -> Path:
    return Path(cfg.daemon.state_dir).expanduser().resolve()


def secret_values(cfg: Config) -> list[str]:
    """Every secret value ``cfg`` holds, for :meth:`routerd.redact.Redactor.learn`. Here, beside the
    schema, so a new secret key is listed where it is declared (and the redactor needs no config)."""
    found = [*cfg.http.api_keys, cfg.http.admin_api_key, cfg.redis.password, cfg.redis.sentinel_password,
             _userinfo_password(cfg.redis.url) or "", cfg.control.secret]
    found += [k for t in cfg.tenants for k in t.api_keys]  # env: forms already resolved by the loader
    for fleet in cfg.fleets:
        found += [_userinfo_password(u) or "" for u in fleet.urls]
        found.append(fleet.api_key)
        found += [v for k, v in fleet.env.items() if redact.secret_name(k)]
        found += [str(v) for k, v in fleet.engine_args.items() if redact.secret_name(k)]
    return [s for s in found if s]


def _userinfo_password(value: str) -> str | None:
    try:
        return urlsplit(value).password
    except ValueError:
        return None
