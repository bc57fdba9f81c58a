"""What one engine instance can take and how fast it works, learned from its ``/metrics`` snapshots.

Why learn it: a fleet's config often guesses capacity (``max_num_seqs`` defaults to 256 whatever the
engine runs) and says nothing of speed, so "queue ÷ capacity" sends as much to an instance of 2 slow
sequences as to one of 8 fast ones. Everything here comes from what each scrape already fetches.

What is learned, each from the deltas between two consecutive snapshots of the same engine:

* **capacity** — requests it runs at once. The engine shows it when its running count holds steady
  for :data:`PLATEAU_SCRAPES` scrapes in a row while requests wait (and the KV cache is not what holds
  them back: a KV-bound plateau is lower than ``max-num-seqs`` and says nothing of it). Raised by any
  larger running count. The launch spec and the config outrank or back it: see
  :meth:`routerd.registry.Instance.capacity_source`.
* **running_s** — mean seconds a request spends running (``vllm:request_inference_time_seconds``,
  prefill + decode). With ``capacity`` slots, a slot frees every ``running_s / capacity`` seconds.
* **prefill_s** and **prefill_tokens_per_s** — one request's prefill: mean seconds
  (``vllm:request_prefill_time_seconds``) and its computed (uncached) prompt tokens per second of it
  (``vllm:request_prefill_kv_computed_tokens`` over the same requests; prompt tokens minus prefix-cache
  hits on engines without that histogram).
* **decode_tokens_per_s** — one sequence's decode speed: the tokens after the first over the decode
  time of the same finished requests (``request_generation_tokens`` − count, over
  ``request_decode_time_seconds``); right under speculative decoding too, where one inter-token event
  carries several tokens.
* **prefix_hit_ratio** — the engine's own prefix-cache hit ratio, ``Δprefix_cache_hits / Δqueries``.

Smoothing: each figure is the ratio of two exponentially decayed sums (numerator and denominator
deltas), decayed by ``exp(-Δt/τ)`` only over intervals that brought new evidence for that figure. So a
figure is weighted by evidence (an interval in which 100 requests finished outweighs one in which one
did), and idle time carries no information: it neither pulls a figure toward zero nor forgets it. τ
(:data:`TIME_CONSTANT_S`) is therefore measured in busy time: "the last ~30 s of traffic".

Restarts: a cumulative series going down means the engine restarted behind the same URL (a static
fleet): the learner re-baselines and keeps what it learned (most likely the same hardware and model),
but the next capacity plateau replaces the learned capacity instead of only raising it (the engine may
have come back with other flags). :attr:`Learned.resets` counts them, and is the one place such a
restart is detected: the router reads it to forget its model of the engine's prefix cache. An instance
routerd restarts gets a new registry ``Instance`` (a new generation), hence a fresh :class:`Learned`.

Pure: no I/O, no clock of its own — time is the snapshots' ``scraped_at``, so tests feed synthetic
snapshots and control time completely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .snapshot import LoadSnapshot

TIME_CONSTANT_S = 30.0  # τ of every learned figure, in busy seconds
PLATEAU_SCRAPES = 3  # running count unchanged this many scrapes in a row while requests wait
KV_BOUND = 0.9  # KV-cache usage above which waiting requests wait for memory, not for a slot

# Priors, used until the instance has shown the figure (a fresh or never-loaded instance). Only their
# relation to learned figures matters: a few seconds of traffic replace them.
PRIOR_RUNNING_S = 1.0
PRIOR_PREFILL_S = 0.05
PRIOR_PREFILL_TOKENS_PER_S = 4000.0

# The cumulative series a restart resets; any of them going down means a new engine process.
_CUMULATIVE = ("generation_tokens", "prompt_tokens", "requests_finished", "prefix_cache_queries",
               "prefix_cache_hits", "running_seconds_sum", "running_seconds_count", "prefill_seconds_sum",
               "prefill_seconds_count", "decode_seconds_sum", "decode_seconds_count",
               "finished_generation_tokens")


class DecayedRatio:
    """``Σ num / Σ den`` over recent evidence: both sums decay by ``exp(-dt/τ)`` whenever evidence is
    added, and only then, so idle time changes nothing.

    Public so the figure routing predicts (the prefix index's hit ratio) can be windowed exactly like
    the engine's reported one it is compared with.
    """

    __slots__ = ("_den", "_num", "time_constant_s")

    def __init__(self, time_constant_s: float = TIME_CONSTANT_S) -> None:
        self.time_constant_s = time_constant_s
        self._num = 0.0
        self._den = 0.0

    def add(self, num: float, den: float, dt: float) -> None:
        """Add ``num / den`` observed over the last ``dt`` seconds (``dt`` capped at τ: a long gap
        between scrapes cannot erase more than ~63 % of what was known). No-op without evidence."""
        if den <= 0.0 or num < 0.0:
            return
        decay = math.exp(-min(max(dt, 0.0), self.time_constant_s) / self.time_constant_s)
        self._num = self._num * decay + num
        self._den = self._den * decay + den

    @property
    def value(self) -> float | None:
        """The ratio, or ``None`` before any evidence."""
        return self._num / self._den if self._den > 0.0 else None


class Learned:
    """One instance's learned capacity and speed; :meth:`observe` each new snapshot of it (the scraper
    does, right after storing it)."""

    __slots__ = ("_capacity_provisional", "_decode", "_plateau_n", "_plateau_running", "_prefill_rate",
                 "_prefill_s", "_prefill_s_est", "_prefix", "_prev", "_running_s", "_running_s_est",
                 "capacity", "max_running", "resets")

    def __init__(self, time_constant_s: float = TIME_CONSTANT_S) -> None:
        self._prev: LoadSnapshot | None = None
        self._running_s = DecayedRatio(time_constant_s)
        self._prefill_s = DecayedRatio(time_constant_s)
        self._prefill_rate = DecayedRatio(time_constant_s)
        self._decode = DecayedRatio(time_constant_s)
        self._prefix = DecayedRatio(time_constant_s)
        # Requests the engine runs at once, once it has shown it (a plateau while requests wait).
        self.capacity: int | None = None
        self._capacity_provisional = False  # after a restart: the next plateau replaces it
        self.max_running = 0.0  # the most seen running at once since the last restart
        self._plateau_running = -1.0
        self._plateau_n = 0
        self.resets = 0  # counter resets seen (engine restarts behind the same URL)
        # what wait_s() uses, learned or prior, kept as plain floats: it runs per candidate per request
        self._running_s_est = PRIOR_RUNNING_S
        self._prefill_s_est = PRIOR_PREFILL_S

    # learning ----------------------------------------------------------------------------------
    def observe(self, snap: LoadSnapshot) -> None:
        """Learn from ``snap``, the instance's newest snapshot (``scraped_at`` is the time)."""
        prev, self._prev = self._prev, snap
        if prev is not None and any(getattr(snap, f) < getattr(prev, f) for f in _CUMULATIVE):
            self.resets += 1
            self._capacity_provisional = self.capacity is not None
            self.max_running = 0.0
            prev = None  # re-baseline: this snapshot's counters are the new zero
        self._observe_capacity(snap, prev)
        if prev is None:
            return
        dt = snap.scraped_at - prev.scraped_at
        if dt <= 0.0:
            return
        n_run = snap.running_seconds_count - prev.running_seconds_count
        self._running_s.add(snap.running_seconds_sum - prev.running_seconds_sum, n_run, dt)
        prefill_secs = snap.prefill_seconds_sum - prev.prefill_seconds_sum
        self._prefill_s.add(prefill_secs, snap.prefill_seconds_count - prev.prefill_seconds_count, dt)
        if snap.prefill_computed_tokens is not None and prev.prefill_computed_tokens is not None:
            computed = snap.prefill_computed_tokens - prev.prefill_computed_tokens
        else:
            computed = ((snap.prompt_tokens - prev.prompt_tokens)
                        - (snap.prefix_cache_hits - prev.prefix_cache_hits))
        if computed > 0.0:
            self._prefill_rate.add(computed, prefill_secs, dt)
        decoded = ((snap.finished_generation_tokens - prev.finished_generation_tokens)
                   - (snap.decode_seconds_count - prev.decode_seconds_count))
        if decoded > 0.0:
            self._decode.add(decoded, snap.decode_seconds_sum - prev.decode_seconds_sum, dt)
        self._prefix.add(snap.prefix_cache_hits - prev.prefix_cache_hits,
                         snap.prefix_cache_queries - prev.prefix_cache_queries, dt)
        self._running_s_est = self._running_s.value or PRIOR_RUNNING_S
        self._prefill_s_est = self._prefill_s.value or PRIOR_PREFILL_S

    def _observe_capacity(self, snap: LoadSnapshot, prev: LoadSnapshot | None) -> None:
        running = snap.running
        self.max_running = max(self.max_running, running)
        if self.capacity is not None and running > self.capacity:
            self.capacity = math.ceil(running)  # it runs more than we thought it could
        saturated = snap.waiting > 0.0 and running >= 1.0 and snap.kv_usage < KV_BOUND
        if not saturated or prev is None:
            self._plateau_running, self._plateau_n = (running, 1) if saturated else (-1.0, 0)
            return
        if running == self._plateau_running:
            self._plateau_n += 1
        else:
            self._plateau_running, self._plateau_n = running, 1
        if self._plateau_n >= PLATEAU_SCRAPES:
            seen = round(running)
            if self.capacity is not None and not self._capacity_provisional:
                seen = max(self.capacity, seen)
            # never below what it was seen running (since the last restart)
            self.capacity = max(seen, math.ceil(self.max_running))
            self._capacity_provisional = False

    # what routing reads ------------------------------------------------------------------------
    @property
    def running_s(self) -> float | None:
        return self._running_s.value

    @property
    def prefill_s(self) -> float | None:
        return self._prefill_s.value

    @property
    def prefill_tokens_per_s(self) -> float | None:
        v = self._prefill_rate.value
        return v if v is not None and v > 0.0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        v = self._decode.value
        return v if v is not None and v > 0.0 else None

    @property
    def prefix_hit_ratio(self) -> float | None:
        return self._prefix.value

    def wait_s(self, queue: float, unstarted: float, slots: int, snap: LoadSnapshot | None = None) -> float:
        """Seconds a new request would wait before its own prefill starts.

        ``queue`` requests are on the engine (running or waiting), ``unstarted`` of them not yet
        prefilled, and ``slots`` run at once. With a slot free, the request is scheduled at the next
        step and waits only for the prefills queued ahead of it. Otherwise it is number ``queue + 1 -
        slots`` in line for a slot, and slots free every ``running_s / slots`` seconds on average
        (Little's law over the running set): that many of those intervals. When ``snap`` shows
        requests waiting with the KV cache full, the engine is saturated below its slot count: its
        running count is then the slots that matter.
        """
        if snap is not None and snap.waiting > 0.0 and snap.kv_usage >= KV_BOUND:
            slots = min(slots, int(snap.running))
        if slots < 1:
            slots = 1
        beyond = queue + 1.0 - slots
        if beyond > 0.0:
            return beyond * self._running_s_est / slots
        return unstarted * self._prefill_s_est if unstarted > 0.0 else 0.0


def spec_capacity(engine_args: Mapping[str, Any]) -> int | None:
    """``max-num-seqs`` (or ``max_num_seqs``) of a launch spec's engine args, when it states one."""
    for key in ("max-num-seqs", "max_num_seqs", "--max-num-seqs"):
        raw = engine_args.get(key)
        if raw is None or isinstance(raw, bool):
            continue
        try:
            value = int(raw)
        except (TypeError, ValueError):
            return None
        return value if value > 0 else None
    return None
