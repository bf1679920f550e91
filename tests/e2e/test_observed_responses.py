"""Observed responses (``epp envoy-config --observe-responses``) through a real Envoy: the picker's filter
ends its stream once the request is routed, a second filter in Envoy's observability mode sends the
response to the picker unanswered. The request's accounting must be what a processed response gives."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import aiohttp
import pytest

from epp.extproc import processor
from epp.server.server import EndpointPicker
from epp.sim import EngineConfig
from tests.e2e.conftest import StackFactory, start_sim_picker


def _sample(picker: EndpointPicker, model: str, name: str) -> float:
    """The sum of the picker's series ``name`` for ``model`` (one process's registry, or the owner's)."""
    return sum(
        s.value
        for metric in picker.metrics.registry.collect()
        for s in metric.samples
        if s.name == name and s.labels.get("model_name") == model
    )


def _completion(prompt: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


async def test_an_observed_response_is_accounted_as_a_processed_one() -> None:
    parts = await start_sim_picker([EngineConfig(seed=1), EngineConfig(seed=2)], observe_responses=True)
    model = EngineConfig().model

    sample = functools.partial(_sample, parts.picker, model)

    try:
        url = f"http://127.0.0.1:{parts.envoy.listen_port}/v1/completions"
        streamed = {"stream": True, "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession() as session:
            for extra in ({}, streamed):
                body = {"model": model, "prompt": "tell me a story " * 8, "max_tokens": 12, "ignore_eos": True, **extra}
                async with session.post(url, json=body) as response:
                    assert response.status == 200
                    await response.read()
        deadline = time.monotonic() + 5
        while sample("inference_objective_request_duration_seconds_count") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sample("inference_objective_request_duration_seconds_count") == 2  # both ended complete
        assert sample("inference_objective_output_tokens_count") == 2  # the usage of each was read
        assert sample("inference_objective_output_tokens_sum") == 24
        assert sample("epp_request_time_to_first_byte_seconds_count") == 2
        assert sample("inference_objective_response_sizes_count") == 2
    finally:
        await parts.stop()


async def test_an_observed_stream_counts_in_flight_until_its_response_ends(make_stack: StackFactory) -> None:
    stack = await make_stack(observe_responses=True)
    assert stack.picker is not None
    inflight = lambda: sorted((e.inflight.requests, e.inflight.unanswered) for e in stack.picker.datastore.endpoints())  # noqa: E731
    async with stack.session.post(stack.url + "/v1/completions", data=_completion("s", stream=True, max_tokens=8)) as response:
        assert response.status == 200
        await response.content.readuntil(b"\n\n")
        deadline = time.monotonic() + 2
        while inflight() != [(0, 0), (1, 0)] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # The picker's own stream ended at the route: the response, observed, still counts in flight.
        assert inflight() == [(0, 0), (1, 0)]
        await response.read()
    deadline = time.monotonic() + 2
    while inflight() != [(0, 0), (0, 0)] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert inflight() == [(0, 0), (0, 0)]


async def test_an_observed_stream_outlives_the_picker(make_stack: StackFactory) -> None:
    # With the response processed, a picker that goes away cuts every response it carries (seen with
    # Envoy 1.40: a SIGKILL mid-stream left the client 227 of 1,000 events); observed, it is only watched.
    stack = await make_stack(observe_responses=True)
    assert stack.picker is not None
    tokens = 20  # 50 ms apart: a second of streaming
    async with stack.session.post(stack.url + "/v1/completions", data=_completion("s", stream=True, max_tokens=tokens)) as response:
        assert response.status == 200
        await response.content.readuntil(b"\n\n")
        await stack.picker.stop(0)
        rest = await response.read()
    events = [line for line in rest.split(b"\n\n") if line.startswith(b"data:")]
    assert len(events) == tokens  # the tokens after the first, and [DONE]
    assert events[-1] == b"data: [DONE]"


async def test_with_workers_a_response_observed_by_another_worker_is_accounted(caplog: pytest.LogCaptureFixture) -> None:
    # --workers 2: the owner hands each connection Envoy opens to a worker, the routing cluster's and
    # the observing cluster's alike, so a request's two streams often reach different workers. The
    # observing worker claims the request through the owner: every response's usage, first byte and
    # end reach the owner's metrics, and in-flight counts are released with the response, not 10 s later.
    parts = await start_sim_picker(
        [EngineConfig(seed=1, step_base_s=0.01), EngineConfig(seed=2, step_base_s=0.01)],
        settings={"workers": 2, "metrics_port": 0},
        observe_responses=True,
    )
    model = EngineConfig().model
    workers = parts.picker.workers
    assert workers is not None

    sample = functools.partial(_sample, parts.picker, model)

    try:
        url = f"http://127.0.0.1:{parts.envoy.listen_port}/v1/completions"

        async def complete(session: aiohttp.ClientSession, i: int) -> None:
            body = {"model": model, "prompt": f"request {i} " * 8, "max_tokens": 6, "ignore_eos": True}
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
            async with session.post(url, json=body) as response:
                assert response.status == 200
                await response.read()

        async with aiohttp.ClientSession() as session:
            for i in range(4):
                await complete(session, i)
            await asyncio.gather(*(complete(session, i) for i in range(4, 40)))  # more connections, both kinds
        deadline = time.monotonic() + 3  # (well before the 10 s after which a routing worker gives up)
        while sample("inference_objective_output_tokens_count") < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sample("inference_objective_output_tokens_count") == 40  # every response's usage was read
        assert sample("inference_objective_output_tokens_sum") == 240
        assert sample("inference_objective_request_duration_seconds_count") == 40  # each ended complete
        assert sample("epp_request_time_to_first_byte_seconds_count") == 40
        while any(e.inflight.requests for e in parts.picker.datastore.endpoints()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert [e.inflight.requests for e in parts.picker.datastore.endpoints()] == [0, 0]
        view = workers.view()
        assert sum(w["observed_elsewhere"] for w in view) > 0, view  # the two streams did part ways
        assert all(w["in_flight"] == 0 for w in view), view
        assert "no other worker holds" not in caplog.text
    finally:
        await parts.stop()


async def test_a_response_the_picker_did_not_route_is_observed_without_a_word(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # The picker's own refusal (here a body that is not JSON) is a response too: Envoy's observer sends
    # it, with no token (nothing was routed). Nothing to account, and nothing wrong to log.
    processor._unmatched_limit.reset()
    stack = await make_stack(observe_responses=True)
    async with stack.session.post(stack.url + "/v1/completions", data=b"{not json") as response:
        assert response.status == 400
        await response.read()
    async with stack.session.post(stack.url + "/v1/completions", data=_completion("fine")) as response:
        assert response.status == 200
        await response.read()
    await asyncio.sleep(0.2)
    assert "names no request" not in caplog.text


async def test_a_client_that_leaves_mid_stream_is_released_about_a_second_later() -> None:
    # Envoy closes the observing stream deferred_close_timeout after the HTTP stream: 5 s by default,
    # during which the request counted in flight on its pod. The bootstrap sets 1 s (OBSERVER_CLOSE).
    parts = await start_sim_picker([EngineConfig(seed=1, step_base_s=0.05)], observe_responses=True)
    model = EngineConfig().model
    in_flight = lambda: sum(e.inflight.requests for e in parts.picker.datastore.endpoints())  # noqa: E731
    try:
        session = aiohttp.ClientSession()
        body = {"model": model, "prompt": "hello " * 20, "max_tokens": 400, "ignore_eos": True, "stream": True}
        response = await session.post(f"http://127.0.0.1:{parts.envoy.listen_port}/v1/completions", json=body)
        await response.content.readuntil(b"\n\n")
        assert in_flight() == 1
        response.close()
        await session.close()
        left = time.monotonic()
        while in_flight() and time.monotonic() - left < 10:
            await asyncio.sleep(0.01)
        assert in_flight() == 0
        assert time.monotonic() - left < 3.0  # (5.0 s with Envoy's default)
        assert _sample(parts.picker, model, "inference_objective_request_duration_seconds_count") == 0  # not complete
    finally:
        await parts.stop()
