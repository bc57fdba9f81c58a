"""``routerd._net.free_port``: the one port picker of routerd, its tests and benchmarks."""

import pytest

from routerd import _net


def test_a_process_is_never_handed_the_same_port_twice_before_binding_it() -> None:
    """Fifteen daemons' configs were written before any of them listened: two got one port."""
    picked = [_net.free_port() for _ in range(3000)]
    assert len(set(picked)) == len(picked)


def test_routerd_port_range_narrows_the_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTERD_PORT_RANGE", "21000-22999")
    picked = [_net.free_port() for _ in range(30)]
    assert all(21000 <= p <= 22999 for p in picked)
    assert len(set(picked)) == 30
    monkeypatch.setenv("ROUTERD_PORT_RANGE", "not-a-range")  # a bad value: the default range
    assert _net.PORT_RANGE[0] <= _net.free_port() <= _net.PORT_RANGE[1]
