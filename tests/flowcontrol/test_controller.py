"""The central queue: priority, fairness, FCFS, limits, TTLs, cancellation, the saturation gate.

No assertion is about speed: waits are bounded (``until``), and the dispatcher's safety timer is set
to an hour wherever a test shows that ``wake()`` alone resumes dispatch.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Callable

import pytest

from epp.flowcontrol import (
    AdmissionRequest,
    BandConfig,
    FlowControlConfig,
    FlowControlError,
    FlowController,
    LegacyAdmission,
    Outcome,
)
from epp.flowcontrol.config import ROUND_ROBIN

HOUR = 3600.0


class Pool:
    """A fake pool: saturation is in-flight requests over capacity (no capacity: saturated, as empty)."""

    def __init__(self, capacity: int = 0, *, endpoints: bool = True) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.endpoints = endpoints

    def saturation(self) -> float:
        return 1.0 if self.capacity == 0 else self.in_flight / self.capacity

    def has_endpoints(self) -> bool:
        return self.endpoints


class Req:
    """A request object that can be weakly referenced (to prove the queue lets go of it)."""

    def __init__(self, name: str, priority: int = 0, flow_id: str = "default-flow", byte_size: int = 0, ttl: float | None = None) -> None:
        self.request_id = name
        self.priority = priority
        self.flow_id = flow_id
        self.byte_size = byte_size
        self.ttl = ttl


def controller(pool: Pool, config: FlowControlConfig | None = None, **kwargs) -> FlowController:
    kwargs.setdefault("safety_interval", HOUR)
    return FlowController(config or FlowControlConfig(), pool.saturation, has_endpoints=pool.has_endpoints, **kwargs)


async def until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


async def turns(n: int = 50) -> None:
    """Let the event loop run ``n`` turns (enough for any dispatch a wake could trigger)."""
    for _ in range(n):
        await asyncio.sleep(0)


class Clients:
    """Runs requests the way the director will: admit, then count in flight at once, hold, finish."""

    def __init__(self, fc: FlowController, pool: Pool) -> None:
        self.fc = fc
        self.pool = pool
        self.dispatched: list[str] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self._holds: dict[str, asyncio.Event] = {}
        self._hold_all = True

    def start(self, request: Req) -> asyncio.Task:
        self._holds[request.request_id] = asyncio.Event()
        task = self.tasks[request.request_id] = asyncio.create_task(self._run(request))
        return task

    def release(self, *names: str) -> None:
        """The responses of ``names`` finish."""
        for name in names:
            self._holds[name].set()

    def release_all(self) -> None:
        """Every response finishes, now and from now on."""
        self._hold_all = False
        for event in self._holds.values():
            event.set()

    async def _run(self, request: Req) -> None:
        await self.fc.admit(request)
        self.pool.in_flight += 1  # no await between dispatch and in-flight accounting
        self.dispatched.append(request.request_id)
        try:
            if self._hold_all:
                await self._holds[request.request_id].wait()
        finally:
            self.pool.in_flight -= 1
            self.fc.wake()

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


async def test_empty_queue_and_free_pool_pass_without_queueing() -> None:
    pool = Pool(capacity=4)
    fc = controller(pool)
    assert await fc.admit(AdmissionRequest(priority=0, byte_size=100)) == 0.0
    assert fc.queued == 0 and fc.bands() == {}


async def test_strict_priority_between_bands_then_fcfs_inside() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool)
    clients = Clients(fc, pool)
    for name, priority in [("a1", 0), ("s1", -1), ("h1", 10), ("a2", 0), ("h2", 10), ("s2", -1), ("m1", 5)]:
        clients.start(Req(name, priority))
    await until(lambda: fc.queued == 7)
    assert fc.bands() == {10: (2, 0), 5: (1, 0), 0: (2, 0), -1: (2, 0)}
    pool.capacity = 100
    fc.wake()
    await until(lambda: len(clients.dispatched) == 7)
    assert clients.dispatched == ["h1", "h2", "m1", "a1", "a2", "s1", "s2"]
    assert fc.queued == 0 and fc.bands() == {}  # bands nobody configured go away when empty
    await clients.close()


async def test_fcfs_within_a_flow_and_global_strict_across_flows() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool)  # the default fairness policy is global-strict
    clients = Clients(fc, pool)
    arrivals = ["A1", "B1", "A2", "A3", "B2", "C1", "A4"]
    for name in arrivals:
        clients.start(Req(name, flow_id=name[0]))
    await until(lambda: fc.queued == len(arrivals))
    assert fc.flows(0) == {"A": 4, "B": 2, "C": 1}
    pool.capacity = 100
    fc.wake()
    await until(lambda: len(clients.dispatched) == len(arrivals))
    assert clients.dispatched == arrivals  # one global arrival order
    assert fc.flows(0) == {}
    await clients.close()


async def test_round_robin_gives_flows_of_different_rates_equal_service() -> None:
    pool = Pool(capacity=0)
    config = FlowControlConfig(bands={0: BandConfig(priority=0, fairness=ROUND_ROBIN)})
    fc = controller(pool, config)
    clients = Clients(fc, pool)
    # Flow "heavy" arrives three times as fast as flow "light": 30 requests against 10.
    for i in range(10):
        for j in range(3):
            clients.start(Req(f"heavy-{3 * i + j}", flow_id="heavy"))
        clients.start(Req(f"light-{i}", flow_id="light"))
    await until(lambda: fc.queued == 40)
    # Two slots; every round both requests in flight finish and two more are dispatched.
    pool.capacity = 2
    fc.wake()
    for round_ in range(1, 11):
        await until(lambda: len(clients.dispatched) == 2 * round_)  # noqa: B023 (awaited in this iteration)
        await turns()
        assert len(clients.dispatched) == 2 * round_  # the gate holds until a slot frees
        clients.release(*clients.dispatched[-2:])
    first = clients.dispatched[:20]
    assert sum(name.startswith("heavy") for name in first) == 10
    assert sum(name.startswith("light") for name in first) == 10
    # FCFS inside each flow.
    heavy = [name for name in clients.dispatched if name.startswith("heavy")]
    assert heavy == sorted(heavy, key=lambda n: int(n.split("-")[1]))
    await clients.close()


async def test_global_strict_serves_the_same_arrivals_in_arrival_order() -> None:
    """The contrast with round-robin: the busier flow gets three quarters of the service."""
    pool = Pool(capacity=0)
    fc = controller(pool)
    clients = Clients(fc, pool)
    for i in range(10):
        for j in range(3):
            clients.start(Req(f"heavy-{3 * i + j}", flow_id="heavy"))
        clients.start(Req(f"light-{i}", flow_id="light"))
    await until(lambda: fc.queued == 40)
    pool.capacity = 100
    fc.wake()
    await until(lambda: len(clients.dispatched) == 40)
    assert sum(name.startswith("heavy") for name in clients.dispatched[:20]) == 15
    await clients.close()


async def test_saturated_pool_dispatches_nothing_and_wake_resumes_at_once() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool)  # safety timer: one hour, so only wake() can resume dispatch here
    clients = Clients(fc, pool)
    for i in range(3):
        clients.start(Req(f"r{i}"))
    await until(lambda: fc.queued == 3)
    await turns()
    assert clients.dispatched == []

    pool.capacity = 2  # capacity returns (a metrics update, say) and the director wakes us
    fc.wake()
    await until(lambda: len(clients.dispatched) == 2)
    await turns()
    # Two in flight fill the pool: the gate holds the third (one dispatch per saturation check).
    assert clients.dispatched == ["r0", "r1"] and fc.queued == 1

    clients.release_all()  # responses finish; each calls wake()
    await until(lambda: clients.dispatched == ["r0", "r1", "r2"])
    assert fc.queued == 0
    await clients.close()


async def test_safety_timer_resumes_dispatch_when_no_wake_comes() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool, safety_interval=0.01)
    clients = Clients(fc, pool)
    clients.start(Req("r0"))
    await until(lambda: fc.queued == 1)
    pool.capacity = 1  # and nobody calls wake()
    await until(lambda: clients.dispatched == ["r0"])
    await clients.close()


async def test_zero_endpoints_hold_requests_until_a_pod_appears() -> None:
    pool = Pool(capacity=0, endpoints=False)  # scaled to zero: saturation reads 1.0
    fc = controller(pool)
    clients = Clients(fc, pool)
    clients.start(Req("r0"))
    clients.start(Req("r1"))
    await until(lambda: fc.queued == 2)
    await turns()
    assert clients.dispatched == []
    pool.endpoints, pool.capacity = True, 4  # a pod joined; the director wakes the queue
    fc.wake()
    await until(lambda: clients.dispatched == ["r0", "r1"])
    await clients.close()


async def test_an_empty_pool_holds_even_if_the_saturation_signal_says_free() -> None:
    endpoints = False
    fc = FlowController(FlowControlConfig(), lambda: 0.0, has_endpoints=lambda: endpoints, safety_interval=HOUR)
    task = asyncio.create_task(fc.admit(Req("r0")))
    await until(lambda: fc.queued == 1)
    await turns()
    assert not task.done()
    endpoints = True
    fc.wake()
    assert await asyncio.wait_for(task, 2) >= 0.0


@pytest.mark.parametrize(
    ("config", "kwargs", "outcome", "reason"),
    [
        (FlowControlConfig(bands={0: BandConfig(priority=0, max_requests=2)}), {}, Outcome.REJECTED_CAPACITY, "rejected-saturated"),
        (FlowControlConfig(max_requests=2), {}, Outcome.REJECTED_CAPACITY, "rejected-saturated"),
        (FlowControlConfig(default_band=BandConfig(max_requests=2)), {}, Outcome.REJECTED_CAPACITY, "rejected-saturated"),
        (FlowControlConfig(max_requests=2), {"endpoints": False}, Outcome.REJECTED_NO_ENDPOINTS, "rejected-no-endpoints"),
    ],
)
async def test_request_limits_refuse_with_429(config: FlowControlConfig, kwargs: dict, outcome: Outcome, reason: str) -> None:
    pool = Pool(capacity=0, **kwargs)
    fc = controller(pool, config)
    clients = Clients(fc, pool)
    clients.start(Req("r0"))
    clients.start(Req("r1"))
    await until(lambda: fc.queued == 2)
    with pytest.raises(FlowControlError) as excinfo:
        await fc.admit(Req("r2"))
    error = excinfo.value
    assert (error.outcome, error.reason) == (outcome, reason)
    assert error.status == (503 if outcome is Outcome.REJECTED_NO_ENDPOINTS else 429)
    assert error.headers == {"x-llm-d-request-dropped-reason": reason}
    assert "queue is full" in error.message
    assert fc.queued == 2  # the refused request never entered
    await clients.close()
    assert fc.queued == 0


async def test_byte_limits_per_band_and_global() -> None:
    pool = Pool(capacity=0)
    config = FlowControlConfig(max_bytes=100, bands={-1: BandConfig(priority=-1, max_bytes=30)})
    fc = controller(pool, config)
    clients = Clients(fc, pool)
    clients.start(Req("big", byte_size=60))
    await until(lambda: fc.queued_bytes == 60)
    with pytest.raises(FlowControlError, match="global maxBytes 100") as excinfo:
        await fc.admit(Req("too-big", byte_size=50))
    assert excinfo.value.status == 429
    with pytest.raises(FlowControlError, match="maxBytes 30 at priority -1"):
        await fc.admit(Req("sheddable", priority=-1, byte_size=31))
    clients.start(Req("fits", byte_size=40))  # 60 + 40 = 100: exactly the limit
    await until(lambda: fc.queued == 2)
    assert fc.queued_bytes == 100 and fc.bands()[0] == (2, 100)
    await clients.close()
    assert (fc.queued, fc.queued_bytes) == (0, 0)


async def test_ttl_expiry_answers_503_and_frees_the_entry() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool, FlowControlConfig(default_request_ttl=0.03))
    request = Req("r0", byte_size=10)
    with pytest.raises(FlowControlError) as excinfo:
        async with asyncio.timeout(2):
            await fc.admit(request)
    error = excinfo.value
    assert (error.outcome, error.status, error.reason) == (Outcome.EVICTED_TTL, 503, "rejected-ttl-expired")
    assert (fc.queued, fc.queued_bytes, fc.bands()) == (0, 0, {})


async def test_a_requests_own_ttl_overrides_the_configured_budget() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool, FlowControlConfig(default_request_ttl=0))  # 0: no configured limit
    with pytest.raises(FlowControlError) as excinfo:
        async with asyncio.timeout(2):
            await fc.admit(Req("r0", ttl=0.02))
    assert excinfo.value.outcome is Outcome.EVICTED_TTL


async def test_no_endpoint_budget_applies_while_the_pool_is_empty() -> None:
    pool = Pool(capacity=0, endpoints=False)
    fc = controller(pool, FlowControlConfig(default_request_ttl=HOUR, no_endpoint_request_ttl=0.03))
    with pytest.raises(FlowControlError) as excinfo:
        async with asyncio.timeout(2):
            await fc.admit(Req("r0"))
    error = excinfo.value
    assert (error.outcome, error.status, error.reason) == (Outcome.EVICTED_NO_ENDPOINTS, 503, "rejected-no-endpoints")


async def test_a_pod_appearing_moves_queued_requests_onto_the_default_budget() -> None:
    pool = Pool(capacity=0, endpoints=False)
    # While empty, wait for ever (0); once a pod is there, 30 ms of saturation is the limit.
    fc = controller(pool, FlowControlConfig(default_request_ttl=0.03, no_endpoint_request_ttl=0))
    task = asyncio.create_task(fc.admit(Req("r0")))
    await until(lambda: fc.queued == 1)
    await asyncio.sleep(0.05)
    assert not task.done()  # no budget while the pool is empty
    pool.endpoints = True  # a pod joined but the pool is saturated
    fc.wake()
    with pytest.raises(FlowControlError) as excinfo:
        async with asyncio.timeout(2):
            await task
    assert excinfo.value.outcome is Outcome.EVICTED_TTL


async def test_cancelled_client_leaves_the_queue_at_once_and_nothing_leaks() -> None:
    pool = Pool(capacity=0)
    # Band 0 is configured (it stays); bands -1 and 1 are made on demand (they go when empty).
    fc = controller(pool, FlowControlConfig(default_request_ttl=HOUR, bands={0: BandConfig(priority=0)}))
    requests = [Req(f"r{i}", flow_id=f"tenant-{i % 2}", priority=i % 3 - 1, byte_size=10 * (i + 1)) for i in range(6)]
    refs = [weakref.ref(r) for r in requests]
    tasks = [asyncio.create_task(fc.admit(r)) for r in requests]
    await until(lambda: fc.queued == 6)
    assert fc.queued_bytes == 210

    tasks[2].cancel()  # one client goes away
    with pytest.raises(asyncio.CancelledError):
        await tasks[2]
    assert (fc.queued, fc.queued_bytes) == (5, 180)

    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (fc.queued, fc.queued_bytes) == (0, 0)
    assert fc.bands() == {0: (0, 0)} and fc.flows(0) == {}  # no empty flow is kept either
    del requests, tasks, task
    await turns(5)  # the finished tasks' done-callbacks (holding their tracebacks) run first
    gc.collect()
    assert [ref() for ref in refs] == [None] * 6  # no queue structure, timer or future holds a request


async def test_cancellation_racing_a_dispatch_skips_the_cancelled_entry() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool)
    clients = Clients(fc, pool)
    first = clients.start(Req("first"))
    clients.start(Req("second"))
    await until(lambda: fc.queued == 2)
    pool.capacity = 1
    fc.wake()  # the dispatcher runs before the cancelled task gets to clean up
    first.cancel()
    await until(lambda: clients.dispatched == ["second"])
    with pytest.raises(asyncio.CancelledError):
        await first
    assert fc.queued == 0
    await clients.close()


async def test_close_answers_queued_and_new_requests_503() -> None:
    pool = Pool(capacity=0)
    fc = controller(pool)
    task = asyncio.create_task(fc.admit(Req("r0", byte_size=5)))
    await until(lambda: fc.queued == 1)
    fc.close()
    with pytest.raises(FlowControlError) as excinfo:
        await task
    assert (excinfo.value.status, excinfo.value.reason) == (503, "rejected-shutting-down")
    with pytest.raises(FlowControlError) as excinfo:
        await fc.admit(Req("r1"))
    assert excinfo.value.outcome is Outcome.REJECTED_OTHER
    assert (fc.queued, fc.queued_bytes) == (0, 0)


async def test_a_failing_detector_holds_the_queue_instead_of_crashing(caplog: pytest.LogCaptureFixture) -> None:
    healthy = False

    def saturation() -> float:
        if not healthy:
            raise RuntimeError("detector broke")
        return 0.0

    fc = FlowController(FlowControlConfig(), saturation, safety_interval=0.01)
    with caplog.at_level(logging.ERROR, logger="epp.flowcontrol.controller"):
        task = asyncio.create_task(fc.admit(Req("r0")))
        await until(lambda: fc.queued == 1)
        await turns()
        assert not task.done()
        healthy = True
        await asyncio.wait_for(task, 2)
    assert "saturation detector failed" in caplog.text


@pytest.mark.parametrize(
    ("priority", "saturation", "refused"),
    [(-1, 1.0, True), (-5, 3.0, True), (-1, 0.99, False), (0, 1.0, False), (10, 5.0, False), (-1, True, True), (-1, False, False)],
)
async def test_legacy_admission_sheds_only_sheddable_requests_when_saturated(priority: int, saturation: float, refused: bool) -> None:
    admission = LegacyAdmission(lambda: saturation)
    request = AdmissionRequest(priority=priority)
    if refused:
        with pytest.raises(FlowControlError) as excinfo:
            await admission.admit(request)
        error = excinfo.value
        assert (error.outcome, error.status, error.reason) == (Outcome.REJECTED_SATURATED, 429, "rejected-saturated")
    else:
        assert await admission.admit(request) == 0.0


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("priority", "high", TypeError), ("priority", 1.5, TypeError), ("byte_size", -1, ValueError), ("ttl", -1.0, ValueError)],
)
async def test_bad_requests_are_refused_clearly(field: str, value: object, error: type) -> None:
    request = Req("bad")
    setattr(request, field, value)
    with pytest.raises(error, match=field):
        await controller(Pool(capacity=1)).admit(request)
