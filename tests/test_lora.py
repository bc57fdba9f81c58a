"""LoRA adapters as models, end to end: a real ``routerd run`` over simulated engines (processes) with
``--enable-lora --max-loras 1``, a real Redis.

What a user relies on: ``/v1/models`` lists adapters with ``parent``; a request for an adapter is
answered by an instance that holds it (its log line names the adapter and the rule); an adapter not
held goes to a free slot first, then evicts an idle one; adapters added at run time are kept in Redis
(sealed: a forged record is not served); a path that does not load is a clear admin error; an unknown
model is a 404 listing the models and adapters; check-config refuses what cannot work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from routerd import config as config_mod
from routerd import status
from routerd.client import QueueClient
from routerd.config import RedisConfig
from routerd.fleet.adapters import AdapterPlanner
from routerd.fleet.autoscaler import Autoscaler
from routerd.lora_placement import FleetPlacement, HeldAdapters, LoraRecord
from routerd.plugins import Candidate
from routerd.redis_keys import RedisKeys
from routerd.registry import Instance, InstanceState, Registry
from routerd.routing.adapters import (
    ADAPTER_EVICTED,
    ADAPTER_FREE_SLOT,
    ADAPTER_OVERFLOW,
    AdapterCatalog,
    AdapterLoadFailed,
    AdapterPlan,
    AdapterSlots,
)
from routerd.sim import expected_text
from routerd.sim.lora import adapter_seed
from routerd_bench._common import to_toml
from tests.fixtures.daemon import RouterdFactory, base_config, wait_all_ready
from tests.fixtures.helpers import eventually, until
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimEngineFactory, SimProcessFactory, sim_processes
from tests.test_sim_lora import make_adapter

LORA_ARGS = {"enable-lora": True, "max-loras": 1}


def _adapters_key(server: RedisServer) -> str:
    return RedisKeys.from_config(RedisConfig(url=server.url)).adapters()


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any, str]:
    async with s.post(url, json=body) as r:
        text = await r.text()
        return r.status, json.loads(text), r.headers.get("X-Routerd-Instance", "")


def _lines(log: str, adapter: str) -> list[dict[str, Any]]:
    out = []
    for line in log.splitlines():
        if '"adapter"' in line and '"event":"request"' in line.replace(" ", ""):
            rec = json.loads(line[line.index("{"):])
            if rec.get("adapter") == adapter:
                out.append(rec)
    return out


async def test_adapters_are_models_routed_to_the_instance_holding_them(
        sim_process: SimProcessFactory, routerd_process: RouterdFactory, redis_server: RedisServer,
        tmp_path: Path) -> None:
    sims = await sim_processes(sim_process, 2, model="base", enable_lora=True, max_loras=1, lora_load_s=0.05,
                               ttft_ms=1, itl_ms=1)
    a, b, c = (make_adapter(tmp_path, n) for n in ("a", "b", "c"))
    redis = {"enabled": True, "url": redis_server.url, "consumer": "l1", "block_ms": 100}
    cfg = base_config(tmp_path, redis=redis,
                      fleets=[{"name": "f", "model": "base", "engine": "static",
                               "urls": [s.url for s in sims], "engine_args": LORA_ARGS,
                               "adapters": [{"name": "a", "path": a}, {"name": "b", "path": b}]}])
    # a record written by hand (no seal, as anyone who can write to this Redis could): never served
    forged = msgspec.json.encode({"fleet": "f", "path": make_adapter(tmp_path, "x")})
    redis_server.client().hset(_adapters_key(redis_server), "x", forged)
    rd = routerd_process(cfg)
    url = rd.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        await wait_all_ready(s, url, "f", len(sims), 60)
        async with s.get(f"{url}/v1/models") as r:
            models = {m["id"]: m for m in (await r.json())["data"]}
        assert {k: m["parent"] for k, m in models.items()} == {"base": None, "a": "base", "b": "base"}
        refused = re.compile(r'routerd_shared_rejected_total\{kind="adapters",why="unsigned"\} [1-9]')
        for _ in range(100):  # the store is read within a second of start; bounded
            async with s.get(f"{url}/metrics") as r:
                if refused.search(await r.text()):
                    break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the forged record was not refused")
        async with s.get(f"{url}/v1/models") as r:
            assert "x" not in {m["id"] for m in (await r.json())["data"]}

        prompt = "tell me about adapters"
        st, body, inst_a = await _post(s, f"{url}/v1/completions", {"model": "a", "prompt": prompt,
                                                                    "max_tokens": 5})
        assert st == 200, body
        assert body["model"] == "a"
        assert body["choices"][0]["text"] == expected_text(adapter_seed(0, "a"), prompt, 5)
        assert body["choices"][0]["text"] != expected_text(0, prompt, 5)
        st, body, inst_b = await _post(s, f"{url}/v1/completions", {"model": "b", "prompt": prompt,
                                                                    "max_tokens": 5})
        assert st == 200, body
        assert inst_b != inst_a  # the other instance's free slot, not an eviction
        for _ in range(3):  # each now goes where it is held
            assert (await _post(s, f"{url}/v1/completions", {"model": "a", "prompt": prompt}))[2] == inst_a
            assert (await _post(s, f"{url}/v1/completions", {"model": "b", "prompt": prompt}))[2] == inst_b
        st, body, _ = await _post(s, f"{url}/v1/completions", {"model": "base", "prompt": prompt})
        assert st == 200
        async with QueueClient.from_url(redis_server.url) as queue:  # the other way in
            job = await queue.submit({"model": "b", "prompt": prompt, "max_tokens": 5})
            result = await queue.wait(job, timeout=30)
        assert (result.status, result.instance) == ("ok", inst_b)
        assert result.response is not None
        assert result.response["choices"][0]["text"] == expected_text(adapter_seed(0, "b"), prompt, 5)

        st, body, _ = await _post(s, f"{url}/v1/completions", {"model": "zz", "prompt": prompt})
        assert st == 404
        assert body["error"]["message"].endswith("Valid models: a, b, base")

        rows: dict[str, Any] = {}

        async def engines_said() -> bool:
            async with s.get(f"{url}/admin/fleets") as r:
                rows.update({i["id"]: i for i in (await r.json())["fleets"]["f"]["instances"]})
            return all((rows[i]["adapters"]["engine"] or {}).get("max_lora") == 1 for i in (inst_a, inst_b))

        for _ in range(100):  # the engine's own vllm:lora_requests_info, as the scraper reads it
            if await engines_said():
                break
            await asyncio.sleep(0.2)
        assert rows[inst_b]["adapters"]["held"] == ["b"]
        assert rows[inst_b]["adapters"]["engine"]["max_lora"] == 1
        table = status.render({"fleets": {"f": {"instances": [rows[inst_b]]}}})
        assert f"{inst_b} adapters: held=b (1/1)" in table
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
        assert re.search(r'routerd_adapter_loads_total\{adapter="b",fleet="f",outcome="ok"\} [1-9]', text), \
            [line for line in text.splitlines() if "adapter" in line]
        assert re.search(r'routerd_adapter_requests_total\{adapter="a",fleet="f"\} [4-9]', text)
        # usage per adapter and tenant: in /metrics, and per day in Redis as `routerd usage` reads it
        assert re.search(r'routerd_tenant_adapter_requests_total\{adapter="a",fleet="f",outcome="ok",'
                         r'tenant="default"\} 4', text), [ln for ln in text.splitlines() if "tenant" in ln]

        async def usage_rows() -> list[dict[str, Any]]:
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "routerd", "usage", "--redis", redis_server.url, "--adapter", "a",
                "--json", stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(cli.communicate(), 60)
            return list(json.loads(out)["rows"])

        rows_a: list[dict[str, Any]] = []
        for _ in range(50):  # written to Redis every second
            rows_a = await usage_rows()
            if rows_a and rows_a[0]["requests"] == 4:
                break
            await asyncio.sleep(0.2)
        assert [(r["tenant"], r["fleet"], r["adapter"], r["requests"]) for r in rows_a] == \
            [("default", "f", "a", 4)]
        assert rows_a[0]["completion_tokens"] > 0

        # run time: c added (it loads on an instance, evicting its idle adapter), kept in Redis
        st, body, _ = await _post(s, f"{url}/admin/fleets/f/adapters", {"name": "c", "path": c})
        assert st == 200, body
        assert body["adapter"]["parent"] == "base"
        held_c = body["loaded_on"]
        assert held_c in ("f:static0", "f:static1")
        st, body, inst_c = await _post(s, f"{url}/v1/completions", {"model": "c", "prompt": prompt})
        assert (st, inst_c) == (200, held_c)
        assert redis_server.client().hexists(_adapters_key(redis_server), "c"), \
            (redis_server.client().keys("*"), rd.log()[-3000:])  # kept in Redis

        st, body, _ = await _post(s, f"{url}/admin/fleets/f/adapters",
                                  {"name": "bad", "path": str(tmp_path / "nowhere")})
        assert st == 400
        assert "did not load" in body["error"]["message"]
        assert "No adapter found" in body["error"]["message"]
        st, body, _ = await _post(s, f"{url}/admin/fleets/f/adapters", {"name": "base", "path": c})
        assert st == 400

        async with s.delete(f"{url}/admin/fleets/f/adapters/c") as r:
            assert r.status == 200, await r.text()
        st, body, _ = await _post(s, f"{url}/v1/completions", {"model": "c", "prompt": prompt})
        assert st == 404

    log = rd.log_path.read_text()
    rules = {rec["rule"] for rec in _lines(log, "a")} | {rec["rule"] for rec in _lines(log, "b")}
    assert {"adapter_free_slot", "adapter_loaded"} <= rules, rules


def test_check_config_refuses_adapters_that_cannot_work(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, fleets=[
        {"name": "f", "model": "base", "engine": "sim", "engine_args": {"enable-lora": True, "max-loras": 1},
         "adapters": [{"name": "g-model", "path": "/a"}, {"name": "p1", "path": "/p", "pinned": True},
                      {"name": "p2", "path": "/p", "pinned": True}]},
        {"name": "g", "model": "g-model", "engine": "sim", "adapters": [{"name": "q", "path": "/q"}]}])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    out = subprocess.run([sys.executable, "-m", "routerd", "check-config", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == config_mod.EXIT_CONFIG, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "$.fleets[0].adapters[0].name: 'g-model' is the model of $.fleets[1]" in text
    assert "$.fleets[0].adapters: 2 adapters are pinned (p1, p2) but an instance holds 1" in text
    assert "$.fleets[1].adapters: the fleet's engines serve no LoRA adapter" in text


def test_a_tenant_may_be_given_single_adapters(tmp_path: Path) -> None:
    cfg = config_mod.parse(base_config(
        tmp_path, fleets=[{"name": "f", "model": "base", "engine": "sim", "engine_args": LORA_ARGS,
                           "adapters": [{"name": "a", "path": "/a"}]}],
        tenants=[{"name": "t", "api_keys": ["sk-t-0123456789abcdef"], "fleets": ["a"]}]))
    from routerd.tenants.directory import Tenant

    t = Tenant.from_config(cfg.tenants[0])
    assert t.allows("f", "a")
    assert not t.allows("f")



def test_placement_spreads_a_hot_adapter_and_unloads_a_cold_one_only_after_a_while() -> None:
    now = [0.0]
    planner = AdapterPlanner(cold_s=60.0, max_moves=8, clock=lambda: now[0])
    adapters = {"hot": False, "warm": False, "cold": False, "pin": True}
    p = FleetPlacement(slots=2, adapters=adapters, held={"i0": ["cold"], "i1": [], "i2": []},
                       rates={"hot": 9.0, "warm": 1.0, "cold": 0.0}, demand={"hot": 9.0, "warm": 1.0},
                       per_copy=4.0)
    # 9 in flight at 4 a copy asks for 3 copies, 1 for 1, pinned everywhere: 7 > 6 slots, so the hot one
    # gives one up; cold (no traffic) none
    assert planner.wanted(p) == {"hot": 2, "warm": 1, "cold": 0, "pin": 3}
    # free slots first, the hottest first; cold gives its slot up at once where a wanted adapter needs it
    assert [(m.kind, m.instance, m.adapter) for m in planner.plan(p)] == [
        ("load", "i1", "hot"), ("load", "i2", "hot"), ("load", "i0", "warm"), ("load", "i1", "pin"),
        ("load", "i2", "pin"), ("unload", "i0", "cold"), ("load", "i0", "pin")]
    # a trickle for the only adapter in use keeps it on one instance: the free slot stays for the next
    trickle = FleetPlacement(slots=1, adapters={"a": False, "b": False}, held={"i0": ["a"], "i1": []},
                             rates={"a": 0.5}, demand={"a": 1.0}, per_copy=4.0)
    assert planner.plan(trickle) == []

    # a cold adapter with a free slot beside it stays until cold_s has passed
    q = FleetPlacement(slots=2, adapters={"a": False, "b": False}, held={"i0": ["a", "b"]},
                       rates={"a": 1.0, "b": 0.0})
    assert planner.plan(q) == []
    now[0] = 30.0
    assert planner.plan(q) == []
    now[0] = 61.0
    assert [(m.kind, m.adapter) for m in planner.plan(q)] == [("unload", "b")]
    # busy: not unloaded even then
    busy = FleetPlacement(slots=2, adapters={"a": False, "b": False}, held={"i0": ["a", "b"]},
                          busy={"i0": {"b"}}, rates={"a": 1.0, "b": 0.0})
    assert planner.plan(busy) == []
    # an instance over its slots (an overflow load) sheds at once, not after cold_s: a spare copy first
    over = FleetPlacement(slots=2, adapters={"a": False, "b": False, "c": False},
                          held={"i0": ["a", "b", "c"], "i1": ["b"]}, rates={"a": 1.0, "b": 1.0, "c": 1.0},
                          demand={"a": 1.0, "b": 1.0, "c": 1.0}, per_copy=4.0)
    assert [(m.kind, m.instance, m.adapter) for m in planner.plan(over)] == [("unload", "i0", "b")]
    # ... else the least recently used idle one (a wanted one moves to a free slot); never a busy one
    over = FleetPlacement(slots=2, adapters={"a": False, "b": False, "c": False},
                          held={"i0": ["a", "b", "c"], "i1": []}, busy={"i0": {"a"}},
                          rates={"a": 1.0, "b": 1.0, "c": 1.0}, demand={"a": 1.0, "b": 1.0, "c": 1.0},
                          per_copy=4.0)
    assert [(m.kind, m.instance, m.adapter) for m in planner.plan(over)] == [
        ("unload", "i0", "b"), ("load", "i1", "b")]
    all_busy = FleetPlacement(slots=1, adapters={"a": False, "b": False}, held={"i0": ["a", "b"]},
                              busy={"i0": {"a", "b"}}, rates={"a": 1.0, "b": 1.0})
    assert planner.plan(all_busy) == []
    # a restarted instance holds nothing: the demand's copies are loaded there again
    r = FleetPlacement(slots=1, adapters={"a": False}, held={"i0": ["a"], "i1": []}, rates={"a": 5.0},
                       demand={"a": 6.0}, per_copy=4.0)
    assert [(m.kind, m.instance, m.adapter) for m in planner.plan(r)] == [("load", "i1", "a")]


async def test_an_engine_killed_gets_its_adapters_back_as_demand_asks(
        sim_process: SimProcessFactory, routerd_process: RouterdFactory, tmp_path: Path) -> None:
    # One adapter has more requests in flight than half an instance's slots: placement holds it on
    # both instances. One engine is killed and started again empty while the load goes on: placement
    # loads it there again.
    sim_args = {"model": "base", "enable_lora": True, "max_loras": 1, "lora_load_s": 0.01, "ttft_ms": 1,
                "itl_ms": 20, "max_num_seqs": 2}
    sims = await sim_processes(sim_process, 2, **sim_args)
    cfg = base_config(tmp_path, fleets=[{"name": "f", "model": "base", "engine": "static", "max_num_seqs": 2,
                                         "urls": [s.url for s in sims], "engine_args": LORA_ARGS,
                                         "adapters": [{"name": "a", "path": make_adapter(tmp_path, "a")}]}])
    rd = routerd_process(cfg)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        assert (await _post(s, f"{rd.url}/v1/completions", {"model": "a", "prompt": "hi"}))[0] == 200
        stop = asyncio.Event()

        async def load() -> None:  # 4 requests in flight at all times (statuses: the kill fails some)
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    await _post(s, f"{rd.url}/v1/completions",
                                {"model": "a", "prompt": "hi", "max_tokens": 20})

        async def holders() -> set[str]:
            async with s.get(f"{rd.url}/admin/fleets") as r:
                rows = (await r.json())["fleets"]["f"]["instances"]
            return {i["id"] for i in rows if "a" in i["adapters"]["held"] and i["state"] == "ready"}

        async def both() -> bool:
            for _ in range(150):
                if await holders() == {"f:static0", "f:static1"}:
                    return True
                await asyncio.sleep(0.2)
            return False

        async with asyncio.TaskGroup() as tg:
            for _ in range(4):
                tg.create_task(load())
            try:
                assert await both(), "placement spreads the busy adapter over both instances"
                port = sims[0].url.rsplit(":", 1)[1]
                sims[0].signal(signal.SIGKILL)
                sims[0].proc.wait(10)
                again = await sim_process(port=int(port), **sim_args)
                async with s.get(f"{again.url}/v1/models") as r:
                    assert [m["id"] for m in (await r.json())["data"]] == ["base"]  # it came back empty
                assert await both(), "the restarted engine got the adapter back"
            finally:
                stop.set()


async def _one_slot(sim_process: SimProcessFactory, routerd_process: RouterdFactory, tmp_path: Path
                    ) -> tuple[Any, Any]:
    """A sim with one adapter slot (loads of 10 ms, 20 ms a token) and routerd in front of it, adapters
    `a` and `b` declared."""
    sim = await sim_process(model="base", enable_lora=True, max_loras=1, max_cpu_loras=2, lora_load_s=0.01,
                            ttft_ms=1, itl_ms=20, max_num_seqs=4)
    cfg = base_config(tmp_path, fleets=[{"name": "f", "model": "base", "engine": "static", "max_num_seqs": 4,
                                         "urls": [sim.url], "engine_args": LORA_ARGS,
                                         "adapters": [{"name": n, "path": make_adapter(tmp_path, n)}
                                                      for n in ("a", "b")]}])
    return sim, routerd_process(cfg)


async def test_an_adapter_loaded_beyond_the_slots_is_shed_once_idle(
        sim_process: SimProcessFactory, routerd_process: RouterdFactory, tmp_path: Path) -> None:
    # One slot, held by `a` with a request in flight: a request for `b` finds no slot anywhere and is
    # loaded beyond the slots (vLLM keeps it in its CPU cache and runs the two in turn). Once both are
    # idle, placement brings the instance back to its one slot at once, not after cold_s (60 s here):
    # over its slots, every request there waits its turn for an adapter slot.
    _, rd = await _one_slot(sim_process, routerd_process, tmp_path)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def held() -> list[str]:
            async with s.get(f"{rd.url}/admin/fleets") as r:
                held: list[str] = (await r.json())["fleets"]["f"]["instances"][0]["adapters"]["held"]
                return held

        # 250 tokens (5 s): longer than b's wait for a slot to free (OVERFLOW_WAIT_S) before it overflows
        long_a = asyncio.create_task(_post(s, f"{rd.url}/v1/completions",
                                           {"model": "a", "prompt": "hi", "max_tokens": 250}))
        async def a_only() -> bool:
            return await held() == ["a"]

        async def one() -> bool:
            return len(await held()) == 1

        await until(a_only, 10, "a loaded for its request")
        status_b, body_b, _ = await _post(s, f"{rd.url}/v1/completions",
                                          {"model": "b", "prompt": "hi", "max_tokens": 2})
        assert status_b == 200, body_b
        assert (await long_a)[0] == 200
        def b_rules() -> list[str]:
            return [rec["rule"] for rec in _lines(rd.log_path.read_text(), "b")]

        await until(lambda: b_rules() != [], 5, "b's request line in the log")  # written as it ends
        assert b_rules() == ["adapter_overflow"]
        await until(one, 15, "back within its one slot")


async def test_a_request_waiting_for_its_adapter_to_load_is_demand_to_the_autoscaler(
        sim_engine: SimEngineFactory, tmp_path: Path) -> None:
    # A request whose adapter is being loaded has no engine slot yet (the engine has not seen it): the
    # autoscaler counts it as waiting demand, as it counts one waiting in admission, until the load ends.
    eng = await sim_engine(model="base", enable_lora=True, max_loras=1, lora_load_s=2.0, ttft_ms=1, itl_ms=1)
    cfg = config_mod.parse(base_config(tmp_path, fleets=[
        {"name": "f", "model": "base", "engine": "static", "urls": [eng.url], "engine_args": LORA_ARGS,
         "adapters": [{"name": "a", "path": make_adapter(tmp_path, "a")}]}]))
    registry = Registry()
    inst = registry.add(Instance(id="f:static0", fleet="f", url=eng.url, capacity_hint=8))
    registry.set_state(inst, InstanceState.READY)
    catalog = AdapterCatalog(cfg)
    adapter = catalog.get("a")
    assert adapter is not None
    scaler = Autoscaler(cfg, registry, None, on_change=lambda: None, pin=lambda fleet: None)
    fleet = cfg.fleets[0]
    idle = scaler._signals(fleet)
    async with aiohttp.ClientSession() as session:
        slots = AdapterSlots(registry, catalog, session)
        loads = [asyncio.create_task(slots.ensure(inst, AdapterPlan(adapter, ADAPTER_FREE_SLOT, load=True)))
                 for _ in range(2)]  # two requests, one load shared
        assert await eventually(lambda: scaler._signals(fleet).waiting == idle.waiting + 2, 10)
        assert scaler._signals(fleet).demand == idle.demand + 2
        await asyncio.gather(*loads)
        assert slots.holds(inst, "a")
        assert slots.loads == {("f", "a", "ok"): 1}
        assert (scaler._signals(fleet).waiting, scaler._signals(fleet).demand) == (idle.waiting, idle.demand)


async def test_an_engine_listing_older_than_a_load_or_unload_does_not_undo_it(
        sim_engine: SimEngineFactory, tmp_path: Path) -> None:
    # routerd asks each engine what it holds every sync_interval_s. On a busy machine an answer the engine
    # gave before an unload was read after it: the adapter was held again in routerd's record, requests
    # were routed to it there and the engine answered 404 "model does not exist" (bench lora, loaded CI).
    eng = await sim_engine(model="base", enable_lora=True, max_loras=2, ttft_ms=1, itl_ms=1)
    asked, answer = asyncio.Event(), asyncio.Event()

    async def relay(request: web.Request) -> web.Response:
        """The engine's own answers; one to /v1/models is held back in transit until ``answer``."""
        async with session.request(request.method, eng.url + request.path, data=await request.read(),
                                   headers={"Content-Type": "application/json"}) as r:
            body, status_code = await r.read(), r.status
        if request.path == "/v1/models":
            asked.set()
            await answer.wait()
        return web.Response(body=body, status=status_code, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    cfg = config_mod.parse(base_config(tmp_path, fleets=[
        {"name": "f", "model": "base", "engine": "static", "urls": [f"http://127.0.0.1:{port}"],
         "engine_args": {"enable-lora": True, "max-loras": 2},
         "adapters": [{"name": n, "path": make_adapter(tmp_path, n)} for n in ("a", "b")]}]))
    registry = Registry()
    inst = registry.add(Instance(id="f:static0", fleet="f", url=f"http://127.0.0.1:{port}", capacity_hint=8))
    registry.set_state(inst, InstanceState.READY)
    catalog = AdapterCatalog(cfg)
    plans = {n: AdapterPlan(a, ADAPTER_FREE_SLOT, load=True) for n in ("a", "b") if (a := catalog.get(n))}

    async def sync_around(move: Any) -> None:
        """``move`` done while the engine's answer to a /v1/models asked before it is in transit."""
        asked.clear()
        answer.clear()
        syncing = asyncio.create_task(slots.sync(inst))
        async with asyncio.timeout(10):
            await asked.wait()
        await move
        answer.set()
        await syncing

    try:
        async with aiohttp.ClientSession() as session:
            slots = AdapterSlots(registry, catalog, session)
            answer.set()
            await slots.ensure(inst, plans["a"])
            await slots.ensure(inst, plans["b"])
            await sync_around(slots.unload(inst, "a"))
            assert slots.held(inst) == ["b"], "an unload is not undone by a listing older than it"
            await sync_around(slots.ensure(inst, plans["a"]))
            assert sorted(slots.held(inst)) == ["a", "b"], "nor a load forgotten"
            await slots.unload(inst, "b")
            await slots.sync(inst)  # a listing asked after the moves is the record again
            assert slots.held(inst) == ["a"]
            async with session.get(f"{eng.url}/v1/models") as r:
                assert sorted(m["id"] for m in (await r.json())["data"]) == ["a", "base"]
    finally:
        await runner.cleanup()


async def _two_replicas(s: aiohttp.ClientSession, routerd_process: RouterdFactory, redis_server: RedisServer,
                        tmp_path: Path, fleet: dict[str, Any]) -> tuple[Any, Any]:
    """Two routerd on one Redis serving ``fleet``: (the controller, the follower), each with every
    instance ready."""
    replicas = []
    for name in ("la", "lb"):
        (tmp_path / name).mkdir()
        replicas.append(routerd_process(base_config(
            tmp_path / name, fleets=[fleet],
            redis={"enabled": True, "url": redis_server.url, "consumer": name, "block_ms": 100})))
    controls: list[bool] = []

    async def one_controller() -> bool:
        controls.clear()
        for rp in replicas:
            async with s.get(f"{rp.url}/admin/fleets") as r:
                control = (await r.json())["control"]
            controls.append(bool(control["controls"]) if control["controller"] is not None else False)
        return controls.count(True) == 1

    await until(one_controller, 30, "each replica sees the one controller")
    for rp in replicas:
        await wait_all_ready(s, rp.url, fleet["name"], len(fleet["urls"]), 60)
    return (replicas[0], replicas[1]) if controls[0] else (replicas[1], replicas[0])


async def _seen(s: aiohttp.ClientSession, rp: Any, inst: str) -> dict[str, Any]:
    """What routerd ``rp``'s /admin/fleets says of instance ``inst``'s adapters (fleet f)."""
    async with s.get(f"{rp.url}/admin/fleets") as r:
        rows = (await r.json())["fleets"]["f"]["instances"]
    return dict(next(i for i in rows if i["id"] == inst)["adapters"])


def _events(rp: Any, event: str) -> list[dict[str, Any]]:
    """The log records of ``event`` in a routerd's log."""
    recs = [json.loads(line[line.index("{"):]) for line in rp.log().splitlines() if f'"{event}"' in line]
    return [r for r in recs if r.get("event") == event]


def _two_ready(tmp_path: Path, adapters: tuple[str, ...], engine_args: dict[str, Any]
               ) -> tuple[config_mod.Config, Registry, tuple[Instance, Instance]]:
    """A static LoRA fleet of two ready instances (no engines behind them: routing's record is set by
    hand), with ``adapters`` made locally."""
    cfg = config_mod.parse(base_config(tmp_path, fleets=[
        {"name": "f", "model": "base", "engine": "static", "urls": ["http://127.0.0.1:9", "http://127.0.0.1:10"],
         "engine_args": engine_args,
         "adapters": [{"name": n, "path": make_adapter(tmp_path, n)} for n in adapters]}]))
    registry = Registry()
    insts = [registry.add(Instance(id=f"f:static{i}", fleet="f", url=f"http://127.0.0.1:{9 + i}",
                                   capacity_hint=8)) for i in range(2)]
    for inst in insts:
        registry.set_state(inst, InstanceState.READY)
    return cfg, registry, (insts[0], insts[1])


async def test_a_follower_does_not_evict_an_adapter_the_controllers_request_waits_on(
        tmp_path: Path) -> None:
    # The controller publishes its record at once when a load ends; its request on that adapter is then
    # one step from being sent, and no shared load says so yet. The record names it busy, so a follower
    # asked for another adapter evicts the idle one elsewhere, not this one (fresh-clone CI: it did).
    cfg, registry, (x, y) = _two_ready(tmp_path, ("a", "b", "c"), LORA_ARGS)
    insts = [x, y]

    async def never(inst: Instance, name: str, evict: str | None) -> tuple[int, str]:
        raise AssertionError("the follower asked for a load")

    async with aiohttp.ClientSession() as session:
        ctl = AdapterSlots(registry, AdapterCatalog(cfg), session)
        fol = AdapterSlots(registry, AdapterCatalog(cfg), session)
        fol.remote, fol.controls = never, lambda: False
        # what the controller found its engines hold (its sync's record, set here without engines)
        ctl._of(x).names["a"], ctl._of(y).names["b"] = 0.0, 0.0
        assert ctl.record() == LoraRecord(instances={x.id: HeldAdapters(generation=x.generation, held=["a"]),
                                                     y.id: HeldAdapters(generation=y.generation, held=["b"])})
        c = fol.catalog.get("c")
        assert c is not None
        pairs = [(Candidate(id=i.id, load=0.0, inflight=0, queue=0.0, capacity=8, kv_usage=0.0,
                            stale=False), i) for i in insts]
        with ctl.using(x, "a"):  # the controller's request on a (as from the moment its load ended)
            fol.follow(ctl.record())
            chosen, plans = fol.narrow(c, pairs)
        assert [i.id for _, i in chosen] == [y.id]
        assert (plans[y.id].rule, plans[y.id].evict) == (ADAPTER_EVICTED, "b")
        fol.follow(ctl.record())  # the request ended: both idle, either may be evicted
        chosen, _ = fol.narrow(c, pairs)
        assert sorted(i.id for _, i in chosen) == [x.id, y.id]


async def test_an_eviction_takes_the_adapter_with_the_least_traffic_per_copy(tmp_path: Path) -> None:
    # One instance holds a popular adapter (used first, so least recently) and a rare one (used last),
    # both idle; another instance holds a second copy of the popular one. A third adapter's request
    # evicts by the rates placement measured — the rare one — not by recency; a popular adapter with
    # copies enough elsewhere goes before a rarer single copy.
    two_slots = {"enable-lora": True, "max-loras": 2}
    cfg, registry, (x, y) = _two_ready(tmp_path, ("hot", "rare", "new"), two_slots)
    async with aiohttp.ClientSession() as session:
        slots = AdapterSlots(registry, AdapterCatalog(cfg), session)
        slots._of(x).names.update({"hot": 1.0, "rare": 2.0})  # least recently used first
        new = slots.catalog.get("new")
        assert new is not None
        pairs = [(Candidate(id=x.id, load=0.0, inflight=0, queue=0.0, capacity=8, kv_usage=0.0,
                            stale=False), x)]
        _, plans = slots.narrow(new, pairs)
        assert plans[x.id].evict == "hot"  # no rates measured yet (a follower): by recency
        assert slots.placement("f", {"hot": 2.0, "rare": 0.1}, {}) is not None
        _, plans = slots.narrow(new, pairs)
        assert (plans[x.id].rule, plans[x.id].evict) == (ADAPTER_EVICTED, "rare")
        slots._of(y).names["hot"] = 3.0  # a second copy: hot 2.0 / 2 = 1.0 a copy, rare 1.5 on its one
        slots.placement("f", {"hot": 2.0, "rare": 1.5}, {})
        _, plans = slots.narrow(new, pairs)
        assert plans[x.id].evict == "hot"
        with slots.using(x, "hot"):  # busy: never the victim
            _, plans = slots.narrow(new, pairs)
            assert plans[x.id].evict == "rare"


async def test_a_request_with_no_slot_anywhere_waits_for_the_first_to_free(tmp_path: Path) -> None:
    # Both instances' one slot is held by an adapter with a request in flight: a request for a third
    # would be loaded beyond the slots (its instance then runs every request in turns for the slot). It
    # waits, up to a bound, for the first slot to free anywhere, and evicts there. The victim an
    # eviction in flight has claimed is no other request's: d, woken by the same freed slot, must not
    # unload b again (two loads for one slot) and overflows instead.
    cfg, registry, (x, y) = _two_ready(tmp_path, ("a", "b", "c", "d", "e"),
                                       {"enable-lora": True, "max-loras": 1})
    async with aiohttp.ClientSession() as session:
        slots = AdapterSlots(registry, AdapterCatalog(cfg), session)
        slots._of(x).names["a"] = 1.0
        slots._of(y).names["b"] = 2.0
        c, d = slots.catalog.get("c"), slots.catalog.get("d")
        assert c is not None
        assert d is not None
        pairs = [(Candidate(id=i.id, load=0.0, inflight=0, queue=0.0, capacity=8, kv_usage=0.0,
                            stale=False), i) for i in (x, y)]
        with slots.using(x, "a"):
            with slots.using(y, "b"):
                assert slots.no_slot(c)
                assert await slots.wait_for_slot(c, 0.3) >= 0.3  # nothing freed: the bound, then overflow
                assert {p.rule for p in slots.narrow(c, pairs)[1].values()} == {ADAPTER_OVERFLOW}
                waiter = asyncio.create_task(slots.wait_for_slot(c, 60.0))
                await asyncio.sleep(0.3)
                assert not waiter.done()
                assert registry.adapter_waiting == {"f": 1}  # demand the autoscaler counts
            assert await asyncio.wait_for(waiter, 10.0) < 10.0  # b idle on y: c's slot
            assert registry.adapter_waiting == {}
            assert slots.overflow_waits == {"f": 2}
            assert slots.overflow_wait_seconds["f"] >= 0.3
            _, plans = slots.narrow(c, pairs)
            assert (plans[y.id].rule, plans[y.id].evict) == (ADAPTER_EVICTED, "b")
            load = asyncio.create_task(slots.ensure(y, plans[y.id]))
            await asyncio.sleep(0)  # the eviction has started (its load task made, not yet run)
            assert slots.no_slot(d)
            assert {p.rule for p in slots.narrow(d, pairs)[1].values()} == {ADAPTER_OVERFLOW}
            with contextlib.suppress(AdapterLoadFailed):  # no engine behind these URLs
                await load
            assert not slots.no_slot(d)  # the failed load left b's slot free (b was unloaded)
        # x over its one slot (an overflow there left `a` and `e`, both idle now): a load there unloads
        # both, not only its victim — swapping one for the other would keep x over its slots
        slots._of(x).names.update({"a": 3.0, "e": 4.0})
        _, plans = slots.narrow(c, pairs[:1])
        assert (plans[x.id].rule, plans[x.id].evict) == (ADAPTER_EVICTED, "a")
        with contextlib.suppress(AdapterLoadFailed):
            await slots.ensure(x, plans[x.id])
        assert slots.held(x) == []


async def test_a_request_waits_for_a_busy_adapter_to_finish_rather_than_overflow(
        sim_process: SimProcessFactory, routerd_process: RouterdFactory, tmp_path: Path) -> None:
    # One slot, held by `a` with a short request in flight (40 tokens, ~0.8 s): `b`'s request waits for
    # it to end and evicts `a` — it is not loaded beside `a` beyond the engine's one slot.
    sim, rd = await _one_slot(sim_process, routerd_process, tmp_path)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def a_only() -> bool:
            async with s.get(f"{rd.url}/admin/fleets") as r:
                return bool((await r.json())["fleets"]["f"]["instances"][0]["adapters"]["held"] == ["a"])

        long_a = asyncio.create_task(_post(s, f"{rd.url}/v1/completions",
                                           {"model": "a", "prompt": "hi", "max_tokens": 40}))
        await until(a_only, 10, "a loaded for its request")
        status_b, body_b, _ = await _post(s, f"{rd.url}/v1/completions",
                                          {"model": "b", "prompt": "hi", "max_tokens": 2})
        assert status_b == 200, body_b
        assert (await long_a)[0] == 200

        def rules(name: str) -> list[str]:
            return [rec["rule"] for rec in _lines(rd.log_path.read_text(), name)]

        await until(lambda: rules("b") != [], 5, "b's request line in the log")
        assert rules("b") == [ADAPTER_EVICTED]
        async with s.get(f"{sim.url}/v1/models") as r:
            assert sorted(m["id"] for m in (await r.json())["data"]) == ["b", "base"]
        async with s.get(f"{rd.url}/metrics") as r:
            text = await r.text()
        assert re.search(r'routerd_adapter_no_slot_waits_total\{fleet="f"\} 1\.0', text), \
            [line for line in text.splitlines() if "no_slot" in line]
        waited = re.search(r'routerd_adapter_no_slot_wait_seconds_total\{fleet="f"\} ([0-9.e+-]+)', text)
        assert waited is not None
        assert 0.0 < float(waited[1]) < 2.5  # until a's end, within the bound (OVERFLOW_WAIT_S, 2 s)
        # ... and b's request line says how long it waited, which a's (a free slot) does not
        log = rd.log_path.read_text()
        [line_b], [line_a] = _lines(log, "b"), _lines(log, "a")
        assert line_b["slot_wait_ms"] == pytest.approx(float(waited[1]) * 1000, abs=0.01)
        assert "slot_wait_ms" not in line_a


async def test_a_follower_routes_by_the_controllers_placement_and_never_loads(
        sim_process: SimProcessFactory, routerd_process: RouterdFactory, redis_server: RedisServer,
        tmp_path: Path) -> None:
    # Two routerd on one Redis. Only the controller loads and unloads, and only it asks the engines
    # what they hold; the follower routes from the record the controller publishes in the fleet state
    # (held, loads in flight) and from every process's requests in flight (the shared load). While the
    # controller loads `a` on one instance for a long request of its own, the follower's request for
    # `c` does not take that instance's only slot (the engine would hold two adapters in one slot):
    # it evicts the idle `b` on the other one, through the controller. And the follower's traffic is
    # the controller's demand: an adapter only it asked for is kept loaded by the controller.
    sims = await sim_processes(sim_process, 2, model="base", enable_lora=True, max_loras=1, lora_load_s=1.5,
                               ttft_ms=1, itl_ms=5)
    fleet = {"name": "f", "model": "base", "engine": "static", "urls": [s.url for s in sims],
             "engine_args": LORA_ARGS,
             "adapters": [{"name": n, "path": make_adapter(tmp_path, n)} for n in ("a", "b", "c")]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        ctl, fol = await _two_replicas(s, routerd_process, redis_server, tmp_path, fleet)

        def seen(rp: Any, inst: str) -> Any:
            return _seen(s, rp, inst)

        short = {"prompt": "hi", "max_tokens": 3}
        st, body, x = await _post(s, f"{ctl.url}/v1/completions", {"model": "b", **short})
        assert st == 200, body
        y = ({"f:static0", "f:static1"} - {x}).pop()

        async def b_idle_on_x() -> bool:  # held, and the controller's request on it seen to have ended
            there = await seen(fol, x)
            return there["held"] == ["b"] and not there["in_flight"]

        await until(b_idle_on_x, 30, "the follower sees b idle where the controller loaded it")
        long_a = asyncio.create_task(_post(s, f"{ctl.url}/v1/completions",
                                           {"model": "a", "prompt": "hi", "max_tokens": 300}))

        async def a_busy_on_y() -> bool:  # being loaded there, or held with the controller's request on it
            # in the controller's record as the follower has it: the shared load can show the request
            # on a before the record that places a there has reached the follower (y then looked free)
            there = await seen(fol, y)
            return "a" in there["loading"] or ("a" in there["held"] and there["in_flight"].get("a", 0) > 0)

        await until(a_busy_on_y, 30, "the follower sees the controller's load of a and its request")
        st, body, inst_c = await _post(s, f"{fol.url}/v1/completions", {"model": "c", **short})
        assert (st, inst_c) == (200, x), (body, _lines(fol.log(), "c"), await seen(fol, y))
        assert body["choices"][0]["text"] == expected_text(adapter_seed(0, "c"), "hi", 3)
        st, body, inst_a = await long_a
        assert (st, inst_a) == (200, y), body

        async def placed() -> bool:
            return (await seen(fol, x))["held"] == ["c"] and (await seen(fol, y))["held"] == ["a"]

        await until(placed, 30, "the follower sees c and a where the controller holds them")
        st, body, inst = await _post(s, f"{fol.url}/v1/completions", {"model": "a", **short})
        assert (st, inst) == (200, y), body
        for sim, held in ((x, ["c"]), (y, ["a"])):  # one adapter per slot on the engines themselves
            url = sims[int(sim[-1])].url
            async with s.get(f"{url}/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"] if m.get("parent")] == held

        # Every routerd's traffic is demand to the controller's placement (it rides the shared load):
        # c, which only the follower asked for, is loaded again by the controller, ahead of any request,
        # once the engine holding it lost it (as in a restart). b, colder, stays out.
        async with s.post(f"{sims[int(x[-1])].url}/v1/unload_lora_adapter", json={"lora_name": "c"}) as r:
            assert r.status == 200, await r.text()

        def c_placed() -> bool:
            return any((r["move"], r["instance"], r["adapter"], r["ok"]) == ("load", x, "c", True)
                       for r in _events(ctl, "adapter_placed"))

        await until(c_placed, 30, "the controller loaded c again from the follower's traffic")

    assert [(r["instance"], r["by"]) for r in _events(fol, "adapter_loaded")] == [(x, "controller")]
    assert _events(fol, "adapter_unloaded") == []  # the follower called no engine's load or unload
    assert {r["by"] for r in _events(ctl, "adapter_loaded")} == {"here"}
    # The controller evicted b on x for the follower's c. What it moves after the test unloaded c behind
    # its back is placement by demand, and timing: a fresh-clone run also saw c and b swapped on x.
    unloads = [(r["instance"], r["adapter"]) for r in _events(ctl, "adapter_unloaded")]
    assert unloads[:1] == [(x, "b")], unloads
    rules = {(rec["adapter"], rec["rule"]) for a in ("a", "c") for rec in _lines(fol.log(), a)}
    assert rules == {("c", "adapter_evicted"), ("a", "adapter_loaded")}, rules


async def test_a_daemon_of_workers_places_by_its_workers_demand(
        sim_process: SimProcessFactory, routerd_process: RouterdFactory, redis_server: RedisServer,
        tmp_path: Path) -> None:
    # workers > 1: the parent serves no request but controls the fleets; its placement plans by the
    # workers' adapter traffic (their shared load), so an adapter the workers' requests use is loaded
    # again by the parent, ahead of any request, once the engine lost it.
    sim = await sim_process(model="base", enable_lora=True, max_loras=1, lora_load_s=0.05, ttft_ms=1,
                            itl_ms=1)
    cfg = base_config(tmp_path, daemon={"workers": 2},
                      redis={"enabled": True, "url": redis_server.url, "block_ms": 100},
                      fleets=[{"name": "f", "model": "base", "engine": "static", "urls": [sim.url],
                               "engine_args": LORA_ARGS,
                               "adapters": [{"name": "a", "path": make_adapter(tmp_path, "a")}]}])
    rd = await asyncio.to_thread(routerd_process, cfg)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for _ in range(4):  # a fresh connection each: both workers take some
            async with s.post(f"{rd.url}/v1/completions", headers={"Connection": "close"},
                              json={"model": "a", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
        async with s.post(f"{sim.url}/v1/unload_lora_adapter", json={"lora_name": "a"}) as r:
            assert r.status == 200, await r.text()

        def placed() -> bool:
            return any((r["move"], r["adapter"], r["ok"]) == ("load", "a", True)
                       for r in _events(rd, "adapter_placed"))

        await until(placed, 30, "the parent loaded a again from its workers' traffic")
        async with s.get(f"{sim.url}/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["base", "a"]


async def test_admin_refuses_a_fleet_without_lora_and_a_timed_out_load_leaves_no_half_state(
        sim_process: SimProcessFactory, routerd_process: RouterdFactory, tmp_path: Path) -> None:
    # Issue 30 item 8. An admin add on a fleet whose engines run without enable-lora is refused with a
    # clear 400. A load that outlives adapter_load_timeout_s is a 504 that adds nothing; the engine
    # finishes it after all, and routerd's record then says what the engine holds (asked, not guessed):
    # adding the adapter again is answered at once, from that record.
    slow, plain = await asyncio.gather(  # started together: each start is mostly its own imports
        sim_process(model="base", enable_lora=True, max_loras=1, lora_load_s=3.0, ttft_ms=1, itl_ms=1),
        sim_process(model="other", ttft_ms=1, itl_ms=1))
    cfg = base_config(tmp_path, fleets=[
        {"name": "f", "model": "base", "engine": "static", "urls": [slow.url], "engine_args": LORA_ARGS,
         "adapter_load_timeout_s": 1.0},
        {"name": "g", "model": "other", "engine": "static", "urls": [plain.url]}])
    rd = routerd_process(cfg)
    c = make_adapter(tmp_path, "c")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        await wait_all_ready(s, rd.url, "f", 1, 60)
        st, body, _ = await _post(s, f"{rd.url}/admin/fleets/g/adapters", {"name": "c", "path": c})
        assert st == 400, body
        assert body["error"]["message"] == ("fleet 'g' serves no LoRA adapter: its engine_args need "
                                            "enable-lora = true (and max-loras)")

        st, body, _ = await _post(s, f"{rd.url}/admin/fleets/f/adapters", {"name": "c", "path": c})
        assert st == 504, body
        assert "took over 1 s (fleets.adapter_load_timeout_s)" in body["error"]["message"]
        async with s.get(f"{rd.url}/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["base", "other"]  # not added

        async def engine_holds() -> list[str]:
            async with s.get(f"{slow.url}/v1/models") as r:
                return [m["id"] for m in (await r.json())["data"] if m.get("parent")]

        async def routerd_holds() -> list[str]:
            async with s.get(f"{rd.url}/admin/fleets") as r:
                return list((await r.json())["fleets"]["f"]["instances"][0]["adapters"]["held"])

        async def settled() -> bool:
            return await engine_holds() == ["c"] and await routerd_holds() == ["c"]

        await until(settled, 30, "the engine finished the load and routerd's record says so")
        st, body, _ = await _post(s, f"{rd.url}/admin/fleets/f/adapters", {"name": "c", "path": c})
        assert (st, body["loaded_on"]) == (200, "f:static0"), body
        st, body, inst = await _post(s, f"{rd.url}/v1/completions",
                                     {"model": "c", "prompt": "hi", "max_tokens": 3})
        assert (st, inst) == (200, "f:static0"), body
        assert body["choices"][0]["text"] == expected_text(adapter_seed(0, "c"), "hi", 3)
