"""Heartbeats that catch hangs, not just deaths: a pure per-instance state machine plus its async driver.

Why two signals: vLLM's ``/health`` only reports a *dead* engine core; a hung engine (GPU/NCCL deadlock,
SIGSTOP) keeps the port open and may even answer 200. So each instance is checked (a) through its Ray
actor — process alive, ``/health`` within a deadline — and (b) through its scraped metrics — whenever
requests are running, ``generation_tokens`` must advance. A slow ``/health`` while tokens advance is a
loaded engine (BUSY), never a failure: restarting it under load would only move the load elsewhere.
Static fleets (routerd/fleet/static.py) run the same tracker and monitor with a probe that asks
``/health`` itself, there being no actor.

Timing: each probe has a deadline of ``heartbeat_timeout_s / failure_threshold`` and probes run
start-to-start on a jittered ``heartbeat_interval_s`` (never overlapping), so ``failure_threshold``
timeouts in a row take ``heartbeat_timeout_s``: a hang is detected within ``heartbeat_timeout_s`` plus
one interval. A dead actor or process fails the instance at once (the fleet manager also watches a
sentinel call for that, so deaths are seen within ~0.1 s without waiting for a probe).

An idle instance (``Instance.idle``: nothing in flight from routerd, its last scrape saw nothing running
or waiting, and that scrape succeeded) whose last probe was good is probed every
``idle_heartbeat_interval_s`` instead — a missed one is followed up at the fast period: with
hundreds of instances most are idle, and their probes were most of routerd's idle CPU. What that
costs: an idle engine that hangs is taken out of the fresh routing pool by its failing scrape (within
``idle_scrape_interval_s + scrape_timeout_s``), and a failed scrape, like a request sent to it, ends
the idle period — ``run()``, which wakes every ``heartbeat_interval_s`` anyway, ends the nap — so
from then on it is probed at the fast period and failed as quickly as a busy one.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .. import _aio, log
from ..config import HealthConfig
from ..registry import Instance, InstanceState, LoadSnapshot, Registry

_logger = log.get("routerd.health")


class ProbeResult(enum.StrEnum):
    """One heartbeat's outcome, as the state machine sees it."""

    OK = "ok"
    BUSY = "busy"  # answer slow or missing, but tokens advanced recently: loaded, not hung
    TIMEOUT = "timeout"  # no answer within the probe deadline and no token progress
    UNHEALTHY_HTTP = "unhealthy_http"  # /health answered non-200 (vLLM: 503 = engine dead)
    CONNECT_ERROR = "connect_error"  # port refused/reset while the process still runs
    STALLED = "stalled"  # requests running, /health fine, but no token progress for progress_timeout_s
    ACTOR_UNAVAILABLE = "actor_unavailable"  # Ray says the actor is temporarily unreachable
    PROCESS_DEAD = "process_dead"  # the engine process exited
    ACTOR_DEAD = "actor_dead"  # the supervising Ray actor is gone


