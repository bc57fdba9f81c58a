"""Choosing an instance: candidate views over the registry, what routerd knows of the request, and the
policy plugin.

The router reads the registry (the circuit fields it reads are written by :class:`CircuitBreaker`,
which upstream drives) and writes two fields of it, ``Instance.predicted_prefix_hit_ratio`` and
``Instance.estimated_prefix_hit_ratio``. Rules that
hold whatever the policy is:

* only READY instances whose circuit lets a request through are candidates — never a starting,
  draining or unhealthy one;
* instances whose last scrape is stale or failed are left out while a fresh one exists (their load
  figure is a guess); if every instance is stale they are all used, on routerd's own in-flight counts;
* instances this request already tried are left out while an untried one exists (failover goes
  elsewhere first).

Load is *expected wait* (:meth:`Instance.expected_wait_s`: the last scrape plus routerd's in-flight
delta since it, over what the instance is learned to get through), so a burst between two scrapes is
visible at once, because upstream counts a request in flight *before* it awaits anything.

Each candidate also carries what the request would cost there: the prompt blocks the
:class:`PrefixIndex` says it holds, and so the estimated time to first token, ``wait + uncached prompt
tokens / the fleet's learned prefill speed``; whether the request's session went there last; and
whether it is *saturated* — a new request would not start at once (its slots are full), or it carries
more than ``routing.affinity_load_factor`` × the fleet's mean load (an instance may always fill half its
slots; slots it has not shown are counted as its siblings' at most).

Once the policy chose, the router records the prompt's blocks on the chosen instance (the index learns
only from decisions, at pick time), notes the session, counts the prediction into the instance's
predicted hit ratio, and learns the fleet's tokens per byte from the engines' prompt-token
counters. The :class:`RouteDecision` it returns explains itself in the request's log line.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from .. import plugins
from ..config import RoutingConfig
from ..errors import NoReadyInstance
from ..plugins import Candidate, RequestView, RoutingPolicy
from ..registry import Instance, InstanceState, LoadSnapshot, Registry
from ..speed import PRIOR_PREFILL_TOKENS_PER_S, DecayedRatio
from .adapters import AdapterPlan, AdapterSlots
from .breaker import CircuitBreaker
from .engine_cache.blocks import EngineCacheSource
from .prefix_index import PrefixIndex, Sessions
from .request import RequestViews

SWEEP_EVERY = 1024  # decisions between two sweeps of what is kept for instances no longer registered


class RouteDecision:
    """One routing decision: the instance, the candidate view chosen and the others the policy saw.

    :meth:`log_fields` turns it into the request log line's explanation only when the line is written.
    """

    __slots__ = ("_fields", "adapter", "chosen", "events", "instance", "policy", "policy_rule", "request",
                 "rule", "views")

    def __init__(self, instance: Instance, chosen: Candidate, views: list[Candidate], request: RequestView,
                 policy: str, rule: str, events: frozenset[str] = frozenset()) -> None:
        self.events = events  # the candidates whose cache was scored by the engine's own events
        self._fields: dict[str, Any] | None = None  # log_fields(), made once (attempt span, log line)
        self.instance = instance
        self.chosen = chosen
        self.views = views
        self.request = request
        self.policy = policy
        # Which of the policy's rules chose (ExplainingPolicy), so that a choice that is not the least
        # estimate says why: "session", "prefix_spread", …; "only_candidate" when there was no choice.
        self.rule = rule
        # An adapter request: where its adapter is and what to load (routing.adapters); the rule is then
        # the adapter's (adapter_loaded, adapter_free_slot, …) and the policy's is kept beside it.
        self.adapter: AdapterPlan | None = None
        self.policy_rule = ""

    def runner_up(self) -> Candidate | None:
        """The best other candidate by estimated TTFT (``None`` when there was no other)."""
        others = [v for v in self.views if v is not self.chosen]
        return min(others, key=lambda v: (v.ttft_s, v.wait_s)) if others else None

    def log_fields(self) -> dict[str, Any]:
        """Why this instance: the rule that chose it, its matched blocks (in one block size, stated),
        expected wait and estimated TTFT, and the runner-up's. Made once: a traced request's attempt
        span and its log line both read it; callers copy it, never change it."""
        if self._fields is not None:
            return self._fields
        c, req = self.chosen, self.request
        view = "events" if c.id in self.events else "model"
        # One unit per line: the block fields count blocks of ``block_tokens`` tokens — the engine's
        # own blocks where its events scored the instance, routerd's (estimated) ones where its model
        # did; tokens are the engine's count (``prompt_tokens``) wherever routerd could count them.
        if view == "events":
            block_tokens: float = req.engine_block_tokens
            prompt_blocks = len(req.engine_keys)  # the blocks a hit can cover
        else:
            block_tokens, prompt_blocks = round(req.block_tokens, 1), len(req.block_keys)
        out: dict[str, Any] = {
            "policy": self.policy, "rule": self.rule,
            ("prompt_tokens" if req.exact_tokens else "prompt_tokens_est"): req.prompt_tokens,
            "cache_view": view, "block_tokens": block_tokens,
            "prompt_blocks": prompt_blocks, "matched_blocks": c.matched_blocks,
            "cached_tokens_est": round(c.cached_tokens),
            "wait_est_ms": round(c.wait_s * 1000, 1), "ttft_est_ms": round(c.ttft_s * 1000, 1),
        }
        if c.session:
            out["session_affinity"] = True
        if self.adapter is not None:
            out.update(adapter=self.adapter.adapter.name, policy_rule=self.policy_rule)
            if self.adapter.evict is not None:
                out["adapter_evicted"] = self.adapter.evict
        r = self.runner_up()
        if r is not None:
            out.update(runner_up=r.id, runner_up_cached_tokens_est=round(r.cached_tokens),
                       runner_up_wait_est_ms=round(r.wait_s * 1000, 1),
                       runner_up_ttft_est_ms=round(r.ttft_s * 1000, 1))
            if ("events" if r.id in self.events else "model") == view:
                out["runner_up_matched_blocks"] = r.matched_blocks
            else:  # its blocks are of another size: its cached tokens say what it holds
                out["runner_up_cache_view"] = "model" if view == "events" else "events"
        self._fields = out
        return out


class _Track:
    """What the router follows of one instance (one engine generation): its predicted hit ratio, and
    the counters the fleet's tokens per byte are learned from."""

    __slots__ = ("at", "bytes_at_snap", "estimated", "estimated_at", "figures", "figures_of", "generation",
                 "ids", "ids_at_snap", "nbytes", "predicted", "resets", "snap_at", "snap_tokens")

    def __init__(self, generation: int, now: float) -> None:
        self.generation = generation
        # Predicted hits over the prompt's tokens, windowed as the engine's reported ratio
        # (learned.prefix_hit_ratio) — apart by what the prompt's size is: the engines' own count (their
        # tokenizer, or token ids), or an estimate from its bytes. Exact hits over an estimated size
        # would misreport a prediction that is right to the token.
        self.predicted = DecayedRatio()
        self.estimated = DecayedRatio()
        self.at = now
        self.estimated_at = now
        self.nbytes = 0  # bytes of canonical text sent (text prompts)
        self.ids = 0  # tokens sent as token ids (exact: not part of the ratio)
        self.snap_at: float | None = None  # scraped_at of the last snapshot looked at
        self.snap_tokens = 0.0
        self.resets = 0  # the engine restarts routerd.speed had seen at that snapshot (Learned.resets)
        self.bytes_at_snap = 0
        # The instance's load figures (queue, capacity, expected wait, learned prefill speed or 0, whether
        # the capacity is more than the config's guess) and the state they were read from: they change
        # only with a new scrape or routerd's in-flight counts.
        self.figures: tuple[float, int, float, float, bool] = (0.0, 1, 0.0, 0.0, False)
        self.figures_of: tuple[LoadSnapshot | None, int, int, int, int | None] | None = None
        self.ids_at_snap = 0


