"""Tenants without the network: config and key forms, the fair share of the one scheduler under an
injected clock, the per-tenant bounds, and what the usage tap does to a stream."""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any

import msgspec
import pytest

from routerd import config, redact
from routerd.config import AdmissionConfig, ConfigError, parse
from routerd.dataplane import resume
from routerd.dataplane.admission import Admission
from routerd.dataplane.usage import UsageTap, usage_of
from routerd.errors import Overloaded
from routerd.ingress.validate import read_head
from routerd.registry import Instance, InstanceState, LoadSnapshot, Registry
from routerd.routing.request import RequestViews
from routerd.tenants import Directory, inspect
from routerd.tenants.fairshare import Share
from routerd.tenants.service import Tenancy
from routerd.tenants.usage import Usage


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def fleet_cfg(**tenants_and_more: Any) -> dict[str, Any]:
    return {"fleets": [{"name": "f", "model": "m", "engine": "static", "urls": ["http://127.0.0.1:1"]},
                       {"name": "g", "model": "n", "engine": "static", "urls": ["http://127.0.0.1:2"]}],
            **tenants_and_more}


# -- config and keys ----------------------------------------------------------------------------------
def test_tenant_keys_in_every_form_map_to_their_tenant() -> None:
    hashed = "sha256:" + hashlib.sha256(b"sk-hashed-key").hexdigest()
    cfg = parse(fleet_cfg(
        http={"api_keys": ["sk-plain-default"]},
        tenants=[{"name": "batch", "api_keys": ["sk-batch-plain", hashed], "weight": 1},
                 {"name": "chat", "api_keys": ["env:CHAT_KEY"], "weight": 3, "fleets": ["f"]}]),
        environ={"CHAT_KEY": "sk-from-the-environment"})
    d = Directory(cfg)
    assert not d.open
    by = {k: (t.name if (t := d.by_token(k.encode())) else None)
          for k in ["sk-batch-plain", "sk-hashed-key", "sk-from-the-environment", "sk-plain-default", "nope",
                    hashed]}
    assert by == {"sk-batch-plain": "batch", "sk-hashed-key": "batch", "sk-from-the-environment": "chat",
                  "sk-plain-default": "default", "nope": None, hashed: None}  # the hash itself opens nothing
    chat = d.get("chat")
    assert chat is not None
    assert chat.allows("f")
    assert not chat.allows("g")
    # The loader resolved env:CHAT_KEY, and the log filter learns it like every other key.
    redactor = redact.Redactor()
    redactor.learn(config.secret_values(cfg))
    line = redactor.value("error", "client sent sk-from-the-environment, then sk-batch-plain")
    assert line == "client sent ***, then ***"


def test_no_key_anywhere_is_open_and_everything_is_default() -> None:
    d = Directory(parse(fleet_cfg(tenants=[{"name": "a", "weight": 2}]), environ={}))
    assert d.open
    assert d.default.name == "default"
    assert d.configured


def test_tenant_config_errors_name_their_key_path() -> None:
    with pytest.raises(ConfigError) as e:
        parse(fleet_cfg(tenants=[
            {"name": "a", "api_keys": ["k-shared", "env:MISSING_VAR"], "fleets": ["nope"]},
            {"name": "a", "api_keys": ["k-shared", "sha256:abc", ""], "weight": 0},
        ]), environ={})
    problems = "\n".join(e.value.problems)
    assert "$.tenants[1].weight: Expected `float` > 0.0" in problems
    with pytest.raises(ConfigError) as e:
        parse(fleet_cfg(tenants=[
            {"name": "a", "api_keys": ["k-shared", "env:MISSING_VAR"], "fleets": ["nope"]},
            {"name": "a", "api_keys": ["k-shared", "sha256:abc", ""]},
        ]), environ={})
    assert e.value.problems == [
        "$.tenants[0].api_keys[1]: env:MISSING_VAR: the environment variable is not set (or empty)",
        "$.tenants[1].api_keys[1]: sha256: must be followed by 64 hexadecimal digits",
        "$.tenants[1].api_keys[2]: empty key",
        "$.tenants[0].fleets: no fleet named 'nope' (fleets: f, g)",
        "$.tenants[1].name: duplicate tenant name 'a' (also $.tenants[0])",
        "$.tenants[1].api_keys[0]: the same key is given to $.tenants[0]",
    ]


