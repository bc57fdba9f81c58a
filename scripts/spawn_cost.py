"""How long starting a child process holds the event loop of a process as big as routerd's parent of
workers (Ray imported, ``ballast`` MiB more resident): with a ``preexec_fn`` (a full fork of the address
space) and without one (``vfork``). Usage: ``.venv/bin/python scripts/spawn_cost.py [ballast_mib]``.

Why: the parent spawned its workers with ``preexec_fn=die_with_parent`` and held its loop (the lease's
renewals, engine supervision) for each; the worker now sets its own PDEATHSIG (routerd/workers.py).
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import sys
import time

import ray  # noqa: F401  # the parent's address space

import routerd.assembly  # noqa: F401
from routerd.redis_server import die_with_parent


async def held_s(preexec: bool) -> float:
    """Seconds ``create_subprocess_exec`` took before it returned (the loop did nothing else meanwhile)."""
    started = time.perf_counter()
    if preexec:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass", preexec_fn=die_with_parent)
    else:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    held = time.perf_counter() - started
    await proc.wait()
    return held


async def main(ballast_mib: int) -> None:
    ballast = bytearray(ballast_mib * 2**20)  # touched: resident, as a running parent's memory is
    print(f"resident: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
          f"(ballast {len(ballast) >> 20} MiB)")
    for preexec in (True, False, True, False):
        xs = [await held_s(preexec) for _ in range(10)]
        label = "preexec_fn" if preexec else "vfork     "
        print(f"{label} held the loop: median {statistics.median(xs) * 1000:.1f} ms, "
              f"max {max(xs) * 1000:.1f} ms")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 400))
