"""The simulated engine's LoRA adapters, over real HTTP and ZMQ, against vLLM 0.32's behaviour.

What a router relies on: the load/unload routes answer as vLLM's (a duplicate load 400, an unknown
unload 404, a missing path 404, no LoRA 500), ``/v1/models`` lists adapters with ``parent``, an
adapter's requests answer under its name with other output than the base, requests beyond
``--max-loras`` distinct adapters wait for a running adapter to finish, ``vllm:lora_requests_info``
says who runs and who waits, and the KV events carry ``lora_name`` with keys that include the adapter.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from routerd.routing.engine_cache.blocks import EngineBlocks
from routerd.routing.engine_cache.subscriber import KvEventSubscriber, ViewHealth
from routerd.sim import expected_text
from routerd.sim.lora import adapter_seed
from routerd.sim_tokens import token_ids
from routerd.vllm_wire import block_hash
from tests.fixtures.ray_cluster import eventually
from tests.fixtures.sim import SimEngineFactory, SimProcessFactory

FAST = {"ttft_ms": 1.0, "itl_ms": 1.0}


def make_adapter(root: Path, name: str, rank: int = 8) -> str:
    """A directory that looks like a PEFT adapter to the sim (its ``adapter_config.json``)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank,
                                                       "target_modules": ["q_proj", "v_proj"]}))
    return str(d)