# -- fair share in the one scheduler (injected clock) ------------------------------------------------
def scheduler(slots: int, shares: dict[str, Share], **cfg: Any) -> tuple[Admission, Registry, Clock]:
    registry = Registry()
    registry.add(Instance(id="f:0", fleet="f", url="http://x", state=InstanceState.READY))
    clock = Clock()
    settings: dict[str, Any] = {"max_inflight_per_instance": slots, "max_queued": 1000}
    settings.update(cfg)
    adm = Admission(registry, msgspec.convert(settings, AdmissionConfig), clock=clock, shares=shares)
    return adm, registry, clock


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


class Jobs:
    """Tenants' jobs as tasks holding a ticket until :meth:`finish_next` ends the earliest one."""

    def __init__(self, adm: Admission, clock: Clock, rng: random.Random) -> None:
        self.adm, self.clock, self.rng = adm, clock, rng
        self.running: list[tuple[float, int, asyncio.Event, str]] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.started: list[str] = []
        self._n = 0

    def submit(self, tenant: str, duration: float | None = None, source: Any = "queue") -> asyncio.Task[None]:
        task = asyncio.create_task(self._job(tenant, duration, source))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _job(self, tenant: str, duration: float | None, source: Any) -> None:
        async with self.adm.ticket("f", tenant=tenant, source=source):
            done = asyncio.Event()
            self._n += 1
            d = duration if duration is not None else self.rng.uniform(0.5, 1.5)
            self.running.append((self.clock.t + d, self._n, done, tenant))
            self.started.append(tenant)
            await done.wait()

    async def finish_next(self) -> str:
        self.running.sort()
        end, _, done, tenant = self.running.pop(0)
        self.clock.t = max(self.clock.t, end)
        done.set()
        await settle()
        return tenant

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def occupancy(adm: Admission) -> dict[str, float]:
    return {tenant: s["slot_seconds"] for tenant, fleet, s in adm.tenant_stats() if fleet == "f"}


async def test_backlogged_tenants_share_slots_by_weight() -> None:
    """Weights 1 : 1.5 : 4 over 8 slots (no whole-slot split matches them): each tenant's slot-seconds,
    with every tenant always backlogged and jobs of random length, end within 5 % of its weight's share."""
    weights = {"a": 1.0, "b": 1.5, "c": 4.0}
    adm, _, clock = scheduler(8, {t: Share(w) for t, w in weights.items()})
    jobs = Jobs(adm, clock, random.Random(7))
    for t in weights:
        for _ in range(12):  # always more waiting than the fleet has slots
            jobs.submit(t)
    await settle()
    start = clock.t
    while clock.t < start + 400:
        tenant = await jobs.finish_next()
        jobs.submit(tenant)  # keep it backlogged
        await settle()
    used = occupancy(adm)
    total = sum(used.values())
    for t, w in weights.items():
        share, want = used[t] / total, w / sum(weights.values())
        assert abs(share - want) / want < 0.05, (t, share, want)
    await jobs.close()


async def test_a_flood_does_not_delay_another_tenant_beyond_the_next_slot() -> None:
    adm, _, clock = scheduler(8, {"batch": Share(1.0), "chat": Share(1.0)})
    jobs = Jobs(adm, clock, random.Random(1))
    for _ in range(200):
        jobs.submit("batch")
    await settle()
    assert adm.stats("f")["queued_queue"] == 192
    chat = jobs.submit("chat", source="http")
    await settle()
    assert not chat.done()
    assert jobs.started.count("chat") == 0
    await jobs.finish_next()  # the first slot that frees goes to the tenant holding none
    assert jobs.started[-1] == "chat"
    # the flood keeps the rest: work-conserving, and its own order is untouched
    await jobs.finish_next()
    assert jobs.started[-1] == "batch"
    await jobs.close()


