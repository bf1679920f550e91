"""``--workers 2`` end to end: a real Envoy, the owner in-process with two worker processes, simulated
vLLM pods. Streams spread over both workers, a repeated long prompt goes to the pod that holds it
whichever worker took it, and the owner's ``/metrics`` counts every request once."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import pytest

from epp.requestcontrol import ipc
from epp.requestcontrol.owner import WorkerRequests
from epp.sim import EngineConfig
from tests.e2e.conftest import SimPicker, start_sim_picker

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Every request takes a while (16 tokens at 20 ms a step), so a burst keeps many streams open at once
# and Envoy opens several connections to the picker (each worker announces a stream limit per connection).
POD = EngineConfig(seed=1, step_base_s=0.02, max_num_seqs=64)
# Prefix affinity alone, so that where a request goes says only what the prefix index knows.
PREFIX_ONLY = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
  - pluginRef: max-score-picker
"""


@pytest.fixture
async def stack(routes_by_worker: dict[str, int]) -> AsyncIterator[tuple[SimPicker, aiohttp.ClientSession]]:
    parts = await start_sim_picker([POD] * 3, PREFIX_ONLY, settings={"workers": 2, "metrics_port": 0})
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    yield parts, session
    await session.close()
    await parts.stop()


@pytest.fixture
def routes_by_worker(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The test's id of each request the owner routed -> which worker's channel it came on (patched
    before the workers start: their channels' handlers are bound then)."""
    seen: dict[str, int] = {}
    real = WorkerRequests._route

    def recording(self: WorkerRequests, message: ipc.Route) -> None:
        seen[message.headers.get("x-test-id", "")] = id(self)
        real(self, message)

    monkeypatch.setattr(WorkerRequests, "_route", recording)
    return seen


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, request_id: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True}
    headers = {"content-type": "application/json", "x-test-id": request_id}
    async with session.post(url + "/v1/completions", data=json.dumps(body), headers=headers) as response:
        text = await response.text()
        assert response.status == 200, text
        return response.headers["x-sim-pod"]


def metric(port: int, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        page = reply.read().decode()
    return {labels: float(value) for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", page, re.M)}


async def test_streams_spread_over_both_workers_and_a_shared_prefix_sticks_to_its_pod_across_them(
    stack: tuple[SimPicker, aiohttp.ClientSession], routes_by_worker: dict[str, int]
) -> None:
    parts, session = stack
    url = f"http://127.0.0.1:{parts.envoy.listen_port}"
    workers = parts.picker.workers
    assert workers is not None
    system = "You are a careful assistant who answers in one sentence. " * 40  # ~2,300 characters, 36 blocks
    home = await complete(session, url, system + "first question", "seed")
    others = [f"unrelated prompt number {i} " * 30 for i in range(40)]
    # A burst: the shared prompt and unrelated ones at once, so that Envoy spreads them over several
    # connections, which the owner has handed to both workers.
    served = await asyncio.gather(
        *(complete(session, url, system + f"question {i}", f"shared-{i}") for i in range(40)),
        *(complete(session, url, prompt, f"other-{i}") for i, prompt in enumerate(others)),
    )
    shared, unrelated = served[:40], served[40:]
    assert Counter(shared) == {home: 40}  # every repeat went where the prefix is, whichever worker took it
    per_worker = Counter(routes_by_worker[f"shared-{i}"] for i in range(40))
    assert len(per_worker) == 2, per_worker  # the repeats came through both workers
    assert len(set(unrelated)) > 1  # and the picker did not just send everything to one pod
    requests = [w["requests"] for w in workers.view()]
    assert all(count > 0 for count in requests) and sum(requests) == 81, requests

    # The owner's /metrics counts each request once, whichever worker carried it (once the last
    # responses' ends, which a worker posts a little later than it answers Envoy, have arrived).
    for _ in range(500):
        if all(e.inflight.requests == 0 for e in parts.picker.datastore.endpoints()):
            break
        await asyncio.sleep(0.01)
    assert metric(parts.picker.metrics_port, "epp_requests_total") == {'{outcome="routed"}': 81.0}
    per_worker_metric = metric(parts.picker.metrics_port, "epp_worker_requests_total")
    assert sum(per_worker_metric.values()) == 81 and len(per_worker_metric) == 2
    total = metric(parts.picker.metrics_port, "inference_objective_request_total")
    assert sum(total.values()) == 81
    completed = metric(parts.picker.metrics_port, "inference_objective_request_duration_seconds_count")
    assert sum(completed.values()) == 81


async def test_workers_serve_tls_with_the_owners_self_signed_certificate() -> None:
    from epp.datalayer.static import parse_endpoints
    from epp.envoy.bootstrap import BootstrapOptions, render
    from epp.server.server import EndpointPicker
    from epp.testing.backends import start_echo_servers
    from epp.testing.envoy import EnvoyProcess
    from epp.testing.harness import wait_for_picker
    from tests.pickers import loopback_settings

    backends = await start_echo_servers(2)
    pool = ",".join(b.hostport for b in backends)
    picker = EndpointPicker(
        loopback_settings(endpoints=tuple(parse_endpoints(pool)), secure_serving=True, workers=2, scrape_metrics=False)
    )
    await picker.start()
    options = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, picker_port=picker.grpc_port,
                               picker_tls=True)  # fmt: skip
    envoy = EnvoyProcess(render(options), concurrency=2)
    try:
        await asyncio.to_thread(envoy.start)
        await asyncio.to_thread(wait_for_picker, envoy)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            for i in range(4):
                body = {"model": MODEL, "prompt": f"over tls {i}", "max_tokens": 2}
                async with session.post(f"http://127.0.0.1:{envoy.listen_port}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    answer = await response.json()
                assert f"127.0.0.1:{answer['port']}" in pool.split(",")
        assert picker.workers is not None and sum(w["requests"] for w in picker.workers.view()) == 4
    finally:
        await asyncio.to_thread(envoy.stop)
        await picker.stop(0)
        for backend in backends:
            await backend.stop()


async def test_a_request_traced_across_the_processes_is_one_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
    except ImportError as exc:  # xds-protos' old opentelemetry/proto won the install (see test_tracing.py)
        pytest.skip(f"opentelemetry/proto is xds-protos' old copy ({exc})")
    import grpc

    from epp.datalayer.static import parse_endpoints
    from epp.envoy.bootstrap import BootstrapOptions, render
    from epp.server.server import EndpointPicker
    from epp.testing.backends import start_echo_servers
    from epp.testing.envoy import EnvoyProcess
    from epp.testing.harness import wait_for_picker
    from tests.pickers import loopback_settings

    spans: list[tuple[object, object]] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        async def Export(self, request, context):  # type: ignore[no-untyped-def]
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    spans.extend((resource_spans.resource, span) for span in scope_spans.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    await collector.start()
    # The worker processes read the same environment (they inherit it).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    backends = await start_echo_servers(2)
    pool = ",".join(b.hostport for b in backends)
    picker = EndpointPicker(
        loopback_settings(endpoints=tuple(parse_endpoints(pool)), workers=2, tracing=True, scrape_metrics=False)
    )
    await picker.start()
    envoy = EnvoyProcess(render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                                 picker_port=picker.grpc_port)), concurrency=1)  # fmt: skip
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        await asyncio.to_thread(envoy.start)
        await asyncio.to_thread(wait_for_picker, envoy)
        headers = {"traceparent": f"00-{client_trace}-{client_span}-01"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
            async with session.post(url, json={"model": "m", "prompt": "hello"}, headers=headers) as response:
                assert response.status == 200, await response.text()
        for _ in range(200):
            if len([s for _, s in spans if s.trace_id.hex() == client_trace]) >= 6:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(envoy.stop)
        await picker.stop(0)  # the workers export what is left as they exit
        for backend in backends:
            await backend.stop()
        await collector.stop(0)
    traced = {span.name: span for _, span in spans if span.trace_id.hex() == client_trace}  # type: ignore[attr-defined]
    assert set(traced) == {
        "gateway.request", "epp.parse", "gateway.request_orchestration", "epp.admission", "epp.scheduling",
        "epp.response",
    }  # fmt: skip
    assert traced["gateway.request"].parent_span_id.hex() == client_span
    for name in ("epp.admission", "epp.scheduling"):  # made in the owner, under the worker's span
        assert traced[name].parent_span_id == traced["gateway.request_orchestration"].span_id, name
