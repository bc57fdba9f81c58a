"""The continuous-batching model: one engine task steps every running request, like vLLM's scheduler.

Why a single loop rather than a sleep per request: load must *interact*. With one loop, at most
``max_num_seqs`` requests decode at once and the rest wait FIFO; each step's duration grows with the
batch, so inter-token latency rises under load and time to first token includes queueing — which is
what a least-load router has to react to. KV blocks are accounted per request
(⌈(prompt + generated) / block_size⌉); when a step needs a block and none is free, the most recently
admitted request is preempted back to the head of the waiting queue (vLLM's recompute preemption).

Every observable number (running, waiting, KV usage, TTFT, …) is recorded in :class:`SimMetrics` under
vLLM's names, so routerd's scraper sees the same signals it would from vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from routerd import _aio, log
from routerd.vllm_wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

from .config import SimConfig
from .faults import Faults
from .lora import SimAdapter, SimLora
from .metrics import SimMetrics

_log = log.get("routerd.sim.engine")


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: its fixed output (``pieces``) and how far generation got."""

    prompt_tokens: int
    block_hashes: list[int]
    pieces: list[str]
    finish_reason: str
    stop_reason: str | None
    max_tokens: int
    arrival: float
    state: SeqState = SeqState.WAITING
    generated: int = 0
    blocks: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    scheduled_at: float | None = None
    ready_at: float = 0.0  # chunked prefill: no token before this (scheduled + ttft_ms)
    first_token_at: float | None = None
    last_token_at: float | None = None
    # The engine puts the index of each produced token; ``None`` means the engine dropped the request.
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    # The prompt's token ids, for the KV events' BlockStored (empty when the engine publishes none).
    token_ids: list[int] = field(default_factory=list)
    # A pooling request (embeddings, score, …): one prefill step, no generated token counted.
    pooling: bool = False
    # The LoRA adapter the request asked for (None: the base model).
    lora: SimAdapter | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.pieces)

    @property
    def done(self) -> bool:
        return self.state in (SeqState.FINISHED, SeqState.ABORTED)

    async def stream(self) -> AsyncIterator[int]:
        """Yield token indices as the engine produces them, until the last one."""
        while True:
            idx = await self.out.get()
            if idx is None:
                return
            yield idx
            if idx + 1 >= self.num_tokens:
                return


@dataclass(frozen=True)
class SimStats:
    """A point-in-time view for tests: how many requests are where, and what happened so far."""

    running: int
    waiting: int
    completed: int
    aborted: int
    failed: int
    preemptions: int
    kv_cache_usage: float


