"""``routerd_adapter_*`` in ``/metrics``: what :class:`~routerd.routing.adapters.AdapterSlots` counted
of LoRA loads, unloads, requests and waits for a slot, and the adapters held per instance."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .adapters import AdapterSlots


class AdaptersCollector:
    """``routerd_adapter_*`` in ``/metrics``: loads (by outcome), unloads, load seconds, requests per
    adapter, waits for a slot (requests that had to wait for a load) and the seconds requests spent
    waiting, adapters held per instance."""

    def __init__(self, slots: AdapterSlots) -> None:
        self.slots = slots

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.slots
        loads = CounterMetricFamily("routerd_adapter_loads", "LoRA adapter loads routerd asked an engine for",
                                    labels=["fleet", "adapter", "outcome"])
        for (fleet, name, outcome), n in s.loads.items():
            loads.add_metric([fleet, name, outcome], n)
        unloads = CounterMetricFamily("routerd_adapter_unloads", "LoRA adapters unloaded from an engine",
                                      labels=["fleet", "adapter"])
        for (fleet, name), n in s.unloads.items():
            unloads.add_metric([fleet, name], n)
        seconds = CounterMetricFamily("routerd_adapter_load_seconds",
                                      "Seconds spent in successful LoRA adapter loads", labels=["fleet"])
        for fleet, v in s.load_seconds.items():
            seconds.add_metric([fleet], v)
        requests = CounterMetricFamily("routerd_adapter_requests", "Requests routed for each LoRA adapter",
                                       labels=["fleet", "adapter"])
        for (fleet, name), n in s.requests.items():
            requests.add_metric([fleet, name], n)
        waits = _by_fleet(CounterMetricFamily, "routerd_adapter_slot_waits",
                          "Adapter loads requests waited for (no instance with room held it)", s.slot_waits)
        wait_s = _by_fleet(CounterMetricFamily, "routerd_adapter_slot_wait_seconds",
                           "Seconds requests waited for their adapter's load before being sent "
                           "(summed over requests)", s.slot_wait_seconds)
        full = _by_fleet(CounterMetricFamily, "routerd_adapter_no_slot_waits",
                         "Requests that found no adapter slot free anywhere in the fleet and waited for one "
                         "before routing", s.overflow_waits)
        full_s = _by_fleet(CounterMetricFamily, "routerd_adapter_no_slot_wait_seconds",
                           "Seconds requests waited for an adapter slot to free anywhere in the fleet "
                           "(summed over requests)", s.overflow_wait_seconds)
        held = GaugeMetricFamily("routerd_adapters_held", "LoRA adapters loaded on an instance",
                                 labels=["fleet", "instance"])
        for fleet, n in s.catalog.slots.items():
            if n:
                for inst in s.registry.instances(fleet):
                    held.add_metric([fleet, inst.id], len(s.held(inst)))
        yield from (loads, unloads, seconds, requests, waits, wait_s, full, full_s, held)


def _by_fleet(family: Any, name: str, documentation: str, values: Mapping[str, float]) -> Any:
    """One metric family labelled by fleet, from ``values`` (fleet → value)."""
    out = family(name, documentation, labels=["fleet"])
    for fleet, v in values.items():
        out.add_metric([fleet], v)
    return out
