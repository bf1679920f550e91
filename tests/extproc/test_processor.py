"""The ext_proc stream state machine, driven by a gRPC client that speaks the protocol as Envoy does."""

from __future__ import annotations

import asyncio
import json
import unittest.mock
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from epp.datalayer.datastore import Datastore
from epp.datalayer.static import parse_endpoints
from epp.extproc.processor import MAX_STREAMED_CHUNK, ExternalProcessor
from epp.framework import Endpoint, Handle, InferenceRequest, Outcome, PluginMetrics
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.requestcontrol.metrics import RequestMetrics
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.server.server import EXT_PROC_SERVICE, EndpointPicker
from tests.doubles import WireStream
from tests.pickers import loopback_settings

Mode = processing_mode_pb2.ProcessingMode
POOL = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"


@pytest.fixture
async def picker() -> AsyncIterator[EndpointPicker]:
    running = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints(POOL)),
            max_request_body_bytes=1_000_000,
            # Nothing listens at POOL's addresses: with scraping on the pool would never be ready.
            scrape_metrics=False,
        )
    )
    await running.start()
    yield running
    await running.stop(0)


@pytest.fixture
async def stub(picker: EndpointPicker) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)


def headers(pairs: dict[str, str], *, end_of_stream: bool = False, mode: int | None = None, subset: object = None) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            ),
            end_of_stream=end_of_stream,
        )
    )
    if mode is not None:
        message.protocol_config.request_body_mode = mode
        message.protocol_config.response_body_mode = Mode.FULL_DUPLEX_STREAMED
    if subset is not None:
        fields = message.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields
        if isinstance(subset, list):
            fields["x-gateway-destination-endpoint-subset"].list_value.values.extend(
                struct_pb2.Value(string_value=s) for s in subset
            )
        else:
            fields["x-gateway-destination-endpoint-subset"].string_value = str(subset)
    return message