class Verdict(enum.StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # some misses, below the threshold
    FAILED = "failed"


FATAL = frozenset({ProbeResult.PROCESS_DEAD, ProbeResult.ACTOR_DEAD})
GOOD = frozenset({ProbeResult.OK, ProbeResult.BUSY})


@dataclass(frozen=True, slots=True)
class ActorProbe:
    """What the engine actor reported for one probe (``EngineActor.probe``)."""

    process_alive: bool
    http_status: int | None  # None: no HTTP answer
    error: str = ""  # "timeout", "connect", or a short message
    returncode: int | None = None


def probe_deadline(cfg: HealthConfig) -> float:
    """Per-probe deadline: ``failure_threshold`` of them in a row span ``heartbeat_timeout_s``."""
    return cfg.heartbeat_timeout_s / cfg.failure_threshold


class HealthTracker:
    """The state machine for one instance. Pure: no I/O, time only from the injected clock.

    Feed it snapshots (``observe_snapshot``) and probe outcomes (``classify`` then ``record``); it answers
    with a Verdict. FAILED is sticky: a new engine behind the instance (a restart, a new generation) gets a
    new tracker from :class:`HealthMonitor`.
    """

    def __init__(self, cfg: HealthConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.misses = 0
        self.verdict = Verdict.HEALTHY
        self.last_result: ProbeResult | None = None
        self._tokens: float | None = None
        self._scraped_at: float | None = None
        self._last_advance_at: float | None = None  # when generation_tokens last grew
        self._idle_since: float | None = None  # running == 0 seen, so no progress is expected

    def observe_snapshot(self, snap: LoadSnapshot | None) -> None:
        """Track token progress from the scraper's latest snapshot (ignored if not newer than the last)."""
        if snap is None or (self._scraped_at is not None and snap.scraped_at <= self._scraped_at):
            return
        self._scraped_at = snap.scraped_at
        # First sample, progress, or a counter reset (a new engine behind the URL): all "advanced".
        if self._tokens is None or snap.generation_tokens != self._tokens:
            self._tokens = snap.generation_tokens
            self._last_advance_at = snap.scraped_at
        if snap.running <= 0:
            self._idle_since = snap.scraped_at
            self._last_advance_at = snap.scraped_at  # nothing to advance: not a stall
        else:
            self._idle_since = None

    def progressing(self) -> bool:
        """Requests running and tokens advanced within one probe deadline, per a fresh scrape.

        The window is short on purpose: a hung engine stops advancing (and its scrapes fail), so after
        one deadline its timeouts count as misses; a loaded one keeps advancing between scrapes.
        """
        if self._last_advance_at is None or self._idle_since is not None:
            return False
        return self.clock() - self._last_advance_at <= probe_deadline(self.cfg)

    def stalled(self) -> bool:
        """Requests running, scrapes fresh, yet no new token for ``progress_timeout_s``: a silent hang."""
        if self._last_advance_at is None or self._idle_since is not None or self._scraped_at is None:
            return False
        now = self.clock()
        fresh = now - self._scraped_at <= self.cfg.heartbeat_timeout_s
        return fresh and now - self._last_advance_at > self.cfg.progress_timeout_s

    def classify(self, probe: ActorProbe | None, *, actor_dead: bool = False,
                 actor_unavailable: bool = False, latency_s: float = 0.0) -> ProbeResult:
        """Turn one probe outcome into a ProbeResult. ``probe=None`` means the call itself timed out."""
        if actor_dead:
            return ProbeResult.ACTOR_DEAD
        if actor_unavailable:
            return ProbeResult.ACTOR_UNAVAILABLE
        if probe is None:
            return ProbeResult.BUSY if self.progressing() else ProbeResult.TIMEOUT
        if not probe.process_alive:
            return ProbeResult.PROCESS_DEAD
        if probe.http_status is None:
            if probe.error == "timeout":
                return ProbeResult.BUSY if self.progressing() else ProbeResult.TIMEOUT
            return ProbeResult.CONNECT_ERROR
        if probe.http_status != 200:
            return ProbeResult.UNHEALTHY_HTTP
        if self.stalled():
            return ProbeResult.STALLED
        if latency_s > probe_deadline(self.cfg):
            return ProbeResult.BUSY if self.progressing() else ProbeResult.TIMEOUT
        return ProbeResult.OK

    def record(self, result: ProbeResult) -> Verdict:
        """Count the result: fatal → FAILED at once; ``failure_threshold`` misses in a row → FAILED."""
        self.last_result = result
        if self.verdict is Verdict.FAILED:
            return self.verdict
        if result in FATAL:
            self.verdict = Verdict.FAILED
        elif result in GOOD:
            self.misses = 0
            self.verdict = Verdict.HEALTHY
        else:
            self.misses += 1
            self.verdict = Verdict.FAILED if self.misses >= self.cfg.failure_threshold else Verdict.SUSPECT
        return self.verdict


ProbeFn = Callable[[Instance, float], Awaitable["tuple[ActorProbe | None, bool, bool]"]]
"""``probe(inst, deadline_s) -> (probe or None on timeout, actor_dead, actor_unavailable)``."""
FailFn = Callable[[Instance, ProbeResult], Awaitable[None]]


def in_rotation(inst: Instance) -> bool:
    """The default watch set of a monitor: READY and DRAINING instances (requests may run on them)."""
    return inst.state in (InstanceState.READY, InstanceState.DRAINING)


class HealthMonitor:
    """Probes every instance ``watch`` selects (default: READY/DRAINING) on its own jittered schedule.

    Writes ``inst.health`` and ``inst.last_heartbeat`` (its fields in the registry) and calls ``on_failed``
    once per failure; the owner then takes the instance out of rotation (and restarts it, for a launched
    one). Each owner's ``watch`` selects only its own instances: the fleet manager's the launched ones,
    the static fleets' theirs, so every instance has one monitor writing its health.
    """

    def __init__(self, registry: Registry, cfg: HealthConfig, probe: ProbeFn, on_failed: FailFn, *,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 wall: Callable[[], float] = time.time,
                 watch: Callable[[Instance], bool] = in_rotation) -> None:
        self.registry = registry
        self.cfg = cfg
        self._probe = probe
        self._on_failed = on_failed
        self._watch = watch
        self._clock = clock
        self._wall = wall
        self._rng = rng or random.Random()
        self._trackers: dict[str, HealthTracker] = {}
        self._generation: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._naps = _aio.Naps()  # idle instances' probe loops, by instance id

    def update_config(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        for t in self._trackers.values():
            t.cfg = cfg

    def tracker(self, instance_id: str) -> HealthTracker | None:
        return self._trackers.get(instance_id)

    async def run(self) -> None:
        """Keep one probe loop per monitored instance; loops end when their instance leaves rotation."""
        try:
            since = -1
            while True:
                self._sync()
                for iid in self._naps.napping():
                    inst = self.registry.get(str(iid))
                    if inst is None or not inst.idle():
                        self._naps.wake(iid)
                since = await self.registry.wait_changed(since, timeout=self.cfg.heartbeat_interval_s)
        finally:
            tasks = list(self._tasks.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _sync(self) -> None:
        for inst in self.registry:
            watched = self._watch(inst)
            task = self._tasks.get(inst.id)
            if watched and self._generation.get(inst.id) != inst.generation and task is not None:
                task.cancel()  # a new engine behind the same id: start from a clean tracker
                task = None
            if watched and task is None:
                tracker = HealthTracker(self.cfg, self._clock)
                self._trackers[inst.id] = tracker
                self._generation[inst.id] = inst.generation
                task = asyncio.create_task(self._loop(inst, tracker), name=f"health:{inst.id}")
                self._tasks[inst.id] = task
                task.add_done_callback(functools.partial(self._done, inst.id))

    def _done(self, instance_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(instance_id) is task:
            del self._tasks[instance_id]
        if not task.cancelled() and task.exception() is not None:
            _logger.error("health_loop_crashed", instance=instance_id, exc_info=task.exception())

    async def _loop(self, inst: Instance, tracker: HealthTracker) -> None:
        generation = inst.generation
        while self._watch(inst) and inst.generation == generation and self.registry.get(inst.id) is inst:
            started = self._clock()
            try:
                verdict = await self.check_once(inst, tracker)
            except Exception:  # a loop boundary: an unexpected probe error is a miss, not a fresh tracker
                _logger.exception("heartbeat_probe_error", instance=inst.id)
                verdict = tracker.record(ProbeResult.TIMEOUT)
                inst.health = ProbeResult.TIMEOUT.value
            if verdict is Verdict.FAILED:
                await self._on_failed(inst, tracker.last_result or ProbeResult.TIMEOUT)
                return
            jitter = self._rng.uniform(0.8, 1.2)
            elapsed = self._clock() - started
            idle = self.cfg.idle_heartbeat_interval_s
            if idle > self.cfg.heartbeat_interval_s and inst.idle() and tracker.misses == 0:
                await self._naps.nap(inst.id, idle * jitter - elapsed)
            else:
                await asyncio.sleep(max(0.0, self.cfg.heartbeat_interval_s * jitter - elapsed))

    async def check_once(self, inst: Instance, tracker: HealthTracker) -> Verdict:
        """One heartbeat: probe through the actor, fold in the latest snapshot, update the registry."""
        deadline = probe_deadline(self.cfg)
        started = self._clock()
        probe, dead, unavailable = await self._probe(inst, deadline)
        tracker.observe_snapshot(inst.snapshot)
        result = tracker.classify(probe, actor_dead=dead, actor_unavailable=unavailable,
                                  latency_s=self._clock() - started)
        verdict = tracker.record(result)
        inst.health = result.value
        if result in GOOD:
            inst.last_heartbeat = self._wall()
        elif verdict is not Verdict.FAILED:
            _logger.info("heartbeat_missed", instance=inst.id, result=result.value, misses=tracker.misses)
        return verdict
