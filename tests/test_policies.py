"""The built-in policies, loaded the way routerd loads them (entry points), over Candidate views."""

from __future__ import annotations

import collections
import random

import pytest

from routerd import plugins
from routerd.plugins import Candidate, RoutingPolicy


def cand(id_: str, load: float, inflight: int = 0) -> Candidate:
    return Candidate(id=id_, load=load, inflight=inflight, queue=load * 10, capacity=10, kv_usage=0.0,
                     stale=False)


def policy(name: str) -> RoutingPolicy:
    p = plugins.load(plugins.POLICY_GROUP, name)
    assert isinstance(p, RoutingPolicy)
    assert p.name == name
    return p


def test_entry_points_are_installed() -> None:
    assert {"least_load", "power_of_two", "round_robin"} <= set(plugins.available(plugins.POLICY_GROUP))


def test_unknown_policy_lists_the_installed_ones() -> None:
    with pytest.raises(plugins.PluginNotFound, match="least_load"):
        plugins.load(plugins.POLICY_GROUP, "nope")


def test_least_load_picks_the_lowest_load() -> None:
    cs = [cand("a", 0.9), cand("b", 0.1), cand("c", 0.5)]
    assert policy("least_load").choose(cs, random.Random(0)).id == "b"


def test_least_load_breaks_load_ties_by_inflight_then_at_random() -> None:
    p = policy("least_load")
    assert p.choose([cand("a", 0.2, inflight=3), cand("b", 0.2, inflight=1)], random.Random(0)).id == "b"
    rng = random.Random(1)
    seen = collections.Counter(p.choose([cand("a", 0.0), cand("b", 0.0), cand("c", 0.0)], rng).id
                               for _ in range(300))
    assert set(seen) == {"a", "b", "c"}
    assert min(seen.values()) > 60


def test_power_of_two_never_picks_the_worst_of_three() -> None:
    p = policy("power_of_two")
    rng = random.Random(2)
    cs = [cand("a", 0.1), cand("b", 0.5), cand("c", 0.9)]
    picks = collections.Counter(p.choose(cs, rng).id for _ in range(300))
    assert "c" not in picks
    assert picks["a"] > picks["b"]


def test_round_robin_rotates_in_id_order_regardless_of_load() -> None:
    p = policy("round_robin")
    rng = random.Random(0)
    cs = [cand("b", 0.0), cand("a", 5.0), cand("c", 0.0)]
    assert [p.choose(cs, rng).id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("name", ["least_load", "power_of_two", "round_robin"])
def test_single_candidate(name: str) -> None:
    assert policy(name).choose([cand("only", 3.0)], random.Random(0)).id == "only"