def body(data: bytes, *, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


POST = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r1"}
COMPLETION = json.dumps({"model": "m", "prompt": "hello"}).encode()


class Conversation:
    """Sends messages one at a time and reads what the picker answers in between."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, message: pb.ProcessingRequest) -> None:
        await self.call.write(message)

    async def read(self) -> pb.ProcessingResponse:
        reply = await self.call.read()
        assert reply is not grpc.aio.EOF
        return reply

    async def finish(self) -> list[pb.ProcessingResponse]:
        await self.call.done_writing()
        rest = []
        while (reply := await self.call.read()) is not grpc.aio.EOF:
            rest.append(reply)
        return rest


def destination(reply: pb.ProcessingResponse, phase: str = "request_headers") -> str:
    common = getattr(reply, phase).response
    assert common.clear_route_cache
    (option,) = common.header_mutation.set_headers
    assert option.header.key == "x-gateway-destination-endpoint"
    value = option.header.raw_value.decode()
    metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert metadata.string_value == value  # the protocol forbids the two from differing
    return value


def streamed(reply: pb.ProcessingResponse, phase: str) -> tuple[bytes, bool]:
    chunk = getattr(reply, phase).response.body_mutation.streamed_response
    return chunk.body, chunk.end_of_stream


async def test_headers_answer_waits_for_the_body_then_body_streams_back(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST, mode=Mode.FULL_DUPLEX_STREAMED))
    await talk.send(body(COMPLETION[:10], end_of_stream=False))
    await talk.send(body(COMPLETION[10:], end_of_stream=False))
    await talk.send(body(b"", end_of_stream=True))
    first = await talk.read()
    assert first.WhichOneof("response") == "request_headers"  # nothing was answered before the end of the body
    assert destination(first) in POOL.split(",")
    second = await talk.read()
    assert streamed(second, "request_body") == (COMPLETION, True)
    await talk.finish()


async def test_large_body_is_streamed_back_in_chunks_of_at_most_62000_bytes(stub: pb_grpc.ExternalProcessorStub) -> None:
    payload = json.dumps({"model": "m", "prompt": "q" * 200_000}).encode()
    talk = Conversation(stub)
    await talk.send(headers(POST))
    for start in range(0, len(payload), 16384):
        await talk.send(body(payload[start : start + 16384], end_of_stream=False))
    await talk.send(body(b"", end_of_stream=True))
    assert (await talk.read()).WhichOneof("response") == "request_headers"
    chunks = []
    while True:
        data, end = streamed(await talk.read(), "request_body")
        assert len(data) <= MAX_STREAMED_CHUNK
        chunks.append(data)
        if end:
            break
    assert b"".join(chunks) == payload
    assert len(chunks) == -(-len(payload) // MAX_STREAMED_CHUNK)
    await talk.finish()


async def test_bodyless_request_is_routed_on_its_headers(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
    assert destination(await talk.read()) in POOL.split(",")
    await talk.finish()


async def test_buffered_mode_continues_headers_and_routes_on_the_body(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST, mode=Mode.BUFFERED))
    reply = await talk.read()
    assert reply.WhichOneof("response") == "request_headers"
    assert not reply.request_headers.response.HasField("header_mutation")
    await talk.send(body(COMPLETION, end_of_stream=True))
    assert destination(await talk.read(), "request_body") in POOL.split(",")
    await talk.finish()


async def test_response_phase_passes_headers_and_each_chunk_through(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST))
    await talk.send(body(COMPLETION, end_of_stream=True))
    await talk.read()
    await talk.read()
    await talk.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
    reply = await talk.read()
    assert reply.WhichOneof("response") == "response_headers"
    assert not reply.response_headers.response.HasField("header_mutation")
    for i, chunk in enumerate([b"data: 1\n\n", b"data: 2\n\n", b""]):
        end = i == 2
        await talk.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end)))
        assert streamed(await talk.read(), "response_body") == (chunk, end)  # answered before the next chunk
    # Nothing follows a body's end_of_stream in Envoy (trailers come after a body that has not ended): the
    # picker ends the stream itself with OK rather than wait for Envoy's half-close and reset.
    assert await talk.call.read() is grpc.aio.EOF
    assert await talk.call.code() == grpc.StatusCode.OK


async def test_response_trailers_are_answered_and_end_the_stream(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST))
    await talk.send(body(COMPLETION, end_of_stream=True))
    await talk.read()
    await talk.read()
    await talk.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
    await talk.read()
    await talk.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n", end_of_stream=False)))
    assert streamed(await talk.read(), "response_body") == (b"data: 1\n\n", False)
    await talk.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert (await talk.read()).WhichOneof("response") == "response_trailers"
    assert await talk.call.read() is grpc.aio.EOF  # the trailers are always the last message
    assert await talk.call.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("streamed_answer", [True, False])
async def test_the_response_usage_and_size_reach_the_request_metrics(
    picker: EndpointPicker, stub: pb_grpc.ExternalProcessorStub, streamed_answer: bool
) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST))
    await talk.send(body(COMPLETION, end_of_stream=True))
    await talk.read()
    await talk.read()
    content_type = b"text/event-stream" if streamed_answer else b"application/json"
    response_headers = [base_pb2.HeaderValue(key=":status", raw_value=b"200"), base_pb2.HeaderValue(key="content-type", raw_value=content_type)]
    await talk.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=response_headers))))
    await talk.read()
    if streamed_answer:
        chunks = [b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'] * 9 + [
            b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":9}}\n\n',
            b"data: [DONE]\n\n",
        ]
    else:
        chunks = [b'{"choices":[{"text":"abc"}],', b'"usage":{"prompt_tokens":11,"completion_tokens":9}}']
    for i, chunk in enumerate(chunks):
        await talk.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=i == len(chunks) - 1)))
        await talk.read()
    assert await talk.finish() == []
    value = picker.metrics.registry.get_sample_value
    model = {"model_name": "m", "target_model_name": "m"}
    await asyncio.sleep(0)  # the stream's end runs its finally
    assert value("inference_objective_output_tokens_sum", model) == 9
    assert value("inference_objective_input_tokens_sum", model) == 11
    assert value("inference_objective_response_sizes_sum", model) == sum(map(len, chunks))


async def test_request_trailers_end_the_body(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST))
    await talk.send(body(COMPLETION, end_of_stream=False))
    await talk.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert destination(await talk.read()) in POOL.split(",")
    assert streamed(await talk.read(), "request_body") == (COMPLETION, False)
    assert (await talk.read()).WhichOneof("response") == "request_trailers"
    await talk.finish()


@pytest.mark.parametrize(
    ("subset", "allowed"),
    [
        (["10.0.0.2:8000"], {"10.0.0.2:8000"}),
        (["10.0.0.9:8000", "10.0.0.3:8000"], {"10.0.0.3:8000"}),
        ("10.0.0.1:8000, 10.0.0.3:8000", {"10.0.0.1:8000", "10.0.0.3:8000"}),
    ],
)
async def test_subset_hint_limits_the_candidates(stub: pb_grpc.ExternalProcessorStub, subset: object, allowed: set[str]) -> None:
    for _ in range(8):
        talk = Conversation(stub)
        await talk.send(headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True, subset=subset))
        assert destination(await talk.read()) in allowed
        await talk.finish()


async def test_with_the_subset_filter_off_every_endpoint_is_a_candidate() -> None:
    # --disable-endpoint-subset-filter: a hint naming no pool endpoint (503 above) is not read at all.
    director = _SpyDirector()
    processor = ExternalProcessor(director, RequestMetrics(), max_request_body_bytes=100_000, subset_filter=False)  # type: ignore[arg-type]
    picked = set()
    for _ in range(40):
        wire = WireStream()
        call = processor.open(wire)  # type: ignore[arg-type]
        call.message(headers(POST, subset=["10.9.9.9:8000"]).SerializeToString())
        call.message(body(COMPLETION, end_of_stream=True).SerializeToString())
        picked.add(destination(wire.sent[0]))
    assert picked == {endpoint.hostport for endpoint in _FUZZ_POOL}  # (random-picker over all three)


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:8000"], ""])
async def test_empty_or_foreign_subset_is_503(stub: pb_grpc.ExternalProcessorStub, subset: object) -> None:
    talk = Conversation(stub)
    await talk.send(headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True, subset=subset))
    reply = await talk.read()
    assert reply.immediate_response.status.code == 503
    assert "subset" in json.loads(reply.immediate_response.body)["error"]["message"]
    assert await talk.finish() == []


async def test_bad_body_is_an_immediate_400_with_openai_error(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST))
    await talk.send(body(b'{"model": 7, "prompt": "x"}', end_of_stream=True))  # vLLM refuses it too
    reply = await talk.read()
    immediate = reply.immediate_response
    assert immediate.status.code == 400
    error = json.loads(immediate.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert "`$.model`" in error["message"]
    assert [(h.header.key, h.header.raw_value) for h in immediate.headers.set_headers] == [("content-type", b"application/json")]
    assert await talk.finish() == []


async def test_body_over_the_limit_is_413_before_the_body_ends(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST))
    await talk.send(body(b"x" * 600_000, end_of_stream=False))
    await talk.send(body(b"x" * 600_000, end_of_stream=False))  # over 1,000,000: answered now
    reply = await talk.read()
    assert reply.immediate_response.status.code == 413
    assert "1000000" in json.loads(reply.immediate_response.body)["error"]["message"]


async def test_unsupported_body_mode_is_a_clear_500(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    await talk.send(headers(POST, mode=Mode.STREAMED))
    reply = await talk.read()
    assert reply.immediate_response.status.code == 500
    assert "FULL_DUPLEX_STREAMED" in json.loads(reply.immediate_response.body)["error"]["message"]


async def test_client_control_headers_are_removed(stub: pb_grpc.ExternalProcessorStub) -> None:
    talk = Conversation(stub)
    forged = {
        **POST,
        "x-gateway-destination-endpoint": "6.6.6.6:80",
        "x-gateway-destination-endpoint-subset": "6.6.6.6:80",
        "x-gateway-destination-endpoint-served": "6.6.6.6:80",
    }
    await talk.send(headers(forged))
    await talk.send(body(COMPLETION, end_of_stream=True))
    reply = await talk.read()
    assert destination(reply) in POOL.split(",")  # overwritten
    removed = set(reply.request_headers.response.header_mutation.remove_headers)
    assert removed == {"x-gateway-destination-endpoint-subset", "x-gateway-destination-endpoint-served"}
    await talk.finish()


async def test_a_bad_request_does_not_disturb_a_concurrent_one(stub: pb_grpc.ExternalProcessorStub) -> None:
    good, bad = Conversation(stub), Conversation(stub)
    await good.send(headers(POST))
    await bad.send(headers(POST))
    await good.send(body(COMPLETION[:5], end_of_stream=False))
    await bad.send(body(b"\xff\xfe", end_of_stream=True))
    assert (await bad.read()).immediate_response.status.code == 400
    await good.send(body(COMPLETION[5:], end_of_stream=True))
    assert destination(await good.read()) in POOL.split(",")
    assert streamed(await good.read(), "request_body") == (COMPLETION, True)
    await good.finish()


async def test_empty_pool_is_503_and_not_ready(picker: EndpointPicker, stub: pb_grpc.ExternalProcessorStub) -> None:
    picker.datastore.replace([])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(50):
            status = (await health.Check(health_pb2.HealthCheckRequest(service="readiness"))).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        live = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert live.status == health_pb2.HealthCheckResponse.SERVING
    talk = Conversation(stub)
    await talk.send(headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
    reply = await talk.read()
    assert reply.immediate_response.status.code == 503
    assert "no ready endpoint" in json.loads(reply.immediate_response.body)["error"]["message"]


@pytest.mark.parametrize("service", ["", "liveness", "readiness", EXT_PROC_SERVICE])
async def test_health_services_serve_on_both_ports(picker: EndpointPicker, service: str) -> None:
    for port in (picker.grpc_health_port, picker.grpc_port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- admission answers: the dropped-reason header, and a stream that goes away while queued --------

_ADMISSION_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl={gate}]
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
inferenceObjectives:
- name: bulk
  priority: -1
"""


async def _admission_picker(gate: bool) -> EndpointPicker:
    # The pool is never scraped (nothing listens there): stale metrics read as saturated.
    running = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints(POOL)),
            scrape_metrics=False,
            config_text=_ADMISSION_CONFIG.format(gate="true" if gate else "false"),
        )
    )
    await running.start()
    return running


