"""What one ``/metrics`` scrape of an engine said: the scraper makes it
(:mod:`routerd.vllm_wire.metrics_text`),
the registry keeps the newest per instance, the health monitor compares two, and :mod:`routerd.speed`
learns from the deltas. A type on the floor so none of them imports another for it.
"""

from __future__ import annotations

import msgspec


class LoadSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What one ``/metrics`` scrape said, reduced to what routing and health need.

    Counters are cumulative as the engine reports them; the health monitor compares two snapshots.
    """

    scraped_at: float  # monotonic seconds
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # fraction 0..1 (vllm:kv_cache_usage_perc, or gpu_cache_usage_perc < 0.12)
    capacity: int | None = None  # max_num_seqs when the engine reveals it
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    preemptions: float = 0.0
    requests_finished: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    # Sums and counts of the finished-request histograms, from which routing learns each instance's
    # speed (routerd.speed): seconds running (inference = prefill + decode), in prefill and
    # in decode; the generated tokens of the same requests; their computed (uncached) prompt tokens,
    # None when the engine does not export vllm:request_prefill_kv_computed_tokens.
    running_seconds_sum: float = 0.0
    running_seconds_count: float = 0.0
    prefill_seconds_sum: float = 0.0
    prefill_seconds_count: float = 0.0
    decode_seconds_sum: float = 0.0
    decode_seconds_count: float = 0.0
    finished_generation_tokens: float = 0.0
    prefill_computed_tokens: float | None = None
    # vllm:lora_requests_info (its newest series): the adapters with requests running and waiting, and
    # max_lora; None without --enable-lora
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int | None = None
