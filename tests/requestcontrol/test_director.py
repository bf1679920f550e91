"""Admission wired into the director and the service: priorities, flows, the queue, shedding,
the capacity limit, and the wake-ups that release queued requests.

The pools here use ``concurrency-detector`` (saturation from the picker's own in-flight count), so
that what saturates the pool is exactly the requests a test routes; no assertion is about speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.errors import EppError, Reason
from epp.flowcontrol import AdmissionRequest, FlowControlMetrics, build_admission
from epp.flowcontrol.capacity import check_prompt_fits, kv_capacity, place_by_free_kv
from epp.flowcontrol.objectives import Objectives
from epp.framework import Endpoint, Handle, InferenceRequest, Metrics, PluginMetrics, SchedulingResult
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.server.metrics import Metrics as PickerMetrics
from epp.server.server import EndpointPicker
from epp.server.settings import Settings

POD = Endpoint("pod-a", "10.0.0.1", 8000)
HEADER = "x-llm-d-inference-objective"


def config(*, flow_control: bool, extra: str = "", max_concurrency: int = 1) -> str:
    return f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl={'true' if flow_control else 'false'}]
plugins:
- type: concurrency-detector
  parameters: {{maxConcurrency: {max_concurrency}}}
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
saturationDetector: {{pluginRef: concurrency-detector}}
inferenceObjectives:
- name: interactive
  priority: 10
- name: batch
  priority: -1
{extra}
"""


class Stack:
    """A director with the admission its config describes, over ``endpoints``."""

    def __init__(self, text: str, endpoints: Sequence[Endpoint] = (POD,)) -> None:
        self.datastore = Datastore(endpoints)
        self.metrics = PickerMetrics()
        built = load_config(text, default_registry(), Handle(self.datastore, metrics=PluginMetrics(self.metrics.registry)))
        assert built.detector is not None
        self.admission = build_admission(
            built.admission,
            built.detector,
            self.datastore.endpoints,
            metrics=FlowControlMetrics(self.metrics.registry),
            safety_interval=3600.0,  # only wake() may release a queued request here
        )
        self.datastore.subscribe(lambda added, removed: self.admission.wake())  # as the server does
        self.director = Director(
            self.datastore, built.scheduler, self.metrics.requests, admission=self.admission,
            objectives=Objectives(built.objectives),
        )

    def route(self, objective: str = "", prompt: str = "hello", **headers: str) -> asyncio.Task[RoutedRequest]:
        if objective:
            headers[HEADER] = objective
        request = InferenceRequest(
            request_id=f"r-{time.monotonic_ns()}", method="POST", path="/v1/completions", headers=headers, model="m", prompt=prompt
        )
        return asyncio.ensure_future(self.director.route(request))

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, {"inference_pool": "", **labels}) or 0.0


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# --- priorities and flows -------------------------------------------------------------------


class SpyAdmission:
    def __init__(self) -> None:
        self.seen: list[AdmissionRequest] = []
        self.wakes = 0

    async def admit(self, request: AdmissionRequest) -> float:
        self.seen.append(request)
        return 0.0

    def wake(self) -> None:
        self.wakes += 1

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("headers", "objective", "priority", "flow"),
    [
        ({}, "", 0, "default-flow"),
        ({"x-llm-d-inference-objective": "interactive"}, "interactive", 10, "default-flow"),
        ({"x-gateway-inference-objective": "batch"}, "batch", -1, "default-flow"),
        # llm-d's header wins over GIE's when both are sent
        ({"x-gateway-inference-objective": "batch", "x-llm-d-inference-objective": "interactive"}, "interactive", 10, "default-flow"),
        ({"x-llm-d-inference-objective": "nobody-defined-this"}, "nobody-defined-this", 0, "default-flow"),
        ({"x-gateway-inference-fairness-id": "tenant-a"}, "", 0, "tenant-a"),
        ({"x-gateway-inference-fairness-id": "b", "x-llm-d-inference-fairness-id": "a"}, "", 0, "a"),
    ],
)
async def test_priority_and_flow_come_from_the_request_headers(headers: dict[str, str], objective: str, priority: int, flow: str) -> None:
    spy = SpyAdmission()
    datastore = Datastore([POD])
    built = load_config(config(flow_control=False), default_registry(), Handle(datastore))
    director = Director(datastore, built.scheduler, PickerMetrics().requests, admission=spy, objectives=Objectives(built.objectives))
    request = InferenceRequest(request_id="r1", method="POST", path="/v1/completions", headers=headers, model="m", prompt="abcd" * 10)
    routing = await director.route(request)
    assert (routing.request.objective, routing.request.priority) == (objective, priority)
    assert spy.seen == [AdmissionRequest(priority=priority, flow_id=flow, byte_size=0, request_id="r1")]
    assert spy.wakes == 0
    routing.finish()
    assert spy.wakes == 1  # a response that ends wakes admission, after its in-flight release
    assert datastore.get("pod-a").inflight.requests == 0


