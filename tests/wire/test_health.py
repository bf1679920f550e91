"""epp.wire.health: grpc.health.v1 Check and Watch, asked by gRPC's own client (C-core) and by a raw one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.wire.health import NOT_SERVING, SERVING, Health
from epp.wire.server import GrpcServer, bind_socket
from tests.conftest import eventually
from tests.wire.rawh2 import Client, Loopback, data
from tests.wire.rawh2 import grpc as grpc_message

Response = health_pb2.HealthCheckResponse
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"


class Served:
    def __init__(self) -> None:
        self.health = Health()
        self.server = GrpcServer(self.health.methods(), flag="--grpc-health-port 0")
        self.port = self.server.serve_socket(bind_socket("127.0.0.1", 0))


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    running = Served()
    yield running
    running.health.stop()
    await running.server.stop(0)


@pytest.fixture
async def stub(served: Served) -> AsyncIterator[health_pb2_grpc.HealthStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield health_pb2_grpc.HealthStub(channel)


def request(service: str) -> bytes:
    return health_pb2.HealthCheckRequest(service=service).SerializeToString()


async def test_check_answers_each_service_s_status(served: Served, stub: health_pb2_grpc.HealthStub) -> None:
    served.health.set("", SERVING)
    served.health.set("readiness", NOT_SERVING)
    assert (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status == Response.SERVING
    assert (await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))).status == Response.NOT_SERVING
    served.health.set("readiness", SERVING)
    assert (await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))).status == Response.SERVING


async def test_check_of_an_unknown_service_is_not_found(stub: health_pb2_grpc.HealthStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in (error.value.details() or "")


async def test_watch_gets_the_status_now_then_each_change_and_ends_when_health_stops(
    served: Served, stub: health_pb2_grpc.HealthStub
) -> None:
    call = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
    assert (await call.read()).status == Response.SERVICE_UNKNOWN  # not set yet
    served.health.set("readiness", NOT_SERVING)
    assert (await call.read()).status == Response.NOT_SERVING
    served.health.set("readiness", NOT_SERVING)  # no change: nothing sent
    served.health.set("other", SERVING)  # another service: nothing sent
    served.health.set("readiness", SERVING)
    assert (await call.read()).status == Response.SERVING
    served.health.stop()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call.read()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.details() == "the server is stopping"
    assert not any(served.health._watchers.values())


async def test_watch_of_a_set_service_starts_with_its_status(served: Served, stub: health_pb2_grpc.HealthStub) -> None:
    served.health.set("", SERVING)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    assert (await call.read()).status == Response.SERVING
    call.cancel()


async def test_a_watch_ends_when_the_server_stops(served: Served, stub: health_pb2_grpc.HealthStub) -> None:
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    assert (await call.read()).status == Response.SERVICE_UNKNOWN
    await served.server.stop(0.1)  # a Watch never ends on its own: the grace runs out, the connection closes
    assert await call.code() == grpc.StatusCode.UNAVAILABLE
    await eventually(lambda: not any(served.health._watchers.values()), "the watch forgotten")


async def test_a_watch_the_client_cancels_is_forgotten(served: Served, stub: health_pb2_grpc.HealthStub) -> None:
    calls = [stub.Watch(health_pb2.HealthCheckRequest(service="readiness")) for _ in range(3)]
    for call in calls:
        await call.read()
    assert len(served.health._watchers["readiness"]) == 3
    calls[0].cancel()
    await eventually(lambda: len(served.health._watchers["readiness"]) == 2, "the cancelled watch forgotten")
    served.health.set("readiness", SERVING)
    for call in calls[1:]:
        assert (await call.read()).status == Response.SERVING


async def test_many_watches_over_one_connection_each_get_every_change(served: Served) -> None:
    client = await Client.connect(served.port)
    ids = list(range(1, 41, 2))
    await client.send(
        b"".join(client.requests.open(i, WATCH) + data(i, grpc_message(request("s")), end_stream=True) for i in ids)
    )
    await client.until(lambda peer: all(len(peer.streams.get(i, _empty).messages) == 1 for i in ids))
    for status in (SERVING, NOT_SERVING, SERVING):
        served.health.set("s", status)
    await client.until(lambda peer: all(len(peer.streams[i].messages) == 4 for i in ids))
    for i in ids:
        statuses = [Response.FromString(m).status for m in client.peer.streams[i].messages]
        assert statuses == [Response.SERVICE_UNKNOWN, Response.SERVING, Response.NOT_SERVING, Response.SERVING]
    await client.close()


class _Empty:
    messages: tuple[bytes, ...] = ()


_empty = _Empty()


# -- what a C-core client would not send ---------------------------------------------------------------------


async def test_check_of_bytes_that_are_no_request_is_internal() -> None:
    health = Health()
    loop = Loopback(health.methods())
    loop.open(1, CHECK)
    loop.send(data(1, grpc_message(b"\xff\xff\xff"), end_stream=True))
    assert loop.response(1).status == 13


async def test_check_without_a_request_is_invalid_argument() -> None:
    health = Health()
    health.set("", SERVING)
    loop = Loopback(health.methods())
    loop.open(1, CHECK, end_stream=True)
    assert loop.response(1).status == 3


async def test_watch_without_a_request_is_invalid_argument() -> None:
    health = Health()
    loop = Loopback(health.methods())
    loop.open(1, WATCH, end_stream=True)
    await asyncio.sleep(0)
    assert loop.response(1).status == 3
    assert not loop.connection.streams


async def test_a_second_watch_request_on_the_same_stream_changes_nothing() -> None:
    health = Health()
    loop = Loopback(health.methods())
    loop.open(1, WATCH)
    loop.send(data(1, grpc_message(request("a"))) + data(1, grpc_message(request("b"))))
    assert len(loop.response(1).messages) == 1
    assert set(health._watchers) == {"a"}
