"""One engine's prefix cache as the engine itself reports it: the blocks its KV-cache events say it holds.

Where :mod:`routerd.routing.prefix_index` is routerd's *model* (what it sent where, forgotten by its own
LRU guess), this is the engine's *truth*, fed in order by a
:class:`~routerd.routing.kv_events.KvEventSubscriber`. A key is counted, not just present: vLLM may
cache two physical blocks with one hash (two requests filling the same block in one step) and removes
them one event at a time, so a block is held while its count is above zero.

Bounded by the engine's real KV capacity when known: an engine cannot hold more blocks than it has, so
anything beyond that is the trace of removals the view missed; the oldest entries go first (counted in
``overflow``, which should stay 0).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

# Media that are the engine's own device cache (vLLM: None before offloading existed, then "GPU").
_DEVICE_MEDIA = (None, "GPU")


class EngineCacheView:
    """The block keys one engine (rank) holds. ``apply``/``reset`` are the subscriber's sink."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self.block_size = 0  # tokens per block, as the engine's BlockStored events state it
        self.overflow = 0
        self.resets = 0
        self.last_reset_reason = ""

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def keys(self) -> set[int]:
        return set(self._blocks)

    def apply(self, batch: EventBatch) -> None:
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

    def reset(self, reason: str) -> None:
        """Forget everything: the engine restarted, or the event history broke."""
        self._blocks.clear()
        self.resets += 1
        self.last_reset_reason = reason

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a request (its keys in order) the engine holds: vLLM's hit stops
        at the first missing block."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            n += 1
        return n

    def _store(self, keys: Iterable[int]) -> None:
        blocks = self._blocks
        for k in keys:
            blocks[k] = blocks.get(k, 0) + 1
            blocks.move_to_end(k)
        cap = self.capacity_blocks
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
            if n <= 1:
                del blocks[k]
            else:
                blocks[k] = n - 1