async def test_a_shed_request_gets_429_with_the_dropped_reason_header() -> None:
    running = await _admission_picker(gate=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
            talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
            await talk.send(headers({**POST, "x-gateway-inference-objective": "bulk"}))
            await talk.send(body(COMPLETION, end_of_stream=True))
            immediate = (await talk.read()).immediate_response
            assert immediate.status.code == 429
            assert json.loads(immediate.body)["error"]["type"] == "rate_limit_exceeded"
            assert [(h.header.key, h.header.raw_value) for h in immediate.headers.set_headers] == [
                ("content-type", b"application/json"),
                ("x-llm-d-request-dropped-reason", b"rejected-saturated"),
            ]
            assert immediate.details == "epp_shed"
            assert await talk.finish() == []
    finally:
        await running.stop(0)


async def test_a_stream_cancelled_while_queued_leaves_the_queue() -> None:
    running = await _admission_picker(gate=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
            talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
            await talk.send(headers(POST))
            await talk.send(body(COMPLETION, end_of_stream=True))
            for _ in range(500):
                if running.admission.queued == 1:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.01)
            assert running.admission.queued == 1  # type: ignore[union-attr]
            talk.call.cancel()  # what Envoy does when the client goes away
            for _ in range(500):
                if running.admission.queued == 0:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.01)
            assert running.admission.queued == 0  # type: ignore[union-attr]
        value = running.metrics.registry.get_sample_value
        assert value("inference_extension_flow_control_queue_size", {"priority": "0", "inference_pool": "static"}) == 0
        assert value("llm_d_epp_flow_control_requests_total", {"outcome": "EvictedContextCancelled", "priority": "0", "inference_pool": "static"}) == 1
    finally:
        await running.stop(0)