def test_configured_objectives_are_overridden_by_discovered_ones() -> None:
    objectives = Objectives({"chat": 5, "batch": -1})
    assert objectives.resolve({HEADER: "chat"}) == ("chat", 5)
    objectives.set_discovered({"chat": 7, "new": 3})
    assert objectives.resolve({HEADER: "chat"}) == ("chat", 7)
    assert objectives.resolve({HEADER: "new"}) == ("new", 3)
    assert objectives.resolve({HEADER: "batch"}) == ("batch", -1)
    objectives.set_discovered({})
    assert objectives.resolve({HEADER: "chat"}) == ("chat", 5)
    assert objectives.resolve({HEADER: "new"}) == ("new", 0)


# --- flow control off: upstream's legacy admission --------------------------------------------


async def test_without_flow_control_only_sheddable_requests_are_refused_while_saturated() -> None:
    stack = Stack(config(flow_control=False))
    first = await stack.route("batch")  # not saturated yet: even a sheddable request passes
    with pytest.raises(EppError) as excinfo:
        await stack.route("batch")  # one in flight, maxConcurrency 1: saturated
    error = excinfo.value
    assert (error.reason, error.status) == (Reason.SHED, 429)
    assert dict(error.headers) == {"x-llm-d-request-dropped-reason": "rejected-saturated"}
    # Priority >= 0 passes whatever the saturation: nothing waits with flow control off.
    others = [await stack.route("interactive"), await stack.route()]
    assert stack.datastore.get("pod-a").inflight.requests == 3
    for routing in [first, *others]:
        routing.finish()
    assert stack.sample("llm_d_epp_flow_control_requests_total", outcome="RejectedSaturated", priority="-1") == 1


# --- flow control on: the central queue ------------------------------------------------------


async def test_a_queued_request_is_scheduled_when_a_response_ends() -> None:
    stack = Stack(config(flow_control=True))
    first = await stack.route()
    waiting = stack.route()
    await settle()
    assert not waiting.done() and stack.admission.queued == 1
    assert stack.sample("inference_extension_flow_control_queue_size", priority="0") == 1
    first.finish()  # the pod is free again: the director wakes admission
    second = await asyncio.wait_for(waiting, 5)
    assert second.destination == POD.hostport
    # The released request counted in flight before anything else could be dispatched.
    assert stack.datastore.get("pod-a").inflight.requests == 1 and stack.admission.queued == 0
    assert stack.sample("inference_extension_flow_control_queue_size", priority="0") == 0
    second.finish()


async def test_higher_priority_leaves_the_queue_first_and_flows_take_turns() -> None:
    extra = "flowControl:\n  priorityBands:\n  - priority: 0\n    fairnessPolicyRef: round-robin-fairness-policy\n"
    stack = Stack(config(flow_control=True, extra=extra))
    blocker = await stack.route()
    order: list[str] = []
    routed: list[RoutedRequest] = []

    async def tagged(tag: str, objective: str = "", **headers: str) -> None:
        routed.append(await stack.route(objective, **headers))
        order.append(tag)

    tasks = [asyncio.ensure_future(tagged(f"batch-{i}", "batch")) for i in range(2)]
    await settle()
    tasks += [asyncio.ensure_future(tagged(f"a-{i}", **{"x-gateway-inference-fairness-id": "a"})) for i in range(3)]
    await settle()
    tasks += [asyncio.ensure_future(tagged(f"b-{i}", **{"x-gateway-inference-fairness-id": "b"})) for i in range(2)]
    await settle()
    tasks.append(asyncio.ensure_future(tagged("interactive", "interactive")))
    await settle()
    assert order == [] and stack.admission.queued == 8
    blocker.finish()
    for count in range(1, 9):  # one at a time: each finish lets exactly the next one go
        while len(order) < count:
            await asyncio.sleep(0.001)
        assert len(order) == count
        routed[-1].finish()
    await asyncio.gather(*tasks)
    assert order == ["interactive", "a-0", "b-0", "a-1", "b-1", "a-2", "batch-0", "batch-1"]


async def test_a_client_that_goes_away_leaves_the_queue_at_once() -> None:
    stack = Stack(config(flow_control=True))
    blocker = await stack.route()
    waiting = stack.route()
    await settle()
    assert stack.admission.queued == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert stack.admission.queued == 0
    assert stack.sample("inference_extension_flow_control_queue_size", priority="0") == 0
    assert stack.sample("llm_d_epp_flow_control_requests_total", outcome="EvictedContextCancelled", priority="0") == 1
    blocker.finish()
    assert stack.datastore.get("pod-a").inflight.requests == 0  # the cancelled one never counted


