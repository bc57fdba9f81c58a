"""The HTTP ingress: request checks and their OpenAI error JSON, auth, admin, readiness, metrics, 429."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import aiohttp
import pytest

from routerd.assembly import Routerd, build
from routerd.dataplane.upstream import make_session
from routerd.errors import BadRequest
from routerd.ingress.admin import add_admin_routes
from routerd.ingress.validate import read_head
from routerd.registry import Registry
from routerd.tracing import Tracing
from tests.fixtures.dataplane import EngineFactory, PlaneFactory, RunningPlane, plane_config

if TYPE_CHECKING:
    from routerd.fleet import FleetManager

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def plane(scripted_engine: EngineFactory, dataplane: PlaneFactory) -> RunningPlane:
    eng = await scripted_engine()
    return await dataplane([eng.url], http={"max_body_bytes": 2048})


async def error_of(resp: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    return err


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    (CHAT, b"{not json", None),
    (CHAT, b"[1, 2]", None),
    (CHAT, b'{"messages": []}', "model"),
    (CHAT, b'{"model": 3, "messages": []}', "model"),
    (CHAT, b'{"model": "m"}', "messages"),
    (CHAT, b'{"model": "m", "messages": "hi"}', "messages"),
    (CHAT, b'{"model": "m", "messages": [], "stream": "yes"}', "stream"),
    (COMP, b'{"model": "m", "prompt": 5}', "prompt"),
    # the queue's rules for a job's body, now the HTTP ingress's too (routerd.ingress.validate)
    (CHAT, b'{"model": "", "messages": [{"role": "user", "content": "x"}]}', "model"),
    (CHAT, b'{"model": "m", "messages": []}', "messages"),
    (CHAT, b'{"model": "m", "messages": ["x"]}', "messages"),
    (COMP, b'{"model": "m", "prompt": ""}', "prompt"),
    (COMP, b'{"model": "m", "prompt": [ ]}', "prompt"),
    (COMP, b'{"model": "m"}', "prompt"),
])
async def test_malformed_requests_are_400(plane: RunningPlane, client: aiohttp.ClientSession,
                                          endpoint: str, body: bytes, param: str | None) -> None:
    async with client.post(plane.url + endpoint, data=body,
                           headers={"Content-Type": "application/json"}) as r:
        err = await error_of(r, 400)
    assert err["param"] == param


def _model_and_stream(endpoint: str, body: bytes) -> tuple[str, bool]:
    head = read_head(endpoint, body)
    return head.model, bool(head.stream)


def test_the_body_check_accepts_what_clients_send() -> None:
    assert _model_and_stream(COMP, b'{"model":"m","prompt":["a","b"],"stream":true,"n":2}') == ("m", True)
    assert _model_and_stream(CHAT, b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":null}'
                             ) == ("m", False)
    with pytest.raises(BadRequest):
        read_head(COMP, b'{"model":"m","prompt":null}')


async def test_body_too_large_is_413(plane: RunningPlane, client: aiohttp.ClientSession) -> None:
    big = b'{"model": "m", "prompt": "' + b"x" * 4096 + b'"}'
    async with client.post(plane.url + COMP, data=big) as r:
        await error_of(r, 413)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit still holds
        yield big[:1000]
        yield big[1000:]

    async with client.post(plane.url + COMP, data=chunks()) as r:
        await error_of(r, 413)


async def test_reload_applies_the_body_limit(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                            client: aiohttp.ClientSession) -> None:
    eng = await scripted_engine()
    p = await dataplane([eng.url], http={"max_body_bytes": 2048})
    await p.wait_ready(1)
    big = b'{"model": "m", "prompt": "' + b"x" * 4096 + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        yield big[:1000]
        yield big[1000:]

    await p.dp.apply(plane_config([eng.url], http={"max_body_bytes": 8192}))
    async with client.post(p.url + COMP, data=big) as r:
        assert r.status == 200, await r.text()
    async with client.post(p.url + COMP, data=chunks()) as r:  # no Content-Length
        assert r.status == 200, await r.text()
    await p.dp.apply(plane_config([eng.url], http={"max_body_bytes": 1024}))
    async with client.post(p.url + COMP, data=chunks()) as r:
        await error_of(r, 413)


async def test_unknown_model_is_404_listing_valid_ones(plane: RunningPlane,
                                                       client: aiohttp.ClientSession) -> None:
    async with client.post(plane.url + COMP, json={"model": "gpt-9", "prompt": "x"}) as r:
        err = await error_of(r, 404)
    assert err["param"] == "model"
    assert "gpt-9" in err["message"]
    assert "`m`" not in err["message"]
    assert "Valid models: m" in err["message"]


async def test_api_keys(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                        client: aiohttp.ClientSession) -> None:
    eng = await scripted_engine()
    p = await dataplane([eng.url], http={"api_keys": ["k1", "k2"], "admin_api_key": "adm"})
    body = {"model": "m", "prompt": "x"}
    async with client.post(p.url + COMP, json=body) as r:
        await error_of(r, 401)
    async with client.post(p.url + COMP, json=body, headers={"Authorization": "Bearer nope"}) as r:
        await error_of(r, 401)
    async with client.post(p.url + COMP, json=body, headers={"Authorization": "Bearer k2"}) as r:
        assert r.status == 200
    async with client.get(p.url + "/v1/models") as r:
        await error_of(r, 401)
    async with client.get(p.url + "/admin/fleets", headers={"Authorization": "Bearer k1"}) as r:
        await error_of(r, 401)  # a client key is not an admin key
    async with client.get(p.url + "/admin/fleets", headers={"Authorization": "Bearer adm"}) as r:
        assert r.status == 200
    async with client.get(p.url + "/healthz") as r:
        assert r.status == 200  # operations routes stay open


async def test_models_readyz_admin_metrics(plane: RunningPlane, client: aiohttp.ClientSession) -> None:
    async with client.get(plane.url + "/v1/models") as r:
        models = await r.json()
    assert [m["id"] for m in models["data"]] == ["m"]
    assert models["object"] == "list"
    async with client.get(plane.url + "/readyz") as r:
        assert r.status == 200
        assert (await r.json())["ready"] is True
    async with client.get(plane.url + "/admin/fleets") as r:
        fleets = (await r.json())["fleets"]
    inst = fleets["f"]["instances"][0]
    assert inst["id"] == "f:static0"
    assert inst["state"] == "ready"
    assert inst["circuit"] == "closed"
    assert inst["scrape_age_s"] is not None
    assert inst["scrape_age_s"] < 1.0
    assert fleets["f"]["admission"]["limit"] > 0
    async with client.post(plane.url + COMP, json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 200
    async with client.get(plane.url + "/metrics") as r:
        text = await r.text()
    for needle in ('routerd_requests_total{code="200",fleet="f",instance="f:static0",'
                   'route="/v1/completions"} 1.0',
                   'routerd_instance_inflight{fleet="f",instance="f:static0"} 0.0',
                   "routerd_request_duration_seconds_bucket", "routerd_time_to_first_byte_seconds_count",
                   'routerd_circuit_state{fleet="f",instance="f:static0"} 0.0', "routerd_scrape_age_seconds"):
        assert needle in text, needle


async def test_readyz_503_names_the_fleet_without_ready_instances(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    eng = await scripted_engine(healthy=False)
    p = await dataplane([eng.url], wait=False, admission={"waiting_room_s": 0.2})
    async with client.get(p.url + "/readyz") as r:
        assert r.status == 503
        assert (await r.json())["not_ready"] == ["f"]
    async with client.post(p.url + COMP, json={"model": "m", "prompt": "x"}) as r:
        await error_of(r, 503)
    eng.healthy = True
    await p.wait_ready(1)
    async with client.get(p.url + "/readyz") as r:
        assert r.status == 200


async def test_over_capacity_is_429_with_retry_after(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    eng = await scripted_engine(default="hang")
    p = await dataplane([eng.url], admission={"max_inflight_per_instance": 1, "max_queued": 1})
    body = {"model": "m", "prompt": "x"}
    first = asyncio.create_task(client.post(p.url + COMP, json=body))
    await p.wait_for(lambda: eng.active == 1, what="first request at the engine")
    second = asyncio.create_task(client.post(p.url + COMP, json=body))  # waits in admission
    await p.wait_for(lambda: p.dp.admission.stats("f")["queued_http"] == 1, what="second queued")
    async with client.post(p.url + COMP, json=body) as r:
        await error_of(r, 429)
        assert int(r.headers["Retry-After"]) >= 1
    for t in (first, second):
        t.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    await p.wait_for(lambda: p.dp.admission.stats("f")["active"] == 0, what="admission released")
    await p.wait_for(lambda: p.inflight() == 0, what="in-flight released")


async def test_reload_swaps_keys_policy_and_static_urls(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    old = await scripted_engine()
    new = await scripted_engine()
    p = await dataplane([old.url])
    await p.dp.apply(plane_config([new.url], http={"api_keys": ["k"]}, routing={"policy": "round_robin"}))
    body = {"model": "m", "prompt": "x"}
    async with client.post(p.url + COMP, json=body) as r:
        await error_of(r, 401)
    await p.wait_ready(1)  # the changed URL is a new instance: in rotation once it answers /health
    async with client.post(p.url + COMP, json=body, headers={"Authorization": "Bearer k"}) as r:
        assert r.status == 200
    assert (old.requests, new.requests) == (0, 1)
    async with client.get(p.url + "/admin/fleets") as r:
        status = await r.json()
    assert status["policy"] == "round_robin"
    assert [i["url"] for i in status["fleets"]["f"]["instances"]] == [new.url]


async def test_drain_stops_intake_keeps_streams_then_ends_them_with_an_error_event(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    eng = await scripted_engine(chunks=400, chunk_delay_s=0.01)
    p = await dataplane([eng.url])
    body = {"model": "m", "prompt": "x", "stream": True}
    async with client.post(p.url + COMP, json=body) as r:
        assert await r.content.readline()  # the stream is flowing
        await p.listener.stop_intake()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as fresh, fresh.post(p.url + COMP, json=body):
                pass  # the listener is closed: new clients are refused
        assert not await p.listener.wait_idle(0.1)  # the open stream holds the drain
        await p.listener.close_streams("routerd is shutting down")
        text = await r.text()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert "routerd is shutting down" in events[-2]
    assert await p.listener.wait_idle(1.0)
    await p.wait_for(lambda: eng.cancelled == 1, timeout=3, what="engine request aborted")
    await p.wait_for(lambda: p.inflight() == 0, what="in-flight released")


async def test_unknown_routes_and_unexpected_failures_answer_in_openai_json(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    # Two instances, so the policy is consulted (one candidate skips it).
    plane = await dataplane([(await scripted_engine()).url, (await scripted_engine()).url])
    async with client.get(plane.url + "/v1/nope") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == 404
    async with client.get(plane.url + CHAT) as r:
        assert r.status == 405
        assert (await r.json())["error"]["code"] == 405

    class Broken:
        name = "broken"

        def choose(self, candidates: Any, rng: Any) -> Any:
            raise LookupError("a faulty policy plugin")

    router = plane.dp.serving.router
    good = router.policy
    router.policy = Broken()  # type: ignore[assignment]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        async with client.post(plane.url + CHAT, json=body) as r:
            assert r.status == 500
            err = (await r.json())["error"]
            assert err["type"] == "InternalServerError"
    finally:
        router.policy = good
    async with client.post(plane.url + CHAT, json=body) as r:  # the server goes on
        assert r.status == 200
    assert all(i.inflight == 0 for i in plane.dp.registry.instances("f"))


async def test_every_response_carries_x_request_id(scripted_engine: EngineFactory, dataplane: PlaneFactory,
                                                   client: aiohttp.ClientSession) -> None:
    p = await dataplane([(await scripted_engine()).url], http={"api_keys": ["k"]})
    key = {"Authorization": "Bearer k"}
    cases: list[tuple[str, str, Any, dict[str, str], int]] = [
        ("POST", COMP, {"model": "m", "prompt": "x"}, key, 200),
        ("POST", COMP, {"model": "m", "prompt": "x", "stream": True}, key, 200),
        ("POST", COMP, {"model": "nope", "prompt": "x"}, key, 404),
        ("POST", COMP, {"model": "m"}, key, 400),
        ("POST", COMP, {"model": "m", "prompt": "x"}, {}, 401),
        ("GET", "/v1/nope", None, {}, 404),
        ("GET", CHAT, None, {}, 405),
        ("GET", "/v1/models", None, key, 200),
        ("GET", "/healthz", None, {}, 200),
        ("GET", "/metrics", None, {}, 200),
        ("GET", "/admin/fleets", None, {}, 200),
    ]
    for i, (method, path, body, headers, status) in enumerate(cases):
        sent = f"client-id.{i}"
        async with client.request(method, p.url + path, json=body,
                                  headers={**headers, "X-Request-Id": sent}) as r:
            await r.read()
            assert r.status == status, (path, r.status)
            assert r.headers.get("X-Request-Id") == sent, (path, r.headers)
    seen = set()
    for sent in (None, "x" * 129, "has space", "tab\tinside"):  # absent or not sane: routerd's own
        async with client.get(p.url + "/healthz", headers={"X-Request-Id": sent} if sent else {}) as r:
            rid = r.headers["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid), rid
        seen.add(rid)
    assert len(seen) == 4


async def test_admin_fleets_reports_one_replica_per_static_url(
        scripted_engine: EngineFactory, dataplane: PlaneFactory, client: aiohttp.ClientSession) -> None:
    p = await dataplane([(await scripted_engine()).url for _ in range(3)])
    async with client.get(p.url + "/admin/fleets") as r:
        fleet = (await r.json())["fleets"]["f"]
    assert (fleet["replicas"], fleet["ready"], len(fleet["instances"])) == (3, 3, 3)


class _Fleets:
    """What the admin routes call on the fleet manager, recorded (the real one needs Ray)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def restart_instance(self, instance_id: str) -> dict[str, Any]:
        self.calls.append(("restart", instance_id))
        return {"id": instance_id}

    async def drain_instance(self, instance_id: str, timeout_s: float) -> dict[str, Any]:
        self.calls.append(("drain", instance_id, timeout_s))
        return {"id": instance_id}

    def max_replicas(self, fleet: str) -> tuple[int, str]:
        return 4, "a test's bound"

    async def set_replicas(self, fleet: str, replicas: int) -> dict[str, Any]:
        self.calls.append(("replicas", fleet, replicas))
        return {"fleet": fleet, "replicas": replicas}