async def test_one_tenant_alone_uses_the_whole_fleet_and_a_newcomer_gets_no_debt() -> None:
    """Work-conserving: alone, the batch tenant holds every slot for a long time; a tenant arriving
    afterwards is neither starved by the batch tenant's history nor given its idle time as credit."""
    adm, _, clock = scheduler(8, {"batch": Share(1.0), "late": Share(1.0)})
    jobs = Jobs(adm, clock, random.Random(3))
    for _ in range(16):
        jobs.submit("batch")
    await settle()
    for _ in range(400):
        jobs.submit(await jobs.finish_next())
        await settle()
    assert adm.stats("f")["active"] == 8
    before = occupancy(adm)
    for _ in range(16):
        jobs.submit("late")
    await settle()
    start = clock.t
    while clock.t < start + 100:
        jobs.submit(await jobs.finish_next())
        await settle()
    after = occupancy(adm)
    gained = {t: after[t] - before.get(t, 0.0) for t in after}
    assert 0.45 < gained["late"] / sum(gained.values()) < 0.55
    await jobs.close()


async def test_a_low_weight_tenant_is_not_starved_by_whole_slots() -> None:
    """Weights 10 : 1 over 4 slots: the small tenant's due share is 0.36 slot — it still gets it."""
    adm, _, clock = scheduler(4, {"big": Share(10.0), "small": Share(1.0)})
    jobs = Jobs(adm, clock, random.Random(5))
    for t in ("big", "small"):
        for _ in range(8):
            jobs.submit(t)
    await settle()
    while clock.t < 1300:
        jobs.submit(await jobs.finish_next())
        await settle()
    used = occupancy(adm)
    assert abs(used["small"] / (used["small"] + used["big"]) - 1 / 11) < 0.01
    await jobs.close()


async def test_a_tenant_below_its_share_takes_a_slot_back_from_the_latest_preemptible_job() -> None:
    adm, _, _ = scheduler(4, {"batch": Share(1.0), "chat": Share(1.0)})
    log: list[str] = []

    async def job(tenant: str, name: str, preemptible: bool) -> None:
        done = asyncio.Event()

        def abort() -> bool:
            log.append(f"abort {name}")
            done.set()  # what the job's engine call does when cancelled: it ends, leaving its slot
            return True

        async with adm.ticket("f", tenant=tenant, source="queue", preempt=abort if preemptible else None):
            log.append(f"start {name}")
            await done.wait()

    tasks = [asyncio.create_task(job("batch", f"b{i}", preemptible=i != 3)) for i in range(6)]
    await settle()
    assert log == ["start b0", "start b1", "start b2", "start b3"]
    tasks.append(asyncio.create_task(job("chat", "c0", preemptible=False)))
    await settle()
    # b3 (the latest) is not preemptible (a stream already seen, say): b2 gives its slot to the chat,
    # not to the batch jobs that were waiting before it
    assert log[4:] == ["abort b2", "start c0"]
    tasks.append(asyncio.create_task(job("chat", "c1", preemptible=False)))
    await settle()
    assert log[6:] == ["abort b1", "start c1"]
    tasks.append(asyncio.create_task(job("chat", "c2", preemptible=False)))
    await settle()
    assert len(log) == 8  # two slots of four: the chat tenant holds its share, so it waits now
    assert adm.stats("f")["preempted_total"] == 2
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def flood_and_chats(rounds: int = 600) -> list[float]:
    """The fairness benchmark's shape under an injected clock: 8 slots at equal weights, a batch
    tenant's flood of preemptible queue jobs (2.6 s each, run again when taken back), an interactive
    tenant's HTTP chats arriving at random, 2 a second, each lasting 1–1.8 s (about 3 slots on average:
    below its share of 4, with bursts above it). Returns each chat's wait for its slot."""
    rng = random.Random(18)
    adm, _, clock = scheduler(8, {"batch": Share(1.0), "chat": Share(1.0)})
    ends: list[tuple[float, int, asyncio.Event]] = []
    seq = iter(range(1 << 30))
    waits: list[float] = []
    tasks: list[asyncio.Task[None]] = []

    async def batch_job() -> None:
        while True:
            done = asyncio.Event()
            taken_back: list[bool] = []

            def abort(done: asyncio.Event = done, taken_back: list[bool] = taken_back) -> bool:
                taken_back.append(True)
                done.set()
                return True

            async with adm.ticket("f", tenant="batch", source="queue", preempt=abort):
                ends.append((clock.t + 2.6, next(seq), done))
                await done.wait()
            if not taken_back:
                return

    async def chat() -> None:
        arrived = clock.t
        async with adm.ticket("f", tenant="chat", source="http"):
            waits.append(clock.t - arrived)
            done = asyncio.Event()
            ends.append((clock.t + rng.uniform(1.0, 1.8), next(seq), done))
            await done.wait()

    tasks += [asyncio.create_task(batch_job()) for _ in range(300)]
    await settle()
    next_chat = clock.t + rng.expovariate(2.0)
    for _ in range(rounds):
        ends.sort()
        if ends and ends[0][0] <= next_chat:
            end, _, done = ends.pop(0)
            clock.t = max(clock.t, end)
            done.set()
        else:
            clock.t = next_chat
            next_chat += rng.expovariate(2.0)
            tasks.append(asyncio.create_task(chat()))
        await settle()
        ends[:] = [e for e in ends if not e[2].is_set()]  # taken back: its slot is already free
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return waits