async def call(s: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with s.request(method, url, json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def test_load_unload_and_models_answer_as_vllm(sim_engine: SimEngineFactory, tmp_path: Path) -> None:
    eng = await sim_engine(model="base", enable_lora=True, max_loras=2, max_lora_rank=8, lora_load_s=0.01,
                           **FAST)
    a = make_adapter(tmp_path, "a")
    big = make_adapter(tmp_path, "big", rank=64)
    load = f"{eng.url}/v1/load_lora_adapter"
    async with aiohttp.ClientSession() as s:
        st, text = await call(s, "POST", load, {"lora_name": "a", "lora_path": a})
        assert (st, text) == (200, "Success: LoRA adapter 'a' added successfully.")
        st, body = await call(s, "POST", load, {"lora_name": "a", "lora_path": a})
        assert st == 400
        assert body["error"]["type"] == "InvalidUserInput"
        assert "has already been loaded" in body["error"]["message"]
        st, body = await call(s, "POST", load, {"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")})
        assert (st, body["error"]["type"]) == (404, "NotFoundError")
        assert body["error"]["message"] == \
            f"Loading lora gone failed: No adapter found for {tmp_path}/nowhere"
        st, body = await call(s, "POST", load, {"lora_name": "big", "lora_path": big})
        assert (st, body["error"]["message"]) == (500, "LoRA rank 64 is greater than max_lora_rank 8.")
        st, body = await call(s, "POST", load, {"lora_name": "base", "lora_path": a})
        assert st == 400
        assert "conflicts with a served base model" in body["error"]["message"]
        st, body = await call(s, "POST", load, {"lora_name": "x"})
        assert (st, body["error"]["message"]) == (400, "Both 'lora_name' and 'lora_path' must be provided.")

        st, body = await call(s, "GET", f"{eng.url}/v1/models")
        cards = {m["id"]: m for m in body["data"]}
        assert set(cards) == {"base", "a"}
        assert (cards["a"]["parent"], cards["a"]["root"], cards["base"]["parent"]) == ("base", a, None)

        st, body = await call(s, "POST", f"{eng.url}/v1/completions",
                              {"model": "a", "prompt": "hello there", "max_tokens": 6})
        assert st == 200
        assert body["model"] == "a"
        text_a = body["choices"][0]["text"]
        assert text_a == expected_text(adapter_seed(0, "a"), "hello there", 6)
        assert text_a != expected_text(0, "hello there", 6)

        st, body = await call(s, "POST", f"{eng.url}/v1/unload_lora_adapter", {"lora_name": "a"})
        assert (st, body) == (200, "Success: LoRA adapter 'a' removed successfully.")
        st, body = await call(s, "POST", f"{eng.url}/v1/unload_lora_adapter", {"lora_name": "a"})
        assert (st, body["error"]) == (404, {"message": "The lora adapter 'a' cannot be found.",
                                             "type": "NotFoundError", "param": None, "code": 404})
        st, body = await call(s, "POST", f"{eng.url}/v1/completions", {"model": "a", "prompt": "hello"})
        assert (st, body["error"]["message"]) == (404, "The model `a` does not exist. Valid aliases: base.")


async def test_an_engine_without_lora_refuses_a_load(sim_engine: SimEngineFactory, tmp_path: Path) -> None:
    eng = await sim_engine(model="base", **FAST)
    async with aiohttp.ClientSession() as s:
        st, body = await call(s, "POST", f"{eng.url}/v1/load_lora_adapter",
                              {"lora_name": "a", "lora_path": make_adapter(tmp_path, "a")})
        assert st == 500
        assert body["error"]["message"] == "LoRA is not enabled. Use --enable-lora to enable LoRA."
        async with s.get(f"{eng.url}/metrics") as r:
            assert "vllm:lora_requests_info" not in await r.text()


def _lora_info(metrics: str) -> dict[str, str]:
    """The newest ``vllm:lora_requests_info`` series' labels (vLLM sets the value to the time)."""
    best: tuple[float, dict[str, str]] = (-1.0, {})
    for line in metrics.splitlines():
        if line.startswith("vllm:lora_requests_info{"):
            labels, value = line[len("vllm:lora_requests_info{"):].rsplit("} ", 1)
            parsed = dict(part.split("=", 1) for part in labels.split('",') if part)
            parsed = {k: v.strip('"') for k, v in parsed.items()}
            if float(value) > best[0]:
                best = (float(value), parsed)
    return best[1]


async def test_adapters_beyond_the_slots_wait_for_a_running_one(sim_process: SimProcessFactory,
                                                                 tmp_path: Path) -> None:
    # One slot: b's request is admitted only once a's requests have finished. Seen from outside: a
    # process, HTTP, /metrics.
    sim = await sim_process(model="base", enable_lora=True, max_loras=1, lora_load_s=0.01, ttft_ms=1,
                            itl_ms=40)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for name in ("a", "b"):
            st, _ = await call(s, "POST", f"{sim.url}/v1/load_lora_adapter",
                               {"lora_name": name, "lora_path": make_adapter(tmp_path, name)})
            assert st == 200
        done: dict[str, float] = {}
        first: dict[str, float] = {}

        async def stream(model: str) -> None:
            body = {"model": model, "prompt": f"p {model}", "max_tokens": 20, "stream": True,
                    "ignore_eos": True}
            async with s.post(f"{sim.url}/v1/completions", json=body) as r:
                assert r.status == 200
                async for _ in r.content:
                    first.setdefault(model, time.monotonic())
            done[model] = time.monotonic()

        run_a = asyncio.create_task(stream("a"))
        assert await eventually(lambda: "a" in first, 20)
        run_b = asyncio.create_task(stream("b"))
        seen: dict[str, str] = {}

        async def waiting_b() -> bool:
            async with s.get(f"{sim.url}/metrics") as r:
                seen.update(_lora_info(await r.text()))
            return seen.get("waiting_lora_adapters") == "b" or "a" in done

        for _ in range(1000):  # bounded: a's stream ends within a second or two
            if await waiting_b():
                break
        assert seen == {"max_lora": "1", "waiting_lora_adapters": "b", "running_lora_adapters": "a"}
        await asyncio.gather(run_a, run_b)
        assert first["b"] >= done["a"]


async def test_kv_events_carry_the_adapter_and_its_keys(sim_engine: SimEngineFactory, tmp_path: Path) -> None:
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
                      "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"})
    eng = await sim_engine(model="base", enable_lora=True, kv_events_config=cfg, **FAST)
    assert eng.kv_events is not None
    path = make_adapter(tmp_path, "a")
    view = EngineBlocks()
    seen: list[Any] = []
    original = view.apply

    def apply(batch: Any) -> None:
        seen.extend(batch.events)
        original(batch)

    view.apply = apply  # type: ignore[method-assign]  # records what the subscriber decoded
    sub = KvEventSubscriber(eng.kv_events.endpoint, view, replay_endpoint=eng.kv_events.replay_endpoint,
                            topic="kv", replay_timeout_s=2.0, probe_interval_s=0.2)
    task = asyncio.create_task(sub.run())
    try:
        assert await eventually(lambda: sub.health is ViewHealth.COMPLETE, 15)
        prompt = " ".join(f"w{i}" for i in range(40))
        async with aiohttp.ClientSession() as s:
            assert (await call(s, "POST", f"{eng.url}/v1/load_lora_adapter",
                               {"lora_name": "a", "lora_path": path}))[0] == 200
            for model in ("base", "a"):
                st, _ = await call(s, "POST", f"{eng.url}/v1/completions",
                                   {"model": model, "prompt": prompt, "max_tokens": 2})
                assert st == 200
        ids = token_ids(prompt.split())
        root = block_hash.none_hash(None)
        base_keys = block_hash.block_keys(ids, 16, root)
        lora_keys = block_hash.block_keys(ids, 16, root, extra=block_hash.lora_extra("a", path))
        assert set(base_keys).isdisjoint(lora_keys)
        assert await eventually(lambda: view.keys() == set(base_keys) | set(lora_keys), 15)
        names = {e.lora_name for e in seen if hasattr(e, "lora_name")}
        assert names == {None, "a"}
    finally:
        task.cancel()
        await asyncio.wait([task])


def test_lora_flags_map_onto_sim_config() -> None:
    from routerd.sim.server import _parser

    args = vars(_parser().parse_args(["--port", "1", "--model", "m", "--enable-lora", "--max-loras", "4",
                                      "--lora-load-s", "0.5", "--max-cpu-loras", "8"]))
    assert (args["enable_lora"], args["max_loras"], args["lora_load_s"], args["max_cpu_loras"]) == \
        (True, 4, 0.5, 8)
