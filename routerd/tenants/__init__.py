"""Tenants: who sent the work, what share of a saturated fleet they get, what they may send, what
they used. The fair share itself is decided by the one scheduler, :mod:`routerd.dataplane.admission`.

Only the light parts are re-exported here (the config loader checks key forms through this package);
the per-data-plane service, which talks to Redis, is :mod:`routerd.tenants.service`."""

from ..api_keys import KeyFormError
from .body import RequestFacts, inspect
from .directory import DEFAULT, Directory, Tenant
from .fairshare import Share

__all__ = ["DEFAULT", "Directory", "KeyFormError", "RequestFacts", "Share", "Tenant", "inspect"]
