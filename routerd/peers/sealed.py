"""Sealed shared records: what one routerd process writes to Redis for another to act on.

Every such record is sealed with the deployment's secret (routerd/trust.py) for its *kind* and its
*place* — the admin call's answer for that call's id, a replica count for its fleet, a process's load
for its ident, a scrape for its instance, a session for its digest — so a record written by hand, sealed
with another secret, or moved to another key is refused (:class:`~routerd.trust.Rejected`) before it is
decoded, let alone acted on. Each refusal is counted (``routerd_shared_rejected_total{kind,why}``) and
logged once per kind and why, with the fingerprints of both secrets (never the secrets).

One :class:`Seals` per process, built beside its :class:`~routerd.trust.Trust` and handed to every
component that writes or reads a shared record.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily

from .. import log
from ..trust import Rejected, Trust, Why

_log = log.get("routerd.peers.sealed")

# The kinds of shared record (the metric's ``kind`` label). Wake calls are admin calls (op ``wake``).
ADMIN_CALL: Final = "admin_call"
ADMIN_ANSWER: Final = "admin_answer"
FLEET_STATE: Final = "fleet_state"
REPLICAS: Final = "replicas"
ADAPTERS: Final = "adapters"
LOAD: Final = "load"
SCRAPE: Final = "scrape"
SESSION: Final = "session"
KINDS: Final = (ADMIN_CALL, ADMIN_ANSWER, FLEET_STATE, REPLICAS, ADAPTERS, LOAD, SCRAPE, SESSION)

_EFFECT = {
    Why.UNSIGNED: "refused, not acted on: not written by a routerd of this deployment (anyone who can "
                  "write to this Redis could have)",
    Why.OTHER_SECRET: "refused, not acted on: a routerd holding another secret wrote it; give every "
                      "routerd sharing this Redis the same [control] secret",
    Why.FORGED: "refused, not acted on: its seal does not match its content or its key",
    Why.REPLAYED: "refused, not acted on: a genuine record older than one already acted on, written again",
}


def _subject(kind: str, subject: str) -> str:
    return f"{kind}:{subject}" if subject else kind


class Seals:
    """Seal and open the shared records of one process; refusals counted and logged."""

    def __init__(self, trust: Trust) -> None:
        self.trust = trust
        self.rejected: dict[tuple[str, str], int] = {}  # (kind, why) → records refused
        self._logged: set[tuple[str, str]] = set()

    @property
    def fingerprint(self) -> str:
        return self.trust.fingerprint

    def seal(self, kind: str, payload: bytes, subject: str = "") -> bytes:
        """``payload`` sealed for ``kind`` at ``subject`` (the key it is written under, when several)."""
        return self.trust.seal(_subject(kind, subject), payload)

    def open(self, kind: str, record: bytes, subject: str = "", **where: Any) -> bytes:
        """The payload of ``record``, or :class:`Rejected` (counted, logged once per kind and why;
        ``where`` says where it was found, for that log line)."""
        try:
            return self.trust.open(_subject(kind, subject), record)
        except Rejected as e:
            self.refuse(kind, e.why, record=record, **where)
            raise Rejected(kind, e.why) from None

    def refuse(self, kind: str, why: Why, *, record: bytes = b"", **where: Any) -> None:
        """Count and (once per kind and why) log a refused record: :meth:`open`'s, or a genuine one its
        reader refuses (``replayed``)."""
        key = (kind, why.value)
        self.rejected[key] = self.rejected.get(key, 0) + 1
        if key in self._logged:
            return
        self._logged.add(key)
        _log.warning("shared_record_refused", kind=kind, why=why.value, fingerprint=self.fingerprint,
                     record_fingerprint=Trust.fingerprint_of(record) if record else None,
                     effect=_EFFECT[why], **where)

    def collector(self) -> SealsCollector:
        return SealsCollector(self)


class SealsCollector:
    """``/metrics``: the shared records refused, by kind and why."""

    def __init__(self, seals: Seals) -> None:
        self._seals = seals

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are built per collect

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily("routerd_shared_rejected", "Shared records from Redis refused "
                                     "(unsigned, sealed with another secret, forged, or replayed): never "
                                     "acted on", labels=["kind", "why"])
        rejected = self._seals.rejected
        for kind in KINDS:  # every series from the start, so the first refusal is an increase
            for why in Why:
                family.add_metric([kind, why.value], rejected.get((kind, why.value), 0))
        yield family
