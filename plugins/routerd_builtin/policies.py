"""The built-in routing policies: ``least_load`` (default), ``power_of_two``, ``round_robin``.

Each is sync and pure over the :class:`~routerd.plugins.Candidate` views the router builds per
request (never empty, never holding a non-ready instance); randomness comes from the router's ``rng``
so tests are reproducible. They register through the same entry-point group a third-party policy uses.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from routerd.plugins import Candidate


def _key(c: Candidate) -> tuple[float, int]:
    # Load first; on equal load fewer of routerd's own requests in flight (they are the freshest fact).
    return (c.load, c.inflight)


class LeastLoad:
    """The candidate with the lowest load (scraped queue + in-flight delta over capacity, plus KV use).

    Ties are broken at random: with identical idle instances a burst must spread, not pile onto the
    first id (each pick raises that instance's in-flight count before the next pick, so the next one
    already sees it).
    """

    name = "least_load"

    def choose(self, candidates: Sequence[Candidate], rng: random.Random) -> Candidate:
        best = min(_key(c) for c in candidates)
        ties = [c for c in candidates if _key(c) == best]
        return ties[0] if len(ties) == 1 else rng.choice(ties)


class PowerOfTwo:
    """Two candidates at random, the less loaded one wins: near least-load quality at O(1), and it
    spreads even when every router sees the same stale snapshot."""

    name = "power_of_two"

    def choose(self, candidates: Sequence[Candidate], rng: random.Random) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = rng.sample(list(candidates), 2)
        return a if _key(a) <= _key(b) else b


class RoundRobin:
    """Each candidate in turn, blind to load: the baseline the benchmarks compare against.

    The position is the policy's only state; candidates are ordered by id so the rotation is stable
    when the set changes.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Candidate], rng: random.Random) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return chosen
