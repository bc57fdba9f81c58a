"""The prefix index (routerd's model of each engine's prefix cache) and the cache-aware router over a
real Registry, with an injected clock: no sleeping, no engine."""

from __future__ import annotations

import collections
import random
from typing import Any

import msgspec
import pytest

from routerd.config import RoutingConfig
from routerd.ingress.validate import read_head
from routerd.plugins import RequestView
from routerd.registry import Instance, InstanceState, LoadSnapshot, Registry
from routerd.routing import PrefixIndex, Router, Sessions

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def inst(n: int, generation: int = 0) -> Instance:
    return Instance(id=f"f:{n}", fleet="f", url=f"http://127.0.0.1:{9000 + n}", generation=generation)


def send(idx: PrefixIndex, to: Instance, keys: tuple[int, ...], capacity: int | None = None) -> None:
    """What the router does: match, then record on the instance chosen."""
    idx.record(to, keys, idx.match(to, keys), capacity)


# the index ------------------------------------------------------------------------------------------

def test_match_finds_the_longest_held_prefix() -> None:
    idx = PrefixIndex(max_blocks=1000)
    a = inst(0)
    send(idx, a, (1, 2, 3, 4, 5, 6, 7), capacity=None)
    assert idx.match(a, (1, 2, 3, 4, 5, 6, 7, 8, 9)) == 7
    assert idx.match(a, (1, 2, 3)) == 3
    assert idx.match(a, (1, 2, 3, 40, 50)) == 3
    assert idx.match(a, (9, 2, 3)) == 0
    assert idx.match(inst(1), (1, 2, 3)) == 0
    assert idx.match(a, ()) == 0


def test_lru_within_capacity_keeps_what_is_sent_again() -> None:
    """A system prompt every request sends stays while old conversations' own blocks age out, oldest
    first, and the engine's capacity is never exceeded."""
    idx = PrefixIndex(max_blocks=10_000)
    a = inst(0)
    system = (1, 2, 3)
    for conv in range(10):
        send(idx, a, (*system, *range(100 * conv + 10, 100 * conv + 14)), capacity=12)
        assert idx.held("f:0") <= 12
    assert idx.match(a, (*system, 999)) == 3
    assert idx.match(a, (*system, *range(910, 914))) == 7  # the newest conversation is whole
    assert idx.match(a, (*system, *range(10, 14))) == 3  # the oldest went
    assert idx.refs <= 8 * 12


def test_what_an_instance_holds_of_any_prompt_is_a_prefix_of_it() -> None:
    """The invariant the binary search rests on, under conversations that grow turn by turn, shared
    system prompts, new prompts and evictions at a small capacity: for every prompt sent, the blocks
    held are exactly its first ``match`` blocks."""
    rng = random.Random(7)
    idx = PrefixIndex(max_blocks=400)
    a = inst(0)
    systems = [tuple(rng.getrandbits(62) for _ in range(5)) for _ in range(3)]
    convs: list[tuple[int, ...]] = []
    for _ in range(3000):
        if convs and rng.random() < 0.7:  # a conversation's next turn
            i = rng.randrange(len(convs))
            convs[i] = (*convs[i], *(rng.getrandbits(62) for _ in range(rng.randint(1, 4))))
            keys = convs[i]
        else:
            keys = (*rng.choice(systems), *(rng.getrandbits(62) for _ in range(rng.randint(1, 8))))
            convs.append(keys)
            if len(convs) > 40:
                convs.pop(0)
        send(idx, a, keys, capacity=60)
        assert idx.held("f:0") <= 60
        for chain in convs:
            held = [k in idx._caches["f:0"].blocks for k in chain]
            m = idx.match(a, chain)
            assert held == [True] * m + [False] * (len(chain) - m)


def test_a_new_engine_generation_holds_nothing() -> None:
    idx = PrefixIndex(max_blocks=1000)
    send(idx, inst(0, generation=1), (1, 2, 3), capacity=None)
    assert idx.match(inst(0, generation=1), (1, 2, 3)) == 3
    assert idx.match(inst(0, generation=2), (1, 2, 3)) == 0
    assert idx.held("f:0") == 0
    send(idx, inst(0, generation=1), (1, 2, 3), capacity=None)
    idx.forget("f:0")
    assert idx.match(inst(0, generation=1), (1, 2, 3)) == 0
    assert idx.refs == 0


def test_memory_is_bounded_over_all_instances() -> None:
    idx = PrefixIndex(max_blocks=500)
    rng = random.Random(0)
    for n in range(400):
        send(idx, inst(n % 4), tuple(rng.getrandbits(62) for _ in range(20)), capacity=None)
        assert idx.refs <= 500
    assert 400 <= len(idx) <= 500
    assert {idx.held(f"f:{i}") for i in range(4)} <= set(range(80, 141))  # the oldest went, anywhere