async def test_an_interactive_tenant_below_its_share_over_time_is_not_held_up_by_a_flood() -> None:
    """Issue 18 item 10: the chat tenant uses less than its share on average but bursts past it; its
    requests used to wait for a flood job to end (up to a whole job, 2.6 s), because every request put
    it level with the flood again. Now it keeps a bounded credit and takes back a preemptible slot."""
    waits = sorted(await flood_and_chats())
    assert len(waits) > 150
    # Before: 85 of 207 chats waited, p99 1.09 s; now a handful do, the p99 is none at all.
    assert sum(w > 0 for w in waits) < 0.05 * len(waits), waits[-10:]
    assert waits[int(0.99 * len(waits))] < 0.1, waits[-10:]


async def test_max_concurrent_holds_a_tenant_not_the_fleet() -> None:
    adm, _, clock = scheduler(8, {"capped": Share(1.0, max_concurrent=2), "other": Share(1.0)})
    jobs = Jobs(adm, clock, random.Random(2))
    for _ in range(5):
        jobs.submit("capped", duration=1.0)
    await settle()
    assert jobs.started.count("capped") == 2  # slots are free, but it holds its two
    jobs.submit("other", duration=5.0)
    await settle()
    assert jobs.started.count("other") == 1  # admitted at once past the capped tenant's waiters
    assert await jobs.finish_next() == "capped"
    assert jobs.started.count("capped") == 3  # the slot it gave back is its own again
    assert sum(1 for _, _, _, t in jobs.running if t == "capped") == 2
    await jobs.close()


async def test_a_flooding_tenant_fills_only_its_part_of_the_http_waiting_room() -> None:
    adm, _, clock = scheduler(1, {"flood": Share(1.0), "chat": Share(1.0)}, max_queued=10)
    jobs = Jobs(adm, clock, random.Random(1))
    jobs.submit("flood", source="http")
    for _ in range(5):
        jobs.submit("flood", source="http")
    await settle()
    with pytest.raises(Overloaded):
        async with adm.ticket("f", tenant="flood", source="http"):
            pass
    chat = jobs.submit("chat", source="http")  # its own part of the room is free
    await settle()
    assert not chat.done()
    assert adm.stats("f")["queued_http"] == 6
    await jobs.close()


