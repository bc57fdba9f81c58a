"""vLLM's KV-cache events off the wire, decoded tolerantly, in order, with what was missed replayed.

The wire and its tolerant decoding are :mod:`routerd.vllm_wire.kv_events`'s: one ZMQ PUB message per
scheduler step that changed the cache, frames ``[topic, 8-byte big-endian seq, msgpack batch]``.

Delivery: PUB drops what a subscriber misses (before it subscribed, while disconnected, more than
``hwm`` behind); the seq numbers show it. The publisher's ROUTER socket resends its last
``buffer_steps`` batches from a requested seq (request ``[b"", seq as 8 bytes]`` from a DEALER; replies
``[b"", topic, seq, payload]`` …, then ``[b"", b"", -1 as 8 bytes, b""]``). :class:`KvEventSubscriber`
applies batches to its :class:`BatchSink` strictly in seq order: a gap is filled from the replay socket
before the batch after it is applied; a gap the buffer no longer covers resets the sink (what it holds
would be wrong in both directions); a seq that goes *back* is the engine restarted (the sink is reset)
unless it is a batch already applied arriving late (the same payload), which is skipped. An idle
engine publishes nothing, so silence proves nothing: every ``probe_interval_s`` the subscriber asks
the replay socket for what follows its last seq — an answer proves the publisher alive *and* delivers
a lost last batch, which no later batch would reveal; no answer marks the view stale.

A stream outlives one subscription to it: a new subscriber may be handed the previous one's
:class:`SubscriberStats`, so its counters go on (a Prometheus counter never goes back) and the history
it finds is judged against where the previous one left the stream — a publisher whose seq went back,
that holds other content at that seq, or that has published nothing is an engine that restarted while
nobody listened, and is counted as a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from routerd import log

from ...vllm_wire.kv_events import (
    END_SEQ,
    MAX_MESSAGE_BYTES,
    AllBlocksCleared,
    DecodeError,
    EventBatch,
    decode_batch,
    decode_seq,
)

_log = log.get("routerd.routing.engine_cache.subscriber")


class BatchSink(Protocol):
    """What the subscriber feeds: batches in seq order, and a reset when its history broke."""

    def apply(self, batch: EventBatch) -> None: ...

    def reset(self, reason: str) -> None: ...


class ViewHealth(enum.Enum):
    """How far an engine's event view can be trusted.

    ``COMPLETE``: every batch since the engine started (or last cleared its cache) was applied.
    ``PARTIAL``: history before some point is missing (subscribed after the replay buffer moved on, or
    a gap it no longer held, after which the view was emptied): what it holds is held, older blocks
    may be missing. ``STALE``: not in sync, or the publisher did not answer — routing must not use it."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    STALE = "stale"


@dataclass
class SubscriberStats:
    """Counters shown by status and ``/metrics``; only the subscriber writes them."""

    batches: int = 0
    events: int = 0
    skipped_events: int = 0
    undecodable: int = 0
    gaps: int = 0
    replayed_batches: int = 0
    unrecovered_gaps: int = 0
    restarts: int = 0
    probes: int = 0
    last_seq: int | None = None
    last_crc: int | None = None  # CRC-32 of the last applied batch's payload: where the stream was left
    last_event_ts: float | None = None  # the engine's wall clock at its last applied batch
    last_heard: float | None = None  # our monotonic clock: a batch or a replay answer


@dataclass
class _Applied:
    """Digests of recently applied payloads by seq: a late copy is skipped, and the last one proves
    that the publisher answering a replay is the one whose history the view holds."""

    size: int = 1024
    order: deque[int] = field(default_factory=deque)
    digests: dict[int, int] = field(default_factory=dict)

    def add(self, seq: int, payload: bytes) -> int:
        """Remember ``payload`` as applied at ``seq``; returns its digest."""
        crc = self.digests[seq] = zlib.crc32(payload)
        self.order.append(seq)
        while len(self.order) > self.size:
            self.digests.pop(self.order.popleft(), None)
        return crc

    def seen(self, seq: int, payload: bytes) -> bool:
        return self.digests.get(seq) == zlib.crc32(payload)

    def clear(self) -> None:
        self.order.clear()
        self.digests.clear()


_Replayed = list[tuple[int, bytes, bytes]]  # (seq, payload, the whole seq frame) in publisher order