def test_sessions_are_lru_bounded() -> None:
    s = Sessions(max_entries=3)
    for n in range(5):
        s.note(f"s{n}", inst(n % 2))
    assert len(s) == 3
    assert s.last("s0") is None
    assert s.last("s4") == ("f:0", 0)
    s.note("s2", inst(1))  # refreshed: s3 is now the oldest
    s.note("s5", inst(0))
    assert s.last("s3") is None
    assert s.last("s2") == ("f:1", 0)


# the router -----------------------------------------------------------------------------------------

def make(clock: Clock, n: int, *, capacity: int = 8, **routing: Any) -> tuple[Registry, Router]:
    reg = Registry(clock=clock)
    for i in range(n):
        ins = reg.add(Instance(id=f"f:{i}", fleet="f", url=f"http://127.0.0.1:{9000 + i}",
                               capacity_hint=capacity))
        ins.state = InstanceState.READY
        ins.snapshot = LoadSnapshot(scraped_at=clock.t, num_gpu_blocks=4096, block_size=16)
    cfg = RoutingConfig(prefix_block_tokens=16, **routing)
    return reg, Router.from_config(reg, cfg, rng=random.Random(0), clock=clock)


def chat_view(router: Router, messages: list[dict[str, str]], **kw: Any) -> RequestView:
    body = msgspec.json.encode({"model": "m", "messages": messages})
    return router.views.build("f", CHAT, read_head(CHAT, body), **kw)


def turns(conv: int, n: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You help. " * 40},
                {"role": "user", "content": f"conversation {conv} opens with its document. " * 60}]
    for t in range(1, n):
        messages += [{"role": "assistant", "content": f"answer {t} " * 30},
                     {"role": "user", "content": f"question {t} of conversation {conv} " * 10}]
    return messages


def busy(ins: Instance, running: int, clock: Clock) -> None:
    """What the next scrape of ``ins`` says: ``running`` requests and nothing waiting."""
    ins.snapshot = LoadSnapshot(scraped_at=clock.t, running=running, num_gpu_blocks=4096, block_size=16)


def test_a_conversation_stays_where_its_context_lives_until_that_instance_is_saturated() -> None:
    clock = Clock()
    reg, router = make(clock, 3)
    first = router.pick("f", request=chat_view(router, turns(0, 1)))
    others = [i for i in reg.instances("f") if i is not first]
    busy(first, 3, clock)  # busier than the others (idle), but with free slots and its context
    for n in range(2, 5):
        d = router.choose("f", request=chat_view(router, turns(0, n)))
        assert d.instance is first
        assert d.chosen.matched_blocks > 0
        assert all(v.matched_blocks == 0 for v in d.views if v.id != first.id)
    for o in others:
        busy(o, 7, clock)
    busy(first, 7, clock)  # the whole fleet is busy: one slot left here, and its context
    assert router.pick("f", request=chat_view(router, turns(0, 5))) is first
    busy(first, 8, clock)  # its slots are full: the next turn goes where it starts at once
    moved = router.pick("f", request=chat_view(router, turns(0, 6)))
    assert moved in others
    busy(first, 0, clock)
    busy(moved, 2, clock)
    for o in others:
        if o is not moved:
            busy(o, 0, clock)
    assert router.pick("f", request=chat_view(router, turns(0, 7))) is moved  # it holds the most now


def test_an_instance_far_over_its_share_draws_nothing_by_what_it_holds() -> None:
    """Beyond half its slots an instance keeps drawing requests by its cache or their session only
    while its load is within routing.affinity_load_factor of the fleet's mean."""
    clock = Clock()
    reg, router = make(clock, 3, affinity_load_factor=1.5)
    view = chat_view(router, turns(3, 3), session="s-3")
    home = router.pick("f", request=view)
    busy(home, 4, clock)  # 4 of 8 with the others idle: over 1.5 × the mean, and past half its slots
    d = router.choose("f", request=view)
    assert d.instance is not home
    assert next(v for v in d.views if v.id == home.id).saturated
    for i in reg.instances("f"):
        busy(i, 4, clock)  # the fleet is as busy: no longer over its share
    d = router.choose("f", request=chat_view(router, turns(3, 4), session="other"))
    assert not any(v.saturated for v in d.views)
    assert d.chosen.matched_blocks > 0


def test_a_popular_prefix_spreads_instead_of_piling_on_one_instance() -> None:
    """Many new conversations of one app (one long system prompt): each is held in flight, as upstream
    does, and none of 4 instances takes most of them."""
    clock = Clock()
    _reg, router = make(clock, 4, capacity=8)
    system = [{"role": "system", "content": "The popular app's long instructions. " * 200}]
    picks = []
    for conv in range(24):
        question = {"role": "user", "content": f"q{conv}"}
        chosen = router.pick("f", request=chat_view(router, [*system, question]))
        chosen.inflight += 1
        picks.append(chosen.id)
    shares = collections.Counter(picks)
    assert len(shares) == 4
    assert max(shares.values()) <= 8


