"""The service's readiness (epp.server.server): ready only with an endpoint known to answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.datalayer.static import parse_endpoints
from epp.server.server import EndpointPicker
from epp.testing.envoy import free_port, free_ports
from tests.pickers import loopback_settings

from ..datalayer._scraping import VLLM_PAGE, until

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def pod() -> AsyncIterator[int]:
    """A model server that answers its metrics page; yields its port."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=VLLM_PAGE)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield runner.addresses[0][1]
    await runner.cleanup()


async def _picker(endpoints: str, *, scrape: bool = True) -> EndpointPicker:
    picker = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints(endpoints)),
            scrape_metrics=scrape,
            metrics_scraper_process=False,
            refresh_metrics_interval=0.02,
        )
    )
    await picker.start()
    return picker


async def _readiness(picker: EndpointPicker) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"))
        return int(reply.status)


def _ready_pods(picker: EndpointPicker) -> float | None:
    return picker.metrics.registry.get_sample_value("inference_pool_ready_pods", {"name": "static"})


async def test_a_pool_whose_only_endpoint_never_answered_a_scrape_is_not_ready() -> None:
    dead = f"127.0.0.1:{free_port()}"  # nobody listens
    picker = await _picker(dead)
    try:
        await asyncio.sleep(0.3)  # many scrape attempts, all refused
        assert picker.datastore.endpoints()[0].metrics.error is not None
        assert await _readiness(picker) == _NOT_SERVING
        assert _ready_pods(picker) == 0
    finally:
        await picker.stop(grace=0)


async def test_the_pool_becomes_ready_when_an_endpoint_first_answers(pod: int) -> None:
    dead = f"127.0.0.1:{free_port()}"
    picker = await _picker(f"{dead},127.0.0.1:{pod}")
    try:
        await until(lambda: _ready_pods(picker) == 1)
        assert await _readiness(picker) == _SERVING
        await asyncio.sleep(0.1)
        assert _ready_pods(picker) == 1  # the dead one is still not counted
        picker.datastore.remove(f"127.0.0.1:{pod}")  # the one that answered leaves: not ready again
        await until(lambda: _ready_pods(picker) == 0)
        assert await _readiness(picker) == _NOT_SERVING
    finally:
        await picker.stop(grace=0)


async def test_with_scraping_off_every_endpoint_counts() -> None:
    first, second = free_ports(2)  # two free_port() calls can return one port twice (a CI run failed so)
    picker = await _picker(f"127.0.0.1:{first},127.0.0.1:{second}", scrape=False)
    try:
        assert await _readiness(picker) == _SERVING
        assert _ready_pods(picker) == 2
    finally:
        await picker.stop(grace=0)


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "workers"])
async def test_drain_timeout_keeps_serving_new_streams_while_not_ready(workers: int) -> None:
    # Upstream's --drain-timeout: after SIGTERM the picker says NOT_SERVING at once (the gateway and
    # Kubernetes send elsewhere) and goes on answering the streams that still come, then drains.
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from tests.extproc.test_processor import Conversation, destination, headers

    picker = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints("127.0.0.1:9")), scrape_metrics=False, drain_seconds=1.5, workers=workers
        )
    )
    await picker.start()
    assert await _readiness(picker) == _SERVING
    loop = asyncio.get_running_loop()
    started = loop.time()
    shutting = asyncio.create_task(picker.shut_down())
    await asyncio.sleep(0.3)
    assert await _readiness(picker) == _NOT_SERVING
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:  # a new connection too
        talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
        await talk.send(headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
        assert destination(await talk.read()) == "127.0.0.1:9"
        await talk.finish()
    assert not shutting.done()
    await shutting
    assert loop.time() - started >= 1.5