@contextlib.asynccontextmanager
async def admin_plane(urls: list[str], host: str) -> AsyncIterator[tuple[str, Routerd, _Fleets]]:
    """A data plane with the admin write routes of a fake fleet manager, listening on ``host``."""
    fleets = _Fleets()
    cfg = plane_config(urls, http={"host": host})
    async with make_session(cfg.routing) as session:
        dp = build(cfg, Registry(), session, tracing=Tracing.off())
        async with dp.serving.listener as listener, asyncio.TaskGroup() as tg:
            url = await listener.start(lambda app: add_admin_routes(app, cast("FleetManager", fleets),
                                                                    dp.watch.static_health,
                                                                    lambda: dp.http.cfg.http.admin_api_key),
                                       port=0)
            tasks = [tg.create_task(coro) for coro in dp.loops().values()]
            try:
                yield url, dp, fleets
            finally:
                for t in tasks:
                    t.cancel()


ADMIN_ROUTES = [("GET", "/admin/fleets", None), ("POST", "/admin/instances/g:0/restart", {}),
                ("POST", "/admin/instances/g:0/drain", {"timeout_s": 1}),
                ("POST", "/admin/fleets/g/replicas", {"replicas": 2})]


def non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP: nothing is sent; the kernel picks the outgoing address
        except OSError:
            return None
        addr: str = s.getsockname()[0]
    return None if ipaddress.ip_address(addr).is_loopback else addr


