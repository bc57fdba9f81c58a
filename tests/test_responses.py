"""``POST /v1/responses`` through routerd's one dispatch (routerd/conversations/flow.py), against scripted
engines speaking vLLM 0.32's semantic events (an exact failure at an exact moment): a stream whose engine
dies after ``response.created`` but before any output is retried elsewhere and reaches the client as one
stream; one that dies after its first output ends with the Responses API's ``error`` event and is not
recorded; what completes is recorded before its last event reaches the client, and a continuation sends
the engine the whole conversation."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.fixtures.daemon import RouterdFactory
from tests.fixtures.dataplane import EngineFactory, PlaneFactory
from tests.fixtures.helpers import event_pairs
from tests.fixtures.redis_server import RedisServer


async def test_a_responses_stream_is_retried_until_its_first_output_and_recorded_when_it_completes(
        dataplane: PlaneFactory, scripted_engine: EngineFactory) -> None:
    e0 = await scripted_engine(script=["drop_after_created"])
    e1 = await scripted_engine(script=["ok", "drop_after:2"])
    # round robin by instance id: e0 first, then (alone after e0 failed) e1, then e1, then e0
    plane = await dataplane([e0.url, e1.url], routing={"policy": "round_robin"})
    url = plane.url + "/v1/responses"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        # turn 1: e0 dies in the prefill, after response.created — nothing reached the client: retried on e1
        async with s.post(url, json={"model": "m", "input": "hi", "stream": True}) as r:
            assert r.status == 200
            assert r.headers["X-Routerd-Instance"] == "f:static1"
            events = event_pairs(await r.read())
        kinds = [k for k, _ in events]
        assert kinds.count("response.created") == 1
        assert kinds[0] == "response.created"
        assert kinds[-1] == "response.completed"
        assert (e0.requests, e1.requests) == (1, 1)
        first = events[-1][1]["response"]
        assert first["id"].startswith("resp_")
        assert first["store"] is True
        assert first["output"][0]["content"][0]["text"] == "t0 t1 t2 t3 t4"
        async with s.get(f"{url}/{first['id']}") as r:  # recorded, as the client got it
            assert await r.json() == first

        # turn 2 continues it: the engine gets the whole conversation, and dies after its first output
        async with s.post(url, json={"model": "m", "input": "more", "stream": True,
                                     "previous_response_id": first["id"]}) as r:
            assert r.status == 200
            events = event_pairs(await r.read())
        sent = e1.bodies[-1]
        assert "previous_response_id" not in sent
        assert sent["store"] is False
        assert [i["content"] if i["role"] == "user" else i["content"][0]["text"] for i in sent["input"]] == [
            "hi", "t0 t1 t2 t3 t4", "more"]
        kinds = [k for k, _ in events]
        assert kinds.count("response.output_text.delta") == 2  # what the engine sent before it died
        assert kinds[-1] == "error"  # the Responses API's own terminal event
        assert "response.completed" not in kinds
        second = events[0][1]["response"]
        assert second["previous_response_id"] == first["id"]  # what the client asked, not what was sent
        async with s.get(f"{url}/{second['id']}") as r:  # a failed turn is not recorded: send it again
            assert r.status == 404

        # not streamed: recorded too, and answered as the client asked
        again = {"model": "m", "input": "again", "previous_response_id": first["id"]}
        async with s.post(url, json=again) as r:
            assert r.status == 200
            third = await r.json()
        assert third["previous_response_id"] == first["id"]
        assert third["store"] is True
        async with s.get(plane.url + "/metrics") as r:  # its tenant is billed what the engines counted
            assert 'routerd_tenant_tokens_total{fleet="f",kind="completion",tenant="default"} 10.0' \
                in await r.text()  # turn 1's 5 output tokens and this one's (turn 2 never completed)
        async with s.get(f"{url}/{third['id']}") as r:
            assert await r.json() == third

        # an unknown previous response: OpenAI's 404, and no engine is asked
        asked = e0.requests + e1.requests
        async with s.post(url, json={"model": "m", "input": "x", "previous_response_id": "resp_nope"}) as r:
            assert r.status == 404
            assert await r.json() == {"error": {"message": "Response with id 'resp_nope' not found.",
                                                "type": "invalid_request_error",
                                                "param": "previous_response_id", "code": 404}}
        assert e0.requests + e1.requests == asked


async def test_a_chain_continues_through_another_routerd_and_after_its_engine_is_gone(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        scripted_engine: EngineFactory) -> None:
    engines = [await scripted_engine(), await scripted_engine()]
    fleet = {"name": "f", "model": "m", "engine": "static", "urls": [e.url for e in engines]}
    a, b = (routerd_process(routerd_config(
        redis={"enabled": True, "url": redis_server.url, "consumer": name},
        daemon={"state_dir": str(redis_server.dir / name)}, fleets=[fleet])) for name in ("ra", "rb"))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def turn(url: str, **body: Any) -> tuple[dict[str, Any], int]:
            async with s.post(url + "/v1/responses", json={"model": "m", **body}) as r:
                assert r.status == 200, await r.text()
                return await r.json(), int(r.headers["X-Routerd-Instance"].rsplit("static", 1)[1])

        first, _ = await turn(a.url, input="hi")
        second, served = await turn(b.url, input="more", previous_response_id=first["id"])  # another routerd
        await engines[served].stop()  # the engine that served the chain's last turn is gone
        third, now = await turn(a.url, input="again", previous_response_id=second["id"])
        assert now != served
        # rehydrated: the engine left got the whole conversation, and knew nothing of it before
        sent = engines[now].bodies[-1]
        assert [i["content"] if i["role"] == "user" else "<answer>" for i in sent["input"]] == [
            "hi", "<answer>", "more", "<answer>", "again"]
        assert "previous_response_id" not in sent
        assert third["previous_response_id"] == second["id"]
        async with s.get(f"{b.url}/v1/responses/{third['id']}") as r:  # recorded where every routerd reads
            assert await r.json() == third
