"""The simulated engine's KV-cache events: vLLM's wire, so routerd's subscriber is tested on the real
protocol without a GPU.

Same as vLLM 0.32's ``ZmqEventPublisher``: a PUB socket sending ``[topic, 8-byte big-endian seq,
msgpack [ts, events, data_parallel_rank]]`` once per engine step that changed the cache (seq from 0,
again from 0 after a restart), and a ROUTER socket that resends the last ``buffer_steps`` batches from
a requested seq and ends with seq −1. Events come in either wire form (``form``): ``"map"`` — tagged maps,
what vLLM sends since 2026 — or ``"array"`` — the positional arrays before — so the tolerant decoder
meets both. Unlike vLLM, both sockets always *bind* (the sim has no central collector to connect to),
so tests can keep them on 127.0.0.1; a wildcard host binds the sim's own HTTP host, as vLLM binds its
node IP for ``tcp://*:0``.

Faults (:class:`~routerd.sim.faults.Faults`): ``kv_events_drop_rate`` leaves that fraction of batches
unsent (still in the replay buffer, as vLLM's PUB drops past ``hwm``), ``kv_events_reorder`` holds a
batch back and sends it after the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec
import zmq
import zmq.asyncio

from routerd import log
from routerd.vllm_wire.kv_events import BlockRemoved, BlockStored, KvEvent

from .faults import Faults

_log = log.get("routerd.sim.kv_events")
_pack = msgspec.msgpack.Encoder()
_END = (-1).to_bytes(8, "big", signed=True)
EventForm = Literal["map", "array"]


class KvEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` fields, as JSON, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_config(text: str) -> KvEventsConfig | None:
    """The flag's JSON, or None when empty; raises ``msgspec.ValidationError`` with the field at fault."""
    if not text:
        return None
    try:
        return msgspec.json.decode(text, type=KvEventsConfig)
    except msgspec.DecodeError as e:
        raise msgspec.ValidationError(f"--kv-events-config: {e}") from None


def _wire(event: KvEvent, form: EventForm) -> Any:
    """One event as vLLM puts it on the wire (field order of vllm 0.32's structs)."""
    if isinstance(event, BlockStored):
        fields: dict[str, Any] = {
            "block_hashes": list(event.block_hashes), "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids), "block_size": event.block_size, "lora_id": event.lora_id,
            "medium": event.medium, "lora_name": event.lora_name}
        if event.lora_name is not None:
            # vLLM's per-block extra keys, published untagged: the adapter's name for every block
            fields["extra_keys"] = [[event.lora_name] for _ in event.block_hashes]
        kind = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": list(event.block_hashes), "medium": event.medium}
        kind = "BlockRemoved"
    else:
        fields, kind = {}, "AllBlocksCleared"
    if form == "array":
        return [kind, *fields.values()]
    return {"type": kind, **fields}


def _bound(sock: zmq.Socket[Any], endpoint: str, host: str) -> str:
    """Bind; a wildcard (``tcp://*:N``) binds the engine's own ``host`` when that is an address, as vLLM
    binds its node IP, not every interface (a host name: every interface, as before); port 0 picks a
    free port, and the endpoint with it is returned."""
    if endpoint.startswith("tcp://*:"):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            where = "0.0.0.0"
        else:
            where = f"[{ip}]" if ip.version == 6 else str(ip)
            if ip.version == 6:
                sock.setsockopt(zmq.IPV6, 1)
        endpoint = f"tcp://{where}:{endpoint[len('tcp://*:'):]}"
    sock.bind(endpoint)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class KvEventPublisher:
    """One engine's publisher. :meth:`start` binds (endpoints then hold the real ports), :meth:`publish`
    is called by the engine at the end of a step, :meth:`stop` closes; the replay task is owned here."""

    def __init__(self, config: KvEventsConfig, faults: Faults, *, form: EventForm = "map",
                 dp_rank: int = 0, wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.form = form
        self.dp_rank = dp_rank
        self.faults = faults
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self.published = 0
        self.dropped = 0
        self._clock = wall_clock
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._held: list[bytes] | None = None
        self._ctx = zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, host: str = "127.0.0.1") -> None:
        """Bind both sockets (a wildcard endpoint on ``host``, the engine's HTTP host)."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        self._pub = pub
        self.endpoint = _bound(pub, self.config.endpoint, host)
        if self.config.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self._router = router
            self.replay_endpoint = _bound(router, self.config.replay_endpoint, host)
            self._task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay")
        _log.info("sim_kv_events_publishing", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                  form=self.form, topic=self.config.topic)

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.wait([task])
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def sources(self) -> dict[str, Any]:
        """``GET /kv_event_sources``: this rank's publisher config with the bound endpoints."""
        return {str(self.dp_rank): {**msgspec.structs.asdict(self.config), "publisher": "zmq",
                                    "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint}}

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Number, buffer and send one batch (never blocks: PUB drops when a subscriber is past hwm)."""
        if not events or self._pub is None:
            return
        seq = self._seq
        self._seq += 1
        payload = _pack.encode([self._clock(), [_wire(e, self.form) for e in events], self.dp_rank])
        self._buffer.append((seq, payload))
        frames = [self._topic, seq.to_bytes(8, "big"), payload]
        self.published += 1
        if self.faults.draw_kv_drop():
            self.dropped += 1
            return
        if self.faults.kv_events_reorder and self._held is None:
            self._held = frames
            return
        self._send(frames)
        if self._held is not None:
            held, self._held = self._held, None
            self._send(held)

    def _send(self, frames: list[bytes]) -> None:
        assert self._pub is not None
        with contextlib.suppress(zmq.Again):
            # PUB never waits: a full pipe drops, as vLLM's does; the replay buffer still holds it.
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)

    async def _serve_replay(self) -> None:
        """Answer each ``[id, b"", start_seq]`` with the buffered batches from it, then seq −1."""
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                _log.warning("sim_kv_replay_bad_request", frames=len(frames))
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([client, b"", b"", _END, b""])
