"""Heartbeats and rotation for static fleets: engines at configured URLs that routerd did not launch.

They get the heartbeat of a launched instance (routerd/fleet/health.py) minus the Ray actor: ``/health``
within the probe deadline, asked by routerd itself, plus token progress from the scraped metrics, so a
hung engine (SIGSTOP, a wedged GPU whose HTTP server still answers) is caught, not only a dead one.
There is nothing to restart, so the rules are:

* into rotation when ``/health`` answers 200 and a scrape succeeded within ``stale_after_s``;
* out of rotation when no scrape succeeded for ``stale_after_s`` (its load figure is a guess); it is
  still heartbeaten, and what runs on it goes on. Not right after routerd's own loop was held up:
  that stall held the scrapes up too, so their age counts again from the end of the stall;
* failed after ``failure_threshold`` missed heartbeats or a stall (requests running, no new token for
  ``progress_timeout_s``): out of rotation, and every engine call still on it is ended
  (``Instance.lose``): a stream gets the terminal error event at once, instead of waiting
  ``read_timeout_s`` on a socket that a hung engine never closes; a request with no byte sent yet is
  retried elsewhere;
* back into rotation by the first rule once it answers again, with a fresh heartbeat tracker;
* drained by an admin (``POST /admin/instances/{id}/drain``): out of rotation, what runs on it finishes,
  and the first rule does not bring it back until ``POST /admin/instances/{id}/undrain`` — routerd
  cannot restart an engine it did not launch, so undrain is how a static instance returns.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import aiohttp

from .. import _aio, _net, log, redact
from ..config import Config, FleetConfig
from ..registry import Instance, InstanceState, Registry
from .health import ActorProbe, HealthMonitor, ProbeResult

_log = log.get("routerd.static_health")

STATIC = "static"
_HEALTH_BYTES = 64 * 1024  # vLLM's /health answers with an empty body
_WATCHED = (InstanceState.READY, InstanceState.DRAINING, InstanceState.UNHEALTHY)


def static_instances(fleet: FleetConfig) -> list[Instance]:
    """A static fleet's registry entries, ``<fleet>:static<i>`` per URL, starting out of rotation."""
    return [Instance(id=f"{fleet.name}:static{i}", fleet=fleet.name, url=url.rstrip("/"),
                     capacity_hint=fleet.max_num_seqs, static=True)
            for i, url in enumerate(fleet.urls)]


def _static_fleets(cfg: Config) -> frozenset[str]:
    return frozenset(f.name for f in cfg.fleets if f.engine == STATIC)