def test_with_tenants_a_fleet_admits_what_its_engines_run() -> None:
    registry = Registry()
    for i, cap in enumerate((4, 6)):
        inst = Instance(id=f"f:{i}", fleet="f", url="http://x", state=InstanceState.READY)
        inst.snapshot = LoadSnapshot(scraped_at=0.0, capacity=cap)
        registry.add(inst)
    adm = Admission(registry, AdmissionConfig(max_inflight_per_instance=256))
    assert adm.limit("f") == 512  # no tenants: as before, the engines queue the rest themselves
    adm.update_config(AdmissionConfig(max_inflight_per_instance=256), {"a": Share()})
    assert adm.limit("f") == 10  # their capacities: the rest waits here, in fair order
    adm.update_config(AdmissionConfig(max_inflight_per_instance=256, engine_queue_per_instance=2),
                      {"a": Share()})
    assert adm.limit("f") == 14


# -- what the engine is asked, what the client gets ------------------------------------------------
class Collect:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.data = b""

    async def start(self, status: int, headers: Any) -> None:
        self.headers = dict(headers)

    async def write(self, chunk: bytes) -> None:
        self.data += chunk


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(doc) + b"\n\n"


async def test_a_stream_not_continued_is_read_for_its_usage_as_the_client_asked_it() -> None:
    """The body goes on as the client sent it; upstream's one stream reader (resume.meter, here for a
    stream that cannot be continued: echo) asks the engine for usage, and the client gets what vLLM
    sends without it — no usage, the fingerprint on the finishing event — while the tap bills the
    engine's count."""
    body = b'{"model":"m","prompt":"hello world, friends","stream":true,"echo":true}'
    comp = "/v1/completions"
    facts = inspect(body)
    assert facts.body == body
    assert facts.prompt_tokens == len('"hello world, friends"') // 4  # no request view: JSON / 4
    views = RequestViews(parse(fleet_cfg(), environ={}).routing)
    view = views.build("f", comp, read_head(comp, body))
    assert inspect(body, view).prompt_tokens == view.prompt_tokens  # the one estimate routing uses too
    rs = resume.meter(comp, body, "echo")
    assert rs is not None
    assert rs.fixed == "echo"
    assert msgspec.json.decode(rs.engine_body)["stream_options"] == {"include_usage": True,
                                                                     "continuous_usage_stats": True}
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    final = {**usage, "completion_tokens": 2, "total_tokens": 7}
    finishing = {"id": "x", "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}
    engine = (_event({"id": "x", "choices": [{"index": 0, "text": "a"}], "usage": usage})
              + _event({**finishing, "usage": final})
              + _event({"id": "x", "choices": [], "usage": final, "system_fingerprint": "fp"})
              + b"data: [DONE]\n\n")
    client = Collect()
    tap = UsageTap(client, headers={"x-ratelimit-limit-requests": "9"})
    await tap.start(200, {"Content-Type": "text/event-stream"})
    for i in range(0, len(engine), 7):  # cut anywhere, even inside an event
        await tap.write(rs.feed(engine[i:i + 7]))
    assert client.headers["x-ratelimit-limit-requests"] == "9"
    assert client.data == (_event({"id": "x", "choices": [{"index": 0, "text": "a"}]})
                           + _event({**finishing, "system_fingerprint": "fp"})
                           + b"data: [DONE]\n\n")
    assert tap.usage(rs.usage()) == (5, 2)
    several = b'{"model":"m","prompt":"x","stream":true,"n":2}'
    assert resume.meter(comp, several, "n") is None  # a fingerprint per choice: passed through as is
    assert resume.meter(comp, several[:-1] + b',"stream_options":{"include_usage":true}}', "n") is not None


async def test_usage_is_read_from_a_body_and_taken_from_upstream_for_a_stream() -> None:
    body = msgspec.json.encode({"choices": [{"text": "\"usage\": {\"prompt_tokens\": 99}"}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert usage_of(body) == (3, 4)  # what upstream reads of the body it holds, text not mistaken
    tap = UsageTap(Collect())
    await tap.start(200, {})
    await tap.write(body)
    assert tap.usage(usage_of(body)) == (3, 4)
    stream = _event({"choices": [{"text": "a"}]}) + b"data: [DONE]\n\n"
    tap = UsageTap(client := Collect())
    await tap.start(200, {})
    await tap.write(stream)
    assert tap.usage((8, 1)) == (8, 1)
    assert tap.usage() is None  # nothing counted: the estimate stands
    assert client.data == stream
    failed = UsageTap(Collect())
    await failed.start(400, {})
    await failed.write(body)
    assert failed.usage(usage_of(body)) is None  # an error answer bills nothing


def test_settling_corrects_the_estimate_and_refunds_what_no_engine_did() -> None:
    tenancy = Tenancy(parse(fleet_cfg(tenants=[{"name": "a", "tokens_per_minute": 1000,
                                                "requests_per_minute": 100}]), environ={}), clock=Clock())
    a = tenancy.tenant("a")
    assert a is not None
    local = tenancy.limiter.local

    def level() -> tuple[int, int]:
        g = local.apply(a, 0, 0, check=False)
        return g.requests_left, g.tokens_left

    facts = inspect(b'{"model":"m","prompt":"' + b"x" * 398 + b'"}')
    assert facts.prompt_tokens == 100
    charge = asyncio.run(tenancy.charge(a, "f", facts))
    assert level() == (99, 900)
    tenancy.settle(charge, Usage(120, 280), status=200, ok=True)
    assert level() == (99, 600)  # the engine's 400 tokens, not the estimate's 100
    charge = asyncio.run(tenancy.charge(a, "f", facts))
    tenancy.settle(charge, None, status=0, ok=False)  # no engine answered: given back whole
    assert level() == (99, 600)
    assert tenancy.ledger.totals[("a", "f")] == [1, 1, 0, 120, 280]


async def test_a_reload_that_adds_tenants_applies_their_bounds_at_once() -> None:
    """A reload hands admission its new bounds and the new tenants together. Applied one after the
    other (bounds with the old tenants' settings, then the tenants) the moment between admitted
    waiters under a limit neither config has: without tenants the engines queue beyond their capacity
    (``max_inflight_per_instance`` 100), with them a fleet admits only its engines' capacity (2)."""
    import aiohttp

    from routerd.assembly import build
    from routerd.tracing import Tracing

    def cfg(**extra: Any) -> Any:
        return parse({"redis": {"enabled": False}, "fleets": [
            {"name": "f", "model": "m", "engine": "static", "urls": ["http://127.0.0.1:9"],
             "max_num_seqs": 2}], **extra}, environ={})

    async with aiohttp.ClientSession() as session:
        routerd = build(cfg(admission={"max_inflight_per_instance": 2}), Registry(), session,
                        tracing=Tracing.off())
        inst = routerd.registry.instances("f")[0]
        routerd.registry.set_state(inst, InstanceState.READY)
        adm = routerd.admission
        release = asyncio.Event()

        async def hold() -> None:
            async with adm.ticket("f", source="queue", tenant="a"):
                await release.wait()

        tasks = [asyncio.create_task(hold()) for _ in range(4)]
        while adm.stats("f")["queued_queue"] < 2:  # noqa: ASYNC110  # polls admission's state; no event
            await asyncio.sleep(0)
        assert adm.stats("f")["active"] == 2  # max_inflight_per_instance, the engine queues the rest
        await routerd.apply(cfg(admission={"max_inflight_per_instance": 100}, tenants=[{"name": "a"}]))
        for _ in range(10):
            await asyncio.sleep(0)
        assert adm.limit("f") == 2  # with tenants: the engine's capacity
        assert adm.stats("f")["active"] == 2  # and never more, not even for a moment
        release.set()
        await asyncio.gather(*tasks)
