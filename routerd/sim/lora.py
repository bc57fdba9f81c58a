"""LoRA adapters in the simulated engine, as vLLM 0.32 serves them (``--enable-lora``).

Three layers, as in vLLM:

- **registered** — what ``POST /v1/load_lora_adapter`` added and ``/v1/unload_lora_adapter`` removed
  (vLLM's ``OpenAIServingModels.lora_requests``): the names requests may use, listed by ``/v1/models``
  with ``parent`` = the base model. vLLM's answers: both fields needed (400 ``InvalidUserInput``), a name
  that is the base model's (400), a name already loaded without ``load_inplace`` (400), a path with no
  adapter (404 ``NotFoundError``, "No adapter found"), a rank above ``--max-lora-rank`` (500, the
  worker's error); an unknown name to unload: 404 ``NotFoundError``. Unloading only forgets the name, as
  0.32's does: requests already admitted finish.
- **resident** — the worker's LRU cache of ``--max-cpu-loras`` (default ``--max-loras``) loaded
  weights. A load puts the adapter there; when the cache is full the least recently used adapter that
  no running request uses goes. A request whose adapter was pushed out loads it again when it is
  scheduled, and that step costs ``--lora-load-s`` more for every request in the batch (vLLM's worker
  loads synchronously inside ``execute_model``).
- **slots** — the scheduler admits a waiting request only while the running batch holds at most
  ``--max-loras`` distinct adapters (vLLM's ``scheduled_loras`` check): a request for another adapter
  is skipped, stays waiting (``vllm:num_requests_waiting_by_reason{reason="deferred"}``) and is
  admitted once a running adapter's requests have finished. Requests behind it are not held up.

A load is an engine utility call: it runs between engine steps and stalls them for ``--lora-load-s``
(vLLM's ``add_lora`` goes through the engine core's busy loop), so a load costs every running request
that much, which is what makes placement matter. A client that leaves before the load answers does not
undo it: vLLM's load route is not cancelled with its connection (no ``with_cancellation``, unlike the
generation routes), so the engine holds the adapter once the load ends, whoever waited for it.

:class:`LoraRoutes` is the load and unload routes' family (the server adds it as any other route
family); the completion and chat handlers resolve a request's adapter with :meth:`SimLora.resolve` and
hand it to ``Runner.generation(..., lora=)`` (``routerd/sim/running.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from routerd import log
from routerd.errors import error_body

from . import protocol as p
from . import wire
from .config import SimConfig

_log = log.get("routerd.sim")


@dataclass(frozen=True)
class SimAdapter:
    """One registered adapter: vLLM's ``LoRARequest`` (name, int id, path) and its rank."""

    name: str
    int_id: int
    path: str
    rank: int

    @property
    def extra_key(self) -> tuple[str, str, str]:
        """The block-hash extra key vLLM 0.32 adds to every block of this adapter's requests."""
        return ("lora", self.name, self.path)

    @property
    def extra_key_tuple(self) -> tuple[tuple[str, ...], ...]:
        """The blocks' whole ``extra_keys`` (the LoRA key alone: the sim has no images or salt)."""
        return (self.extra_key,)


class LoraError(Exception):
    """A load or unload vLLM refuses: ``status`` and vLLM's error JSON ``body``."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_, status)


def _read_rank(path: str) -> int | None:
    """The adapter's ``r`` from ``adapter_config.json``; None when the directory holds no adapter."""
    cfg_file = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    rank = cfg.get("r", 8) if isinstance(cfg, dict) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 else None


def adapter_seed(seed: int, name: str) -> int:
    """The seed a sim generates with for adapter ``name`` (``expected_text(adapter_seed(s, n), …)``)."""
    return (seed + zlib.crc32(name.encode()) * 0x9E3779B1) & 0xFFFF_FFFF_FFFF_FFFF


