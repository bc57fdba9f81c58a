"""The built-in routing policies: ``cache_aware`` (default), ``least_load``, ``power_of_two``,
``round_robin``.

Each is sync and pure over the :class:`~routerd.plugins.RequestView` and the
:class:`~routerd.plugins.Candidate` views the router builds per request (never empty, never holding a
non-ready instance); randomness comes from the router's ``rng`` so tests are reproducible. They register
through the same entry-point group a third-party policy uses.

Load is *expected wait* (``Candidate.wait_s``: work queued ahead over what that instance gets through,
learned per instance), so a slow or small instance is not sent as much as a fast one merely because
their queue-over-capacity figures look alike.

Each also ``explain``s a choice (:class:`~routerd.plugins.ExplainingPolicy`): the same choice with the
name of the rule that made it, for the request's log line. ``choose`` is ``explain`` without the name, so
the two cannot disagree.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from routerd.plugins import Candidate, RequestView

# cache_aware: estimated TTFTs closer than this are one choice, decided by the cache held, then by load.
# An estimate is not a measurement (a guessed token count, a learned speed, a wait that moves with every
# scrape): within this band its differences are noise, the cache an instance holds is not.
TTFT_BAND_REL = 0.1
TTFT_BAND_ABS_S = 0.002


def _key(c: Candidate) -> tuple[float, float, int]:
    # Expected wait first; at equal wait (typically 0: a slot is free) the emptier instance, then fewer
    # of routerd's own requests in flight (they are the freshest fact).
    return (c.wait_s, c.load, c.inflight)


def _least(candidates: Sequence[Candidate], rng: random.Random) -> Candidate:
    best = min(map(_key, candidates))
    ties = [c for c in candidates if _key(c) == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class LeastLoad:
    """The candidate with the least expected wait (then the least load, then the fewest in flight).

    Ties are broken at random: with identical idle instances a burst must spread, not pile onto the
    first id (each pick raises that instance's in-flight count before the next pick, so the next one
    already sees it).
    """

    name = "least_load"

    def choose(self, request: RequestView, candidates: Sequence[Candidate],
               rng: random.Random) -> Candidate:
        return self.explain(request, candidates, rng)[0]

    def explain(self, request: RequestView, candidates: Sequence[Candidate],
                rng: random.Random) -> tuple[Candidate, str]:
        return _least(candidates, rng), "least_wait"


class PowerOfTwo:
    """Two candidates at random, the one with less expected wait wins: near least-load quality at O(1),
    and it spreads even when every router sees the same stale snapshot."""

    name = "power_of_two"

    def choose(self, request: RequestView, candidates: Sequence[Candidate],
               rng: random.Random) -> Candidate:
        return self.explain(request, candidates, rng)[0]

    def explain(self, request: RequestView, candidates: Sequence[Candidate],
                rng: random.Random) -> tuple[Candidate, str]:
        if len(candidates) == 1:
            return candidates[0], "only_candidate"
        a, b = rng.sample(list(candidates), 2)
        return (a if _key(a) <= _key(b) else b), "less_wait_of_two"


class RoundRobin:
    """Each candidate in turn, blind to load: the baseline the benchmarks compare against.

    The position is the policy's only state; candidates are ordered by id so the rotation is stable
    when the set changes.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RequestView, candidates: Sequence[Candidate],
               rng: random.Random) -> Candidate:
        return self.explain(request, candidates, rng)[0]

    def explain(self, request: RequestView, candidates: Sequence[Candidate],
                rng: random.Random) -> tuple[Candidate, str]:
        ordered = sorted(candidates, key=lambda c: c.id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return chosen, "round_robin"


class CacheAware:
    """The least estimated time to first token — wait plus the prefill of what the instance is not
    predicted to hold (``Candidate.ttft_s``).

    * **Saturation bounds every affinity.** While some instance is not saturated
      (``Candidate.saturated``, the router's one definition: a new request would not get a slot at
      once, or the instance carries well over its share of the fleet's load), what a saturated one
      holds draws nothing: its estimate is taken without the cache, as if the prompt were new there.
      So a conversation stays where its context lives until that instance is saturated, and then moves
      (paying its prefill once more) instead of queueing; and a popular prefix spreads to a second
      instance once the first cannot keep up — no instance takes a popular app's traffic merely
      because it holds its system prompt. When every instance is saturated the estimates keep their
      cache: the wait is in them, and a cached prefix is then worth the most.
    * **Session affinity is a soft preference under the same bound**: the instance the request's
      session was last sent to wins while it is not saturated.
    * **Close estimates are a tie** (within :data:`TTFT_BAND_REL` of the best, or
      :data:`TTFT_BAND_ABS_S`): of them, the one holding the most of the prompt (its cached tokens,
      as far as they draw: nothing for a saturated one while another has room), then the least
      expected wait, the least load, at random. A tie never gives up cache for a shorter queue: an
      instance with both a higher estimate and less of the prompt is never chosen, and a conversation
      is not moved off its context by an estimate's noise (re-prefilling it there costs far more than
      the few milliseconds the band spans). Prompts sharing nothing, or holding as much everywhere, are
      placed as ``least_load`` places them; saturation, not the band, is what keeps a popular prefix
      from piling onto one instance.

    The rules, as :meth:`explain` names them: ``session`` (the session's instance, not saturated);
    ``saturation_avoided`` (the session's instance is saturated: the conversation moves);
    ``prefix_spread`` (an instance holding the prompt's prefix would have had the least estimate but is
    saturated: the prefix spreads); ``ttft_tie`` (close estimates: the most of the prompt held, then the
    least wait); ``lowest_ttft`` (the least estimate, no other close to it).
    """

    name = "cache_aware"

    def choose(self, request: RequestView, candidates: Sequence[Candidate],
               rng: random.Random) -> Candidate:
        return self.explain(request, candidates, rng)[0]

    def explain(self, request: RequestView, candidates: Sequence[Candidate],
                rng: random.Random) -> tuple[Candidate, str]:
        home = None
        if request.session is not None:
            home = next((c for c in candidates if c.session), None)
            if home is not None and not home.saturated:
                return home, "session"
        if all(c.saturated for c in candidates) or not any(c.saturated for c in candidates):
            estimates = [c.ttft_s for c in candidates]
            held = [c.cached_tokens for c in candidates]
        else:  # a saturated instance's cache draws nothing while another has room
            estimates = [c.ttft_s + c.cached_tokens / c.prefill_tokens_per_s if c.saturated else c.ttft_s
                         for c in candidates]
            held = [0.0 if c.saturated else c.cached_tokens for c in candidates]
        best = min(estimates)
        band = best + max(best * TTFT_BAND_REL, TTFT_BAND_ABS_S)
        near = [(c, h) for c, e, h in zip(candidates, estimates, held, strict=True) if e <= band]
        if len(near) == 1:
            chosen, rule = near[0][0], "lowest_ttft"
        else:
            most = max(h for _, h in near)
            chosen, rule = _least([c for c, h in near if h == most], rng), "ttft_tie"
        if home is not None and chosen is not home:
            rule = "saturation_avoided"  # the session's instance would have had it but for saturation
        elif any(e > band and c.ttft_s <= band for c, e in zip(candidates, estimates, strict=True)):
            rule = "prefix_spread"  # one holding the prefix would have been in the band on its cache
        return chosen, rule