class SharedSessionTable(Protocol):
    """Sessions shared with other routerd processes (:class:`routerd.peers.SharedSessions`)."""

    def noted(self, session: str, instance: str, generation: int) -> None: ...

    async def recall(self, session: str) -> tuple[str, int] | None: ...


class Router:
    """Builds :class:`Candidate` views for one fleet and asks the policy to choose."""

    def __init__(self, registry: Registry, policy: RoutingPolicy, cfg: RoutingConfig, *,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, views: RequestViews | None = None,
                 engine_cache: EngineCacheSource | None = None,
                 shared_sessions: SharedSessionTable | None = None,
                 adapters: AdapterSlots | None = None) -> None:
        """``views`` builds the request views (with the engines' keyers when their KV events are
        followed); ``engine_cache`` is the engines' own cache views
        (routerd.routing.engine_cache.subscriptions);
        ``shared_sessions`` the session table other routerd processes share (None: this one's only)."""
        self.shared_sessions = shared_sessions
        self.registry = registry
        self.policy = policy
        self.cfg = cfg
        self.clock = clock
        self.breaker = CircuitBreaker(cfg, clock)  # the router's own: it alone asks and charges it
        self.rng = rng or random.Random()
        self.views = views if views is not None else RequestViews(cfg)
        self.index = PrefixIndex(cfg.prefix_index_max_blocks)
        self.sessions = Sessions(cfg.sessions_max)
        self._tracks: dict[str, _Track] = {}
        self._decisions = 0
        self.engine_cache = engine_cache
        self.adapters = adapters  # which instance holds which LoRA adapter (None: no LoRA fleet)

    @classmethod
    def from_config(cls, registry: Registry, cfg: RoutingConfig, **kwargs: object) -> Router:
        policy = plugins.load_policy(cfg.policy)
        return cls(registry, policy, cfg, **kwargs)  # type: ignore[arg-type]  # kwargs typed by caller

    def update_config(self, cfg: RoutingConfig) -> None:
        if cfg.policy != self.policy.name:
            self.policy = plugins.load_policy(cfg.policy)
        if cfg.prefix_block_tokens != self.cfg.prefix_block_tokens:
            self.index.clear()  # other blocks, other keys: nothing recorded would match again
        self.cfg = cfg
        self.breaker.cfg = cfg
        self.views.configure(cfg)
        self.index.max_blocks = cfg.prefix_index_max_blocks
        self.sessions.max_entries = cfg.sessions_max

    def _candidates(self, fleet: str, exclude: Collection[str], request: RequestView | None
                    ) -> tuple[list[tuple[Candidate, Instance]], RequestView, frozenset[str]]:
        """The candidates, and the request view brought up to the fleet's tokens per byte as
        just learned from the newest scrapes (the view was built before; the ratio may have moved)."""
        now = self.clock()
        allows = self.breaker.allows
        tracks = self._tracks
        pool = []
        for i in self.registry.instances(fleet):
            if i.state is not InstanceState.READY:
                if i.id in tracks:  # out of rotation: whatever it held is not to be counted on
                    self._forget(i.id)
            elif i.circuit_open_until == 0.0 or allows(i, now):  # a closed circuit needs no call
                pool.append(i)
        if exclude:
            untried = [i for i in pool if i.id not in exclude]
            pool = untried or pool
        stale_after = self.cfg.stale_after_s
        fresh = [i for i in pool if (snap := i.snapshot) is not None and not i.scrape_error
                 and now - snap.scraped_at <= stale_after]
        stale = not fresh
        pool = fresh or pool
        req = request if request is not None else self.views.bare(fleet, "")
        if not pool:
            return [], req, frozenset()
        figures = []
        for i in pool:
            track = tracks.get(i.id)
            if track is None or track.generation != i.generation:
                track = self._track(i, now)
            snap = i.snapshot
            scraped_at = snap.scraped_at if snap is not None else -1.0
            if scraped_at != track.snap_at and snap is not None:
                # A new scrape: learn from it, and see a restart before trusting the index.
                self._observe(i, track, scraped_at, snap.prompt_tokens)
            state = (snap, i.inflight_total, i.inflight_at_scrape, i.capacity_hint, i.launch_capacity)
            if state != track.figures_of:
                track.figures_of = state
                capacity, source = i.capacity_source()
                queue = i.estimated_queue()
                track.figures = (queue, max(capacity, 1), i.expected_wait_s(queue, capacity),
                                 i.learned.prefill_tokens_per_s or 0.0, source != "config")
            figures.append(track.figures)
        req = self.views.current(req)
        # The prefill of a prompt is priced at the fleet's prefill speed (the mean of what its instances
        # learned), not each instance's own: a learned rate is seconds of prefill over tokens computed,
        # and the fixed cost of a prefill step weighs most where the cache saves the most, so an
        # instance serving cache hits learns a rate several times lower than one serving misses —
        # and one that never prefilled keeps the prior. Per-instance rates would rank instances by
        # that noise; an instance's speed is in its wait (learned from its own running times). A
        # capacity an instance has not shown is likewise bounded, for saturation, by its siblings'
        # (same model, most likely the same hardware): at the config's 256 slots it would never be
        # saturated, and cache affinity would pile requests on it.
        rates = [f[3] for f in figures if f[3] > 0.0]
        rate = sum(rates) / len(rates) if rates else PRIOR_PREFILL_TOKENS_PER_S
        known = [f[1] for f in figures if f[4]]
        fleet_cap = max(known) if known else 0
        caps = [f[1] if f[4] or not fleet_cap else min(f[1], fleet_cap) for f in figures]
        limit = min(1.0, max(0.5, self.cfg.affinity_load_factor * sum(f[0] for f in figures) / sum(caps)))
        last = self.sessions.last(req.session) if req.session is not None else None
        keys = req.block_keys
        match = self.index.match
        tokens = req.prompt_tokens
        out = []
        ekeys = req.engine_keys
        ecache = self.engine_cache if ekeys else None
        by_events: set[str] = set()
        for i, (queue, cap, wait, _, _), sat_cap in zip(pool, figures, caps, strict=True):
            snap = i.snapshot
            kv = snap.kv_usage if snap is not None else 0.0
            held = ecache.match(i.id, ekeys) if ecache is not None else None
            if held is not None:  # the engine's own account of its cache, in its own blocks
                by_events.add(i.id)
                matched = held
                # exact: the keys cover only what a hit can (engine_keys.keys(hittable=True))
                cached = float(held * req.engine_block_tokens)
            else:
                matched = match(i, keys) if keys else 0
                cached = min(matched * req.block_tokens, tokens - 1.0) if matched else 0.0
            out.append((Candidate(
                id=i.id, load=queue / cap + kv, inflight=i.inflight_total, queue=queue,
                capacity=cap, kv_usage=kv,
                stale=stale, wait_s=wait, prefill_tokens_per_s=rate, matched_blocks=matched,
                cached_tokens=cached, ttft_s=wait + (tokens - cached) / rate,
                session=last is not None and last[0] == i.id and last[1] == i.generation,
                saturated=queue + 1.0 > sat_cap * limit), i))
        return out, req, frozenset(by_events)

    def choose(self, fleet: str, exclude: Collection[str] = (),
               request: RequestView | None = None) -> RouteDecision:
        """Decide where a request to ``fleet`` goes, and record it (see the module docstring); raises
        :class:`NoReadyInstance` when no instance may take it."""
        pairs, req, events = self._candidates(fleet, exclude, request)
        if not pairs:
            raise NoReadyInstance(f"fleet {fleet!r} has no ready instance")
        plans: dict[str, AdapterPlan] | None = None
        if req.adapter is not None and self.adapters is not None:
            adapter = self.adapters.catalog.get(req.adapter)
            if adapter is not None:
                pairs, plans = self.adapters.narrow(adapter, pairs)
        views = [v for v, _ in pairs]
        if len(pairs) == 1:
            (chosen, inst), rule = pairs[0], "only_candidate"
        else:
            # An ExplainingPolicy names its rule; getattr, not a runtime Protocol check: this is per request.
            explain = getattr(self.policy, "explain", None)
            if explain is not None:
                chosen, rule = explain(req, views, self.rng)
            else:
                chosen, rule = self.policy.choose(req, views, self.rng), "policy_choice"
            found = next((i for v, i in pairs if v.id == chosen.id), None)
            if found is None:
                raise LookupError(f"policy {self.policy.name!r} returned {chosen.id!r}, not a candidate")
            inst = found
        self._sent(inst, chosen, req, inst.id in events)
        decision = RouteDecision(inst, chosen, views, req, self.policy.name, rule, events)
        if plans is not None:
            decision.adapter = plans[inst.id]
            decision.policy_rule, decision.rule = rule, decision.adapter.rule
        return decision

    def served(self, session: str, instance_id: str, generation: int) -> None:
        """Where ``session``'s last turn was served, as a record says (a stored response's): kept unless
        this process routed the session itself, so a chain returns to its instance after its session
        left the shared table."""
        if self.sessions.last(session) is None:
            self.sessions.remember(session, instance_id, generation)

    async def recall(self, session: str) -> None:
        """Before a turn of ``session`` is routed: if this process has not routed it, learn where
        another process did (bounded; see :mod:`routerd.peers.sessions`)."""
        if self.shared_sessions is None or self.sessions.last(session) is not None:
            return
        found = await self.shared_sessions.recall(session)
        if found is not None and self.sessions.last(session) is None:
            self.sessions.remember(session, *found)

    def note_session(self, session: str, inst: Instance) -> None:
        """``session`` lives on ``inst`` from now on (a Responses API answer's id, noted as it leaves:
        the next turn names it as its ``previous_response_id``)."""
        self.sessions.note(session, inst)
        if self.shared_sessions is not None:
            self.shared_sessions.noted(session, inst.id, inst.generation)

    def pick(self, fleet: str, exclude: Collection[str] = (), request: RequestView | None = None) -> Instance:
        """The instance :meth:`choose` decides on."""
        return self.choose(fleet, exclude, request).instance

    # what a decision teaches ---------------------------------------------------------------------
    def _sent(self, inst: Instance, chosen: Candidate, req: RequestView, by_events: bool = False) -> None:
        now = self.clock()
        self._decisions += 1
        if self._decisions % SWEEP_EVERY == 0:
            self._sweep()
        track = self._track(inst, now)
        snap = inst.snapshot
        if req.session is not None:
            self.sessions.note(req.session, inst)
            if self.shared_sessions is not None:
                self.shared_sessions.noted(req.session, inst.id, inst.generation)
        if req.prompt_tokens <= 0:
            return
        if req.prompt_bytes:
            track.nbytes += req.prompt_bytes
        else:
            track.ids += req.prompt_tokens
        if req.block_keys:
            capacity = None
            if snap is not None and snap.num_gpu_blocks and snap.block_size and req.block_tokens > 0:
                capacity = int(snap.num_gpu_blocks * snap.block_size / req.block_tokens)
            # The model's own match (the chosen one may be in the engine's blocks): it stays the
            # fallback for when the engine's events go stale.
            matched = self.index.match(inst, req.block_keys) if by_events else chosen.matched_blocks
            self.index.record(inst, req.block_keys, matched, capacity)
        if by_events and self.engine_cache is not None:
            # Until the engine's BlockStored arrives, the blocks it is about to store: a burst sharing a
            # new prefix lands together instead of spreading over instances that all look empty.
            self.engine_cache.speculate(inst.id, req.engine_keys)
        if req.exact_tokens:
            track.predicted.add(chosen.cached_tokens, float(req.prompt_tokens), now - track.at)
            track.at = now
            inst.predicted_prefix_hit_ratio = track.predicted.value
        else:
            track.estimated.add(chosen.cached_tokens, float(req.prompt_tokens), now - track.estimated_at)
            track.estimated_at = now
            inst.estimated_prefix_hit_ratio = track.estimated.value

    def _track(self, inst: Instance, now: float) -> _Track:
        track = self._tracks.get(inst.id)
        if track is None or track.generation != inst.generation:
            self.index.forget(inst.id)
            track = self._tracks[inst.id] = _Track(inst.generation, now)
        return track

    def _observe(self, inst: Instance, track: _Track, scraped_at: float, prompt_tokens: float) -> None:
        """A new scrape of ``inst``: the prompt tokens it counted since the last one teach the fleet's
        tokens per byte. An engine restart since (its cache is gone) is the one :mod:`routerd.speed`
        saw — it looks at every scrape and every counter, the router only at those it routes after."""
        resets = inst.learned.resets
        if track.snap_at is not None:
            if resets != track.resets:
                self.index.forget(inst.id)
            else:
                counted = prompt_tokens - track.snap_tokens
                self.views.ratio(inst.fleet).add(counted - (track.ids - track.ids_at_snap),
                                                 float(track.nbytes - track.bytes_at_snap))
        track.snap_at, track.snap_tokens, track.resets = scraped_at, prompt_tokens, resets
        track.bytes_at_snap, track.ids_at_snap = track.nbytes, track.ids

    def _forget(self, instance_id: str) -> None:
        self.index.forget(instance_id)
        self._tracks.pop(instance_id, None)

    def _sweep(self) -> None:
        """Drop what is kept for instances the registry no longer has (removed, replaced)."""
        for instance_id in {*self._tracks, *self.index.instances()}:
            if self.registry.get(instance_id) is None:
                self._forget(instance_id)
