"""The fleet state one routerd controls and every other routerd follows, through Redis.

Exactly one process controls the fleets (launch, adopt, health, restarts, scaling: the fleet manager and
the static fleets' heartbeats run there). It *publishes* what its registry knows of every instance — id,
URL, state and why, generation, restarts, PID, node, capacity, health, last heartbeat, resources —
plus each launched fleet's desired replica count, its LoRA record (which instance holds, and is loading,
which adapter; the adapters that failed to load), its own ident and its config fingerprint: one msgpack
value in the hash :meth:`routerd.redis_keys.RedisKeys.fleet_state`, written by one Lua script that refuses a
writer whose fencing token is older than the stored one (a deposed controller cannot overwrite its
successor), gives each write the next version of a counter, renews a short expiry and announces a
changed value on :meth:`~routerd.redis_keys.RedisKeys.fleet_channel`. It publishes on every registry change
and at
least every ``publish_every_s``.

Every other process *follows*: on the notice (or at the latest after ``publish_every_s``, the poll that
covers a lost notice) it reads the value and applies it to its own registry — instances added, their
controller-owned fields updated (its own in-process fields — in-flight counts, scrapes, learned speed,
circuit breaker — kept), instances the controller no longer has removed. A new engine generation gets
a new :class:`~routerd.registry.Instance`, as on the controller, and an instance that leaves rotation
failed has its engine calls ended here too (a hung engine never closes its sockets). A read that returns
after this process took control is dropped: its registry is its own from then on.

The state's age is the time since this follower last saw a *new* version (its own monotonic clock, so
hosts' clocks may differ). Past ``stale_after_s`` — no controller publishing — the follower keeps the
last state it had (the engines still serve; readiness does not flap), logs it, and says so in
``/admin/fleets`` and ``routerd_view_age_seconds``.

The value is sealed (routerd/peers/sealed.py) with the publisher's fencing token and a sequence number
inside the seal: a follower applies only a state it can open, and never one older (lower token, or the
same token and a lower sequence) than one it applied — so neither a state written by hand (an instance
URL of anyone's choosing) nor a genuine older one written again is followed. Freshness is the sealed
sequence moving, not the hash's version (which anyone could bump). A follower whose published state it
cannot trust keeps the last one it could (a forgery is overwritten by the next publish); when it has
none, or that one is stale, it is not ready (``/readyz`` 503 says why: :meth:`FleetStateSync.untrusted`).

Which config wins: what decides launches and the fleets' life — ``[[fleets]]``, ``[health]``,
``ray.namespace`` (:func:`config_fingerprint`) — is the controller's: a follower routes over the
controller's instances and replica counts whatever its own file says, and says loudly when its own
differs (a warning at start and on every change, ``routerd_view_config_mismatch``; not while a reload of
a worker's own parent is still reaching it: the state carries the controller's count of reloads).
Routing, tenants, admission and ``[http]`` are each process's own. The controller's fleets are the
fleets: a follower serves, lists and reports readiness only for those
(:meth:`FleetStateSync.followed_fleets`),
and engines of fleets the controller lacks are published as orphaned, left running, not routed to.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import redis.asyncio as aioredis
from prometheus_client.core import GaugeMetricFamily

from .. import _aio, log, redact
from ..config import Config
from ..lora_placement import LoraRecord
from ..redis_keys import RedisKeys
from ..redis_server import REDIS_DOWN
from ..registry import Instance, InstanceState, Registry
from ..trust import Rejected, Trust, Why
from .sealed import FLEET_STATE, Seals

_log = log.get("routerd.peers")

PUBLISH_EVERY_S = 0.5  # the controller's refresh; a follower's poll when a notice is lost
EXPIRE_MS = 5000  # a controller gone this long leaves no state behind
STALE_AFTER_S = 3.0  # a follower whose state is older says so
_IN_ROTATION = (InstanceState.READY, InstanceState.DRAINING)

# KEYS: state hash, version counter. ARGV: token, state, expiry ms, channel, announce (1/0).
# Returns the version written, or -1 when a newer controller (higher token) has written already.
_PUBLISH = """
local held = tonumber(redis.call('HGET', KEYS[1], 'token') or '-1')
if tonumber(ARGV[1]) < held then return -1 end
local v = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'version', v, 'state', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[5] == '1' then redis.call('PUBLISH', ARGV[4], v) end
return v
"""


class PublishedInstance(msgspec.Struct, frozen=True, kw_only=True):
    """The controller-owned fields of one instance: what routing, readiness and status read."""

    id: str
    fleet: str
    url: str
    state: str
    state_reason: str = ""
    generation: int = 0
    restarts: int = 0
    pid: int | None = None
    node: str = ""
    capacity_hint: int = 256
    launch_capacity: int | None = None
    static: bool = False
    started_at: float = 0.0
    resources: dict[str, Any] = {}
    health: str = "unknown"
    last_heartbeat: float = 0.0
    lost_at: float = 0.0  # Instance.lost_at: a follower ends its calls on it when this moves on


class PublishedOrphan(msgspec.Struct, frozen=True, kw_only=True):
    """A running engine of a fleet the controller's config lacks (routerd/fleet/adopt.py ``Orphan``)."""

    id: str
    fleet: str
    url: str = ""
    pid: int | None = None
    node: str = ""
    since: float = 0.0
    state: str = "orphaned"
    reason: str = ""


