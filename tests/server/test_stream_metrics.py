"""--enable-grpc-stream-metrics: upstream's ext_proc stream series, one process and --workers (counted in the owner)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.datalayer.static import parse_endpoints
from epp.server.cli import settings_from_args
from epp.server.server import EndpointPicker
from tests.extproc.test_processor import Conversation, destination, headers
from tests.pickers import loopback_settings

_GET = {":method": "GET", ":path": "/v1/models"}


def _value(picker: EndpointPicker, name: str, labels: dict[str, str] | None = None) -> float:
    return picker.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "workers"])
async def test_streams_are_counted_by_how_they_ended(workers: int) -> None:
    settings, not_yet = settings_from_args(["--enable-grpc-stream-metrics"])
    assert settings.grpc_stream_metrics and not not_yet
    picker = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints("127.0.0.1:9")),
            scrape_metrics=False,
            grpc_stream_metrics=True,
            workers=workers,
        )
    )
    await picker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            done = Conversation(stub)  # routed, then the response's headers end it: OK
            await done.send(headers(_GET, end_of_stream=True))
            assert destination(await done.read()) == "127.0.0.1:9"
            status = base_pb2.HeaderValue(key=":status", raw_value=b"200")
            await done.send(
                pb.ProcessingRequest(
                    response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[status]), end_of_stream=True)
                )
            )
            await done.read()
            assert await done.finish() == []
            gone = Conversation(stub)  # routed, then the client goes away: Canceled
            await gone.send(headers(_GET, end_of_stream=True))
            await gone.read()
            open_now = "llm_d_epp_extproc_streams_inflight"
            for _ in range(200):
                if _value(picker, open_now) == 1:
                    break
                await asyncio.sleep(0.01)
            assert _value(picker, open_now) == 1
            gone.call.cancel()
        for _ in range(200):  # (a worker posts its streams' ends to the owner, in the frames that go)
            if _value(picker, "llm_d_epp_extproc_streams_total", {"code": "Canceled"}) == 1:
                break
            await asyncio.sleep(0.01)
        assert _value(picker, "llm_d_epp_extproc_streams_total", {"code": "OK"}) == 1
        assert _value(picker, "llm_d_epp_extproc_streams_total", {"code": "Canceled"}) == 1
        assert _value(picker, open_now) == 0
        assert _value(picker, "llm_d_epp_extproc_stream_duration_seconds_count") == 2
    finally:
        await picker.stop(0)


async def test_off_by_default() -> None:
    picker = EndpointPicker(loopback_settings(endpoints=tuple(parse_endpoints("127.0.0.1:9")), scrape_metrics=False))
    assert picker.streams is None
    names = {metric.name for metric in picker.metrics.registry.collect()}
    assert not any(name.startswith("llm_d_epp_extproc_stream") for name in names)


def test_a_worker_that_dies_takes_its_open_streams_out_of_the_gauge() -> None:
    from prometheus_client import CollectorRegistry

    from epp.datalayer.datastore import Datastore
    from epp.requestcontrol import ipc
    from epp.requestcontrol.director import Director
    from epp.requestcontrol.metrics import StreamMetrics
    from epp.requestcontrol.owner import WorkerRequests
    from epp.scheduling.runner import Scheduler

    registry = CollectorRegistry()
    streams = StreamMetrics(registry)
    requests = WorkerRequests(Director(Datastore(()), Scheduler.__new__(Scheduler)), lambda m: None, streams=streams)
    handlers = requests.handlers()
    for message in (ipc.StreamOpened(), ipc.StreamOpened(), ipc.StreamOpened(), ipc.StreamClosed("OK", 0.5)):
        handlers[type(message)](message)
    assert registry.get_sample_value("llm_d_epp_extproc_streams_inflight") == 2
    requests.lost()
    assert registry.get_sample_value("llm_d_epp_extproc_streams_inflight") == 0
    assert registry.get_sample_value("llm_d_epp_extproc_streams_total", {"code": "OK"}) == 1
