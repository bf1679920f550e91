"""The scheduling framework around the plugins: producers and data declarations, profile handlers,
lifecycle hooks through the director, plugin timing, entry-point loading and turning plugins off."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from epp.datalayer.datastore import Datastore
from epp.datalayer.inflight import InFlight
from epp.datalayer.static import parse_endpoint
from epp.errors import EppError
from epp.flowcontrol import FlowControlMetrics, build_admission
from epp.framework import (
    Endpoint,
    Handle,
    InferenceRequest,
    Metrics,
    Outcome,
    PluginMetrics,
    Profile,
    SchedulingResult,
    ServedModels,
)
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.scheduling.runner import Scheduler
from epp.server.metrics import Metrics as PickerMetrics
from tests.doubles import Hooks, OnlyPicker

ENDPOINTS = tuple(
    Endpoint(e.name, e.address, e.port, metrics=Metrics(stale=False))
    for e in (parse_endpoint(f"10.0.0.{i}:8000") for i in range(1, 4))
)


E1, E2, E3 = ENDPOINTS


def request(prompt: str = "", **headers: str) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers=headers, model="m", prompt=prompt)


class Broken:
    name = "broken"

    def pre_request(self, req: InferenceRequest, result: SchedulingResult) -> None:
        raise RuntimeError("plugin bug")

    def response_complete(self, req: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        raise RuntimeError("plugin bug")


def test_service_metrics_record_plugin_durations_and_attempts() -> None:
    metrics = PickerMetrics()
    datastore = Datastore(ENDPOINTS)
    built = load_config(None, default_registry(), Handle(datastore, metrics=PluginMetrics(metrics.registry)), metrics=metrics.plugins)
    director = Director(datastore, built.scheduler, metrics.requests)
    routing = asyncio.run(director.route(request("y" * 300)))
    routing.finish()
    value = metrics.registry.get_sample_value
    assert value(
        "inference_extension_plugin_duration_seconds_count",
        {"extension_point": "Scorer", "plugin_type": "queue-scorer", "plugin_name": "queue-scorer"},
    ) == 1
    assert value("inference_extension_scheduler_attempts_total", {"status": "success"}) == 1
    assert value("inference_extension_prefix_indexer_size") == 300 // 64


def _director(*plugins: object, endpoints: Sequence[Endpoint] = ENDPOINTS) -> tuple[Director, Datastore]:
    datastore = Datastore(endpoints)
    scheduler = Scheduler(Profile("p", OnlyPicker("only", E2.hostport)), hooks=plugins)
    return Director(datastore, scheduler, PickerMetrics().requests), datastore


@pytest.mark.parametrize(("status", "outcome", "expected"), [("200", "complete", "complete"), ("503", "complete", "error"), ("200", "cancelled", "cancelled")])
def test_lifecycle_hooks_and_in_flight_accounting(status: str, outcome: str, expected: str) -> None:
    hooks = Hooks()
    director, datastore = _director(hooks)
    routing = asyncio.run(director.route(request()))
    endpoint = datastore.get(E2.name)
    assert endpoint is not None and endpoint.inflight.requests == 1
    assert routing.response_headers({":status": status}) == {"x-served-by": E2.name}
    routing.finish(outcome)
    routing.finish("error")  # a second finish changes nothing
    assert hooks.events == [("pre", E2.name, 1), ("headers", E2.name, status), ("complete", E2.name, expected, 0)]
    assert endpoint.inflight.requests == 0


def test_a_failing_hook_is_logged_and_the_request_still_routes(caplog: pytest.LogCaptureFixture) -> None:
    director, datastore = _director(Broken())
    with caplog.at_level(logging.ERROR):
        routing = asyncio.run(director.route(request()))
        routing.finish()
    assert routing.destination == E2.hostport
    assert "PreRequest plugin 'broken' raised" in caplog.text and "ResponseComplete plugin 'broken' raised" in caplog.text
    assert datastore.get(E2.name).inflight.requests == 0  # released despite the failing hook


def test_in_flight_requests_steer_the_default_profile_between_scrapes() -> None:
    # Three idle pods, scraped at t=0; a burst of 30 routed before the next scrape must spread out.
    idle = Metrics(updated_at=0.0, stale=False, num_gpu_blocks=1000, block_size=16)
    pods = [Endpoint(f"pod-{i}", f"10.0.1.{i}", 8000, metrics=idle) for i in range(3)]
    datastore = Datastore(pods)
    metrics = PickerMetrics()
    scheduler = load_config(None, default_registry(), Handle(datastore)).scheduler
    director = Director(datastore, scheduler, metrics.requests)

    async def burst() -> list[str]:
        return [(await director.route(request(f"question {i} " * 20))).endpoints[0].name for i in range(30)]

    picked = asyncio.run(burst())
    counts = {name: picked.count(name) for name in {p.name for p in pods}}
    assert sorted(counts.values()) == [10, 10, 10], counts


def test_a_request_counts_as_unanswered_until_its_response_body_starts() -> None:
    director, datastore = _director()
    endpoint = datastore.get(E2.name)
    first = asyncio.run(director.route(request()))
    second = asyncio.run(director.route(request()))
    assert (endpoint.inflight.requests, endpoint.inflight.unanswered) == (2, 2)
    first.response_headers({":status": "200"})  # streamed responses send headers before prefill ends
    assert endpoint.inflight.unanswered == 2
    first.response_body_started()
    first.response_body_started()  # once per request
    assert (endpoint.inflight.requests, endpoint.inflight.unanswered) == (2, 1)
    first.finish()
    second.finish("cancelled")  # never answered: released from both counts
    assert (endpoint.inflight.requests, endpoint.inflight.unanswered) == (0, 0)


@pytest.mark.parametrize(
    ("headers", "marked"),
    [
        ({":status": "503", "content-type": "text/plain"}, True),  # Envoy's own: could not connect
        ({":status": "503", "x-envoy-upstream-service-time": "3"}, False),  # the pod's own 503
        ({":status": "503", "x-envoy-overloaded": "true"}, False),  # Envoy's circuit breaker
        ({":status": "200"}, False),
    ],
)
def test_envoys_own_503_marks_the_primary_unreachable_until_its_next_good_scrape(
    headers: dict[str, str], marked: bool
) -> None:
    director, datastore = _director()
    routed = asyncio.run(director.route(request()))
    name = routed.primary.name
    datastore.update_metrics(name, Metrics(updated_at=time.monotonic(), stale=False))
    routed.response_headers(headers)
    routed.finish()
    assert datastore.get(name).metrics.stale is marked
    datastore.update_metrics(name, Metrics(updated_at=time.monotonic() + 1, stale=False))
    assert not datastore.get(name).metrics.stale


# -- a stateful test (issue 15): datastore + in-flight accounting + admission + routed requests ------

_STATEFUL_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl=true]
flowControl: {maxRequests: 3}  # a queue that fills: refusals are part of the random lives
plugins:
- type: concurrency-detector
  parameters: {maxConcurrency: 2}
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
saturationDetector: {pluginRef: concurrency-detector}
"""
_NAMES = [f"pod-{i}" for i in range(4)]


