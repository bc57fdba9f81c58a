"""One engine's prefix cache as the engine itself reports it: the blocks its KV-cache events say it holds.

Where :mod:`routerd.routing.prefix_index` is routerd's *model* (what it sent where, forgotten by its own
LRU guess), this is the engine's *truth*, fed in order by a
:class:`~routerd.routing.engine_cache.subscriber.KvEventSubscriber`. A key is counted, not just present: vLLM
may
cache two physical blocks with one hash (two requests filling the same block in one step) and removes
them one event at a time, so a block is held while its count is above zero.

Bounded by the engine's real KV capacity when known: an engine cannot hold more blocks than it has, so
anything beyond that is the trace of removals the view missed; the oldest entries go first (counted in
``overflow``, which should stay 0).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ...vllm_wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

# Media that are the engine's own device cache (vLLM: None before offloading existed, then "GPU").
_DEVICE_MEDIA = (None, "GPU")
# How long a block routerd sent an engine counts as held before the engine's BlockStored says so: the
# events of the step that stores it follow within a scheduler step or a queue wait; past this, the
# request never got scheduled there (or its events were lost) and the guess is dropped.
SPECULATIVE_TTL_S = 5.0


class EngineCacheSource(Protocol):
    """What routing asks of the engines' own cache views
    (``routing.engine_cache.subscriptions.EngineEvents``)."""

    def match(self, instance_id: str, keys: Sequence[int]) -> int | None:
        """Leading blocks of ``keys`` the instance holds by its own events; None: no usable view."""
        ...

    def speculate(self, instance_id: str, keys: Sequence[int]) -> None:
        """``keys`` were just sent there: count them held until the engine's events confirm or expire them."""
        ...


class EngineBlocks:
    """The block keys one engine (rank) holds. ``apply``/``reset`` are the subscriber's sink."""

    def __init__(self, capacity_blocks: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_blocks = capacity_blocks
        self._clock = clock
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._speculative: dict[int, float] = {}  # key → until (monotonic)
        self.block_size = 0  # tokens per block, as the engine's BlockStored events state it
        self.overflow = 0
        self.removed = 0  # blocks the engine said it evicted
        self.resets = 0
        self.last_reset_reason = ""

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def keys(self) -> set[int]:
        return set(self._blocks)

    def apply(self, batch: EventBatch) -> None:
        """One batch, in order; the capacity bound is checked after the whole batch (an engine may
        announce a store before the removal that made room for it)."""
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.medium in _DEVICE_MEDIA:
                    self.block_size = ev.block_size
                    self._store(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                if ev.medium in _DEVICE_MEDIA:
                    self._remove(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._blocks.clear()
                self._speculative.clear()
        self._bound()

    def reset(self, reason: str) -> None:
        """Forget everything: the engine restarted, or the event history broke."""
        self._blocks.clear()
        self._speculative.clear()
        self.resets += 1
        self.last_reset_reason = reason

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a request (its keys in order) the engine holds: vLLM's hit stops
        at the first missing block."""
        n = 0
        blocks, spec = self._blocks, self._speculative
        now = self._clock() if spec else 0.0
        for k in keys:
            if k not in blocks and spec.get(k, 0.0) <= now:
                break
            n += 1
        return n

    def speculate(self, keys: Sequence[int]) -> None:
        """Blocks a request just sent here will store: held until its BlockStored or the TTL."""
        spec = self._speculative
        now = self._clock()
        until = now + SPECULATIVE_TTL_S
        for k in keys:
            if k not in self._blocks:
                spec.pop(k, None)  # to the end: the dict's order is the entries' age
                spec[k] = until
        limit = 4 * (self.capacity_blocks or 65536)
        if len(spec) > limit:
            # Bounded by the engine's KV, however fast requests come (an engine cannot be about to
            # store four times what it can hold): the expired go, then the oldest down to half the
            # bound, so that the sweep comes again only after as many new entries (amortized O(1)).
            for k in [k for k, t in spec.items() if t <= now]:
                del spec[k]
            while len(spec) > limit // 2:
                del spec[next(iter(spec))]

    def _store(self, keys: Iterable[int]) -> None:
        blocks, spec = self._blocks, self._speculative
        for k in keys:
            blocks[k] = blocks.get(k, 0) + 1
            blocks.move_to_end(k)
            spec.pop(k, None)

    def _bound(self) -> None:
        blocks, cap = self._blocks, self.capacity_blocks
        if cap is not None:
            while len(blocks) > cap:
                blocks.popitem(last=False)
                self.overflow += 1

    def _remove(self, keys: Iterable[int]) -> None:
        blocks = self._blocks
        for k in keys:
            n = blocks.get(k)
            if n is None:
                continue
            self.removed += 1
            if n <= 1:
                del blocks[k]
            else:
                blocks[k] = n - 1
