"""Learned capacity and speed where they meet fleets: the launch spec's capacity, a restart forgetting
what the old engine showed, and a static fleet of simulated engines learning under load and showing it
on ``/admin/fleets``, ``/metrics`` and ``routerd status``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from routerd import config
from routerd.assembly import running
from routerd.config import Config
from routerd.registry import Instance, LoadSnapshot, Registry
from routerd.status import render
from routerd.vllm_wire import metrics_text
from tests.fixtures.sim import SimProcessFactory
from tests.test_fleet_supervise import FakeOps, manager, until

pytestmark = pytest.mark.timeout(60)


class RestartingOps(FakeOps):
    """Each launch or restart brings up a new engine generation, as the engine actor does."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def _info(self) -> dict[str, Any]:
        self.generation += 1
        return {**super()._info(), "generation": self.generation}


async def test_a_launched_instance_takes_its_capacity_from_the_spec_and_a_restart_forgets_the_rest(
        tmp_path: Path) -> None:
    cfg = config.parse({
        "daemon": {"state_dir": str(tmp_path)}, "redis": {"enabled": False},
        "health": {"restart_backoff_initial_s": 0.01},
        "fleets": [{"name": "f", "model": "m", "engine": "sim", "engine_args": {"max-num-seqs": 12}}],
    }, environ={})
    async with aiohttp.ClientSession() as session:
        fm, _, registry = manager(cfg, session)
        ops = fm.ops = RestartingOps()  # type: ignore[assignment]  # a fake of EngineOps' interface
        try:
            ops.ready.set()
            await fm.set_replicas("f", 1)
            await until(lambda: registry.ready_count("f") == 1, "ready")
            old = registry.instances("f")[0]
            assert old.capacity_source() == (12, "launch")  # not the config's 256
            for i in range(4):  # what the first engine showed
                old.learned.observe(LoadSnapshot(scraped_at=float(i), running=12, waiting=3,
                                                 generation_tokens=10.0 * i, running_seconds_sum=2.0 * i,
                                                 running_seconds_count=1.0 * i))
            assert old.learned.running_s == pytest.approx(2.0)
            await fm.restart_instance("f:0")
            await until(lambda: registry.get("f:0") is not old and registry.ready_count("f") == 1,
                        "the new generation ready")
            new = registry.get("f:0")
            assert new is not None
            assert new.generation == old.generation + 1
            assert new.learned is not old.learned
            assert (new.learned.running_s, new.learned.capacity) == (None, None)
            assert new.capacity_source() == (12, "launch")
        finally:
            await fm.shutdown(stop_engines=False)


# ---- end to end -------------------------------------------------------------------------------
SLOW = {"max_num_seqs": 2, "itl_ms": 40.0, "prefill_ms_per_token": 0.5}
FAST = {"max_num_seqs": 6, "itl_ms": 10.0, "prefill_ms_per_token": 0.1}
SHARED = " ".join(f"system{i}" for i in range(32))  # two full 16-token blocks every prompt shares
MAX_TOKENS = 60


def static_fleet(urls: list[str]) -> Config:
    """One static fleet over ``urls`` that states no capacity."""
    return msgspec.convert({
        "http": {"host": "127.0.0.1", "port": 0}, "redis": {"enabled": False},
        "routing": {"policy": "least_load", "scrape_interval_s": 0.05, "scrape_timeout_s": 0.5,
                    "stale_after_s": 1.0},
        "fleets": [{"name": "f", "model": "m", "engine": "static", "urls": urls}],
    }, Config)