class SimLora:
    """The adapters of one simulated engine (see the module docstring)."""

    def __init__(self, cfg: SimConfig, *, read_rank: Callable[[str], int | None] = _read_rank) -> None:
        self.cfg = cfg
        self.max_loras = cfg.max_loras
        self.capacity = max(cfg.max_cpu_loras or cfg.max_loras, cfg.max_loras)
        self.registered: dict[str, SimAdapter] = {}
        self.resident: OrderedDict[int, SimAdapter] = OrderedDict()
        self.loads = 0  # weights read from "disk": by the load route and again after eviction
        self._next_id = 0
        self._read_rank = read_rank
        self._pending_load_s = 0.0
        self._info: Gauge | None = None
        self._loads: Counter | None = None

    # ---- the routes -------------------------------------------------------------------------------

    def check_load(self, body: Any) -> SimAdapter:
        """Validate a load request and make its adapter (not yet registered); raise :class:`LoraError`."""
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) \
                or not isinstance(body.get("lora_path"), str):
            raise LoraError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        name, path = body["lora_name"], body["lora_path"]
        inplace = body.get("load_inplace") is True
        if not name or not path:
            raise LoraError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.cfg.model:
            raise LoraError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                            "InvalidUserInput")
        if not inplace and name in self.registered:
            raise LoraError(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                            "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        if not self.cfg.enable_lora:
            raise LoraError(500, "LoRA is not enabled. Use --enable-lora to enable LoRA.",
                            "InternalServerError")
        rank = self._read_rank(path)
        if rank is None:
            raise LoraError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        if rank > self.cfg.max_lora_rank:
            raise LoraError(500, f"LoRA rank {rank} is greater than max_lora_rank {self.cfg.max_lora_rank}.",
                            "InternalServerError")
        previous = self.registered.get(name)
        if previous is not None:
            int_id = previous.int_id
        else:
            self._next_id += 1
            int_id = self._next_id
        return SimAdapter(name=name, int_id=int_id, path=path, rank=rank)

    def commit_load(self, adapter: SimAdapter, busy: Iterable[SimAdapter]) -> None:
        """The weights are read (the engine stalled for it): register and make resident."""
        self.registered[adapter.name] = adapter
        self._make_resident(adapter, {a.int_id for a in busy})
        self._count_load()

    def unload(self, body: Any) -> str:
        """Forget a name (requests already admitted go on); raise :class:`LoraError` as vLLM does."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise LoraError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                            "InvalidUserInput")
        if name not in self.registered:
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.registered[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def resolve(self, model: Any) -> SimAdapter | None:
        """The adapter a request's ``model`` names, or None (the base model, or unknown)."""
        return self.registered.get(model) if isinstance(model, str) else None

    @staticmethod
    def seed(seed: int, adapter: SimAdapter | None) -> int:
        """The output's seed: an adapter's weights change what the model says (a stable function of its
        name, so every instance holding it answers alike: :func:`adapter_seed`)."""
        return seed if adapter is None else adapter_seed(seed, adapter.name)

    def model_cards(self, created: int, perm: dict[str, Any]) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the registered adapters (vLLM's ``ModelCard``: root = path)."""
        return [{"id": a.name, "object": "model", "created": created, "owned_by": "vllm", "root": a.path,
                 "parent": self.cfg.model, "max_model_len": None, "permission": [perm]}
                for a in self.registered.values()]

    # ---- the scheduler's side ---------------------------------------------------------------------

    def admits(self, adapter: SimAdapter | None, running: Iterable[SimAdapter | None]) -> bool:
        """vLLM's ``max_loras`` check: may a request of ``adapter`` join a batch running ``running``?"""
        if adapter is None:
            return True
        scheduled = {a.int_id for a in running if a is not None}
        return adapter.int_id in scheduled or len(scheduled) < self.max_loras

    def activate(self, adapter: SimAdapter, busy: Iterable[SimAdapter | None]) -> None:
        """A request of ``adapter`` was scheduled: reload it if the cache let it go (the step pays)."""
        if adapter.int_id in self.resident:
            self.resident.move_to_end(adapter.int_id)
            return
        self._make_resident(adapter, {a.int_id for a in busy if a is not None})
        self._count_load()
        self._pending_load_s += self.cfg.lora_load_s

    def _count_load(self) -> None:
        self.loads += 1
        if self._loads is not None:
            self._loads.inc()

    def take_load_ms(self) -> float:
        """The loading this step did (ms), once."""
        ms, self._pending_load_s = self._pending_load_s * 1000.0, 0.0
        return ms

    def _make_resident(self, adapter: SimAdapter, busy: set[int]) -> None:
        self.resident.pop(adapter.int_id, None)
        while len(self.resident) >= self.capacity:
            idle = next((i for i in self.resident if i not in busy), None)
            self.resident.pop(idle if idle is not None else next(iter(self.resident)))
        self.resident[adapter.int_id] = adapter

    # ---- metrics ----------------------------------------------------------------------------------

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """``vllm:lora_requests_info`` in the engine's registry (only with ``--enable-lora``, as vLLM)."""
        self._info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry)
        # the simulator's own (vLLM counts no loads): every read of an adapter's weights, by the load
        # route and again when a request's adapter had left the cache — what ``routerd bench lora``
        # compares routers by
        self._loads = Counter("sim:lora_loads", "Adapter weights read (load route, or reloaded when "
                              "scheduled after the cache let them go); the simulator's own.",
                              registry=registry)

    def record(self, running: Iterable[SimAdapter | None], waiting: Iterable[SimAdapter | None]) -> None:
        """One step's stats as vLLM logs them: a series per label set, its value the time it was last
        true — a reader takes the series with the highest value."""
        if self._info is None:
            return
        run = ",".join(dict.fromkeys(a.name for a in running if a is not None))
        wait = ",".join(dict.fromkeys(a.name for a in waiting if a is not None))
        self._info.labels(str(self.max_loras), wait, run).set_to_current_time()

    def deferred(self, running: Iterable[SimAdapter | None], waiting: Iterable[SimAdapter | None]) -> int:
        """Waiting requests the ``max_loras`` check holds back now."""
        batch = list(running)
        return sum(1 for a in waiting if a is not None and not self.admits(a, batch))


class LoraRoutes:
    """``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (always served: without
    ``--enable-lora`` a load answers vLLM's 500). ``utility(s)`` stalls the engine's steps for ``s``
    (a load is an engine utility call); ``busy()`` are the adapters of the running batch (kept resident)."""

    def __init__(self, lora: SimLora, utility: Callable[[float], Awaitable[None]],
                 busy: Callable[[], Iterable[SimAdapter]]) -> None:
        self.lora = lora
        self.utility = utility
        self.busy = busy
        self._loads: set[asyncio.Task[None]] = set()  # loads whose caller may have left: owned here

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/load_lora_adapter", self.load),
                web.post("/v1/unload_lora_adapter", self.unload)]

    async def load(self, request: web.Request) -> web.Response:
        try:
            adapter = self.lora.check_load(await wire.read_json(request))
        except wire.Unparsable:
            return wire.unparsable()
        except (p.RequestError, LoraError) as e:
            return wire.json_response(e.body, e.status)
        # the server cancels a handler whose client left; the load goes on regardless, as vLLM's does
        task = asyncio.get_running_loop().create_task(self._load(adapter),
                                                      name=f"sim-lora-load:{adapter.name}")
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)
        await asyncio.shield(task)
        return web.Response(text=f"Success: LoRA adapter '{adapter.name}' added successfully.")

    async def _load(self, adapter: SimAdapter) -> None:
        await self.utility(self.lora.cfg.lora_load_s)  # reading the weights stalls the engine
        self.lora.commit_load(adapter, self.busy())
        _log.info("sim_lora_loaded", name=adapter.name, path=adapter.path, int_id=adapter.int_id)

    async def unload(self, request: web.Request) -> web.Response:
        try:
            text = self.lora.unload(await wire.read_json(request))
        except wire.Unparsable:
            return wire.unparsable()
        except (p.RequestError, LoraError) as e:
            return wire.json_response(e.body, e.status)
        _log.info("sim_lora_unloaded", text=text)
        return web.Response(text=text)