async def test_a_request_that_waits_its_whole_ttl_is_a_503_ttl_expired() -> None:
    stack = Stack(config(flow_control=True, extra="flowControl: {defaultRequestTTL: 20ms}"))
    blocker = await stack.route()
    with pytest.raises(EppError) as excinfo:
        await stack.route()
    error = excinfo.value
    assert (error.reason, error.status) == (Reason.QUEUE_TIMEOUT, 503)
    assert dict(error.headers) == {"x-llm-d-request-dropped-reason": "rejected-ttl-expired"}
    assert stack.admission.queued == 0
    blocker.finish()


async def test_a_full_queue_is_a_429_saturated() -> None:
    stack = Stack(config(flow_control=True, extra="flowControl: {maxRequests: 1}"))
    blocker = await stack.route()
    first = stack.route()
    await settle()
    with pytest.raises(EppError) as excinfo:
        await stack.route()  # one queued already: over the global maxRequests
    error = excinfo.value
    assert (error.reason, error.status) == (Reason.QUEUE_FULL, 429)
    assert dict(error.headers) == {"x-llm-d-request-dropped-reason": "rejected-saturated"}
    blocker.finish()
    (await asyncio.wait_for(first, 5)).finish()  # the queued one was not disturbed


async def test_closing_admission_answers_queued_requests_503() -> None:
    stack = Stack(config(flow_control=True))
    blocker = await stack.route()
    waiting = stack.route()
    await settle()
    stack.admission.close()
    with pytest.raises(EppError) as excinfo:
        await waiting
    assert (excinfo.value.reason, excinfo.value.status) == (Reason.SHUTTING_DOWN, 503)
    assert dict(excinfo.value.headers) == {"x-llm-d-request-dropped-reason": "rejected-shutting-down"}
    with pytest.raises(EppError, match="shutting down"):
        await stack.route()
    blocker.finish()


async def test_an_empty_pool_holds_requests_until_a_pod_joins() -> None:
    extra = "flowControl: {noEndpointRequestTTL: 30s}"
    stack = Stack(config(flow_control=True, extra=extra), endpoints=())
    waiting = stack.route()
    await settle()
    assert not waiting.done() and stack.admission.queued == 1
    stack.datastore.upsert(POD)  # membership change: admission is woken
    routing = await asyncio.wait_for(waiting, 5)
    assert routing.destination == POD.hostport
    routing.finish()


async def test_an_empty_pool_gives_up_with_no_endpoints() -> None:
    stack = Stack(config(flow_control=True, extra="flowControl: {noEndpointRequestTTL: 20ms}"), endpoints=())
    with pytest.raises(EppError) as excinfo:
        await stack.route()
    assert (excinfo.value.reason, excinfo.value.status) == (Reason.NO_ENDPOINT, 503)
    assert dict(excinfo.value.headers) == {"x-llm-d-request-dropped-reason": "rejected-no-endpoints"}


# --- the service's wiring: metrics updates and pool changes wake the queue ------------------------

_SERVICE_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
flowControl: {noEndpointRequestTTL: 30s}
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""


def _service(endpoints: Sequence[Endpoint]) -> EndpointPicker:
    settings = Settings(
        endpoints=tuple(endpoints), metrics_port=-1, scrape_metrics=False, config_text=_SERVICE_CONFIG, bind_address="127.0.0.1"
    )
    picker = EndpointPicker(settings)
    picker.admission._safety_interval = 3600.0  # type: ignore[union-attr]  # only a wake may release
    return picker


def _request() -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers={}, model="m", prompt="hi")


async def test_the_service_releases_the_queue_on_a_metrics_update() -> None:
    busy = Metrics(waiting_queue_size=20, updated_at=time.monotonic(), stale=False)  # the default utilization-detector: saturated
    picker = _service([replace(POD, metrics=busy)])
    assert type(picker.detector).__name__ == "UtilizationDetector"
    waiting = asyncio.ensure_future(picker.director.route(_request()))
    await settle()
    assert not waiting.done() and picker.admission.queued == 1  # type: ignore[union-attr]
    picker.datastore.update_metrics("pod-a", Metrics(updated_at=time.monotonic(), stale=False))  # a scrape shows room
    routing = await asyncio.wait_for(waiting, 5)
    assert routing.destination == POD.hostport
    routing.finish()


async def test_the_service_releases_the_queue_when_a_pod_joins() -> None:
    picker = _service([])
    waiting = asyncio.ensure_future(picker.director.route(_request()))
    await settle()
    assert picker.admission.queued == 1  # type: ignore[union-attr]
    picker.datastore.upsert(replace(POD, metrics=Metrics(updated_at=time.monotonic(), stale=False)))
    routing = await asyncio.wait_for(waiting, 5)
    assert routing.destination == POD.hostport
    routing.finish()