# -- fuzzing the stream state machine (issue 15), in-process ------------------------------------

_FUZZ = settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
_FUZZ_POOL = [Endpoint(f"pod-{i}", f"10.0.1.{i}", 8000) for i in range(3)]
_RANDOM_PICKER = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""


class _SpyDirector:
    """A real director over a static pool, recording every request it routes."""

    def __init__(self, *, yields: bool = False) -> None:
        self.yields = yields  # each route waits a turn of the loop (goes on in a task)
        self.datastore = Datastore(_FUZZ_POOL)
        built = load_config(_RANDOM_PICKER, default_registry(), Handle(self.datastore, metrics=PluginMetrics(CollectorRegistry())))
        self._director = Director(self.datastore, built.scheduler, RequestMetrics())
        self.base_models = self._director.base_models
        self.routed: list[RoutedRequest] = []

    async def route(self, request: InferenceRequest, subset: object = None, after: Any = None) -> RoutedRequest:
        if self.yields:
            await asyncio.sleep(0)
        routed = await self._director.route(request, subset, after=after)  # type: ignore[arg-type]
        self.routed.append(routed)
        return routed


_MODES = st.sampled_from([Mode.NONE, Mode.STREAMED, Mode.BUFFERED, Mode.BUFFERED_PARTIAL, Mode.FULL_DUPLEX_STREAMED])
_HEADER_SETS = st.sampled_from(
    [
        POST,
        {":method": "GET", ":path": "/v1/models"},
        {":method": "POST", ":path": "/v1/chat/completions", "x-gateway-destination-endpoint-subset": "forged"},
        {},
    ]
)
_BODY_BYTES = st.one_of(
    st.just(COMPLETION),
    st.binary(max_size=64),
    st.sampled_from([COMPLETION[:7], COMPLETION[7:], b'{"model":"m",', b"[" * 3000]),
    st.integers(60_000, 130_000).map(lambda n: json.dumps({"model": "m", "prompt": "q" * n}).encode()),
)