class StaticHealth:
    """Rotation and heartbeats of every static instance in the registry; the data plane owns ``run()``."""

    def __init__(self, cfg: Config, registry: Registry, session: aiohttp.ClientSession, *,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 fetch: _net.Fetch | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.session = session
        self._fetch = fetch or _net.session_fetch(session)
        # asked for every instance on every heartbeat pass: a set, not a scan of the config's fleets
        self._static_fleets = _static_fleets(cfg)
        self.clock = clock
        self._failed: set[str] = set()  # failed their heartbeats: watched again once back in rotation
        self._drained: set[str] = set()  # drained by an admin: kept out of rotation until undrained
        self.monitor = HealthMonitor(registry, cfg.health, self._probe, self._on_failed, clock=clock,
                                     rng=rng, watch=self._watched)

    def update_config(self, cfg: Config) -> None:
        self.cfg = cfg
        self._static_fleets = _static_fleets(cfg)
        self.monitor.update_config(cfg.health)

    def sync(self, cfg: Config) -> None:
        """Make the registry's static instances match ``cfg`` (start-up and reload)."""
        wanted: dict[str, Instance] = {}
        for fleet in cfg.fleets:
            self.registry.ensure_fleet(fleet.name)
            if fleet.engine == STATIC:
                wanted.update((i.id, i) for i in static_instances(fleet))
        for inst in list(self.registry):
            if not inst.static:
                continue
            new = wanted.get(inst.id)
            if new is None or new.url != inst.url:
                self.registry.remove(inst.id)
                self._drained.discard(inst.id)  # a drain was of that engine, not of a new URL
            else:
                inst.capacity_hint = new.capacity_hint
                wanted.pop(inst.id)
        for inst in wanted.values():
            self.registry.add(inst)

    def is_static(self, inst: Instance) -> bool:
        return inst.static and inst.fleet in self._static_fleets

    def instances(self) -> list[Instance]:
        return [i for i in self.registry if self.is_static(i)]

    def instance(self, instance_id: str) -> Instance | None:
        """The static instance of that id, or None (no such instance, or a launched one)."""
        inst = self.registry.get(instance_id)
        return inst if inst is not None and self.is_static(inst) else None

    def drain(self, inst: Instance) -> None:
        """Admin: no new requests (in-flight ones go on) until :meth:`undrain`."""
        self._drained.add(inst.id)
        self.registry.set_state(inst, InstanceState.DRAINING, "drained by admin")
        _log.info("instance_drained", instance=inst.id)

    def undrain(self, inst: Instance) -> None:
        """Admin: back into rotation by the usual rule (``/health`` answers, a fresh scrape)."""
        self._drained.discard(inst.id)
        if inst.state is InstanceState.DRAINING:
            self.registry.set_state(inst, InstanceState.UNHEALTHY, "undrained by admin: waiting for /health")
        _log.info("instance_undrained", instance=inst.id)

    def _watched(self, inst: Instance) -> bool:
        return inst.state in _WATCHED and inst.id not in self._failed and self.is_static(inst)

    async def run(self) -> None:
        """Heartbeats and the rotation rules, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.monitor.run(), name="static_heartbeats")
            tg.create_task(self._rotation(), name="static_rotation")

    async def _rotation(self) -> None:
        lag, excused_until = 0.0, 0.0
        while True:
            cfg = self.cfg.routing
            now = self.clock()
            if lag > cfg.scrape_interval_s:
                # This pass ran late: routerd's own loop was held up (CPU starvation, a long pause), and
                # the scrapes with it — their age says nothing of the engines. Count it from now, as if
                # each had just been scraped (and give one scrape at least its period and timeout to
                # land), else a stall of routerd would take every instance out of rotation at once — and
                # a machine still loaded after the stall would take out those whose scrape lands late.
                excused_until = now + max(cfg.stale_after_s, cfg.scrape_interval_s + cfg.scrape_timeout_s)
            probes = []
            for inst in self.instances():
                if inst.id in self._drained:
                    continue  # an admin took it out: only undrain brings it back
                snap = inst.snapshot
                last_ok = snap.scraped_at if snap is not None else None
                if inst.state is InstanceState.READY:
                    if now < excused_until and last_ok is not None:
                        continue
                    if last_ok is None or now - last_ok > cfg.stale_after_s:
                        self.registry.set_state(inst, InstanceState.UNHEALTHY,
                                                f"no successful /metrics scrape for {cfg.stale_after_s}s")
                        _log.warning("instance_out_of_rotation", instance=inst.id, reason=inst.state_reason)
                elif last_ok is not None and now - last_ok <= cfg.stale_after_s:
                    probes.append(self._admit(inst))
            if probes:
                await asyncio.gather(*probes)
            lag = await _aio.overslept(cfg.scrape_interval_s, self.clock)

    async def _admit(self, inst: Instance) -> None:
        """Back into rotation if ``/health`` answers 200 now."""
        try:
            async with asyncio.timeout(self.cfg.routing.scrape_timeout_s):
                status, _ = await self._fetch(inst.url + "/health", _HEALTH_BYTES)
            healthy = status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            healthy = False
        if healthy and inst.state is not InstanceState.READY and self.registry.get(inst.id) is inst \
                and inst.id not in self._drained:  # drained while /health was asked
            self._failed.discard(inst.id)
            self.registry.set_state(inst, InstanceState.READY, "answers /health")
            _log.info("instance_ready", instance=inst.id, url=redact.url(inst.url))

    async def _probe(self, inst: Instance, deadline_s: float) -> tuple[ActorProbe | None, bool, bool]:
        """One heartbeat: ``GET /health`` within ``deadline_s``. No actor: the process is not ours to
        see, so it counts as alive and only the HTTP answer (and token progress) decide."""
        try:
            async with asyncio.timeout(deadline_s):
                status, _ = await self._fetch(inst.url + "/health", _HEALTH_BYTES)
            return ActorProbe(process_alive=True, http_status=status), False, False
        except TimeoutError:
            return ActorProbe(process_alive=True, http_status=None, error="timeout"), False, False
        except (aiohttp.ClientError, OSError):
            return ActorProbe(process_alive=True, http_status=None, error="connect"), False, False

    async def _on_failed(self, inst: Instance, result: ProbeResult) -> None:
        if self.registry.get(inst.id) is not inst or not self._watched(inst):
            return  # removed or replaced by a reload meanwhile
        self._failed.add(inst.id)
        self.registry.set_state(inst, InstanceState.UNHEALTHY, f"heartbeat: {result.value}")
        ended = inst.lose(f"instance {inst.id} failed its heartbeats ({result.value})")
        _log.warning("instance_failed", instance=inst.id, result=result.value, requests_ended=ended)