def test_session_affinity_is_soft_and_bounded_by_saturation() -> None:
    clock = Clock()
    reg, router = make(clock, 3)
    v = router.views.bare("f", CHAT, session="conv-1")
    home = router.pick("f", request=v)
    busy(home, 3, clock)  # busier than the idle others, still under half its slots
    assert all(router.pick("f", request=v) is home for _ in range(5))
    for i in reg.instances("f"):
        busy(i, 7, clock)
    assert router.pick("f", request=v) is home  # the fleet is as busy: a slot left at home
    assert router.choose("f", request=v).rule == "session"
    busy(home, 8, clock)
    moved = router.choose("f", request=v)
    assert moved.instance is not home
    assert moved.rule == "saturation_avoided", moved.log_fields()


def test_predicted_hit_ratio_and_the_decision_explained() -> None:
    clock = Clock()
    _reg, router = make(clock, 2)
    first = router.choose("f", request=chat_view(router, turns(1, 1)))
    # prompts measured in bytes (no keyer): the prediction is over estimated sizes, kept apart
    assert first.instance.estimated_prefix_hit_ratio == 0.0
    assert first.instance.predicted_prefix_hit_ratio is None
    clock.t += 1.0
    second = router.choose("f", request=chat_view(router, turns(1, 2)))
    assert second.instance is first.instance
    req, chosen = second.request, second.chosen
    assert chosen.cached_tokens == pytest.approx(chosen.matched_blocks * req.block_tokens)
    ratio = second.instance.estimated_prefix_hit_ratio
    assert ratio is not None
    # the ratio of predicted-cached to asked tokens over both requests (the engine's own definition)
    total = first.request.prompt_tokens + req.prompt_tokens
    assert ratio == pytest.approx(chosen.cached_tokens / total, rel=0.05)
    fields = second.log_fields()
    other = next(v for v in second.views if v is not chosen)
    assert fields["matched_blocks"] == chosen.matched_blocks > 0
    assert fields["prompt_blocks"] == len(req.block_keys)
    assert fields["block_tokens"] == round(req.block_tokens, 1)  # routerd's blocks: the model's view
    assert fields["prompt_tokens_est"] == req.prompt_tokens
    assert fields["runner_up"] == other.id
    assert fields["runner_up_matched_blocks"] == 0
    assert fields["ttft_est_ms"] < fields["runner_up_ttft_est_ms"]
    assert fields["wait_est_ms"] == round(chosen.wait_s * 1000, 1)
    assert (fields["policy"], fields["rule"]) == ("cache_aware", "lowest_ttft")


class _FirstId:
    """A third-party policy with ``choose`` alone (no ``explain``)."""

    name = "first_id"

    def choose(self, request: RequestView, candidates: Any, rng: random.Random) -> Any:
        return min(candidates, key=lambda c: c.id)


def test_a_decision_without_a_choice_or_an_explaining_policy_says_so() -> None:
    clock = Clock()
    _reg, router = make(clock, 1)
    assert router.choose("f", request=chat_view(router, turns(1, 1))).log_fields()["rule"] == "only_candidate"
    _reg, router = make(clock, 2)
    router.policy = _FirstId()
    assert router.choose("f", request=chat_view(router, turns(1, 1))).rule == "policy_choice"


def test_what_an_instance_held_is_forgotten_when_it_leaves_rotation_or_restarts() -> None:
    clock = Clock()
    _reg, router = make(clock, 2)
    view = chat_view(router, turns(2, 1))
    a = router.pick("f", request=view)
    assert router.index.match(a, view.block_keys) == len(view.block_keys)
    a.state = InstanceState.UNHEALTHY
    router.pick("f", request=view)  # a request comes while it is out
    a.state = InstanceState.READY
    assert router.index.match(a, view.block_keys) == 0

    b = router.pick("f", request=view)
    clock.t += 1
    scrape(b, clock.t, prompt_tokens=5000.0)
    router.pick("f", request=view)
    assert router.index.match(b, view.block_keys) == len(view.block_keys)
    clock.t += 1  # the same URL now counts from 0: the engine restarted and its cache is empty
    scrape(b, clock.t, prompt_tokens=10.0)
    b.inflight = 8  # (so the next request goes to the other instance and b's forgetting shows)
    router.pick("f", request=view)
    assert router.index.match(b, view.block_keys) == 0


