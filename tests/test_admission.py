"""The one admission scheduler, with an injected clock: order, aging, bounds, waiting room, deadlines."""

from __future__ import annotations

import asyncio

import pytest

from routerd.config import AdmissionConfig
from routerd.dataplane.admission import Admission, Source
from routerd.errors import DeadlineExceeded, NoReadyInstance, Overloaded
from routerd.registry import Instance, InstanceState, Registry


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(ready: int = 1, **cfg: float) -> tuple[Admission, Registry, Clock]:
    registry = Registry()
    for i in range(ready):
        registry.add(Instance(id=f"f:{i}", fleet="f", url="http://x", state=InstanceState.READY))
    registry.ensure_fleet("f")
    clock = Clock()
    settings = {"max_inflight_per_instance": 1, "max_queued": 10, "waiting_room_s": 5.0, "aging_s": 10.0}
    settings.update(cfg)
    return Admission(registry, AdmissionConfig(**settings), clock=clock), registry, clock  # type: ignore[arg-type]


class Holder:
    """Holds a ticket in a task until released; records the order tickets were granted in."""

    def __init__(self, adm: Admission, order: list[str]) -> None:
        self.adm = adm
        self.order = order
        self.release = asyncio.Event()

    async def hold(self, name: str, *, priority: int = 0, deadline: float | None = None,
                   source: Source = "http") -> None:
        async with self.adm.ticket("f", priority=priority, deadline=deadline, source=source):
            self.order.append(name)
            await self.release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def drain(tasks: list[asyncio.Task[None]], holder: Holder) -> None:
    holder.release.set()
    await asyncio.gather(*tasks)


async def test_priority_then_deadline_then_arrival() -> None:
    adm, _, _ = make()
    order: list[str] = []
    h = Holder(adm, order)
    tasks = [asyncio.create_task(h.hold("first"))]
    await settle()
    for name, prio, deadline in [("p0", 0, None), ("p5", 5, None), ("p1-late", 1, 1030.0),
                                 ("p1-soon", 1, 1010.0), ("p1-none", 1, None)]:
        tasks.append(asyncio.create_task(h.hold(name, priority=prio, deadline=deadline)))
        await settle()
    assert adm.stats("f")["queued_http"] == 5
    assert adm.free_slots("f") == 0
    h.release.set()
    await asyncio.gather(*tasks)
    assert order == ["first", "p5", "p1-soon", "p1-late", "p1-none", "p0"]
    assert adm.stats("f")["active"] == 0
    assert adm.stats("f")["queued_http"] == 0


async def test_aging_serves_a_long_waiting_low_priority_first() -> None:
    adm, _, clock = make(aging_s=10.0)
    order: list[str] = []
    h = Holder(adm, order)
    tasks = [asyncio.create_task(h.hold("first"))]
    await settle()
    tasks.append(asyncio.create_task(h.hold("old-p0", priority=0)))
    await settle()
    clock.t += 30  # three aging periods later
    tasks.append(asyncio.create_task(h.hold("new-p2", priority=2)))
    tasks.append(asyncio.create_task(h.hold("new-p4", priority=4)))
    await settle()
    await drain(tasks, h)
    assert order == ["first", "new-p4", "old-p0", "new-p2"]


async def test_http_bound_gives_429_with_retry_after_queue_is_not_refused() -> None:
    adm, _, _ = make(max_queued=2)
    h = Holder(adm, [])
    tasks = [asyncio.create_task(h.hold(f"h{i}")) for i in range(3)]
    await settle()
    with pytest.raises(Overloaded) as e:
        async with adm.ticket("f", source="http"):
            pass
    assert e.value.status == 429
    assert e.value.retry_after_s >= 1.0
    tasks.append(asyncio.create_task(h.hold("q", source="queue")))  # the queue path waits instead
    await settle()
    assert adm.stats("f")["queued_queue"] == 1
    assert adm.stats("f")["rejected_total"] == 1
    await drain(tasks, h)