@st.composite
def _message(draw: st.DrawFn) -> pb.ProcessingRequest:
    kind = draw(st.sampled_from(["headers", "body", "trailers", "response_headers", "response_body", "response_trailers", "empty", "bytes"]))
    if kind == "headers":
        mode = draw(st.none() | _MODES)
        return headers(draw(_HEADER_SETS), end_of_stream=draw(st.booleans()), mode=mode)
    if kind == "body":
        return body(draw(_BODY_BYTES), end_of_stream=draw(st.booleans()))
    if kind == "trailers":
        return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    if kind == "response_headers":
        status = draw(st.sampled_from([b"200", b"503", b"x", b""]))
        return pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status)]),
                end_of_stream=draw(st.booleans()),
            )
        )
    if kind == "response_body":
        return pb.ProcessingRequest(response_body=pb.HttpBody(body=draw(st.binary(max_size=32)), end_of_stream=draw(st.booleans())))
    if kind == "response_trailers":
        return pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    if kind == "bytes":  # whatever random bytes parse as
        try:
            return pb.ProcessingRequest.FromString(draw(st.binary(max_size=48)))
        except Exception:  # not a message at all: gRPC would have failed the stream before us
            return pb.ProcessingRequest()
    return pb.ProcessingRequest()


async def _settle() -> None:
    for _ in range(5):  # a routing task runs to its end (no admission wait in these tests)
        await asyncio.sleep(0)


