"""Tracing end to end: client -> real Envoy -> picker (traced) -> echo backend, spans to an in-process OTLP receiver."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import grpc
import pytest

try:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
except ImportError as exc:  # xds-protos' old opentelemetry/proto won the install (.ci/run puts it right)
    pytest.skip(
        f"opentelemetry/proto is xds-protos' old copy ({exc}): "
        "pip install --no-deps --force-reinstall opentelemetry-proto",
        allow_module_level=True,
    )

from epp.requestcontrol.tracing import Tracing
from tests.e2e.conftest import StackFactory

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []

    async def Export(self, request, context):  # type: ignore[no-untyped-def]
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((resource_spans.resource, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[_Receiver, int]]:
    server = grpc.aio.server()
    collector = _Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield collector, port
    await server.stop(0)


def _attributes(span) -> dict:  # type: ignore[no-untyped-def]
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        value = getattr(kv.value, kind)
        if kind == "array_value":
            value = [getattr(v, v.WhichOneof("value")) for v in value.values]
        out[kv.key] = value
    return out


async def test_spans_reach_the_collector_and_the_model_server_continues_the_trace(
    make_stack: StackFactory, receiver: tuple[_Receiver, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    collector, port = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "1.0")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "epp-under-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    stack = await make_stack()
    assert stack.picker is not None and stack.picker.director.tracing is None  # --tracing=false: no tracer
    tracing = Tracing()
    stack.picker.director.tracing = tracing
    stack.picker.director.scheduler = stack.picker.scheduler  # the real runner (it fills the trace's records)
    try:
        body = json.dumps({"model": "m", "prompt": "hello", "stream": True, "max_tokens": 3}).encode()
        headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "x-request-id": "traced-1"}
        async with stack.session.post(stack.url + "/v1/completions", data=body, headers=headers) as response:
            assert response.status == 200
            text = await response.text()
        assert "[DONE]" in text
        # A refused request is traced too (400: not JSON).
        async with stack.session.post(stack.url + "/v1/completions", data=b'not json') as response:
            assert response.status == 400
        deadline = time.monotonic() + 10
        while len(collector.spans) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(tracing.shutdown)

    traced = [span for _, span in collector.spans if span.trace_id.hex() == CLIENT_TRACE]
    by_name = {span.name: span for span in traced}
    assert set(by_name) == {
        "gateway.request",
        "epp.parse",
        "gateway.request_orchestration",
        "epp.admission",
        "epp.scheduling",
        "epp.response",
    }
    root = by_name["gateway.request"]
    assert root.parent_span_id.hex() == CLIENT_SPAN  # continues the client's trace
    assert root.kind == root.SPAN_KIND_SERVER
    for name in ("epp.parse", "gateway.request_orchestration", "epp.response"):
        assert by_name[name].parent_span_id == root.span_id, name
    for name in ("epp.admission", "epp.scheduling"):
        assert by_name[name].parent_span_id == by_name["gateway.request_orchestration"].span_id, name
    resource = next(resource for resource, span in collector.spans if span is root)
    assert {kv.key: kv.value.string_value for kv in resource.attributes}["service.name"] == "epp-under-test"

    # The model server got a traceparent of the same trace, whose parent is the picker's request span.
    received = [(r, b) for b in stack.backends for r in b.received if r.headers.get("x-request-id") == "traced-1"]
    assert len(received) == 1
    version, trace_id, parent_id, flags = received[0][0].headers["traceparent"].split("-")
    assert (version, trace_id, parent_id, flags) == ("00", CLIENT_TRACE, root.span_id.hex(), "01")

    scheduling = _attributes(by_name["epp.scheduling"])
    picked = scheduling["epp.scheduling.endpoint"]
    assert received[0][1].hostport == picked
    assert scheduling["epp.scheduling.profile"] == "default"
    assert scheduling["epp.scheduling.candidates"] == 2
    assert sorted(scheduling["epp.scheduling.top_endpoints"]) == sorted(b.hostport for b in stack.backends[:2])
    scorers = [key for key in scheduling if key.startswith("epp.scheduling.score.")]
    assert scorers, scheduling
    for key in scorers:
        assert len(scheduling[key]) == 2 and all(0.0 <= s <= 1.0 for s in scheduling[key])
    assert _attributes(by_name["epp.parse"])["gen_ai.request.model"] == "m"
    assert _attributes(by_name["epp.admission"])["epp.admission.outcome"] == "admitted"
    response_attributes = _attributes(by_name["epp.response"])
    assert response_attributes["http.response.status_code"] == 200
    assert response_attributes["epp.response.bytes"] == len(text.encode())
    assert response_attributes["epp.outcome"] == "complete"
    assert response_attributes["epp.endpoint"] == picked
    assert by_name["epp.response"].end_time_unix_nano <= root.end_time_unix_nano

    # The refused request: one root span with the refusal, and its parse span.
    others = [span for _, span in collector.spans if span.trace_id.hex() != CLIENT_TRACE]
    refused = [span for span in others if span.name == "gateway.request"]
    assert len(refused) == 1
    assert _attributes(refused[0])["http.response.status_code"] == 400
    assert refused[0].status.code == refused[0].status.STATUS_CODE_ERROR
    assert {span.name for span in others} == {"gateway.request", "epp.parse"}


async def test_a_streamed_responses_usage_and_first_byte_are_on_the_response_span() -> None:
    # The simulated vLLM reports usage in the stream's last event when the client asks for it.
    import aiohttp
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from epp.sim import EngineConfig
    from tests.e2e.conftest import start_sim_picker

    tracing = Tracing({"OTEL_TRACES_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "always_on"})
    exporter = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))

    def traced(picker) -> None:  # type: ignore[no-untyped-def]
        picker.director.tracing = tracing

    parts = await start_sim_picker([EngineConfig(seed=1), EngineConfig(seed=2)], before_start=traced)
    try:
        body = {
            "model": EngineConfig().model,
            "prompt": "tell me a story " * 8,
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"http://127.0.0.1:{parts.envoy.listen_port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            assert response.status == 200
            text = await response.text()
    finally:
        await parts.stop()
        tracing.shutdown()
    usage = json.loads([line for line in text.splitlines() if '"usage"' in line and "null" not in line][-1][6:])[
        "usage"
    ]
    spans = {span.name: span for span in exporter.get_finished_spans()}
    response_span = spans["epp.response"].attributes
    assert response_span["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert response_span["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 40
    assert 0 < response_span["epp.response.first_byte_ms"] < (spans["epp.response"].end_time - spans[
        "epp.response"
    ].start_time) / 1e6
    assert spans["epp.scheduling"].attributes["epp.scheduling.candidates"] == 2