class BatchEngine:
    """The engine loop. Handlers :meth:`submit` a :class:`Sequence`, iterate ``seq.stream()`` and
    :meth:`abort` it in ``finally`` (a no-op once finished), so a cancelled handler frees its slot."""

    def __init__(self, cfg: SimConfig, faults: Faults, metrics: SimMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.faults = faults
        self.metrics = metrics
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_blocks = cfg.num_gpu_blocks
        self.completed = 0
        self.aborted = 0
        self.failed = 0
        self.preemptions = 0
        self._wake = asyncio.Event()
        # Prefix cache: block-hash chain → present. Bounded by the KV size, least recently used first out.
        self._prefix: OrderedDict[int, None] = OrderedDict()
        # KV-cache events of the current step, handed to ``kv_publish`` (one batch) when it ends.
        self.kv_publish: Callable[[list[KvEvent]], None] | None = None
        self._kv_events: list[KvEvent] = []
        # --enable-lora (routerd/sim/lora.py), and the utility calls (adapter loads) waiting for the loop
        self.lora: SimLora | None = None
        self._utility: list[tuple[float, asyncio.Future[None]]] = []

    @property
    def stats(self) -> SimStats:
        return SimStats(running=len(self.running), waiting=len(self.waiting), completed=self.completed,
                        aborted=self.aborted, failed=self.failed, preemptions=self.preemptions,
                        kv_cache_usage=self.kv_usage)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.cfg.num_gpu_blocks

    def submit(self, seq: Sequence) -> None:
        seq.arrival = self.clock()
        self.waiting.append(seq)
        self._update_gauges()
        self._wake.set()

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Drop a request that is not finished: "abort" when the client left or the server stops,
        "error" when an injected fault broke it. A no-op for a finished request."""
        if seq.done:
            return
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
            self._free(seq)
        else:
            self.waiting.remove(seq)
        seq.state = SeqState.ABORTED
        if reason == "abort":
            self.aborted += 1
        else:
            self.failed += 1
        self.metrics.success[reason].inc()
        self._observe_finished(seq, self.clock())
        seq.out.put_nowait(None)
        self._update_gauges()

    def abort_all(self) -> None:
        for seq in [*self.running, *self.waiting]:
            self.abort(seq)

    async def run(self) -> None:
        """The engine task: step while there is work, sleep on an event while there is none."""
        while True:
            if not self.running and not self.waiting and not self._utility:
                self._wake.clear()
                await self._wake.wait()
            await self.faults.wait_unhung()
            if self._utility:
                await self._run_utility()
                if not self.running and not self.waiting:
                    continue
            try:
                await self.step()
            except Exception:  # noqa: BLE001 — loop boundary: log, fail what is in flight, keep serving
                _log.exception("sim_engine_step_failed")
                for seq in [*self.running, *self.waiting]:
                    self.abort(seq, reason="error")

    async def utility(self, seconds: float) -> None:
        """Run ``seconds`` of work on the engine's own loop, between two steps, stalling them (vLLM's
        utility calls such as ``add_lora`` are served by the engine core's busy loop); returns when done."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._utility.append((seconds, fut))
        self._wake.set()
        await fut

    async def _run_utility(self) -> None:
        calls, self._utility = self._utility, []
        try:
            await asyncio.sleep(sum(s for s, _ in calls) * self.faults.slow_factor)
        finally:
            for _, fut in calls:
                if not fut.done():
                    fut.set_result(None)

    async def step(self) -> None:
        """One iteration: admit what fits, reserve KV for the decode, wait the step time, emit tokens."""
        decoding = list(self.running)
        self._reserve_decode_blocks(decoding)
        decoding = [s for s in decoding if s.state is SeqState.RUNNING]
        admitted = self._admit()
        prefill_tokens = sum(s.prompt_tokens + s.generated - s.cached_tokens for s in admitted)
        idle = False
        if self.cfg.chunked_prefill:
            step_ms, idle = self._chunked_step_ms(decoding, prefill_tokens)
        else:
            step_ms = 0.0
            if admitted:
                step_ms += self.cfg.ttft_ms + self.cfg.prefill_ms_per_token * prefill_tokens
            if decoding:
                step_ms += self._decode_ms()
        if self.lora is not None and (load_ms := self.lora.take_load_ms()):
            step_ms, idle = step_ms + load_ms, False  # adapters read inside the step stall all of it
        self._update_gauges()
        if idle:  # nothing to compute until a first token is due: a new request is scheduled at once
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await _aio.wait_for(self._wake.wait(), step_ms * self.faults.slow_factor / 1000.0)
        else:
            await asyncio.sleep(step_ms * self.faults.slow_factor / 1000.0)
        await self.faults.wait_unhung()  # a hang set mid-step holds the step's output back too
        now = self.clock()
        for seq in [*decoding, *admitted]:
            if seq.state is SeqState.RUNNING and seq.ready_at <= now:  # may have been aborted meanwhile
                self._emit(seq, now)
        self.metrics.iteration_tokens.observe(prefill_tokens + len(decoding))
        self._update_gauges()
        self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        events, self._kv_events = self._kv_events, []
        if events and self.kv_publish is not None:
            self.kv_publish(events)

    def cached_block_keys(self) -> set[int]:
        """The block keys the prefix cache holds now (what its KV events must have told a subscriber)."""
        return set(self._prefix)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): one ``AllBlocksCleared``."""
        self._prefix.clear()
        self._kv_events.append(AllBlocksCleared())
        self._flush_kv_events()

    def _decode_ms(self) -> float:
        load = len(self.running) / self.cfg.max_num_seqs
        return self.cfg.itl_ms * (1.0 + self.cfg.batch_factor * load)

    def _chunked_step_ms(self, running: list[Sequence], prefill_tokens: int) -> tuple[float, bool]:
        """One V1 step: the decodes of the requests past their first-token latency and the new
        prompts' tokens in one forward pass; with nothing to compute, the wait (``True``) until the
        first request's ``ttft_ms`` is up."""
        now = self.clock()
        step_ms = self.cfg.prefill_ms_per_token * prefill_tokens
        if any(s.ready_at <= now for s in running):
            return step_ms + self._decode_ms(), False
        if step_ms > 0.0:
            return step_ms, False
        pending = [s.ready_at for s in self.running]
        return (max(0.0, (min(pending) - now) * 1000.0) if pending else 0.0), True

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.cfg.block_size)

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        skipped: list[Sequence] = []
        now = self.clock()
        lora = self.lora
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if lora is not None and not lora.admits(seq.lora, (s.lora for s in self.running)):
                skipped.append(self.waiting.popleft())  # over max_loras: vLLM skips it, keeps its place
                continue
            need = self._blocks_for(seq.prompt_tokens + seq.generated + 1)
            if need > self.free_blocks:
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            if lora is not None and seq.lora is not None:
                lora.activate(seq.lora, (s.lora for s in self.running))
            self.free_blocks -= need
            seq.blocks = need
            seq.state = SeqState.RUNNING
            if seq.scheduled_at is None:
                seq.scheduled_at = now
                self.metrics.queue_time.observe(now - seq.arrival)
                if self.cfg.chunked_prefill:
                    seq.ready_at = now + self.cfg.ttft_ms / 1000.0
            self._prefix_lookup(seq)
            self.running.append(seq)
            admitted.append(seq)
        self.waiting.extendleft(reversed(skipped))
        return admitted

    def _reserve_decode_blocks(self, decoding: list[Sequence]) -> None:
        """Each decoding request may need one more block; preempt from the back when KV is full."""
        for seq in decoding:
            if seq.state is not SeqState.RUNNING:
                continue
            need = self._blocks_for(seq.prompt_tokens + seq.generated + 1) - seq.blocks
            while need > self.free_blocks and seq.state is SeqState.RUNNING:
                self._preempt(self.running[-1])
            if seq.state is SeqState.RUNNING and need > 0:
                self.free_blocks -= need
                seq.blocks += need

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.WAITING
        seq.preemptions += 1
        seq.cached_tokens = 0
        self.preemptions += 1
        self.metrics.preemptions.inc()
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def _prefix_lookup(self, seq: Sequence) -> None:
        """Count prefix-cache queries/hits over the prompt's full blocks, as vLLM does at admission."""
        m = self.metrics
        m.prefix_queries.inc(seq.prompt_tokens)
        hits = 0
        if self.cfg.enable_prefix_caching:
            for h in seq.block_hashes:
                if h not in self._prefix:
                    break
                self._prefix.move_to_end(h)
                hits += 1
            stored = [i for i in range(hits, len(seq.block_hashes))
                      if seq.block_hashes[i] not in self._prefix]
            for h in seq.block_hashes[hits:]:
                self._prefix[h] = None
            evicted = [self._prefix.popitem(last=False)[0]
                       for _ in range(len(self._prefix) - self.cfg.num_gpu_blocks)]
            if self.kv_publish is not None:
                self._record_kv(seq, stored, evicted)
        # At least the last prompt token is always computed, so a fully cached prompt recomputes a block.
        cached = min(hits * self.cfg.block_size,
                     (seq.prompt_tokens - 1) // self.cfg.block_size * self.cfg.block_size)
        seq.cached_tokens = max(0, cached)
        computed = seq.prompt_tokens + seq.generated - seq.cached_tokens
        m.prefix_hits.inc(seq.cached_tokens)
        m.prompt_cached.inc(seq.cached_tokens)
        m.prompt_cached_device.inc(seq.cached_tokens)
        m.prompt_cache_hit.inc(seq.cached_tokens)
        m.prompt_computed.inc(computed)
        m.prompt_tokens.inc(seq.prompt_tokens)

    def _record_kv(self, seq: Sequence, stored: list[int], evicted: list[int]) -> None:
        """BlockRemoved for what the new blocks displaced, then BlockStored per run of consecutive new
        blocks (parent = the block before) — vLLM's order: a cached block is evicted when its memory is
        allocated again, before the new content is cached there."""
        bs, hashes = self.cfg.block_size, seq.block_hashes
        if evicted:
            self._kv_events.append(BlockRemoved(block_hashes=tuple(evicted), medium="GPU"))
        run: list[int] = []
        for i in [*stored, -1]:
            if run and (i != run[-1] + 1):
                first = run[0]
                self._kv_events.append(BlockStored(
                    block_hashes=tuple(hashes[run[0]:run[-1] + 1]),
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=tuple(seq.token_ids[first * bs:(run[-1] + 1) * bs]), block_size=bs,
                    medium="GPU", lora_name=seq.lora.name if seq.lora is not None else None,
                    lora_id=seq.lora.int_id if seq.lora is not None else None))
                run = []
            if i >= 0:
                run.append(i)

    def _emit(self, seq: Sequence, now: float) -> None:
        m = self.metrics
        idx = seq.generated
        seq.generated += 1
        if not seq.pooling:
            m.generation_tokens.inc()
        if seq.first_token_at is None:
            seq.first_token_at = now
            m.ttft.observe(now - seq.arrival)
        elif seq.last_token_at is not None:
            m.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        seq.out.put_nowait(idx)
        if seq.generated >= seq.num_tokens:
            self.running.remove(seq)
            self._free(seq)
            seq.state = SeqState.FINISHED
            self.completed += 1
            m.success[seq.finish_reason].inc()
            self._observe_finished(seq, now)

    def _observe_finished(self, seq: Sequence, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - seq.arrival)
        m.req_prompt_tokens.observe(seq.prompt_tokens)
        # at finish, as vLLM does (num_prompt_tokens - cached): the same requests as the time histograms
        m.req_prefill_computed.observe(max(seq.prompt_tokens - seq.cached_tokens, 0))
        m.req_generation_tokens.observe(0 if seq.pooling else seq.generated)
        m.req_max_gen_tokens.observe(seq.max_tokens)
        m.req_params_max_tokens.observe(seq.max_tokens)
        m.req_params_n.observe(1)
        m.req_preemptions.observe(seq.preemptions)
        if seq.scheduled_at is not None:
            m.inference_time.observe(now - seq.scheduled_at)
            if seq.first_token_at is not None:
                m.prefill_time.observe(seq.first_token_at - seq.scheduled_at)
                m.decode_time.observe(now - seq.first_token_at)
                if seq.generated > 1:
                    m.tpot.observe((now - seq.first_token_at) / (seq.generated - 1))

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.waiting))
        deferred = 0
        if self.lora is not None:
            running, waiting = [s.lora for s in self.running], [s.lora for s in self.waiting]
            deferred = self.lora.deferred(running, waiting)
            self.lora.record(running, waiting)
        m.waiting_capacity.set(len(self.waiting) - deferred)
        m.waiting_deferred.set(deferred)
        m.kv_usage.set(self.kv_usage)