async def _drive(
    processor: ExternalProcessor,
    sequence: list[pb.ProcessingRequest],
    cancel_after: int | None = None,
    *,
    settle: bool = True,
) -> WireStream:
    """Deliver ``sequence`` as the wire does (nothing after the stream ended), then half-close, or cancel.

    ``settle``: the loop turns between messages (a route that waits is done before the next); without,
    they come at once, as in one read.
    """
    wire = WireStream()
    call = processor.open(wire)  # type: ignore[arg-type]
    for message in sequence:
        if wire.status is not None:
            return wire
        call.message(message.SerializeToString())
        if settle:
            await _settle()
        if cancel_after is not None and len(wire.sent) > cancel_after and wire.status is None:
            call.cancel()  # Envoy (or the client) goes away mid-stream
            await _settle()
            return wire
    if wire.status is None:
        call.half_close()
        await _settle()
    return wire


@_FUZZ
@given(
    sequence=st.lists(_message(), max_size=8),
    cancel_after=st.none() | st.integers(0, 6),
    waits=st.booleans(),
    settle=st.booleans(),
)
async def test_fuzz_any_message_sequence_gets_well_formed_answers_and_finishes_each_request_once(
    sequence: list[pb.ProcessingRequest], cancel_after: int | None, waits: bool, settle: bool
) -> None:
    director = _SpyDirector(yields=waits)
    processor = ExternalProcessor(director, RequestMetrics(), max_request_body_bytes=100_000)  # type: ignore[arg-type]
    finishes: list[RoutedRequest] = []
    real_finish = RoutedRequest.finish

    def counted(routed: RoutedRequest, outcome: Outcome = "complete") -> None:
        finishes.append(routed)
        real_finish(routed, outcome)

    with unittest.mock.patch.object(RoutedRequest, "finish", counted):
        wire = await _drive(processor, sequence, cancel_after, settle=settle)
        await _settle()  # (a route still waiting when the sequence ended)
    answers = wire.sent
    if wire.status is not None and wire.status[0] != 0:
        # the documented stream failure: only once the request was routed, too late for an answer
        assert director.routed
    for answer in answers:
        assert isinstance(answer, pb.ProcessingResponse)
        assert answer.WhichOneof("response") is not None
        pb.ProcessingResponse.FromString(answer.SerializeToString())
        if answer.HasField("immediate_response"):
            assert answer is answers[-1]  # an immediate response ends the stream
            assert 400 <= answer.immediate_response.status.code < 600
    # every routed request finished exactly once; nothing left in flight
    assert sorted(map(id, finishes)) == sorted(map(id, director.routed))
    assert len(set(map(id, finishes))) == len(finishes)
    for endpoint in director.datastore.endpoints():
        assert (endpoint.inflight.requests, endpoint.inflight.unanswered, endpoint.inflight.tokens) == (0, 0, 0)


async def test_request_headers_again_after_the_pick_fail_the_stream_and_the_pick_is_finished() -> None:
    # Found by the fuzz test above: a second request_headers used to route again, and the first
    # routed request was never finished (its in-flight count leaked).
    director = _SpyDirector()
    processor = ExternalProcessor(director, RequestMetrics(), max_request_body_bytes=100_000)  # type: ignore[arg-type]
    get = {":method": "GET", ":path": "/v1/models"}
    wire = await _drive(processor, [headers(get, end_of_stream=True)] * 2)
    assert wire.status is not None
    assert wire.status[0] != 0 and "request headers after the request was routed" in wire.status[1]
    assert len(director.routed) == 1
    assert all(e.inflight.requests == 0 for e in director.datastore.endpoints())


# -- when the route runs: in the read, or in a task when it waits --------------------------------


class _WaitingDirector(_SpyDirector):
    """Routes once ``go`` is set: a route that waits (admission's queue, a tokenizer on a thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.go: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.cancelled = 0

    async def route(self, request: InferenceRequest, subset: object = None, after: Any = None) -> RoutedRequest:
        try:
            await self.go
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().route(request, subset, after)


def _requested(director: _SpyDirector) -> tuple[WireStream, Any]:
    """A stream of a processor over ``director``, and its call, given a request's headers."""
    processor = ExternalProcessor(director, RequestMetrics(), max_request_body_bytes=100_000)  # type: ignore[arg-type]
    wire = WireStream()
    call = processor.open(wire)  # type: ignore[arg-type]
    call.message(headers(POST).SerializeToString())
    return wire, call