# --- the capacity limit ------------------------------------------------------------------------


def pod(name: str, blocks: int | None, usage: float, *, block_size: int = 16) -> Endpoint:
    metrics = Metrics(kv_cache_usage=usage, num_gpu_blocks=blocks, block_size=block_size if blocks else None, updated_at=1.0, stale=False)
    return Endpoint(name, f"10.0.1.{len(name)}{blocks or 0}"[:12], 8000, metrics=metrics)


# Totals: a 1600 tokens (free 160), b 3200 (free 1600), c 800 (free 800).
A, B, C = pod("a", 100, 0.9), pod("b", 200, 0.5), pod("c", 50, 0.0)


def test_kv_capacity_reads_the_geometry_and_usage() -> None:
    assert kv_capacity(B) == (3200, 1600.0)
    assert kv_capacity(pod("unknown", None, 0.0)) is None


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (0, ["a", "b", "c"]),  # no prompt (a GET): nothing to place
        (500, ["a", "b", "c"]),  # fits some pod's free cache: the scheduler decides
        (1600, ["a", "b", "c"]),  # exactly b's free cache
        (2000, ["b"]),  # fits nobody's free cache: the pod with the most free
        (3200, ["b"]),
    ],
)
def test_placement_by_free_kv_cache(tokens: int, expected: list[str]) -> None:
    assert [e.name for e in place_by_free_kv(tokens, [A, B, C])] == expected
    check_prompt_fits(tokens, [A, B, C])  # every one of these fits some pod's whole cache


def test_ties_keep_every_pod_with_the_most_free_cache() -> None:
    twin = pod("bb", 200, 0.5)
    assert [e.name for e in place_by_free_kv(2000, [A, B, twin])] == ["b", "bb"]


def test_a_prompt_larger_than_every_cache_is_413() -> None:
    with pytest.raises(EppError) as excinfo:
        check_prompt_fits(3201, [A, B, C])
    assert (excinfo.value.reason, excinfo.value.status) == (Reason.PROMPT_TOO_LARGE, 413)
    assert "about 3201 tokens" in excinfo.value.message and "the largest holds 3200 tokens" in excinfo.value.message


def test_unknown_geometry_decides_nothing() -> None:
    unknown = pod("u", None, 0.0)
    check_prompt_fits(10**6, [A, unknown])  # the unknown pod might hold it
    assert place_by_free_kv(2000, [A, B, unknown]) == [A, B, unknown]
    check_prompt_fits(10**6, [])  # an empty pool: admission decides (the request waits for a pod)


class RecordingScheduler:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.candidates: list[list[str]] = []

    def run(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> SchedulingResult:
        self.candidates.append([e.name for e in candidates])
        return self.inner.run(request, candidates)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_the_director_applies_the_capacity_limit_before_scheduling() -> None:
    spy = SpyAdmission()
    stack = Stack(config(flow_control=False), endpoints=[A, B, C])
    stack.director.admission = spy
    recorder = RecordingScheduler(stack.director.scheduler)
    stack.director.scheduler = recorder  # type: ignore[assignment]
    routing = await stack.route(prompt="x" * 8000)  # 2000 tokens: fits only b's whole cache, nobody's free cache
    assert routing.destination == B.hostport and recorder.candidates == [["b"]]
    routing.finish()
    with pytest.raises(EppError) as excinfo:
        await stack.route(prompt="x" * 20000)  # 5000 tokens: larger than any cache
    assert excinfo.value.status == 413
    assert len(spy.seen) == 1  # refused before admission: it never queued


async def test_data_is_prepared_before_admission_for_requests_with_a_body() -> None:
    order: list[str] = []

    class OrderedAdmission(SpyAdmission):
        async def admit(self, request: AdmissionRequest) -> float:
            order.append("admit")
            return await super().admit(request)

    class Preparing(RecordingScheduler):
        prepares = True

        async def prepare(self, request: InferenceRequest) -> None:
            order.append(f"prepare {request.body!r}")

    stack = Stack(config(flow_control=False))
    stack.director.admission = OrderedAdmission()
    stack.director.scheduler = Preparing(stack.director.scheduler)  # type: ignore[assignment]
    with_body = InferenceRequest("r", "POST", "/v1/completions", model="m", prompt="hi", body=b'{"prompt": "hi"}')
    (await stack.director.route(with_body)).finish()
    (await stack.route()).finish()  # no body: nothing to prepare
    assert order == ["prepare b'{\"prompt\": \"hi\"}'", "admit", "admit"]
