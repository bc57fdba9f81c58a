"""How many replicas an autoscaled fleet should run: signals in, a desired count and its reason out.

Pure (no I/O, time passed in), so every rule below is tested by feeding signals at chosen times.

**What it looks at** (one :class:`Signals` per tick, gathered by routerd/fleet/autoscaler.py):

* *demand* — requests in the fleet: running and waiting at its ready engines (the scrape corrected by
  routerd's own in-flight count) plus those waiting in admission (HTTP requests and queue jobs read for
  this fleet). ``ceil(demand / (capacity × target_utilization))`` replicas keep each engine's batch at the
  target share of its slots; this is the main signal, and it is absolute, so it never overshoots while
  new replicas start.
* *expected wait* — how long a request sent now would wait for a slot (before its first token) on the
  best instance: above ``target_wait_s`` the fleet needs ``ready × wait / target`` replicas (adding
  replicas divides the backlog's wait in proportion). It catches engines whose real limit is below their
  slot count (long prompts, memory).
* *KV-cache use* — mean over the ready engines; above ``target_kv_usage`` the fleet needs
  ``ready × kv / target`` (requests would soon be preempted).

The wait and KV rules act only when every replica is ready: while replicas start, the backlog they will
clear still shows, and scaling on it again would overshoot.

**Noise.** The demand of a fleet under Poisson arrivals wobbles by about its square root from one scrape
to the next — ±40 % at a few requests in flight. A rule that compares each scrape with a threshold just
above the mean flaps: up on a wobble, down on the mean. So the two reasons to add replicas are kept
apart, as Knative's autoscaler keeps its panic and stable windows:

* *Up, urgent* — a request is expected to wait past ``target_wait_s`` (or KV use is past its target)
  on every scrape for ``scale_up_delay_s``: at once, in proportion — several replicas in one decision,
  to the count the signals ask for (the lowest over that window, so a spike of one scrape adds
  nothing). "Full" alone is not urgent: with every slot busy a request still starts within a few
  decode steps, and at a few requests in flight the fleet is full on many scrapes at any load. With no
  ready replica at all the window is skipped: every request is waiting, and the count it asks for is
  not noise. A fleet at zero starts one replica on the first request (:meth:`ScalingPolicy.wake`).
* *Up, stable* — the mean demand over :data:`STABLE_WINDOW_S` is more than the replicas carry at
  ``target_utilization × (1 + TOLERANCE)``: to the count the mean asks for.
* *Down* — one replica at a time, each after a whole ``scale_down_delay_s`` without either reason to
  add one, in which the replicas left would have carried the *mean* demand at
  ``target_utilization / (1 + TOLERANCE)`` (the mean KV use likewise). The last replica of a fleet
  scaling to zero goes only after a window without a single request (*idle*).

Between up at ``u × (1 + TOLERANCE)`` and down at ``u / (1 + TOLERANCE)`` lies a band of about 40 % of
the target, and a mean counts as past a threshold only when it is past it by two of its standard errors
(at a few requests in flight and a short window that is a good part of the band; at hundreds, a
sliver — the check is looked at every tick, so one error would be crossed by chance): steady load
anywhere makes at most one decision. The fleet manager drains the replica it removes (out of rotation,
in-flight requests finish) before it stops the engine, so a scale-down cuts no request.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..config import AutoscaleConfig

# The band around the target, each way: twice Kubernetes HPA's 10 %, because an engine's concurrency
# grows faster than its load as its batch fills (each decode step slows): one replica fewer raises the
# concurrency on the others by more than N / (N - 1) — by 22 % from 4 to 3 replicas in the autoscale bench.
TOLERANCE = 0.2
STABLE_WINDOW_S = 10.0  # the mean demand that adds replicas short of an urgent need


@dataclass(frozen=True)
class Signals:
    """What the fleet looks like now (one tick's inputs; logged with every decision)."""

    ready: int  # replicas in rotation
    demand: float  # requests running or waiting at ready engines + waiting in admission
    waiting: float  # of which waiting, for a slot at an engine or in admission (shown with decisions)
    capacity: float  # requests one replica runs at once (max_num_seqs, learned or configured)
    expected_wait_s: float  # a request sent now waits this long for a slot on the best replica
    kv_usage: float  # mean KV-cache use of the ready replicas, 0..1


@dataclass(frozen=True)
class ScaleDecision:
    """A change of the desired count: from ``previous`` to ``replicas`` because of ``reason``."""

    replicas: int
    previous: int
    reason: str  # cold_start | queued | wait | kv | load | underused | idle | bounds
    recommendation: int  # what the signals asked for at that moment (before windows and steps)
    at: float

    @property
    def direction(self) -> str:
        return "up" if self.replicas > self.previous else "down"


class ScalingPolicy:
    """One fleet's autoscaling state: the desired count and the windows that stabilise it."""

    def __init__(self, cfg: AutoscaleConfig, replicas: int, now: float) -> None:
        """``replicas`` is where the fleet starts (clamped into the bounds)."""
        self.cfg = cfg
        self.replicas = min(max(replicas, cfg.min_replicas), cfg.max_replicas)
        self.last_change = now
        self.last_recommendation = self.replicas
        # (time, count asked for when urgent, else 0) over scale_up_delay_s
        self._urgent: deque[tuple[float, int]] = deque()
        # (time, demand, KV in use summed over ready replicas) since the last change
        self._history: deque[tuple[float, float, float]] = deque()
        self._down_from = now  # the down-window runs from the last change or the last reason to add

    def reconfigure(self, cfg: AutoscaleConfig, now: float) -> ScaleDecision | None:
        """A reload: new bounds and targets; the count is clamped into the new bounds at once."""
        self.cfg = cfg
        clamped = min(max(self.replicas, cfg.min_replicas), cfg.max_replicas)
        return self._change(clamped, "bounds", clamped, now) if clamped != self.replicas else None

    def reset(self, replicas: int, now: float) -> None:
        """Resume from ``replicas`` (an admin pin was lifted): windows start over."""
        self.replicas = min(max(replicas, self.cfg.min_replicas), self.cfg.max_replicas)
        self._restart(now)

    def wake(self, now: float) -> ScaleDecision | None:
        """A request is waiting for this fleet and it has no replica: start one now."""
        if self.replicas > 0:
            return None
        return self._change(1, "cold_start", 1, now)

    def recommend(self, s: Signals) -> tuple[int, str]:
        """The count the signals ask for now, and the signal that asks for most."""
        cfg = self.cfg
        best, reason = 0, "load"
        if s.demand > 0:
            best = math.ceil(s.demand / (max(s.capacity, 1.0) * cfg.target_utilization))
        if s.ready and s.ready >= self.replicas:  # all ready: no replica on its way will clear the backlog
            if s.expected_wait_s > cfg.target_wait_s:
                by_wait = math.ceil(s.ready * s.expected_wait_s / cfg.target_wait_s)
                if by_wait > best:
                    best, reason = by_wait, "wait"
            if s.kv_usage > cfg.target_kv_usage:
                by_kv = math.ceil(s.ready * s.kv_usage / cfg.target_kv_usage)
                if by_kv > best:
                    best, reason = by_kv, "kv"
        return min(max(best, cfg.min_replicas), cfg.max_replicas), reason

    def observe(self, s: Signals, now: float) -> ScaleDecision | None:
        """One tick: a decision when the desired count changes, else None."""
        cfg = self.cfg
        rec, _ = self.recommend(s)
        self.last_recommendation = rec
        capacity = max(s.capacity, 1.0)
        trigger = self._trigger(s)
        urgent = trigger is not None and rec > self.replicas
        self._urgent.append((now, rec if urgent else 0))
        while len(self._urgent) > 1 and self._urgent[1][0] <= now - cfg.scale_up_delay_s:
            self._urgent.popleft()
        self._history.append((now, s.demand, s.kv_usage * s.ready))
        keep = max(STABLE_WINDOW_S, cfg.scale_down_delay_s)
        while self._history[0][0] < now - keep:
            self._history.popleft()
        if urgent:
            target = self._urgent_target(s, now)
            if target > self.replicas:
                return self._change(target, "cold_start" if self.replicas == 0 else str(trigger), rec, now)
        stable = self._stable_target(capacity, now)
        if stable > self.replicas:
            return self._change(stable, "load", rec, now)
        if trigger is not None or stable or s.expected_wait_s > cfg.target_wait_s:
            self._down_from = now  # a reason to add replicas (not yet acted on): none goes
            return None
        if self.replicas <= cfg.min_replicas or now - self._down_from < cfg.scale_down_delay_s:
            return None
        over = self._over_provisioned(capacity, now)
        if over is None:
            return None
        return self._change(self.replicas - 1, over, rec, now)  # restarts the windows: one per delay

    def _trigger(self, s: Signals) -> str | None:
        """Why the fleet needs replicas now, not on average: ``queued`` (requests and no ready
        replica), ``wait`` (a request would wait past ``target_wait_s``), ``kv`` (KV use past its
        target) — the last two only with every replica ready; else None."""
        cfg = self.cfg
        if s.ready == 0:
            return "queued" if s.demand > 0 else None
        if s.ready < self.replicas:
            return None
        if s.expected_wait_s > cfg.target_wait_s:
            return "wait"
        return "kv" if s.kv_usage > cfg.target_kv_usage else None

    def _urgent_target(self, s: Signals, now: float) -> int:
        """The count to scale up to on an urgent need: the lowest asked for over the up-window, once
        the window is full; with no ready replica (or no window), what is asked for now."""
        rec = self._urgent[-1][1]
        if s.ready == 0 or self.cfg.scale_up_delay_s == 0:
            return rec
        if self._urgent[0][0] > now - self.cfg.scale_up_delay_s:
            return self.replicas  # not yet a whole window of evidence
        return min(r for _, r in self._urgent)

    def _stable_target(self, capacity: float, now: float) -> int:
        """The count the mean demand over the stable window asks for, once the window is full and only
        when it is above the replicas' target by the tolerance and by its own noise; else 0."""
        cfg = self.cfg
        if now - self.last_change < STABLE_WINDOW_S:
            return 0
        low, _ = _bounds([d for t, d, _ in self._history if t >= now - STABLE_WINDOW_S])
        per_replica = capacity * cfg.target_utilization
        if low <= self.replicas * per_replica * (1.0 + TOLERANCE):
            return 0
        return min(math.ceil(low / per_replica), cfg.max_replicas)

    def _over_provisioned(self, capacity: float, now: float) -> str | None:
        """Whether one replica fewer would have carried the down-window with the tolerance to spare —
        on average, so noise does not hold a replica forever — and why (``idle``: no request at all in
        the window; only then does the last replica go)."""
        cfg = self.cfg
        left = self.replicas - 1
        since = max(self._down_from, now - cfg.scale_down_delay_s)
        window = [(d, k) for t, d, k in self._history if t >= since]
        if max(d for d, _ in window) <= 0:
            return "idle"
        if left == 0:
            return None
        _, high = _bounds([d for d, _ in window])
        if high > left * capacity * cfg.target_utilization / (1.0 + TOLERANCE):
            return None
        kv = sum(k for _, k in window) / len(window)
        return None if kv > left * cfg.target_kv_usage / (1.0 + TOLERANCE) else "underused"

    def _change(self, replicas: int, reason: str, rec: int, now: float) -> ScaleDecision:
        decision = ScaleDecision(replicas=replicas, previous=self.replicas, reason=reason, recommendation=rec,
                            at=now)
        self.replicas = replicas
        self._restart(now)
        return decision

    def _restart(self, now: float) -> None:
        """After a change, every window starts over: the next decision needs fresh evidence."""
        self.last_change = now
        self._down_from = now
        self._urgent.clear()
        self._history.clear()


def _bounds(samples: list[float]) -> tuple[float, float]:
    """The mean of ``samples`` less and plus two standard errors: a mean is past a threshold only when
    it is past it by more than its own noise, looked at every tick. Scrapes 0.5 s apart are not
    independent (a request spans several), so half of them count."""
    n = len(samples)
    mean = sum(samples) / n
    if n < 2:
        return mean, mean
    var = sum((x - mean) ** 2 for x in samples) / (n - 1)
    se = 2.0 * math.sqrt(var / max(1.0, n / 2))
    return mean - se, mean + se
