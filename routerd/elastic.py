"""What the data plane may ask of fleets whose replica count floats (``[fleets.autoscale]``).

The request path must never await Ray, yet a request for a fleet scaled to zero has to start an engine
and wait for it. So the data plane holds this small interface, implemented by the fleet manager's
autoscaler (routerd/fleet/autoscaler.py): every call is synchronous and O(1) — it records the demand
and wakes the fleet manager, which does the Ray work in its own loop.
"""

from __future__ import annotations

from typing import Any, Protocol


class Elastic(Protocol):
    """Admission asks it to start a fleet on demand; ``/readyz`` and ``/admin/fleets`` read it."""

    def wake(self, fleet: str) -> float | None:
        """A request for ``fleet`` found no ready instance: start one if the fleet is scaled to zero.

        Returns the seconds until an instance is expected ready (for ``Retry-After``), or None when the
        fleet does not scale on demand (a fixed fleet, or one pinned by the admin route)."""
        ...

    def standby(self, fleet: str) -> bool:
        """``fleet`` may have no ready instance and still be ready to serve: scaled to zero, or starting
        from zero, and not failing. ``/readyz`` counts it as ready; the queue reads its jobs."""
        ...

    def status(self, fleet: str) -> dict[str, Any] | None:
        """The autoscaling state shown by ``GET /admin/fleets`` (None: the fleet is not autoscaled)."""
        ...