class FleetState(msgspec.Struct, frozen=True, kw_only=True):
    """One published state: the instances, the fleets' desired replicas, who published it."""

    controller: str
    fingerprint: str
    fleets: list[str] = []
    instances: list[PublishedInstance] = []
    replicas: dict[str, int] = {}
    # How many reloads the controller has applied: its own workers tell a reload still reaching them
    # (their parent's count moved on, theirs not yet) from a config that differs (FleetStateSync.mismatch).
    reloads: int = 0
    orphans: list[PublishedOrphan] = []
    # Who holds which LoRA adapter, as the controller's record says (routerd/routing/adapters.py); None:
    # no fleet serves adapters (or a controller of a version before it published one)
    lora: LoraRecord | None = None


class Published(msgspec.Struct, frozen=True, array_like=True):
    """What is sealed: the state (msgpack of :class:`FleetState`) and its order — the publisher's
    fencing token, then its own sequence — so that a copy of an older one is known as older."""

    token: int
    seq: int
    state: bytes


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(FleetState).decode
_decode_published = msgspec.msgpack.Decoder(Published).decode


def config_fingerprint(cfg: Config) -> str:
    """A short hash of what decides launches and the fleets' life: ``[[fleets]]``, ``[health]`` and
    ``ray.namespace``. Two processes with the same fingerprint would launch and restart the same way.

    The fleets' secrets (a static fleet's ``api_key``, URL passwords, secret-named ``env`` and
    ``engine_args``) are left out: the fingerprint is published in Redis, where a short unsalted hash
    of a guessable key could be searched offline."""
    fleets = [msgspec.structs.replace(
        f, api_key="", urls=[redact.url(u) for u in f.urls],
        env={k: redact.MASK if redact.secret_name(k) else v for k, v in f.env.items()},
        engine_args={k: redact.MASK if redact.secret_name(k) else v for k, v in f.engine_args.items()})
        for f in cfg.fleets]
    blob = msgspec.json.encode({"fleets": fleets, "health": cfg.health, "ray_namespace": cfg.ray.namespace})
    return hashlib.sha256(blob).hexdigest()[:16]


def view_of(inst: Instance) -> PublishedInstance:
    return PublishedInstance(id=inst.id, fleet=inst.fleet, url=inst.url, state=inst.state.value,
                        state_reason=inst.state_reason, generation=inst.generation, restarts=inst.restarts,
                        pid=inst.pid, node=inst.node, capacity_hint=inst.capacity_hint,
                        launch_capacity=inst.launch_capacity, static=inst.static, started_at=inst.started_at,
                        resources=inst.resources, health=inst.health, last_heartbeat=inst.last_heartbeat,
                        lost_at=inst.lost_at)


def _state(value: str) -> InstanceState:
    try:
        return InstanceState(value)
    except ValueError:  # a newer controller's state this process does not know: out of rotation
        return InstanceState.UNHEALTHY


def _new_instance(v: PublishedInstance) -> Instance:
    return Instance(id=v.id, fleet=v.fleet, url=v.url, state=_state(v.state), state_reason=v.state_reason,
                    capacity_hint=v.capacity_hint, static=v.static, launch_capacity=v.launch_capacity,
                    generation=v.generation, restarts=v.restarts, pid=v.pid, node=v.node,
                    started_at=v.started_at, resources=dict(v.resources), health=v.health,
                    last_heartbeat=v.last_heartbeat, lost_at=v.lost_at)


