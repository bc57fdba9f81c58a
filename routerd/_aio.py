"""Small asyncio helpers shared across components.

``wait_for`` exists because ``asyncio.wait_for`` on Python 3.11 can swallow a cancellation that arrives
in the same loop iteration as the awaited thing completes (fixed in 3.12, gh-86296). A control loop
cancelled that way keeps running, and the daemon's TaskGroup never finishes shutting down — which is
exactly what happened to routerd's registry waits. ``asyncio.timeout`` counts cancellations properly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw`` with a deadline; raises TimeoutError like ``asyncio.wait_for``, never loses a cancel."""
    async with asyncio.timeout(timeout):
        return await aw
