"""vLLM's KV-cache events: the tolerant decoder, and the subscriber on real ZMQ sockets against the
simulated engine's publisher (in-process and as a process) — in order, gaps replayed, restarts and
clears rebuilding the view, silence marked stale."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest

from routerd import _aio
from routerd._net import free_port
from routerd.routing.engine_cache.blocks import EngineBlocks
from routerd.routing.engine_cache.subscriber import KvEventSubscriber, ViewHealth
from routerd.sim.server import SimEngine
from routerd.sim_tokens import token_ids
from routerd.vllm_wire import block_hash
from routerd.vllm_wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
)
from tests.fixtures.helpers import eventually
from tests.fixtures.sim import SimEngineFactory, SimProcessFactory

# ---- vLLM 0.32's structs, declared as in vllm/distributed/kv_events.py, in both wire forms --------


class _MapEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class _ArrEvent(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    pass


class MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    session_id: str | None = None


class MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class ArrStored(_ArrEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrRemoved(_ArrEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_enc = msgspec.msgpack.Encoder()


@pytest.mark.parametrize("form", ["map", "array"])
def test_both_wire_forms_of_vllms_structs_decode_alike(form: str) -> None:
    stored, removed = (MapStored, MapRemoved) if form == "map" else (ArrStored, ArrRemoved)
    payload = _enc.encode(Batch(ts=12.5, events=[
        stored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
               lora_id=None, medium="GPU", lora_name=None),
        removed(block_hashes=[1], medium="GPU"),
        MapCleared(),
    ], data_parallel_rank=0))
    batch = decode_batch(7, payload)
    assert batch.seq == 7
    assert batch.ts == 12.5
    assert batch.dp_rank == 0
    assert batch.skipped == 0
    assert batch.events == (
        BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=tuple(range(32)), block_size=16,
                    medium="GPU"),
        BlockRemoved(block_hashes=(1,), medium="GPU"),
        AllBlocksCleared(),
    )


def test_unknown_kinds_fields_and_bad_events_are_skipped_and_counted() -> None:
    digest = bytes(range(32))
    payload = _enc.encode({"ts": 1.0, "data_parallel_rank": 3, "new_batch_field": True, "events": [
        {"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": None, "token_ids": [1] * 16,
         "block_size": 16, "medium": None, "brand_new_field": {"x": 1}},
        {"type": "BlockPinned", "block_hashes": [5]},           # a kind from the future
        ["BlockRemoved", "not a list"],                        # a malformed event
        {"no_type": 1},
        ["BlockStored", [9], 8, [1] * 16, 16],                 # an old, short positional event
    ]})
    batch = decode_batch(0, payload)
    assert batch.skipped == 3
    assert batch.dp_rank == 3
    first, last = batch.events
    assert isinstance(first, BlockStored)
    assert first.block_hashes == (block_hash.external(digest),)
    assert first.block_hashes[0] == int.from_bytes(digest[-8:], "big")  # the int form of the same key
    assert isinstance(last, BlockStored)
    assert last.parent_block_hash == 8
    assert last.medium is None


def test_odd_but_readable_numbers_decode_as_before() -> None:
    """Block keys and token ids are read in C when they are plain ints; what is not (a negative key,
    a float or bool token id) takes the tolerant path and decodes as it always did."""
    big, negative = (1 << 64) - 1, -1
    payload = _enc.encode([1.0, [{"type": "BlockStored", "block_hashes": [big, negative, 7],
                                  "token_ids": [1.0, 2, True], "block_size": 16}], None])
    (ev,) = decode_batch(0, payload).events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (block_hash.external(big), block_hash.external(negative), 7)
    assert ev.token_ids == (1, 2, 1)


@pytest.mark.parametrize("payload", [b"\xc1", _enc.encode("text"), _enc.encode([1.0, "events"])])
def test_an_unreadable_batch_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(0, payload)


# ---- the subscriber against the simulated engine ---------------------------------------------------


def _kv_config(**over: Any) -> str:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
           "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv", **over}
    return json.dumps(cfg)


class Subscribed:
    """A subscriber task over an EngineBlocks, cancelled at teardown."""

    def __init__(self, endpoint: str, replay: str | None, **kw: Any) -> None:
        self.view = EngineBlocks()
        self.sub = KvEventSubscriber(endpoint, self.view, replay_endpoint=replay, topic="kv",
                                     replay_timeout_s=kw.pop("replay_timeout_s", 2.0),
                                     probe_interval_s=kw.pop("probe_interval_s", 0.2), **kw)
        self.task = asyncio.create_task(self.sub.run())

    async def close(self) -> None:
        stuck = await _aio.cancel_and_wait([self.task], 5.0)
        assert not stuck, f"the subscriber did not end when cancelled: {_aio.where(self.task)}"


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[..., Subscribed]]:
    subs: list[Subscribed] = []

    def start(endpoint: str, replay: str | None, **kw: Any) -> Subscribed:
        s = Subscribed(endpoint, replay, **kw)
        subs.append(s)
        return s

    yield start
    for s in subs:
        await s.close()


async def _poll(cond: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    assert await eventually(cond, timeout_s, step=0.02), what


def _prompt(conv: int, turn: int) -> str:
    """Conversation ``conv`` up to ``turn``: each turn extends the last, so prefixes are shared."""
    return " ".join(f"c{conv} t{t} " + " ".join(f"w{conv}x{t}x{i}" for i in range(40))
                    for t in range(turn + 1))


def _keys(prompt: str) -> list[int]:
    """What a router computes for a prompt to the sim: its token ids, keyed as vLLM keys blocks."""
    return block_hash.block_keys(token_ids(prompt.split()), 16, block_hash.none_hash(None))


async def _send(session: aiohttp.ClientSession, url: str, prompt: str) -> None:
    async with session.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()


async def _traffic(url: str, n_conv: int = 6, turns: int = 4) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for turn in range(turns):
            await asyncio.gather(*(_send(s, url, _prompt(c, turn)) for c in range(n_conv)))


def _in_sync(eng: SimEngine, sub: Subscribed) -> Callable[[], bool]:
    return lambda: (sub.view.keys() == eng.engine.cached_block_keys()
                    and sub.sub.health is not ViewHealth.STALE)


def _endpoints(eng: SimEngine) -> tuple[str, str]:
    assert eng.kv_events is not None
    assert eng.kv_events.replay_endpoint is not None
    return eng.kv_events.endpoint, eng.kv_events.replay_endpoint


@pytest.mark.parametrize("form", ["map", "array"])
async def test_the_view_equals_the_engines_cache_under_eviction(
        sim_engine: SimEngineFactory, subscribe: Callable[..., Subscribed], form: str) -> None:
    # 40 blocks of 16 tokens; six conversations of four turns make 60 distinct blocks: evictions.
    eng = await sim_engine(kv_events_config=_kv_config(), kv_events_form=form, num_gpu_blocks=40,
                           max_model_len=640, ttft_ms=1, itl_ms=1)
    sub = subscribe(*_endpoints(eng))
    await _poll(lambda: sub.sub.health is ViewHealth.COMPLETE, "in sync with an idle engine")
    await _traffic(eng.url)
    await _poll(_in_sync(eng, sub), "the view is the engine's cache")
    s = sub.sub.stats
    assert s.events > 0
    assert s.skipped_events == 0
    assert s.gaps == 0
    assert s.unrecovered_gaps == 0
    sent = set().union(*(_keys(_prompt(c, t)) for c in range(6) for t in range(4)))
    assert len(sent) == 60
    assert 0 < len(sub.view) <= 40
    assert sub.view.overflow == 0


async def test_the_keys_are_the_ones_a_router_computes_from_the_prompt(
        sim_engine: SimEngineFactory, subscribe: Callable[..., Subscribed]) -> None:
    eng = await sim_engine(kv_events_config=_kv_config(), ttft_ms=1, itl_ms=1)
    sub = subscribe(*_endpoints(eng))
    await _poll(lambda: sub.sub.health is ViewHealth.COMPLETE, "in sync")
    prompt = _prompt(1, 2)
    async with aiohttp.ClientSession() as s:
        await _send(s, eng.url, prompt)
    keys = _keys(prompt)
    await _poll(lambda: sub.view.matched_blocks(keys) == len(keys), "every full block announced")
    assert len(keys) == len(prompt.split()) // 16
    assert sub.view.keys() == set(keys)


@pytest.mark.parametrize("fault", [{"kv_events_drop_rate": 0.5}, {"kv_events_reorder": True}])
async def test_dropped_or_reordered_batches_are_replayed_in_order(
        sim_engine: SimEngineFactory, subscribe: Callable[..., Subscribed], fault: dict[str, Any]) -> None:
    eng = await sim_engine(kv_events_config=_kv_config(), num_gpu_blocks=40, max_model_len=640, ttft_ms=1,
                           itl_ms=1, seed=3)
    sub = subscribe(*_endpoints(eng))
    await _poll(lambda: sub.sub.health is ViewHealth.COMPLETE, "in sync")
    eng.faults.set(**fault)
    await _traffic(eng.url)
    await _poll(_in_sync(eng, sub), "the view is the engine's cache despite the fault")
    s = sub.sub.stats
    assert s.gaps > 0
    assert s.replayed_batches > 0
    assert s.unrecovered_gaps == 0
    assert s.restarts == 0
    assert sub.view.resets == 0
    assert sub.sub.health is ViewHealth.COMPLETE


async def test_a_late_subscriber_gets_the_history_from_the_replay_buffer(
        sim_engine: SimEngineFactory, subscribe: Callable[..., Subscribed]) -> None:
    eng = await sim_engine(kv_events_config=_kv_config(), num_gpu_blocks=40, max_model_len=640, ttft_ms=1,
                           itl_ms=1)
    await _traffic(eng.url, turns=2)
    sub = subscribe(*_endpoints(eng))
    await _poll(_in_sync(eng, sub), "history replayed")
    assert sub.sub.health is ViewHealth.COMPLETE
    assert sub.sub.stats.replayed_batches > 0


async def test_history_the_buffer_no_longer_holds_leaves_a_partial_view(
        sim_engine: SimEngineFactory, subscribe: Callable[..., Subscribed]) -> None:
    eng = await sim_engine(kv_events_config=_kv_config(buffer_steps=2), ttft_ms=1, itl_ms=1)
    async with aiohttp.ClientSession() as s:
        for c in range(5):  # one step each: five batches, the buffer keeps the last two
            await _send(s, eng.url, _prompt(c, 0))
    sub = subscribe(*_endpoints(eng))
    await _poll(lambda: sub.sub.health is ViewHealth.PARTIAL, "partial: seq 0..2 are gone")
    assert sub.view.keys() < eng.engine.cached_block_keys()  # it holds what it holds, no more
    async with aiohttp.ClientSession() as s:
        await _send(s, eng.url, _prompt(9, 0))
        await s.post(f"{eng.url}/reset_prefix_cache")
    await _poll(lambda: sub.sub.health is ViewHealth.COMPLETE and len(sub.view) == 0,
                "a clear makes the view complete again (and empty)")


async def test_without_a_replay_socket_a_gap_empties_the_view(
        sim_engine: SimEngineFactory, subscribe: Callable[..., Subscribed]) -> None:
    eng = await sim_engine(kv_events_config=_kv_config(replay_endpoint=None), ttft_ms=1, itl_ms=1)
    assert eng.kv_events is not None
    sub = subscribe(eng.kv_events.endpoint, None)
    async with aiohttp.ClientSession() as s:
        # PUB delivers nothing until the subscription arrived: publish until the view shows it.
        for c in range(50):
            await _send(s, eng.url, _prompt(c, 0))
            if len(sub.view):
                break
        assert len(sub.view)
        eng.faults.set(kv_events_drop_rate=1.0)
        await _send(s, eng.url, _prompt(100, 0))
        eng.faults.set(kv_events_drop_rate=0.0)
        await _send(s, eng.url, _prompt(101, 0))
    await _poll(lambda: sub.sub.stats.unrecovered_gaps == 1, "the gap could not be filled")
    assert sub.view.keys() == set(_keys(_prompt(101, 0)))
    assert sub.view.resets == 1
    assert sub.sub.health is ViewHealth.PARTIAL


async def test_a_silent_publisher_makes_the_view_stale(
        sim_engine: SimEngineFactory, subscribe: Callable[..., Subscribed]) -> None:
    eng = await sim_engine(kv_events_config=_kv_config(), ttft_ms=1, itl_ms=1)
    sub = subscribe(*_endpoints(eng), replay_timeout_s=0.3)
    await _poll(lambda: sub.sub.health is ViewHealth.COMPLETE, "in sync")
    await eng.stop()
    await _poll(lambda: sub.sub.health is ViewHealth.STALE, "no answer to the probe: stale")


async def test_an_engine_restart_rebuilds_the_view(
        sim_process: SimProcessFactory, subscribe: Callable[..., Subscribed]) -> None:
    pub, rep = free_port(), free_port()
    cfg = _kv_config(endpoint=f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{rep}")
    first = await sim_process(kv_events_config=cfg, ttft_ms=1, itl_ms=1)
    sub = subscribe(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")

    def keys(conv: int, turn: int) -> set[int]:
        return set(_keys(_prompt(conv, turn)))

    await _poll(lambda: sub.sub.health is ViewHealth.COMPLETE, "in sync")
    await _traffic(first.url, n_conv=3, turns=2)
    before = set().union(*(keys(c, 1) for c in range(3)))
    await _poll(lambda: sub.view.keys() == before, "the first engine's blocks")
    await asyncio.to_thread(first.stop)
    second = await sim_process(kv_events_config=cfg, ttft_ms=1, itl_ms=1)
    async with aiohttp.ClientSession() as s:
        await _send(s, second.url, _prompt(7, 0))
    await _poll(lambda: sub.view.keys() == keys(7, 0), "only the restarted engine's blocks")
    assert sub.sub.stats.restarts == 1
    assert sub.sub.health is ViewHealth.COMPLETE


async def test_a_restart_while_idle_is_noticed_by_the_probe(
        sim_process: SimProcessFactory, subscribe: Callable[..., Subscribed]) -> None:
    pub, rep = free_port(), free_port()
    cfg = _kv_config(endpoint=f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{rep}")
    first = await sim_process(kv_events_config=cfg, ttft_ms=1, itl_ms=1)
    sub = subscribe(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
    await _traffic(first.url, n_conv=2, turns=1)
    await _poll(lambda: len(sub.view) > 0 and sub.sub.health is ViewHealth.COMPLETE, "in sync")
    await asyncio.to_thread(first.stop)
    await sim_process(kv_events_config=cfg, ttft_ms=1, itl_ms=1)  # publishes nothing yet
    await _poll(lambda: len(sub.view) == 0 and sub.sub.health is ViewHealth.COMPLETE,
                "an engine that restarted holds nothing")
    assert sub.sub.stats.restarts == 1


async def test_kv_event_sources_names_the_bound_endpoints(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(kv_events_config=_kv_config())
    plain = await sim_engine()
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{eng.url}/kv_event_sources") as r:
            body = await r.json()
        async with s.get(f"{plain.url}/kv_event_sources") as r:
            assert await r.json() == {}
    src = body["0"]
    assert (src["endpoint"], src["replay_endpoint"]) == _endpoints(eng)
    assert src["topic"] == "kv"
    assert src["publisher"] == "zmq"
    assert not src["endpoint"].endswith(":0")


def test_a_bad_kv_events_config_is_refused() -> None:
    from routerd.sim.server import main
    assert main(["--port", "1", "--model", "m", "--kv-events-config", '{"endpoint": 5}']) == 2
    assert main(["--port", "1", "--model", "m", "--kv-events-config", "{not json"]) == 2




async def test_garbage_on_the_wire_is_counted_never_fatal(subscribe: Callable[..., Subscribed]) -> None:
    """A publisher that sends nonsense — wrong frame counts, a short seq, no msgpack, a bomb of nesting —
    and a replay socket that answers nonsense: each is counted and skipped; the next good batch applies."""
    import msgspec as _m
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind("tcp://127.0.0.1:0")
    router.bind("tcp://127.0.0.1:0")

    async def answer_replays() -> None:
        while True:
            client, _, _start = await router.recv_multipart()
            await router.send_multipart([client, b"", b"kv", b"\x00" * 8, b"\xc1"])  # seq 0, no msgpack
            await router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    replier = asyncio.create_task(answer_replays())
    try:
        sub = subscribe(pub.getsockopt_string(zmq.LAST_ENDPOINT), router.getsockopt_string(zmq.LAST_ENDPOINT))
        good = _m.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [7], "token_ids": [1] * 16,
                                          "parent_block_hash": None, "block_size": 16, "medium": "GPU"}], 0])
        zero = b"\x00" * 8
        garbage = [[b"kv"], [b"kv", b"\x00\x01", good], [b"kv", zero, b"not msgpack \xc1"],
                   [b"kv", zero, b"\x91" * 5000 + b"\xc0"], [b"kv", zero, _m.msgpack.encode({"x": 1})]]

        def applied() -> bool:
            return 7 in sub.view

        for _ in range(200):  # PUB drops until the subscription has arrived: repeat until applied
            for frames in garbage:
                await pub.send_multipart(frames)
            await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), good])
            if await eventually(applied, 0.05, step=0.01):
                break
        assert applied()
        assert sub.sub.stats.undecodable >= len(garbage)
        assert not sub.task.done()  # still running
    finally:
        replier.cancel()
        await asyncio.wait([replier])
        pub.close(linger=0)
        router.close(linger=0)



async def test_a_subscriber_on_a_busy_stream_always_ends_when_cancelled() -> None:
    """Cancelled while batches keep arriving (an engine dropped from the fleet, routerd stopping): a
    cancel lost inside ``asyncio.wait_for`` on 3.11 sent the subscriber back to receiving, and the
    daemon's stop (or the test's teardown) waited for it for ever."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    frames = [b"kv", (0).to_bytes(8, "big"), b"\xc1"]  # unreadable: counted and skipped, cheap to send
    rng = random.Random(21)

    async def publish() -> None:
        while True:
            for _ in range(rng.randint(1, 20)):
                await pub.send_multipart(frames)
            await asyncio.sleep(rng.random() * 0.001)

    publisher = asyncio.create_task(publish())
    try:
        for trial in range(60):
            sub = KvEventSubscriber(endpoint, EngineBlocks(), topic="kv", probe_interval_s=0.002)
            task = asyncio.create_task(sub.run())
            await asyncio.sleep(0.005 + rng.random() * 0.02)
            task.cancel()
            if await _aio.cancel_and_wait([task], 3.0):
                where = _aio.where(task)
                pytest.fail(f"trial {trial}: the cancelled subscriber is still running: {where}")
    finally:
        publisher.cancel()
        await asyncio.wait([publisher])
        pub.close(linger=0)

def test_the_view_is_bounded_by_the_engines_kv_capacity() -> None:
    """An engine holds at most its KV's blocks, so its view does too (the oldest go first); and the
    speculative entries of requests sent there — however fast they come — at most four times that."""
    now = 100.0
    view = EngineBlocks(64, clock=lambda: now)
    keys = list(range(1, 1001))
    view.apply(EventBatch(seq=0, ts=0.0, events=(
        BlockStored(block_hashes=tuple(keys), parent_block_hash=None, token_ids=(), block_size=16,
                    medium="GPU"),)))
    assert len(view) == 64
    assert view.keys() == set(keys[-64:])  # the most recently stored
    for n in range(100):  # 100 requests of 50 new blocks each, within the speculative TTL
        view.speculate(list(range(10_000 + 50 * n, 10_050 + 50 * n)))
    assert len(view._speculative) <= 4 * 64
    assert view.matched_blocks(list(range(10_000 + 50 * 99, 10_050 + 50 * 99))) == 50  # the newest kept