def _replaced(inst: Instance, v: PublishedInstance) -> bool:
    """A new engine behind the same id: nothing of the old one's (scrapes, breaker, in-flight) holds."""
    return bool(inst.generation and v.generation != inst.generation) or bool(
        inst.url and v.url and inst.url != v.url)


def apply_state(registry: Registry, state: FleetState) -> None:
    """Make ``registry`` match the published ``state``: add, update the controller's fields, remove."""
    for fleet in state.fleets:
        registry.ensure_fleet(fleet)
    seen: set[str] = set()
    for v in state.instances:
        seen.add(v.id)
        inst = registry.get(v.id)
        new_state = _state(v.state)
        if inst is None or _replaced(inst, v):
            if inst is not None and inst.state in _IN_ROTATION:
                inst.lose(f"instance {v.id}: a new engine replaced it ({v.state_reason or v.state})")
            new = registry.add(_new_instance(v))
            if inst is not None:  # a counter /metrics exposes under the same labels never goes back
                new.scrape_errors_total = inst.scrape_errors_total
            continue
        inst.url, inst.generation, inst.restarts, inst.pid = v.url, v.generation, v.restarts, v.pid
        inst.node, inst.capacity_hint, inst.launch_capacity = v.node, v.capacity_hint, v.launch_capacity
        inst.static, inst.started_at, inst.resources = v.static, v.started_at, dict(v.resources)
        inst.health, inst.last_heartbeat = v.health, v.last_heartbeat
        if v.lost_at > inst.lost_at:
            # The controller ended its own calls on it (its heartbeats failed, its engine is gone): so do
            # we. Not merely because it left rotation: a static instance whose scrapes went stale is
            # out of rotation while what runs on it goes on, on the controller and here alike.
            inst.lose(f"instance {v.id}: {v.state_reason or v.state}")
            inst.lost_at = v.lost_at
        registry.set_state(inst, new_state, v.state_reason)
    for inst in registry:
        if inst.id not in seen:
            registry.remove(inst.id)