class KvEventSubscriber:
    """One engine rank's event stream, applied to ``sink`` in seq order. Whoever runs :meth:`run` owns it.

    ``endpoint``/``replay_endpoint`` are where to *connect* (``tcp://host:port``); without a replay
    endpoint every gap empties the view. ``stats``: the stream's counters as a previous subscription to
    it left them (see the module docstring); its last position, when it has one, is what this
    subscription's first history is judged against. ``clock`` (monotonic) is injectable for tests.
    """

    def __init__(self, endpoint: str, sink: BatchSink, *, replay_endpoint: str | None = None,
                 topic: str = "", name: str = "", replay_timeout_s: float = 2.0,
                 probe_interval_s: float = 2.0, ctx: zmq.asyncio.Context | None = None,
                 stats: SubscriberStats | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.name = name or endpoint
        self.sink = sink
        self.replay_timeout_s = replay_timeout_s
        self.probe_interval_s = probe_interval_s
        self.stats = stats if stats is not None else SubscriberStats()
        s = self.stats
        # where a previous subscription left the stream: (seq, payload CRC), judged once, on the first history
        self._carried = None if s.last_seq is None or s.last_crc is None else (s.last_seq, s.last_crc)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._clock = clock
        self._next: int | None = None  # the seq the next applied batch must carry; None: not in sync
        self._complete = False
        self._stale = True
        self._applied = _Applied()
        self._dealer: zmq.asyncio.Socket | None = None

    @property
    def health(self) -> ViewHealth:
        if self._stale or self._next is None:
            return ViewHealth.STALE
        return ViewHealth.COMPLETE if self._complete else ViewHealth.PARTIAL

    # ---- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe, sync from the replay buffer, apply live batches; probe whenever the stream is
        quiet for ``probe_interval_s``. Runs until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await self._sync(probe=True)
            while True:
                # poll, then receive what is already there: asyncio.wait_for around recv loses a cancel
                # on 3.11 (see routerd._aio), and a deadline around recv may drop the message it cancels
                if not await sub.poll(self.probe_interval_s * 1000):  # POLLIN
                    await self._sync(probe=True)
                    continue
                await self._on_live(await sub.recv_multipart())
        finally:
            sub.close(linger=0)
            self._close_dealer()
            self._stale = True

    async def _on_live(self, frames: list[bytes]) -> None:
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, payload, batch = parsed
        nxt = self._next
        if nxt is not None and seq == nxt:
            self._apply(batch, payload)
            return
        if nxt is not None and seq < nxt and self._applied.seen(seq, payload):
            return  # replay already brought it, or a reordered copy
        if nxt is not None and seq > nxt:
            self.stats.gaps += 1
            _log.info("kv_event_gap", engine=self.name, expected=nxt, got=seq)
        # A gap, a seq that went back with new content (restart), or the first batch: the replay
        # buffer says what the view is missing; it normally brings this very batch too.
        await self._sync(probe=False)
        if self._next == seq:
            self._apply(batch, payload)
        elif self._next is None or seq > self._next or not self._applied.seen(seq, payload):
            if self._next is not None:
                self._lose("gap_unrecovered")
            self._start_at(batch, payload)

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes, EventBatch] | None:
        try:
            if len(frames) != 3:
                raise DecodeError(f"{len(frames)} frames, not [topic, seq, batch]")
            seq = decode_seq(frames[1])
            return seq, frames[2], decode_batch(seq, frames[2])
        except DecodeError as e:
            self.stats.undecodable += 1
            _log.warning("kv_event_batch_undecodable", engine=self.name, error=str(e))
            return None

    # ---- the view's history -----------------------------------------------------------------------

    def _apply(self, batch: EventBatch, payload: bytes) -> None:
        self.sink.apply(batch)
        crc = self._applied.add(batch.seq, payload)
        self._next = batch.seq + 1
        self._stale = False
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self._complete = True  # nothing from before a clear is held any more
        s = self.stats
        s.batches += 1
        s.events += len(batch.events)
        s.skipped_events += batch.skipped
        s.last_seq = batch.seq
        s.last_crc = crc
        s.last_event_ts = batch.ts
        s.last_heard = self._clock()

    def _start_at(self, batch: EventBatch, payload: bytes) -> None:
        """Begin a history at ``batch`` (the view was just emptied): complete only from seq 0."""
        if self._carried is not None:
            self._judge_carried([(batch.seq, payload)])
        self._complete = batch.seq == 0
        self._apply(batch, payload)

    def _judge_carried(self, history: list[tuple[int, bytes]]) -> None:
        """This subscription's first history (seq order) against where the previous one left the
        stream: the same publisher holds the same payload at that seq, or has moved past it; one whose
        seq went back, that holds other content there, or that has published nothing restarted."""
        if self._carried is None:
            return
        (seq, crc), self._carried = self._carried, None
        same = False
        for s, payload in history:
            if s >= seq:
                same = s > seq or zlib.crc32(payload) == crc
                break
        if not same:
            self.stats.restarts += 1
            _log.warning("kv_event_engine_restarted", engine=self.name, reason="seq_went_back",
                         left_at=seq, found=history[-1][0] if history else None)

    def _lose(self, reason: str) -> None:
        """The view can no longer be trusted in either direction: empty it and start again."""
        if reason == "engine_restarted":
            self.stats.restarts += 1
        else:
            self.stats.unrecovered_gaps += 1
        _log.warning("kv_event_view_reset", engine=self.name, reason=reason, next_seq=self._next)
        self.sink.reset(reason)
        self._applied.clear()
        self._next = None
        self._complete = False

    async def _sync(self, *, probe: bool) -> None:
        """Bring the view up to the publisher's latest batch from its replay buffer.

        The replay starts at the last applied seq, whose payload must match what was applied: else the
        publisher restarted (its buffer is shorter or holds other content there) or its buffer moved
        past us — either way the view is emptied and rebuilt from what the buffer still holds."""
        if self.replay_endpoint is None:
            return  # nothing to ask: liveness and gaps show only in the live stream
        anchor = self._next - 1 if self._next else None
        if probe:
            self.stats.probes += 1
        got = await self._replay(0 if anchor is None else anchor)
        if got is None:
            if not self._stale:
                _log.warning("kv_event_view_stale", engine=self.name, reason="replay_unanswered")
            self._stale = True
            return
        self._stale = False
        if anchor is not None:
            if got and got[0][0] == anchor and self._applied.seen(anchor, got[0][1]):
                got = got[1:]
            else:
                passed = bool(got) and got[0][0] > anchor
                self._lose("gap_unrecovered" if passed else "engine_restarted")
                if not passed and (got := await self._replay(0)) is None:
                    self._stale = True
                    return
        elif self._next == 0 and got and got[0][0] > 0:
            self._lose("gap_unrecovered")  # in sync on an empty buffer, yet its start is gone now
        self._take(got)

    def _take(self, got: _Replayed) -> None:
        """Apply replayed batches that continue the view; on an empty view, start its history."""
        if self._next is None and self._carried is not None:
            self._judge_carried([(seq, payload) for seq, payload, _ in got])
        if self._next is None and not got:
            # An empty buffer from seq 0: the publisher has published nothing since it started.
            self._next, self._complete = 0, True
            return
        for seq, payload, _ in got:
            if self._next is not None and seq < self._next and self._applied.seen(seq, payload):
                continue
            try:
                batch = decode_batch(seq, payload)
            except DecodeError as e:
                self.stats.undecodable += 1
                _log.warning("kv_event_batch_undecodable", engine=self.name, error=str(e))
                continue
            if self._next is None:
                self._start_at(batch, payload)
            elif seq == self._next:
                self._apply(batch, payload)
            else:
                break  # the buffer is contiguous; anything else waits for the next sync
            self.stats.replayed_batches += 1

    # ---- the replay socket ------------------------------------------------------------------------

    async def _replay(self, start: int) -> _Replayed | None:
        """What the publisher's buffer holds from ``start`` on, or None: no replay socket, or no
        complete answer within ``replay_timeout_s`` (then the DEALER is replaced, so a late answer
        cannot be taken for the next one's)."""
        if self.replay_endpoint is None:
            return None
        dealer = self._dealer_socket()
        out: _Replayed = []
        try:
            async with asyncio.timeout(self.replay_timeout_s):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        raise DecodeError(f"replay answer of {len(frames)} frames")
                    seq = decode_seq(frames[2])
                    if seq == END_SEQ:
                        break
                    out.append((seq, frames[3], frames[2]))
        except (TimeoutError, DecodeError) as e:
            _log.debug("kv_event_replay_failed", engine=self.name, start=start, error=repr(e))
            self._close_dealer()
            return None
        self.stats.last_heard = self._clock()
        return out

    def _dealer_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            if self.replay_endpoint is None:
                raise RuntimeError("no replay endpoint")
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            d.connect(self.replay_endpoint)
            self._dealer = d
        return self._dealer

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.close(linger=0)
            self._dealer = None
