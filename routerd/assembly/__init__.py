"""The assembly: a Config in, the components of one routerd process out — built once, in dependency
order, as a few lifecycle objects (*bundles*), each handed what it needs through its constructor.

- ``core.py``: what every bundle shares (the role, session, registry, lease, Redis), and the
  :class:`~routerd.assembly.core.Bundle` protocol: ``loops()``, ``apply(cfg)``, ``collectors()``.
- ``watch.py``: engine watching (scrapes, static rotation, file_sd) — every role.
- ``fleets.py``: fleet control (Ray, the fleet manager and its autoscaler) — a launched fleet, not a worker.
- ``peers.py``: what processes on one Redis share (measures, fleet state, admin and wake relays,
  replica counts) — with Redis.
- ``kv.py``: KV routing by the engines' own cache events — fleets that publish them, a role that serves.
- ``dataplane.py``: the request path, its two ways in and the listener — a role that serves.
- ``batches.py``: the Batch API's runner and routes — with the queue (issue 31).
- ``lora.py``: LoRA adapters as models (issue 30) — every role, with a fleet that serves them.
- ``build.py``: roles as choices of bundles (:func:`compose`); ``routerd.py``: the bundles together
  (:class:`Routerd`: loops, reload, the one ordered stop); ``startup.py``: the start-up order
  (:func:`assemble`, :func:`running`).

The daemon (routerd/daemon.py: signals, drain, reload, sd_notify), the benchmarks and the test fixtures
all get their routerd here, and all stop it through :meth:`Routerd.shutdown`.
"""

from .build import build, compose
from .core import Bundle, Core, HasRoutes, Role, launches
from .routerd import Routerd
from .startup import assemble, running

__all__ = ["Bundle", "Core", "HasRoutes", "Role", "Routerd", "assemble", "build", "compose", "launches",
           "running"]