class FleetStateSync:
    """Publishes the fleet state while this process controls, follows it otherwise: one loop,
    :meth:`run`, that switches with ``controls()`` (the control lease's verdict)."""

    def __init__(self, registry: Registry, client: aioredis.Redis, keys: RedisKeys, *, ident: str,
                 fingerprint: str, controls: Callable[[], bool], seals: Seals,
                 token: Callable[[], int] = lambda: 0,
                 replicas: Callable[[], dict[str, int]] = dict, op_timeout_s: float = 5.0,
                 publish_every_s: float = PUBLISH_EVERY_S, expire_ms: int = EXPIRE_MS,
                 stale_after_s: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic,
                 parent: str | None = None,
                 orphans: Callable[[], list[dict[str, Any]]] = list,
                 lora: Callable[[], LoraRecord | None] = lambda: None,
                 on_lora: Callable[[LoraRecord | None], None] = lambda record: None) -> None:
        """``client``: the caller's (it closes it); ``controls()``/``token()``: the control lease's;
        ``replicas()``: the launched fleets' desired counts (the fleet manager's) to publish; ``seals``:
        the process's (the state is sealed, and opened); ``parent``: a worker's parent's ident
        (routerd/workers.py), whose reloads reach this process after its own; ``orphans()``: the engines
        the fleet manager left running unmanaged, to publish; ``lora()``: the LoRA record to publish,
        ``on_lora(record)``: a followed state's, handed to the routing side on every state applied."""
        self.registry = registry
        self.client = client
        self.keys = keys
        self.ident = ident
        self.fingerprint = fingerprint
        self.controls = controls
        self.seals = seals
        self.token = token
        self.replicas_of = replicas
        self.orphans_of = orphans
        self.lora_of = lora
        self.on_lora = on_lora
        self.op_timeout_s = op_timeout_s
        self.publish_every_s = publish_every_s
        self.expire_ms = expire_ms
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._script = client.register_script(_PUBLISH)
        self.state: FleetState | None = None  # the last state published or followed
        self.version = 0
        self._blob = b""
        self._seq = 0  # this process's last publish's sequence (sealed with its token)
        self._order = (-1, -1)  # (token, seq) of the last state followed: an older one is a copy
        self._refused: tuple[Why, str | None] | None = None  # why the last read state was refused
        # (lease token, the launched fleets' counts in the state seen before this term's first publication)
        self._handover: tuple[int, dict[str, int] | None] | None = None
        self._applied_at = -1  # the registry's version right after the last state was applied
        self._fresh_at = clock()  # when this process last published or saw a new version
        self._following_since = clock()
        self._stale_logged = False
        self._fenced = False  # the last publish was refused (logged once until one is taken again)
        self._mismatch_logged = ""  # the controller fingerprint last warned about
        self.parent = parent
        self.reloads = 0  # reloads applied here (published while controlling)
        # A worker: its parent's reload count when both last had the same fleet config, plus the reloads
        # this worker applied since — the count its parent has when their configs agree (None: not known).
        self._parent_reloads: int | None = None

    # what others read -------------------------------------------------------------------------
    def update_config(self, cfg: Config) -> None:
        """Reload: this process's own fingerprint, compared again on the next state."""
        self.fingerprint = config_fingerprint(cfg)
        self._mismatch_logged = ""
        self.reloads += 1
        if self._parent_reloads is not None:
            self._parent_reloads += 1

    def age_s(self) -> float:
        """Seconds since this process last had fresh state: 0 while it publishes."""
        if self.controls():
            return 0.0
        return self.clock() - (self._fresh_at if self.state is not None else self._following_since)

    def stale(self) -> bool:
        return not self.controls() and self.age_s() > self.stale_after_s

    def mismatch(self) -> bool:
        """This follower's fleet config differs from the controller's (the controller's wins) — not
        while a reload of its own parent is still reaching this worker."""
        state = self.state
        return not self.controls() and state is not None and state.fingerprint != self.fingerprint \
            and not self._reload_reaching(state)

    def _reload_reaching(self, state: FleetState) -> bool:
        """``state`` is this worker's parent's, one or more reloads apart from this worker's own: the
        parent reloaded and told it to (or it reloaded first), and the two configs are the same file's
        at different moments — not a difference between replicas. It ends when both applied the same
        number of reloads; the configs are compared then."""
        return state.controller == self.parent and self._parent_reloads is not None \
            and state.reloads != self._parent_reloads

    def _sync_parent(self, state: FleetState) -> None:
        if state.controller == self.parent and state.fingerprint == self.fingerprint:
            self._parent_reloads = state.reloads

    def untrusted(self) -> str:
        """Why this follower has no fleet view it can trust ("": it has one): the published state is
        refused and this follower has none it could open, or only a stale one."""
        refused = self._refused
        if refused is None or self.controls() or (self.state is not None and not self.stale()):
            return ""
        why, theirs = refused
        if why is Why.OTHER_SECRET:
            return (f"the published fleet state is sealed with another secret (fingerprint {theirs}; this "
                    f"process's is {self.seals.fingerprint}): every routerd sharing this Redis needs the "
                    "same [control] secret")
        return f"the published fleet state is refused ({why.value}): not written by the controlling routerd"

    def replicas(self, fleet: str) -> int | None:
        """The controller's desired count for ``fleet`` while following; None when not known here."""
        if self.controls() or self.state is None:
            return None
        return self.state.replicas.get(fleet)

    def followed_fleets(self) -> frozenset[str] | None:
        """The fleets there are, as the controller says, while following (None: this process controls,
        or has no state yet — its own config's fleets are the fleets). The controller's fleets are the
        fleets: a follower serves, lists and reports readiness only for these."""
        if self.controls() or self.state is None:
            return None
        return frozenset(self.state.fleets)

    def serves(self, fleet: str) -> bool:
        """Whether ``fleet`` is one of the fleets there are (:meth:`followed_fleets`)."""
        followed = self.followed_fleets()
        return followed is None or fleet in followed

    def followed_orphans(self) -> list[dict[str, Any]] | None:
        """The controller's orphaned engines while following (None: this process controls, or has no
        state yet)."""
        if self.controls() or self.state is None:
            return None
        return [msgspec.structs.asdict(o) for o in self.state.orphans]

    def published_replicas(self) -> dict[str, int] | None:
        """The launched fleets' desired counts in the last state published or followed here, whoever
        controlled then (None: none seen): where this process's fleet control starts its autoscaled
        fleets when it takes over."""
        handover = self._handover
        if handover is not None and handover[0] == self.token():
            return handover[1]
        return dict(self.state.replicas) if self.state is not None else None

    def status(self) -> dict[str, Any]:
        """The ``view`` section of ``GET /admin/fleets``."""
        state = self.state
        return {"role": "controller" if self.controls() else "follower", "ident": self.ident,
                "controller": state.controller if state is not None else None, "version": self.version,
                "age_s": round(self.age_s(), 3), "stale": self.stale(), "fingerprint": self.fingerprint,
                "controller_fingerprint": state.fingerprint if state is not None else None,
                "config_mismatch": self.mismatch(), "secret_fingerprint": self.seals.fingerprint,
                "refused": self._refused[0].value if self._refused is not None else None,
                "untrusted": self.untrusted() or None}

    def collector(self) -> FleetStateCollector:
        return FleetStateCollector(self)

    # the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Publish while controlling, follow otherwise, until cancelled; Redis going away is waited
        out (a follower keeps its last state meanwhile)."""
        pubsub: Any = None
        backoff = 0.1
        try:
            while True:
                try:
                    if self.controls():
                        if pubsub is not None:
                            await self._close(pubsub)
                            pubsub = None
                        await self._publish_step()
                    else:
                        if pubsub is None:
                            pubsub = self.client.pubsub()
                            async with _aio.timeout(self.op_timeout_s):
                                await pubsub.subscribe(self.keys.fleet_channel())
                            self._following_since = self.clock()
                        await self._follow_step(pubsub)
                    if backoff > 0.1:
                        _log.info("fleet_view_redis_back")
                    backoff = 0.1
                except Exception as e:  # noqa: BLE001  # a loop boundary: logged, the step tried again
                    if isinstance(e, REDIS_DOWN):
                        if backoff == 0.1:  # once per outage; the queue's own log says more
                            _log.warning("fleet_view_redis_unavailable", error=repr(e),
                                         keeping="the last fleet state")
                    else:
                        _log.exception("fleet_view_step_failed", retry_in_s=backoff)
                    if pubsub is not None:
                        await self._close(pubsub)
                        pubsub = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            if pubsub is not None:
                await self._close(pubsub)

    async def _close(self, pubsub: Any) -> None:
        with contextlib.suppress(*REDIS_DOWN):
            await _aio.wait_for(pubsub.aclose(), 1.0)

    async def _publish_step(self) -> None:
        since = self.registry.version
        await self.publish()
        await self.registry.wait_changed(since, timeout=self.publish_every_s)
        await asyncio.sleep(0.01)  # a burst of changes (a fleet starting) goes out as one value

    async def publish(self) -> int:
        """Write this process's fleet state now; returns its version (-1: a newer controller wrote)."""
        state = FleetState(controller=self.ident, fingerprint=self.fingerprint, fleets=self.registry.fleets(),
                           instances=[view_of(i) for i in self.registry], replicas=self.replicas_of(),
                           reloads=self.reloads,
                           orphans=msgspec.convert(self.orphans_of(), list[PublishedOrphan]),
                           lora=self.lora_of())
        blob = _encode(state)
        changed = blob != self._blob
        token = self.token()
        if self._handover is None or self._handover[0] != token:
            # The first publication of a term replaces the state this term took over from: keep its
            # counts for published_replicas (the fleet manager may begin its term after this, and its
            # figures before then are the file's).
            self._handover = (token, dict(self.state.replicas) if self.state is not None else None)
        self._seq += 1
        record = self.seals.seal(FLEET_STATE, _encode(Published(token=token, seq=self._seq, state=blob)))
        async with _aio.timeout(self.op_timeout_s):
            version = int(await self._script(keys=[self.keys.fleet_state(), self.keys.fleet_version()],
                                             args=[token, record, self.expire_ms,
                                                   self.keys.fleet_channel(), 1 if changed else 0]))
        if version < 0:
            if not self._fenced:
                self._fenced = True
                _log.warning("fleet_view_fenced", ident=self.ident, token=self.token(),
                             why="a controller with a newer lease token published the fleet state")
            return version
        self._fenced = False
        self.state, self._blob, self.version = state, blob, version
        self._fresh_at = self.clock()
        return version

    async def _follow_step(self, pubsub: Any) -> None:
        await self.follow()
        async with _aio.timeout(self.op_timeout_s + self.publish_every_s):
            # Returns on the first message (a notice, or the subscription's confirmation) or after the poll.
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.publish_every_s)

    async def follow(self) -> bool:
        """Read the published state and apply it if it is new; returns whether it was."""
        async with _aio.timeout(self.op_timeout_s):
            got: list[Any] = await self.client.hmget(self.keys.fleet_state(), ["version", "state"])
        if self.controls():
            # Control came here while the read was in flight: the registry is this process's own now
            # (the fleet manager adopts into it, and it is what the next publish says); the previous
            # controller's state, applied over it, would remove what was added since.
            return False
        raw_version, record = got
        if raw_version is None or record is None:
            self._refused = None  # nothing to refuse: no controller publishes (stale says so)
            self._say_stale()
            return False
        published = self._open(record)
        if published is None:
            self._say_stale()
            return False
        blob = published.state
        order = (published.token, published.seq)
        if order != self._order:
            self._order = order
            self.version = version = int(raw_version) if raw_version.isdigit() else self.version
            self._fresh_at = self.clock()
            if self._stale_logged:
                self._stale_logged = False
                _log.info("fleet_view_fresh", version=version)
        else:
            self._say_stale()
        if blob == self._blob:
            state = self.state
            if state is None or self.registry.version == self._applied_at:
                if state is not None:
                    self._check_fingerprint(state)  # this process's own may have changed (a reload)
                return False
            # Something here changed the registry since (a reload's static instances): the controller's again.
        else:
            try:
                state = _decode(blob)
            except msgspec.DecodeError as e:  # sealed by a routerd of another version: keep the last state
                _log.warning("fleet_view_undecodable", version=self.version, error=str(e))
                self._blob = blob
                return False
            self._blob = blob
            self.state = state
        apply_state(self.registry, state)
        self.on_lora(state.lora)  # after the instances: the record names their generations
        self._applied_at = self.registry.version
        self._check_fingerprint(state)
        return True

    def _open(self, record: bytes, **where: Any) -> Published | None:
        """The sealed state in ``record`` if this process may follow it: sealed with its secret, and not
        older than the last one followed; else None, and why kept for :meth:`untrusted`."""
        try:
            published = _decode_published(self.seals.open(FLEET_STATE, record, **where))
        except Rejected as e:
            self._refused = (e.why, Trust.fingerprint_of(record))
            return None
        except msgspec.DecodeError as e:
            _log.warning("fleet_view_undecodable", error=str(e), **where)
            return None
        if (published.token, published.seq) < self._order:
            self.seals.refuse(FLEET_STATE, Why.REPLAYED, record=record, token=published.token,
                              seq=published.seq, following_token=self._order[0], following_seq=self._order[1])
            self._refused = (Why.REPLAYED, Trust.fingerprint_of(record))
            return None
        self._refused = None
        return published

    def _say_stale(self) -> None:
        if self.stale() and not self._stale_logged:
            self._stale_logged = True
            _log.warning("fleet_view_stale", age_s=round(self.age_s(), 1), keeping="the last state",
                         instances=len(self.state.instances) if self.state is not None else 0)

    def _check_fingerprint(self, state: FleetState) -> None:
        self._sync_parent(state)
        if self._reload_reaching(state):
            return
        if state.fingerprint != self.fingerprint and state.fingerprint != self._mismatch_logged:
            self._mismatch_logged = state.fingerprint
            _log.warning("fleet_config_mismatch", controller=state.controller,
                         controller_fingerprint=state.fingerprint, fingerprint=self.fingerprint,
                         effect="fleets, launches and health follow the controller's config; routing, "
                                "tenants, admission and http follow this process's own")
        elif state.fingerprint == self.fingerprint:
            self._mismatch_logged = ""


class FleetStateCollector:
    """``/metrics``: how old this process's fleet state is and whether its config matches (whether it
    controls the fleets is the lease's ``routerd_control_is_controller``)."""

    def __init__(self, view: FleetStateSync) -> None:
        self._view = view

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are built per collect

    def collect(self) -> Iterator[Any]:
        view = self._view
        yield GaugeMetricFamily("routerd_view_age_seconds", "Seconds since this process last published "
                                "(controller: 0) or received a new fleet state", value=view.age_s())
        yield GaugeMetricFamily("routerd_view_config_mismatch", "1 when this process's fleet config "
                                "differs from the controller's (the controller's wins)",
                                value=1.0 if view.mismatch() else 0.0)
        yield GaugeMetricFamily("routerd_view_orphaned_engines", "Engines of fleets the controller's config "
                                "lacks, left running unmanaged (DELETE /admin/orphans/{id} stops one)",
                                value=float(len(view.state.orphans)) if view.state is not None else 0.0)