async def closed_loop(session: aiohttp.ClientSession, url: str, worker: int, stop: asyncio.Event) -> int:
    n = 0
    while not stop.is_set():
        prompt = f"{SHARED} " + " ".join(f"w{worker}n{n}x{k}" for k in range(18))  # 50 tokens
        async with asyncio.timeout(30):
            async with session.post(url + "/v1/completions", json={
                    "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}) as r:
                assert r.status == 200, await r.text()
                await r.read()
        n += 1
    return n


def metric(page: str, name: str, **labels: str) -> float:
    for line in page.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


def sample(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + "{"))


def learned_enough(inst: Instance) -> bool:
    lr = inst.learned
    return (lr.capacity is not None and lr.decode_tokens_per_s is not None
            and lr.prefill_tokens_per_s is not None and lr.running_s is not None)


async def test_a_static_fleet_learns_each_engines_capacity_and_speed_under_load(
        sim_process: SimProcessFactory) -> None:
    # engines in processes of their own: in routerd's event loop, their steps would stretch with its work
    slow = await sim_process(ttft_ms=0.0, batch_factor=0.0, **SLOW)
    fast = await sim_process(ttft_ms=0.0, batch_factor=0.0, **FAST)
    registry = Registry()
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as session:
        dp = await stack.enter_async_context(running(static_fleet([slow.url, fast.url]), registry))
        url = dp.url
        await until(lambda: registry.ready_count("f") == 2, "both engines in rotation", timeout=10)
        insts = {i.url: i for i in registry.instances("f")}
        s_inst, f_inst = insts[slow.url], insts[fast.url]
        assert s_inst.capacity_source() == (256, "config")  # the prior: the fleet states nothing

        stop = asyncio.Event()
        workers = [asyncio.create_task(closed_loop(session, url, w, stop)) for w in range(20)]
        try:
            deadline = time.monotonic() + 30
            # 20 requests in flight over 2 + 6 slots: both engines saturate and show it
            while not (learned_enough(s_inst) and learned_enough(f_inst)
                       and s_inst.learned.running_s and f_inst.learned.prefix_hit_ratio is not None):
                assert time.monotonic() < deadline, (s_inst.status(0.0), f_inst.status(0.0))
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)  # a couple of seconds more evidence
            status = await (await session.get(url + "/admin/fleets")).json()
            page = await (await session.get(url + "/metrics")).text()
            engine_pages = {eng.url: await (await session.get(eng.url + "/metrics")).text()
                            for eng in (slow, fast)}
        finally:
            stop.set()
            done = await asyncio.gather(*workers)
        assert sum(done) >= 10  # every one answered 200 (closed_loop asserts it)

    rows = {row["url"]: row for row in status["fleets"]["f"]["instances"]}
    for eng, cfg in ((slow, SLOW), (fast, FAST)):
        row = rows[eng.url]
        assert (row["capacity"], row["capacity_source"]) == (cfg["max_num_seqs"], "learned"), row
        # What the engine really did over the run (the learning window is longer than the test): on a
        # busy machine its steps run late, so the configured speeds are only a ceiling.
        engine_page = engine_pages[eng.url]
        engine = metrics_text.parse(engine_page, 0.0)
        itl = sample(engine_page, "vllm:inter_token_latency_seconds_sum") / sample(
            engine_page, "vllm:inter_token_latency_seconds_count")
        # decode: one token per step; learned from whole requests, checked against per-token latency
        assert row["decode_tokens_per_s"] == pytest.approx(1 / itl, rel=0.15), row
        # never faster than its itl_ms allows; how much slower is the machine's business (no floor)
        assert row["decode_tokens_per_s"] < 1.1 * 1000 / cfg["itl_ms"], row
        # prefill of the 18 uncached tokens: never faster than prefill_ms_per_token allows (slower when
        # admitted with others, or in a step that also decodes the running ones)
        assert row["prefill_tokens_per_s"] == pytest.approx(
            (engine.prefill_computed_tokens or 0) / engine.prefill_seconds_sum, rel=0.15), row
        assert row["prefill_tokens_per_s"] < 1.1 * 1000 / cfg["prefill_ms_per_token"], row
        assert row["prefix_hit_ratio"] == pytest.approx(
            engine.prefix_cache_hits / engine.prefix_cache_queries, abs=0.05), row
        assert row["prefix_hit_ratio"] > 0.4  # the shared blocks hit
        assert row["expected_wait_s"] >= 0.0
    # told apart (configured 4× apart; a busy machine narrows the gap, so the order, not a ratio)
    assert rows[fast.url]["decode_tokens_per_s"] > rows[slow.url]["decode_tokens_per_s"]
    assert rows[fast.url]["request_running_s"] < rows[slow.url]["request_running_s"]

    lv = {"fleet": "f", "instance": s_inst.id}
    assert metric(page, "routerd_instance_capacity", source="learned", **lv) == 2
    assert metric(page, "routerd_instance_decode_tokens_per_second", **lv) == pytest.approx(
        rows[slow.url]["decode_tokens_per_s"], rel=0.05)
    assert metric(page, "routerd_instance_prefill_tokens_per_second", **lv) > 0
    assert metric(page, "routerd_instance_prefix_cache_hit_ratio", source="engine", **lv) == pytest.approx(
        rows[slow.url]["prefix_hit_ratio"], abs=0.05)
    metric(page, "routerd_instance_expected_wait_seconds", **lv)
    table = render(status)
    assert "2 learned" in table
    assert "6 learned" in table