async def test_a_route_that_does_not_wait_is_answered_in_the_call_of_its_message() -> None:
    # No task and no turn of the loop: the answers are sent before message() returns, so on the wire
    # they leave in the write at the end of the read that brought the request.
    director = _SpyDirector()
    tasks = len(asyncio.all_tasks())
    wire, call = _requested(director)
    call.message(body(COMPLETION, end_of_stream=True).SerializeToString())
    assert len(asyncio.all_tasks()) == tasks
    assert [destination(answer) for answer in wire.sent[:1]] == [director.routed[0].destination]
    assert streamed(wire.sent[1], "request_body") == (COMPLETION, True)


async def test_a_route_that_waits_goes_on_in_a_task_and_what_came_meanwhile_follows_it() -> None:
    director = _WaitingDirector()
    wire, call = _requested(director)
    call.message(body(COMPLETION, end_of_stream=False).SerializeToString())
    call.message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()).SerializeToString())  # ends the body: routes
    call.message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()).SerializeToString())  # arrives while it waits
    await _settle()
    assert wire.sent == [] and not director.routed
    director.go.set_result(None)
    await _settle()
    assert len(director.routed) == 1
    assert destination(wire.sent[0]) == director.routed[0].destination
    assert streamed(wire.sent[1], "request_body") == (COMPLETION, False)  # (the trailers end it)
    # the trailers' answer, then the trailers that waited in the queue: answered in order, after the pick
    assert [answer.WhichOneof("response") for answer in wire.sent[2:]] == ["request_trailers", "request_trailers"]


@pytest.mark.parametrize("settle", [True, False], ids=["waiting", "at-once"])
async def test_a_stream_that_goes_away_while_its_route_waits_cancels_it(settle: bool) -> None:
    # "at-once": the cancel comes before the route's task first ran (the same read as the request).
    director = _WaitingDirector()
    wire, call = _requested(director)
    call.message(body(COMPLETION, end_of_stream=True).SerializeToString())
    if settle:
        await _settle()
    call.cancel()
    await _settle()
    assert director.cancelled == 1
    assert not director.routed and wire.sent == []
    if not director.go.done():  # (a task that waited on it cancelled it too)
        director.go.set_result(None)
    await _settle()
    assert not director.routed  # the route ended with its stream: it never routes later


# -- --emit-endpoint-scores --------------------------------------------------------------------


def _scores_of(answer: pb.ProcessingResponse) -> dict[str, float] | None:
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    if "x-gateway-destination-endpoint-scores" not in lb:
        return None
    return {k: v.number_value for k, v in lb["x-gateway-destination-endpoint-scores"].struct_value.fields.items()}


@pytest.mark.parametrize("emit", [True, False])
async def test_the_pick_s_scores_ride_beside_the_destination_when_asked(emit: bool) -> None:
    datastore = Datastore(_FUZZ_POOL)
    built = load_config(None, default_registry(), Handle(datastore, metrics=PluginMetrics(CollectorRegistry())))
    director = Director(datastore, built.scheduler, RequestMetrics(), emit_scores=emit)
    processor = ExternalProcessor(director, RequestMetrics(), max_request_body_bytes=100_000)
    for _ in range(2):  # (the second: an answer is cached per destination only without scores)
        wire = WireStream()
        call = processor.open(wire)  # type: ignore[arg-type]
        call.message(headers(POST).SerializeToString())
        call.message(body(COMPLETION, end_of_stream=True).SerializeToString())
        answer = wire.sent[0]
        scores = _scores_of(answer)
        if not emit:
            assert scores is None
            continue
        assert scores is not None and set(scores) == {endpoint.hostport for endpoint in _FUZZ_POOL}
        assert scores[destination(answer)] == max(scores.values())  # the max-score picker's pick
        assert all(score >= 0.0 for score in scores.values())
