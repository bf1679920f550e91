"""The scheduling framework around the plugins: producers and data declarations, profile handlers,
lifecycle hooks through the director, plugin timing, entry-point loading and turning plugins off."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.datalayer.static import parse_endpoint
from epp.framework import (
    Endpoint,
    Handle,
    InferenceRequest,
    Metrics,
    PluginMetrics,
    Profile,
    SchedulingResult,
    ScoredEndpoint,
)
from epp.requestcontrol.director import Director
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.scheduling.runner import Scheduler
from epp.server.metrics import Metrics as PickerMetrics

ENDPOINTS = tuple(
    Endpoint(e.name, e.address, e.port, metrics=Metrics(stale=False))
    for e in (parse_endpoint(f"10.0.0.{i}:8000") for i in range(1, 4))
)


E1, E2, E3 = ENDPOINTS


def request(prompt: str = "", **headers: str) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers=headers, model="m", prompt=prompt)


class OnlyPicker:
    """Picks one fixed endpoint (by hostport) when it is a candidate."""

    def __init__(self, name: str, hostport: str) -> None:
        self.name, self.hostport = name, hostport

    def pick(self, req: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        return [s.endpoint for s in scored if s.endpoint.hostport == self.hostport]


class Hooks:
    name = "hooks"

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def pre_request(self, req: InferenceRequest, result: SchedulingResult) -> None:
        # In-flight accounting is already counting this request when plugins hear of the pick.
        self.events.append(("pre", result.endpoints[0].name, result.endpoints[0].inflight.requests))

    def response_received(self, req: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]) -> dict[str, str]:
        self.events.append(("headers", endpoint.name, headers.get(":status")))
        return {"x-served-by": endpoint.name}

    def response_complete(self, req: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        self.events.append(("complete", endpoint.name, outcome, endpoint.inflight.requests))


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
