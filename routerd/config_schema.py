"""The frozen configuration tree: every section of routerd's config file as a msgspec Struct, with the
bounds each value must keep. Loading, environment overrides and validation are
:mod:`routerd.config`, which re-exports all of this.
"""

from __future__ import annotations

import socket
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "EXIT_CONFIG", "AdmissionConfig", "AutoscaleConfig", "BatchesConfig", "Config", "Count", "DaemonConfig",
    "FleetConfig", "Fraction", "HealthConfig", "HttpConfig", "Interval", "MaybeCount", "MaybeSeconds",
    "Name", "RayConfig", "RedisConfig", "Replicas", "ResponsesConfig", "RoutingConfig", "Seconds",
    "TenantConfig", "TracingConfig",
]

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
    # Request-path processes sharing the listener (routerd/workers.py); "auto": the cores this process
    # may use. More than 1 needs Redis (the queue, and what the processes share).
    workers: Annotated[int, Meta(ge=1, le=256)] | Literal["auto"] = 1
    # A worker whose event loop has not pinged the daemon for this long is killed and started again.
    worker_watchdog_s: Seconds = 10.0


class HttpConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    api_keys: list[str] = []
    admin_api_key: str = ""
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 16 * 1024 * 1024  # 1 KiB .. 1 GiB
    # The body limit of the multipart audio routes (/v1/audio/*), apart from JSON's: OpenAI's is 25 MB.
    max_audio_bytes: Annotated[int, Meta(ge=1024, le=1 << 31)] = 25 * 1024 * 1024
    # Forward a POST to any other path under /v1/ to the fleet its body's `model` names (off: a JSON
    # 404 naming the routes served).
    passthrough: bool = False
    # Client bounds (routerd/ingress/_connections.py); a reload applies them to new connections/requests.
    keepalive_timeout_s: Seconds = 75.0  # an idle kept-alive connection is closed after this
    client_header_timeout_s: Seconds = 10.0  # from connect (or a request's first byte) to full headers
    client_body_timeout_s: Seconds = 60.0  # from full headers to the full body, else 408
    client_write_timeout_s: Seconds = 30.0  # a client that reads nothing this long loses its request
    max_connections: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000  # beyond it: 503 + Retry-After
    # HTTPS on the listener (PEM paths; both or neither), for a routerd with no TLS proxy in front.
    tls_cert: str = ""
    tls_key: str = ""


def cluster_names(stream: str, dead: str) -> tuple[str, str]:
    """The request and dead-letter streams' names on a Redis Cluster (``[redis] cluster``): the
    request stream's namespace (its name up to the last ``:``) in braces, Redis' hash tag, so that
    every key derived from it lands in one slot: ``routerd:requests`` → ``{routerd}:requests``,
    ``routerd:dead`` → ``{routerd}:dead``; a dead-letter stream outside the namespace goes under it
    (``dead-letters`` → ``{routerd}:dead-letters``). Names already tagged so are kept."""
    ns = stream.rsplit(":", 1)[0] if ":" in stream else stream
    if ns.startswith("{") and ns.endswith("}"):
        return stream, dead if dead.startswith(ns) else f"{ns}:{dead}"
    tag = "{" + ns + "}"
    if dead == ns or dead.startswith(f"{ns}:"):
        dead = tag + dead[len(ns):]
    elif not dead.startswith(tag):
        dead = f"{tag}:{dead}"
    return tag + stream[len(ns):], dead


class RedisConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str = "redis://127.0.0.1:6379/0"
    # An ACL user (``routerd redis-acl`` prints its rules); "" = the URL's, else Redis' ``default``.
    username: str = ""
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
    # TLS (``rediss://``): the CA that signed the server's certificate ("" = the system's), and a client
    # certificate and its key (PEM) for a server with ``tls-auth-clients yes`` (certfile may hold both).
    ssl_ca_certs: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    # A Redis Cluster: every key under the hash tag of the request stream's namespace (``routerd:requests``
    # → ``{routerd}:requests``, ``{routerd}:done:<id>``…), so all live in one slot, and every client talks
    # to that slot's master, found again when the slot moves (routerd/redis_cluster.py).
    cluster: bool = False
    # Redis Sentinel (routerd/redis_conn.py): the master of ``service_name`` is asked of these sentinels
    # ("host:port") and every client follows it through a failover; ``url`` then names no host, only the
    # scheme and database ("redis:///0", "rediss:///0"; the default URL counts as none).
    sentinels: list[str] = []
    service_name: str = ""
    # The sentinels' own ACL user and password (``requirepass``/``user`` in sentinel.conf), if they have one.
    sentinel_username: str = ""
    sentinel_password: str = ""

    @property
    def consumer_name(self) -> str:
        """This process's name on the queue and among several routerd: ``consumer``, else the
        hostname (stable per machine, so a restart reclaims its own jobs and takes its own lease)."""
        return self.consumer or socket.gethostname()


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
    # An idle instance (nothing in flight from routerd, its last scrape saw nothing running or waiting)
    # is scraped at this slower period, at most stale_after_s / 2 so its figures never go stale; at the
    # fast period again once routerd sends it a request (within scrape_interval_s) or a scrape shows
    # work. Not above scrape_interval_s: every instance at the fast period.
    idle_scrape_interval_s: Interval = 1.0
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

    @property
    def idle_scrape_period_s(self) -> float:
        """The period of an idle instance's scrapes: ``idle_scrape_interval_s``, never below the fast
        period nor above half of ``stale_after_s`` (its figures then never go stale)."""
        return max(self.scrape_interval_s, min(self.idle_scrape_interval_s, self.stale_after_s / 2))


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
    # An idle instance (Instance.idle: nothing in flight, nothing running or waiting) is heartbeaten
    # at this slower period, back at heartbeat_interval_s once routerd sends it a request, a scrape
    # fails or a heartbeat is missed. So a hang of an idle engine is seen first by its scrape (out of
    # the fresh routing pool within idle_scrape_interval_s + scrape_timeout_s), and from that failed
    # scrape on it is heartbeaten at the fast period; what only /health shows (vLLM: a dead engine core
    # behind a live server) is seen within this period, or at once when a request is sent there.
    # Not above heartbeat_interval_s: every instance at the fast period.
    idle_heartbeat_interval_s: Interval = 5.0
    heartbeat_timeout_s: Seconds = 3.0
    failure_threshold: Annotated[int, Meta(ge=1, le=1000)] = 3
    progress_timeout_s: Seconds = 10.0
    restart_backoff_initial_s: Seconds = 1.0
    restart_backoff_max_s: Seconds = 60.0
    startup_timeout_s: Seconds = 900.0
    warmup: bool = True


class AutoscaleConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[fleets.autoscale]``: the fleet's replica count floats between the bounds, driven by what routerd
    measures (routerd/fleet/scaling_policy.py says how); ``replicas`` is then only the count a fresh start
    launches."""

    min_replicas: Replicas = 0  # 0: an idle fleet stops its last engine and starts one on demand
    max_replicas: Annotated[int, Meta(ge=1, le=1024)]
    scale_down_delay_s: Seconds = 300.0  # over-provisioned or idle this long before one replica goes
    scale_up_delay_s: MaybeSeconds = 2.0  # a shortfall must last this long before replicas are added
    target_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.7  # requests per instance / max_num_seqs
    target_wait_s: Seconds = 1.0  # expected wait for a slot (before the first token) to keep under
    target_kv_usage: Annotated[float, Meta(gt=0, le=1)] = 0.85  # mean KV-cache use to keep under
    drain_timeout_s: Seconds = 600.0  # a replica being scaled down may finish its requests this long


class AdapterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[fleets.adapters]]``: a LoRA adapter the fleet's engines serve (routerd/routing/adapters.py)."""

    name: Annotated[str, Meta(min_length=1, max_length=256)]  # what clients send as `model`
    path: Annotated[str, Meta(min_length=1, max_length=4096)]  # a directory on every node
    pinned: bool = False  # kept loaded on every instance (counts against max-loras), never evicted


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
    # A static fleet's engines' API key (vLLM --api-key), plain or env:VAR: sent as "Authorization: Bearer"
    # on every engine call. Launched fleets take none here: routerd derives theirs (routerd/trust.py).
    api_key: str = ""
    max_num_seqs: Count = 256  # capacity used to normalise load when the engine does not say
    autoscale: AutoscaleConfig | None = None  # None: a fixed count of ``replicas``
    # Across Ray nodes (routerd/fleet/spread.py): "any" = where Ray finds room; "spread" = one replica
    # per node while nodes without one have room, then doubling up; "strict_spread" = never two on one
    # node (a replica with no such node stays pending, saying so).
    placement: Literal["any", "spread", "strict_spread"] = "any"
    # LoRA adapters served by the fleet (its engine_args need enable-lora; slots: max-loras)
    adapters: list[AdapterConfig] = []
    # How long routerd waits for one adapter load on an engine; past it the load is an error (the request
    # tries another instance, an admin add answers 504) and the engine is asked what it holds
    adapter_load_timeout_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 60.0

    def lora_slots(self) -> int:
        """Adapters one instance holds at once: ``engine_args`` ``max-loras`` (vLLM's default 1); 0
        without ``enable-lora``."""
        args = self.engine_args
        if not args.get("enable-lora", args.get("enable_lora", False)):
            return 0
        n = args.get("max-loras", args.get("max_loras", 1))
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


class TenantConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[tenants]]``: who sends work, what share of a saturated fleet it gets, what it may send.

    Requests whose key maps to no tenant (and keyless ones when no key is configured) belong to
    ``default``; a ``[[tenants]]`` entry named ``default`` sets that tenant's weight and limits.
    """

    name: Name
    api_keys: list[str] = []  # "sk-…" | "sha256:<hex of the key's SHA-256>" | "env:VAR" (routerd/api_keys.py)
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


class ControlConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[control]``: the lease in Redis that lets one routerd at a time control the fleets
    (routerd/peers/lease.py). Replicas on one Redis must agree on it."""

    # How long a controller that stops renewing keeps the lease; it renews every lease_s / 3 and stops
    # controlling lease_s / 10 before the lease can pass to another. 0.3 s .. 1 hour.
    lease_s: Annotated[float, Meta(ge=0.3, le=3_600)] = 5.0
    # The shared secret that seals what routerd processes exchange through Redis and from which the
    # launched engines' API key is derived (routerd/trust.py): plain or "env:VAR", at least 16 characters.
    # "" → generated once into <state_dir>/secret (fine for one host; replicas on several hosts need one).
    secret: str = ""


class BatchesConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[batches]``: the OpenAI Batch API (``/v1/files``, ``/v1/batches``; routerd/batches/), with Redis."""

    enabled: bool = True
    max_file_bytes: Annotated[int, Meta(ge=1024, le=1 << 40)] = 200 * 1000 * 1000  # OpenAI's 200 MB
    # Every file a tenant has (uploads and batch outputs) counts; an upload that would pass it is refused.
    tenant_quota_bytes: Annotated[int, Meta(ge=1024, le=1 << 44)] = 10 * 1000 * 1000 * 1000
    max_lines: Annotated[int, Meta(ge=1, le=10_000_000)] = 50_000  # requests in one batch (OpenAI's)
    lines_in_flight: Annotated[int, Meta(ge=1, le=100_000)] = 512  # queue jobs of one batch at once
    # Its lines' queue priority: below interactive requests' 0, so they keep their share while it runs.
    priority: Annotated[int, Meta(ge=-1_000_000_000, le=1_000_000_000)] = -10
    # How long OpenAI's one completion window ("24h") lasts here; lines not done by then end expired.
    window_s: Annotated[int, Meta(ge=1, le=7 * 86_400)] = 86_400
    lease_s: Annotated[float, Meta(ge=0.3, le=3_600)] = 10.0  # a dead runner's batches move after this
    poll_s: Interval = 1.0  # how often a routerd looks for batches nobody runs


class ResponsesConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[responses]``: the Responses-API records and conversations routerd keeps (routerd/conversations/),
    in Redis when routerd has one, else in this process's memory."""

    # How long a stored response is kept after its last use (a chain continued keeps its turns), and a
    # conversation after its last change: 7 days. OpenAI keeps responses 30 days, but routerd keeps them
    # in Redis' memory; agents continue a chain within minutes or hours, and a week covers a weekend.
    ttl_s: Annotated[float, Meta(ge=60, le=365 * 86_400)] = 7 * 86_400.0
    # Records (responses) and conversations each tenant may have; beyond it the least recently used go.
    max_per_tenant: Annotated[int, Meta(ge=1, le=10_000_000)] = 10_000
    max_conversation_items: Count = 10_000  # items one conversation holds (OpenAI adds 20 per call)


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
    control: ControlConfig = ControlConfig()
    batches: BatchesConfig = BatchesConfig()
    responses: ResponsesConfig = ResponsesConfig()

    def fleet(self, name: str) -> FleetConfig | None:
        return next((f for f in self.fleets if f.name == name), None)

    def fleet_for_model(self, model: str) -> FleetConfig | None:
        return next((f for f in self.fleets if f.model == model), None)

    def fleet_for_adapter(self, adapter: str) -> FleetConfig | None:
        """The fleet that declares LoRA adapter ``adapter`` (``[[fleets.adapters]]``)."""
        return next((f for f in self.fleets if any(a.name == adapter for a in f.adapters)), None)
