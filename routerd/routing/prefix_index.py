"""routerd's own model of what each engine holds in its prefix cache, and where each session went.

Why a model and not the engine's word: vLLM does not say what its cache holds (KV events need a
connector and a side channel), but routerd knows exactly which prompts it sent where. So for each
instance it keeps the block keys (:mod:`routerd.routing.request`) of the prompts it sent there, aged
the way vLLM ages its own cache:

* **LRU within the instance's KV capacity.** ``vllm:cache_config_info`` gives ``num_gpu_blocks`` ×
  ``block_size`` tokens; the model holds at most that many tokens' worth of blocks there, least
  recently sent first out. Recency is per request: each block holds the stamp of the request that
  last refreshed it, and requests are forgotten oldest first, each taking the blocks still holding
  its stamp. Along one prompt the stamps never grow with depth (a request stamps a whole prefix, or
  extends one at its deepest block's stamp), so what an instance holds of a prompt is always a prefix
  of it — which is what lets :meth:`PrefixIndex.match` binary-search instead of walking every block.
  A request whose matched prefix is still among the newer half of the instance's requests extends
  that request (its new blocks take the deepest matched block's stamp) instead of re-stamping the whole
  prefix: recency is kept to within a factor of two, and a conversation's next turn costs its new
  blocks, not its whole length. What the model does not see: the blocks of generated tokens (vLLM
  caches them too, so a next turn may hit more than predicted), and other traffic on a shared engine.
* **Forgotten when the engine's cache is** — the instance restarts (a new generation, a counter reset
  behind the same URL) or leaves rotation (the router tells it, :meth:`PrefixIndex.forget`).
* **Bounded memory.** The requests remembered hold block references; ``routing.prefix_index_max_blocks``
  bounds them over all instances (the oldest request anywhere goes first beyond it), and each instance
  keeps at most :data:`REFS_PER_BLOCK` × its capacity (a conversation re-sends its whole prefix every
  turn). A reference costs about 45 bytes, a block held about 60 more.

Cost per request, O(prompt blocks), all of it in C loops: a match is O(log blocks) dictionary lookups
per candidate; the record on the chosen instance stamps the prompt's blocks, and forgetting a request
checks each of its blocks once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import compress, repeat
from operator import eq

from ..registry import Instance

__all__ = ["PrefixIndex", "Sessions"]

REFS_PER_BLOCK = 8  # block references kept per block of an instance's capacity


class _Cache:
    """What one engine generation is believed to hold: block key → stamp of the request that last
    refreshed it, and those requests oldest first, each with the blocks it stamped (extended in place
    when a later request extends it)."""

    __slots__ = ("blocks", "by_stamp", "cut", "generation", "refs", "sent")

    def __init__(self, generation: int) -> None:
        self.blocks: dict[int, int] = {}
        self.sent: deque[int] = deque()  # stamps, oldest first
        self.by_stamp: dict[int, list[int]] = {}  # stamp → the blocks it stamped
        self.cut = 0  # blocks of the oldest request already forgotten, from its end (deepest first)
        self.refs = 0  # Σ len(by_stamp values) - cut
        self.generation = generation


class PrefixIndex:
    """Which prompt blocks each instance is believed to hold (see the module docstring)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.refs = 0  # block references over all instances (what max_blocks bounds)
        self._stamp = 0
        self._caches: dict[str, _Cache] = {}

    def __len__(self) -> int:
        """Blocks believed held, over all instances."""
        return sum(len(c.blocks) for c in self._caches.values())

    def held(self, instance_id: str) -> int:
        """Blocks the instance is believed to hold."""
        c = self._caches.get(instance_id)
        return len(c.blocks) if c is not None else 0

    def instances(self) -> list[str]:
        return list(self._caches)

    def match(self, inst: Instance, keys: tuple[int, ...]) -> int:
        """How many leading blocks of ``keys`` ``inst`` is believed to hold (0 when it is another engine
        than the one the blocks were sent to)."""
        c = self._caches.get(inst.id)
        if c is None or not keys:
            return 0
        if c.generation != inst.generation:
            self.forget(inst.id)
            return 0
        blocks = c.blocks
        if keys[0] not in blocks:
            return 0
        lo, hi = 1, len(keys)  # keys[lo - 1] is held; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def record(self, inst: Instance, keys: tuple[int, ...], matched: int, capacity: int | None) -> None:
        """``keys`` (a whole prompt's) were sent to ``inst``, which held the first ``matched`` of them
        (:meth:`match`) and holds at most ``capacity`` blocks (``None``: unknown, only the global bound
        applies)."""
        if not keys:
            return
        c = self._caches.get(inst.id)
        if c is None or c.generation != inst.generation:
            if c is not None:
                self.forget(inst.id)
            c = self._caches[inst.id] = _Cache(inst.generation)
            matched = 0
        blocks = c.blocks
        owner = blocks.get(keys[matched - 1], 0) if matched else 0
        # Recent enough (and not being forgotten already): extend it, new blocks only.
        if owner and owner >= c.sent[len(c.sent) // 2] and not (c.cut and owner == c.sent[0]):
            new = keys[matched:]
            blocks.update(zip(new, repeat(owner)))
            c.by_stamp[owner].extend(new)
        else:
            self._stamp += 1
            new = keys
            blocks.update(zip(keys, repeat(self._stamp)))
            c.sent.append(self._stamp)
            c.by_stamp[self._stamp] = list(keys)
        c.refs += len(new)
        self.refs += len(new)
        # Forgetting is spread over requests, a bounded amount each (twice what this one added), so
        # no request pays for a long one forgotten at once; the bounds may be exceeded meanwhile by
        # about one request's blocks.
        budget = 2 * len(new) + 64
        if capacity is not None:
            cap = max(capacity, 1)
            if len(blocks) > cap or c.refs > REFS_PER_BLOCK * cap:
                budget -= self._forget_oldest(c, budget)
        while self.refs > self.max_blocks and budget > 0:
            oldest = min((c for c in self._caches.values() if c.sent), key=lambda c: c.sent[0])
            budget -= self._forget_oldest(oldest, min(budget, self.refs - self.max_blocks))

    def forget(self, instance_id: str) -> None:
        """The instance's cache is gone (restarted, left rotation, removed)."""
        c = self._caches.pop(instance_id, None)
        if c is not None:
            self.refs -= c.refs

    def clear(self) -> None:
        self._caches.clear()
        self.refs = 0

    def _forget_oldest(self, c: _Cache, budget: int) -> int:
        """Go through up to ``budget`` blocks of ``c``'s oldest requests, deepest first, forgetting
        those still holding the request's stamp; returns how many were gone through. A request's
        blocks are its prompt's in order (then the extensions, deeper still), so what is left of any
        prompt stays a prefix of it."""
        done = 0
        blocks = c.blocks
        while done < budget and c.sent:
            stamp = c.sent[0]
            keys = c.by_stamp[stamp]
            end = len(keys) - c.cut
            start = max(0, end - (budget - done))
            chunk = keys[start:end]
            stale = list(compress(chunk, map(eq, map(blocks.get, chunk), repeat(stamp))))
            deque(map(blocks.pop, stale, repeat(None)), maxlen=0)
            done += end - start
            c.refs -= end - start
            self.refs -= end - start
            if start:
                c.cut += end - start
            else:
                c.sent.popleft()
                del c.by_stamp[stamp]
                c.cut = 0
        return done


class Sessions:
    """Session key → the instance (id and generation) its last request was sent to, LRU-bounded."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._last: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def last(self, session: str) -> tuple[str, int] | None:
        return self._last.get(session)

    def note(self, session: str, inst: Instance) -> None:
        self.remember(session, inst.id, inst.generation)

    def remember(self, session: str, instance_id: str, generation: int) -> None:
        """``session`` went to ``instance_id`` at ``generation`` (here, or in another process)."""
        last = self._last
        last[session] = (instance_id, generation)
        last.move_to_end(session)
        while len(last) > self.max_entries:
            last.popitem(last=False)