class _PoolMachine(RuleBasedStateMachine):
    """Random pod churn and request lives against one director with flow control (the queue holds
    requests while the pool is saturated or empty). Rules that need an open or queued request do
    nothing without one (no preconditions: which requests queue depends on the random picker's
    choices, which hypothesis does not draw). The model: which routed requests are open, on
    which in-flight record, answered or not. Invariants: every record counts exactly its open
    requests, nothing is finished twice, and once everything ends every count is back to zero."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.datastore = Datastore()
        self.metrics = PickerMetrics()
        built = load_config(_STATEFUL_CONFIG, default_registry(), Handle(self.datastore, metrics=PluginMetrics(self.metrics.registry)))
        assert built.detector is not None
        self.admission = build_admission(
            built.admission, built.detector, self.datastore.endpoints, metrics=FlowControlMetrics(self.metrics.registry)
        )
        self.datastore.subscribe(lambda added, removed: self.admission.wake())  # as the server does
        self.director = Director(self.datastore, built.scheduler, self.metrics.requests, admission=self.admission)
        self.pending: list[asyncio.Task[RoutedRequest]] = []
        self.open: list[RoutedRequest] = []
        self.answered: set[int] = set()
        self.records: dict[int, InFlight] = {}  # every record a request was counted in, by id
        self.record_of: dict[int, InFlight] = {}  # routed request id -> its record
        self.finished: dict[int, int] = {}
        self.alive: list[RoutedRequest] = []  # every routed request kept alive: their ids stay unique

    def _settle(self) -> None:
        for _ in range(8):
            self.loop.run_until_complete(asyncio.sleep(0))
        still: list[asyncio.Task[RoutedRequest]] = []
        for task in self.pending:
            if not task.done():
                still.append(task)
            elif not task.cancelled() and task.exception() is None:
                self._opened(task.result())
            elif not task.cancelled():
                assert isinstance(task.exception(), EppError)  # refused: an HTTP answer, never a crash
                event(f"refused: {task.exception()}")
        if still:
            event("a request waited in the queue")
        self.pending = still

    def _opened(self, routed: RoutedRequest) -> None:
        record = self.datastore.in_flight(routed.primary.name)
        assert record is not None  # routed to a pod in the pool
        self.open.append(routed)
        self.records[id(record)] = record
        self.record_of[id(routed)] = record
        self.alive.append(routed)

    @rule(name=st.sampled_from(_NAMES), zone=st.sampled_from(["a", "b"]))
    def add_or_relabel_pod(self, name: str, zone: str) -> None:
        before = self.datastore.in_flight(name)
        self.datastore.upsert(Endpoint(name, f"10.0.2.{_NAMES.index(name)}", 8000, {"zone": zone}))
        if before is not None:
            assert self.datastore.in_flight(name) is before  # a re-label keeps the pod's record
        self._settle()

    @rule(name=st.sampled_from(_NAMES))
    def remove_pod(self, name: str) -> None:
        self.datastore.remove(name)
        self._settle()

    @rule(name=st.sampled_from(_NAMES), waiting=st.integers(0, 9))
    def scrape(self, name: str, waiting: int) -> None:
        before = self.datastore.in_flight(name)
        self.datastore.update_metrics(name, Metrics(waiting_queue_size=waiting, updated_at=1.0, stale=False))
        assert self.datastore.in_flight(name) is before

    @rule(prompt=st.text(max_size=30), objective=st.sampled_from(["", "batch"]))
    def request(self, prompt: str, objective: str) -> None:
        headers = {"x-llm-d-inference-objective": objective} if objective else {}
        request = InferenceRequest("r", "POST", "/v1/completions", headers, model="m", prompt=prompt)
        self.pending.append(self.loop.create_task(self.director.route(request)))
        self._settle()

    @rule(i=st.integers(0, 99))
    def client_goes_away_while_queued(self, i: int) -> None:
        if not self.pending:
            return
        self.pending[i % len(self.pending)].cancel()
        self._settle()

    @rule(i=st.integers(0, 99), status=st.sampled_from(["200", "500", ""]))
    def response_headers(self, i: int, status: str) -> None:
        if not self.open:
            return
        self.open[i % len(self.open)].response_headers({":status": status})

    @rule(i=st.integers(0, 99))
    def response_body(self, i: int) -> None:
        if not self.open:
            return
        routed = self.open[i % len(self.open)]
        routed.response_body_started()
        self.answered.add(id(routed))

    @rule(i=st.integers(0, 99), outcome=st.sampled_from(["complete", "error", "cancelled"]), twice=st.booleans())
    def finish(self, i: int, outcome: Outcome, twice: bool) -> None:
        if not self.open:
            return
        routed = self.open.pop(i % len(self.open))
        routed.finish(outcome)
        if twice:
            routed.finish(outcome)  # a second finish is a no-op
        self.finished[id(routed)] = self.finished.get(id(routed), 0) + 1
        self._settle()  # a freed slot may release a queued request

    @invariant()
    def every_record_counts_exactly_its_open_requests(self) -> None:
        for key, record in self.records.items():
            mine = [r for r in self.open if self.record_of[id(r)] is record]
            assert record.requests == len(mine), key
            assert record.unanswered == sum(1 for r in mine if id(r) not in self.answered)
            assert record.tokens == sum(r.request.prompt_tokens for r in mine)
        running = self.metrics.registry.get_sample_value("inference_objective_running_requests", {"model_name": "m"})
        assert (running or 0) == len(self.open)
        assert all(count == 1 for count in self.finished.values())

    def teardown(self) -> None:
        try:
            for routed in self.open:
                routed.finish("complete")
            self.open.clear()
            self._settle()
            while self.open or self.pending:  # the queue drains as slots free; a request queued for an
                for routed in self.open:  # empty pool is given up when the client goes away
                    routed.finish("complete")
                self.open.clear()
                if not self.datastore.endpoints():
                    for task in self.pending:
                        task.cancel()
                self._settle()
            for record in self.records.values():
                assert (record.requests, record.unanswered, record.tokens) == (0, 0, 0)
            assert self.admission.queued == 0
            running = self.metrics.registry.get_sample_value("inference_objective_running_requests", {"model_name": "m"})
            assert not running
        finally:
            self.admission.close()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()


_PoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
test_pool_state_machine = _PoolMachine.TestCase


# -- the response series: duration, first byte, size, tokens, NTPOT, picks ---------------------------


def _sample(metrics: PickerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_complete_response_records_duration_first_byte_size_tokens_and_ntpot() -> None:
    metrics = PickerMetrics()
    datastore = Datastore(ENDPOINTS)
    director = Director(datastore, Scheduler(Profile("p", OnlyPicker("only", E2.hostport))), metrics.requests)
    routed = asyncio.run(director.route(request("hello")))
    routed.response_headers({":status": "200"})
    routed.response_body_started()
    routed.response_ended(1234, (7, 40))
    routed.finish("complete")
    model = {"model_name": "m", "target_model_name": "m"}
    assert _sample(metrics, "inference_objective_request_duration_seconds_count", **model) == 1
    assert _sample(metrics, "epp_request_time_to_first_byte_seconds_count", **model) == 1
    assert _sample(metrics, "inference_objective_response_sizes_sum", **model) == 1234
    assert _sample(metrics, "inference_objective_input_tokens_sum", **model) == 7
    assert _sample(metrics, "inference_objective_output_tokens_sum", **model) == 40
    duration = _sample(metrics, "inference_objective_request_duration_seconds_sum", **model)
    ntpot = _sample(metrics, "inference_objective_normalized_time_per_output_token_seconds_sum", **model)
    assert ntpot == pytest.approx(duration / 40)
    assert _sample(metrics, "epp_endpoint_picks_total", endpoint=E2.name) == 1


@pytest.mark.parametrize("outcome", ["error", "cancelled"])
def test_a_response_that_did_not_complete_records_no_latency(outcome: str) -> None:
    metrics = PickerMetrics()
    director = Director(Datastore(ENDPOINTS), Scheduler(Profile("p", OnlyPicker("only", E2.hostport))), metrics.requests)
    routed = asyncio.run(director.route(request("hello")))
    routed.response_ended(10, (1, 1))
    routed.finish(outcome)  # type: ignore[arg-type]
    model = {"model_name": "m", "target_model_name": "m"}
    assert _sample(metrics, "inference_objective_request_duration_seconds_count", **model) == 0
    assert _sample(metrics, "inference_objective_output_tokens_count", **model) == 0


@pytest.mark.parametrize(("status", "reported"), [("404", [E2.name]), ("200", []), ("500", [])])
def test_a_404_is_reported_so_the_pods_model_list_is_re_read(status: str, reported: list[str]) -> None:
    director, datastore = _director()
    heard: list[str] = []
    datastore.on_not_found(heard.append)
    routing = asyncio.run(director.route(request()))
    routing.response_headers({":status": status})
    routing.finish()
    assert heard == reported


def test_base_models_are_learnt_from_the_pools_lists() -> None:
    director, datastore = _director()
    assert director.base_models == frozenset()
    datastore.update_served(E2.name, ServedModels.from_entries([{"id": "b"}, {"id": "lora", "parent": "b"}]))
    assert director.base_models == {"b"}
    configured = Director(datastore, director.scheduler, base_models=frozenset({"given"}))
    assert configured.base_models == {"given", "b"}
