"""``POST /admin/fleets/{fleet}/adapters`` and ``DELETE /admin/fleets/{fleet}/adapters/{name}``: LoRA
adapters added and removed at run time, carried out by the process that controls the fleets (a
follower relays the call, as every admin write: routerd/peers/admin_relay.py).

An adapter is added only once it loaded: on an instance of the fleet with a free slot (or an idle
adapter to evict), so a path that does not load is the admin call's clear 400 — and the adapter is
marked failed, not retried in a loop. An instance with room is not needed: with every slot busy the
adapter is kept unloaded, and the first request for it loads it. It is then kept in Redis
(routerd/peers/adapters.py), so every routerd serves it and the next controller starts from it.
Removing one unloads it from every instance that holds it.

A load that outlives the fleet's ``adapter_load_timeout_s`` is a 504: the adapter is not added nor
marked failed (its path may only be slow), and the instance is asked what it holds once the load's call
ended — an engine that finished the load is recorded as holding it, and adding it again is then
answered at once.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ..config import Config, FleetConfig
from ..errors import BadRequest, DeadlineExceeded, NotFound, UpstreamError
from ..peers.adapters import AdapterStore, StoredAdapter
from ..plugins import Candidate
from ..registry import InstanceState, Registry
from ..routing.adapters import (
    ADAPTER_EVICTED,
    ADAPTER_FREE_SLOT,
    Adapter,
    AdapterLoadFailed,
    AdapterPlan,
    AdapterSlots,
)


class _NewAdapter(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class _Load(msgspec.Struct, forbid_unknown_fields=True):
    """A relayed load (op ``adapter_load``, target the instance): the adapter, what to unload first."""

    adapter: str
    evict: str | None = None


def _decode(raw: bytes) -> _NewAdapter:
    try:
        return msgspec.json.decode(raw or b"{}", type=_NewAdapter)
    except msgspec.DecodeError as e:
        raise BadRequest(f"invalid body: {e} (expected {{\"name\": ..., \"path\": ...}})") from e
    except (UnicodeDecodeError, RecursionError):
        raise BadRequest("invalid body: not UTF-8 JSON of a sane depth") from None


class AdapterAdmin:
    """The controller's side of the adapter admin routes."""

    def __init__(self, cfg: Config, registry: Registry, slots: AdapterSlots, store: AdapterStore) -> None:
        self.cfg = cfg
        self.registry = registry
        self.slots = slots
        self.store = store

    def _fleet(self, fleet: str) -> FleetConfig:
        f = self.cfg.fleet(fleet)
        if f is None:
            raise KeyError(fleet)
        if f.lora_slots() == 0:
            raise BadRequest(f"fleet {fleet!r} serves no LoRA adapter: its engine_args need "
                             "enable-lora = true (and max-loras)", param="name")
        return f

    async def add(self, fleet: str, raw: bytes) -> Any:
        body = _decode(raw)
        f = self._fleet(fleet)
        catalog = self.slots.catalog
        if any(g.model == body.name for g in self.cfg.fleets):
            raise BadRequest(f"{body.name!r} is a model's name: an adapter needs its own", param="name")
        existing = catalog.get(body.name)
        if existing is not None:
            raise BadRequest(f"adapter {body.name!r} exists already (fleet {existing.fleet!r}, "
                             f"{existing.source}); remove it first", param="name")
        adapter = Adapter(name=body.name, fleet=f.name, path=body.path, source="admin")
        loaded_on = await self._try_load(adapter)
        await self.store.set(adapter.name, StoredAdapter(fleet=f.name, path=body.path))
        catalog.failed.pop(adapter.name, None)
        return {"adapter": {"name": adapter.name, "fleet": f.name, "path": body.path, "parent": f.model},
                "loaded_on": loaded_on}

    async def _try_load(self, adapter: Adapter) -> str | None:
        """Load it on an instance with room: the path proved; None when no instance had room (or none
        is ready) — the first request loads it then."""
        for inst in self.registry.instances(adapter.fleet):
            if inst.state is not InstanceState.READY:
                continue
            if self.slots.holds(inst, adapter.name):  # an engine finished a load that had timed out
                return inst.id
            plans = dict(self.slots.narrow(adapter, [(_room(), inst)])[1])
            plan = plans.get(inst.id)
            if plan is None or plan.rule not in (ADAPTER_FREE_SLOT, ADAPTER_EVICTED):
                continue
            try:
                await self.slots.ensure(inst, AdapterPlan(adapter, plan.rule, load=True, evict=plan.evict))
            except AdapterLoadFailed as e:
                if e.timed_out:  # a slow path, not a bad one: not added, not marked failed; asked again after
                    raise DeadlineExceeded(
                        f"adapter {adapter.name!r} is not added: {e.message}; {inst.id} is asked what it "
                        "holds once the load ends (a load the engine finished is kept: adding it again "
                        "then succeeds at once)", param="path") from None
                self.slots.catalog.mark_failed(adapter.name, e.message)
                raise BadRequest(f"adapter {adapter.name!r} did not load from {adapter.path!r}: {e.message}",
                                 param="path") from None
            return inst.id
        return None

    async def load(self, instance: str, raw: bytes) -> Any:
        """Load an adapter on ``instance`` for a request of another process (a follower, a worker): only
        the controller loads, so one record of each load there is, fenced by the lease as every engine
        change (the relay carries calls out only while this process controls). 404 when the engine
        says the path holds no adapter (the caller marks it failed), 502 for any other failure."""
        try:
            body = msgspec.json.decode(raw or b"{}", type=_Load)
        except msgspec.DecodeError as e:
            raise BadRequest(f"invalid body: {e}") from None
        inst = self.registry.get(instance)
        if inst is None or inst.state is not InstanceState.READY:
            raise UpstreamError(f"instance {instance!r} is not ready on the controller", instance=instance)
        adapter = self.slots.catalog.get(body.adapter)
        if adapter is None or adapter.fleet != inst.fleet:
            raise NotFound(f"no adapter {body.adapter!r} in fleet {inst.fleet!r}", param="model")
        try:
            await self.slots.ensure(inst, AdapterPlan(adapter, "relayed", load=True, evict=body.evict))
        except AdapterLoadFailed as e:
            if e.permanent:
                raise NotFound(e.message, param="model") from None
            raise UpstreamError(e.message, instance=instance) from None
        return {"instance": instance, "held": self.slots.held(inst)}

    async def remove(self, fleet: str, raw: bytes) -> Any:
        name = msgspec.json.decode(raw or b"{}", type=dict[str, str]).get("name", "")
        self._fleet(fleet)
        adapter = self.slots.catalog.get(name)
        if adapter is None or adapter.fleet != fleet:
            raise KeyError(name)
        if adapter.source == "config":
            raise BadRequest(f"adapter {name!r} is declared in the config: remove it there and reload",
                             param="name")
        await self.store.unset(name)
        unloaded = []
        for inst in self.registry.instances(fleet):
            if self.slots.holds(inst, name) and await self.slots.unload(inst, name):
                unloaded.append(inst.id)
        self.slots.catalog.failed.pop(name, None)
        return {"removed": name, "unloaded_from": unloaded}


def _room() -> Candidate:
    """A candidate that is not saturated, for asking :meth:`AdapterSlots.narrow` about one instance."""
    return Candidate(id="", load=0.0, inflight=0, queue=0.0, capacity=1, kv_usage=0.0, stale=False)