def scrape(i: Instance, at: float, prompt_tokens: float, finished: float = 0.0) -> None:
    """What the scraper does with a new snapshot: store it, then learn from it (routerd.speed)."""
    i.snapshot = LoadSnapshot(scraped_at=at, prompt_tokens=prompt_tokens, requests_finished=finished,
                              num_gpu_blocks=4096, block_size=16)
    i.learned.observe(i.snapshot)


def test_a_restart_between_two_requests_is_seen_though_the_counter_climbed_back() -> None:
    """The engine restarted at a scrape no request came after, and by the next request its prompt
    counter is above where the router last saw it: the restart is still seen (the speed learner saw
    every scrape), so what the index says it held is forgotten, not trusted."""
    clock = Clock()
    reg, router = make(clock, 2)
    view = chat_view(router, turns(2, 1))
    b = router.pick("f", request=view)
    a = next(i for i in reg.instances("f") if i is not b)
    clock.t += 1
    scrape(b, clock.t, prompt_tokens=100.0, finished=40.0)
    router.pick("f", request=view)
    assert router.index.match(b, view.block_keys) == len(view.block_keys)
    clock.t += 1
    scrape(b, clock.t, prompt_tokens=5.0, finished=1.0)  # restarted; no request comes now
    clock.t += 1
    scrape(b, clock.t, prompt_tokens=900.0, finished=3.0)  # busy since: more prompt tokens than before
    scrape(a, clock.t, prompt_tokens=0.0)  # (fresh too, so it may be chosen)
    b.inflight = 8  # (so the next request goes to the other instance and b's forgetting shows)
    router.pick("f", request=view)
    assert router.index.match(b, view.block_keys) == 0


def test_the_fleets_tokens_per_byte_is_learned_from_the_engines_counters() -> None:
    clock = Clock()
    reg, router = make(clock, 1)
    a = reg.instances("f")[0]
    body = {"model": "m", "prompt": "w " * 2000}  # 4000 bytes

    def send() -> RequestView:
        raw = msgspec.json.encode(body)
        v = router.views.build("f", "/v1/completions", read_head("/v1/completions", raw))
        router.pick("f", request=v)
        return v

    assert send().prompt_tokens == 1000  # the prior: 4 bytes a token
    counted = 0.0
    for _ in range(30):  # the engine counts 2000 tokens for each (a byte-level tokenizer)
        clock.t += 0.2
        counted += 2000
        a.snapshot = LoadSnapshot(scraped_at=clock.t, prompt_tokens=counted)
        send()
    assert send().prompt_tokens == pytest.approx(2000, rel=0.05)


def test_an_instance_that_never_prefilled_is_priced_at_its_siblings_speed() -> None:
    """A cold instance is not made to look slower than the rest by a fixed prior: when the instance
    holding a conversation is saturated, the turn goes to the idle one that never served anything,
    instead of queueing at home (a fixed 4,000 tokens/s prior priced its prefill 5× the learned one)."""
    clock = Clock()
    reg, router = make(clock, 2)
    home = router.pick("f", request=chat_view(router, turns(5, 1)))
    cold = next(i for i in reg.instances("f") if i is not home)
    # home has shown 20,000 prefill tokens/s (10 prefills of 2,000 tokens in 1 s); cold has shown nothing
    home.learned.observe(LoadSnapshot(scraped_at=clock.t - 2, prefill_computed_tokens=0.0))
    home.learned.observe(LoadSnapshot(scraped_at=clock.t - 1, prefill_seconds_sum=1.0,
                                      prefill_seconds_count=10, prefill_computed_tokens=20000.0))
    busy(home, 8, clock)  # its slots are full
    d = router.choose("f", request=chat_view(router, turns(5, 2)))
    assert d.instance is cold
    assert [v.prefill_tokens_per_s for v in d.views] == pytest.approx([20000.0, 20000.0])


def test_a_capacity_not_shown_yet_is_bounded_by_the_siblings_for_saturation() -> None:
    """A static fleet states no capacities (the config's 256 is a guess). Once one instance has shown
    its 8 slots, one that has not is saturated past its share of 8 too — not after 128 — so a popular
    prefix held there spreads instead of piling on it."""
    clock = Clock()
    reg, router = make(clock, 3, capacity=256)
    system = [{"role": "system", "content": "The popular app's long instructions. " * 200}]
    holder = router.pick("f", request=chat_view(router, [*system, {"role": "user", "content": "q0"}]))
    shown = next(i for i in reg.instances("f") if i is not holder)
    shown.launch_capacity = 8
    busy(holder, 6, clock)  # 6 running, the others idle: over its share of 8 slots
    d = router.choose("f", request=chat_view(router, [*system, {"role": "user", "content": "q1"}]))
    assert next(v for v in d.views if v.id == holder.id).saturated
    assert d.instance is not holder
