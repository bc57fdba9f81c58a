"""Shared test setup. Fixtures live in tests/fixtures/<area>.py, one module per area."""

import os

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