async def test_admin_routes_without_a_key_answer_loopback_only(scripted_engine: EngineFactory,
                                                               client: aiohttp.ClientSession) -> None:
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    eng = await scripted_engine()
    async with admin_plane([eng.url], addr) as (url, dp, fleets):
        for method, path, body in ADMIN_ROUTES:
            async with client.request(method, url + path, json=body) as r:
                err = await error_of(r, 401)
                assert "loopback" in err["message"], path
        assert fleets.calls == []
        await dp.apply(plane_config([eng.url], http={"host": addr, "admin_api_key": "adm"}))
        for method, path, body in ADMIN_ROUTES:  # with a key, any address that has it
            async with client.request(method, url + path, json=body,
                                      headers={"Authorization": "Bearer adm"}) as r:
                assert r.status == 200, (path, await r.text())
        assert len(fleets.calls) == 3
    async with admin_plane([eng.url], "127.0.0.1") as (url, dp, fleets):
        for method, path, body in ADMIN_ROUTES:  # no key: loopback is served
            async with client.request(method, url + path, json=body) as r:
                assert r.status == 200, (path, await r.text())
        assert len(fleets.calls) == 3


async def test_admin_drain_wait_is_bounded(scripted_engine: EngineFactory,
                                           client: aiohttp.ClientSession) -> None:
    async with admin_plane([(await scripted_engine()).url], "127.0.0.1") as (url, _, fleets):
        for timeout_s in (1e9, -1):
            drain = url + "/admin/instances/f:static0/drain"
            async with client.post(drain, json={"timeout_s": timeout_s}) as r:
                err = await error_of(r, 400)
            assert "timeout_s" in err["message"]
        assert fleets.calls == []
