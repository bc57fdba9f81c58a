"""The tenants of one config, looked up by API key (HTTP) or by name (a queue job's ``tenant``).

Built once per config (start-up and each reload) and then only read: every request asks it one dict
lookup. The tenant ``default`` always exists — requests whose key belongs to no tenant (a key of
``http.api_keys``) and, when no key is configured anywhere, every request — and a ``[[tenants]]``
entry of that name gives it a weight and limits like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..api_keys import digest, key_digest
from ..config import Config, TenantConfig

__all__ = ["DEFAULT", "Directory", "Tenant"]

DEFAULT = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant's settings, as the request path reads them."""

    name: str
    weight: float = 1.0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    fleets: frozenset[str] = frozenset()  # empty: every fleet
    max_priority: int | None = None

    @classmethod
    def from_config(cls, t: TenantConfig) -> Tenant:
        return cls(name=t.name, weight=t.weight, requests_per_minute=t.requests_per_minute,
                   tokens_per_minute=t.tokens_per_minute, max_concurrent=t.max_concurrent,
                   fleets=frozenset(t.fleets), max_priority=t.max_priority)

    @property
    def limited(self) -> bool:
        """Whether a rate limit applies (then each request asks the shared buckets)."""
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0

    def allows(self, fleet: str, adapter: str | None = None) -> bool:
        """Whether it may use ``fleet`` (its model and its adapters), or, for ``adapter`` of that fleet,
        that adapter: a ``fleets`` list may name single adapters."""
        return not self.fleets or fleet in self.fleets or (adapter is not None and adapter in self.fleets)

    def priority(self, requested: int) -> int:
        """A queue job's priority under this tenant's ceiling."""
        return requested if self.max_priority is None else min(requested, self.max_priority)


class Directory:
    """Tenants by name and by key digest; ``open`` when no API key is configured at all."""

    def __init__(self, cfg: Config) -> None:
        self.configured = bool(cfg.tenants)
        tenants = {t.name: Tenant.from_config(t) for t in cfg.tenants}
        self.default = tenants.setdefault(DEFAULT, Tenant(DEFAULT))
        self.tenants: dict[str, Tenant] = tenants
        by_digest: dict[bytes, Tenant] = {key_digest(k): self.default for k in cfg.http.api_keys}
        for t in cfg.tenants:
            by_digest.update((key_digest(k), tenants[t.name]) for k in t.api_keys)  # a tenant's key wins
        self._by_digest = by_digest
        self.open = not by_digest

    def get(self, name: str) -> Tenant | None:
        return self.tenants.get(name)

    def by_token(self, token: bytes) -> Tenant | None:
        """The tenant a presented bearer token belongs to; None when it is no configured key."""
        return self._by_digest.get(digest(token))