async def test_no_ready_instance_503_after_waiting_room_but_admitted_if_one_comes() -> None:
    adm, registry, clock = make(ready=0, waiting_room_s=5.0)
    order: list[str] = []
    h = Holder(adm, order)
    late = asyncio.create_task(h.hold("late"))
    queued = asyncio.create_task(h.hold("job", source="queue"))
    await settle()
    clock.t += 5.1
    adm.sweep()
    with pytest.raises(NoReadyInstance):
        await late
    assert not queued.done()  # queue jobs are not refused: their backlog is Redis's, not ours
    saved = asyncio.create_task(h.hold("saved"))
    await settle()
    clock.t += 3
    registry.add(Instance(id="f:0", fleet="f", url="http://x", state=InstanceState.READY))
    adm.dispatch_all()
    await settle()
    assert order == ["job"]  # one slot: same priority, so the earlier arrival
    await drain([saved, queued], h)
    assert order == ["job", "saved"]  # the HTTP waiter that came within the waiting room is served


async def test_instances_vanishing_while_waiting_start_the_waiting_room() -> None:
    adm, registry, clock = make(ready=1, waiting_room_s=5.0)
    h = Holder(adm, [])
    first = asyncio.create_task(h.hold("first"))
    waiting = asyncio.create_task(h.hold("waiting"))
    await settle()
    clock.t += 100  # waiting a long time on a busy fleet is fine
    adm.sweep()
    await settle()
    assert not waiting.done()
    registry.set_state(registry.get("f:0"), InstanceState.UNHEALTHY)  # type: ignore[arg-type]
    adm.dispatch_all()
    clock.t += 4
    adm.sweep()
    await settle()
    assert not waiting.done()
    clock.t += 1.5
    adm.sweep()
    with pytest.raises(NoReadyInstance):
        await waiting
    await drain([first], h)


async def test_deadline_before_or_while_waiting_never_takes_a_slot() -> None:
    adm, _, clock = make()
    with pytest.raises(DeadlineExceeded):
        async with adm.ticket("f", deadline=clock.t - 1, source="queue"):
            pass
    h = Holder(adm, [])
    first = asyncio.create_task(h.hold("first"))
    await settle()
    expiring = asyncio.create_task(h.hold("x", deadline=clock.t + 2, source="queue"))
    await settle()
    clock.t += 2
    adm.sweep()
    with pytest.raises(DeadlineExceeded):
        await expiring
    stats = adm.stats("f")
    assert stats["active"] == 1
    assert stats["queued_queue"] == 0
    assert stats["expired_total"] == 2
    await drain([first], h)
    assert adm.stats("f")["active"] == 0


async def test_cancelled_waiter_releases_everything() -> None:
    adm, _, _ = make()
    order: list[str] = []
    h = Holder(adm, order)
    first = asyncio.create_task(h.hold("first"))
    gone = asyncio.create_task(h.hold("gone", priority=9))
    nxt = asyncio.create_task(h.hold("next"))
    await settle()
    gone.cancel()
    await settle()
    assert adm.stats("f")["queued_http"] == 1
    await drain([first, nxt], h)
    assert order == ["first", "next"]
    stats = adm.stats("f")
    assert (stats["active"], stats["queued_http"], stats["queued_queue"]) == (0, 0, 0)


async def test_free_slots_and_wait_freed_pace_the_queue() -> None:
    adm, _, _ = make(ready=2, max_inflight_per_instance=2)
    assert adm.free_slots("f") == 4
    h = Holder(adm, [])
    tasks = [asyncio.create_task(h.hold(f"j{i}", source="queue")) for i in range(3)]
    await settle()
    assert adm.free_slots("f") == 1
    waiter = asyncio.create_task(adm.wait_freed(5.0))
    await settle()
    assert not waiter.done()
    h.release.set()
    await asyncio.gather(*tasks)
    await asyncio.wait_for(waiter, 1.0)
    assert adm.free_slots("f") == 4


async def test_both_ways_in_share_one_order() -> None:
    adm, _, _ = make()
    order: list[str] = []
    h = Holder(adm, order)
    tasks = [asyncio.create_task(h.hold("first"))]
    await settle()
    tasks.append(asyncio.create_task(h.hold("http-p0", priority=0, source="http")))
    tasks.append(asyncio.create_task(h.hold("queue-p5", priority=5, source="queue")))
    tasks.append(asyncio.create_task(h.hold("http-p9", priority=9, source="http")))
    await settle()
    await drain(tasks, h)
    assert order == ["first", "http-p9", "queue-p5", "http-p0"]
