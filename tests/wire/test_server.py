"""epp.wire.server: listening sockets, TLS and its mismatches, stopping; and the picker's ext_proc calls on it.

Real sockets on 127.0.0.1, on both event loops (tests/wire/conftest.py): the picker serves on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import unittest.mock
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.datalayer.static import parse_endpoints
from epp.framework import Outcome
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.server.server import EndpointPicker
from epp.server.tls import self_signed_certificate
from epp.wire.health import SERVING, Health
from epp.wire.server import GrpcServer, bind_socket
from tests.conftest import eventually
from tests.pickers import loopback_settings
from tests.wire.rawh2 import (
    ACK,
    NO_ERROR,
    PATH,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    Client,
    Recorder,
    chunk_message,
    data,
    frame,
    rst_stream,
    trusting,
    upb_answer,
    window_update,
)
from tests.wire.rawh2 import (
    grpc as grpc_message,
)

ECHO = "/test.Echo/Echo"
OK = 0


@dataclass
class Served:
    server: GrpcServer
    port: int
    recorder: Recorder
    health: Health


async def _serve(**options: object) -> Served:
    recorder = Recorder()
    health = Health()
    server = GrpcServer({ECHO: recorder, **health.methods()}, flag="--grpc-port 1234", **options)  # type: ignore[arg-type]
    port = server.serve_socket(bind_socket("127.0.0.1", 0))
    return Served(server, port, recorder, health)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    running = await _serve()
    yield running
    await running.server.stop(0)


@pytest.fixture(scope="module")
def certificate() -> tuple[bytes, bytes]:
    return self_signed_certificate()


def _server_context(certificate: tuple[bytes, bytes], tmp_path: object) -> ssl.SSLContext:
    import pathlib

    directory = pathlib.Path(str(tmp_path))
    (directory / "tls.crt").write_bytes(certificate[0])
    (directory / "tls.key").write_bytes(certificate[1])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(directory / "tls.crt", directory / "tls.key")
    return context


@pytest.fixture(params=[True, False], ids=["native-tls", "uvloop-tls"])
async def served_tls(
    certificate: tuple[bytes, bytes], tmp_path: object, request: pytest.FixtureRequest
) -> AsyncIterator[Served]:
    """A TLS port, its records C's (epp.wire._fast.TlsTransport) or the event loop's (``native_tls=False``)."""
    context = _server_context(certificate, tmp_path)
    running = await _serve(ssl_context=context, first_bytes_timeout=0.5, native_tls=request.param)
    assert running.server.native_tls is request.param
    yield running
    await running.server.stop(0)


def _client_context(certificate: tuple[bytes, bytes]) -> ssl.SSLContext:
    return trusting(certificate[0])


async def _echo(client: Client, stream_id: int, message: bytes) -> None:
    await client.send(client.requests.open(stream_id, ECHO) + data(stream_id, grpc_message(message), end_stream=True))
    await client.until(lambda peer: stream_id in peer.streams and peer.streams[stream_id].ended)
    assert client.peer.streams[stream_id].messages == [message]
    assert client.peer.streams[stream_id].status == OK


# -- serving ---------------------------------------------------------------------------------------------


async def test_a_raw_client_is_served_and_the_connection_is_counted(served: Served) -> None:
    client = await Client.connect(served.port)
    await _echo(client, 1, b"hello")
    await _echo(client, 3, b"again")
    assert served.server.connections == 1
    await client.close()
    await eventually(lambda: served.server.connections == 0, "the connection forgotten once closed")


async def test_a_grpc_c_core_client_is_served(served: Served) -> None:
    served.health.set("", SERVING)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        echo = channel.stream_stream(ECHO)
        call = echo(iter([b"a", b"b" * 100_000, b"c"]))
        assert [m async for m in call] == [b"a", b"b" * 100_000, b"c"]
        assert await call.code() == grpc.StatusCode.OK
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "bad",
    [
        frame(0x1, 0x4, 2, b"\x82"),  # an even stream id
        window_update(0, 0),
        frame(0x6, 0, 0, b"short"),  # a PING of 5 bytes
        b"\x00\x00\x00\x09\x00\x00\x00\x00\x01",  # CONTINUATION with no header block
        bytes(range(256)) * 4,  # garbage
    ],
    ids=["even id", "window update 0", "short ping", "continuation", "garbage"],
)
async def test_a_connection_error_closes_that_connection_only(served: Served, bad: bytes) -> None:
    other = await Client.connect(served.port)
    await other.send(other.requests.open(1, ECHO) + data(1, grpc_message(b"before")))
    await other.until(lambda peer: peer.streams.get(1) is not None and peer.streams[1].messages)
    broken = await Client.connect(served.port)
    await broken.send(bad)
    await broken.closed()
    assert broken.peer.goaway is not None and broken.peer.goaway[1] != NO_ERROR
    # the other connection goes on, and new ones are served
    await other.send(data(1, grpc_message(b"after"), end_stream=True))
    await other.until(lambda peer: peer.streams[1].ended)
    assert other.peer.streams[1].messages == [b"before", b"after"]
    fresh = await Client.connect(served.port)
    await _echo(fresh, 1, b"fresh")
    for client in (other, fresh):
        await client.close()


async def test_a_connection_error_is_said_with_goaway_before_the_close(served: Served) -> None:
    client = await Client.connect(served.port)
    await client.send(client.requests.open(1, ECHO) + frame(0x1, 0x4, 2, b"\x82"))
    await client.closed()
    assert client.peer.goaway is not None and client.peer.goaway[:2] == (1, PROTOCOL_ERROR)
    await eventually(lambda: served.recorder.by_id(1).cancelled == 1, "the open call cancelled")


async def test_random_bytes_never_stop_the_server(served: Served) -> None:
    rng = random.Random(14)
    clients = []
    for size in (1, 9, 24, 100, 5000):
        client = await Client.connect(served.port, preface=rng.random() < 0.5)
        await client.send(rng.randbytes(size))
        clients.append(client)
    for client in clients:
        with contextlib.suppress(TimeoutError):  # closed by the server, or waiting for more bytes
            await asyncio.wait_for(client.closed(), 0.3)
        await client.close()
    fresh = await Client.connect(served.port)
    await _echo(fresh, 1, b"still serving")
    await fresh.close()
    await eventually(lambda: served.server.connections == 0, "every connection forgotten")


# -- stopping --------------------------------------------------------------------------------------------


async def test_stop_sends_goaway_lets_open_streams_finish_and_refuses_new_ones() -> None:
    running = await _serve()
    client = await Client.connect(running.port)
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"one")))
    await client.until(lambda peer: peer.streams.get(1) is not None and peer.streams[1].messages)
    stopping = asyncio.create_task(running.server.stop(30))
    await client.until(lambda peer: peer.goaway is not None and peer.goaway[0] == 1)  # (after its PING's answer)
    assert client.peer.goaway[:2] == (1, NO_ERROR)  # type: ignore[index]
    await client.send(client.requests.open(3, ECHO))
    await client.until(lambda peer: 3 in peer.streams and peer.streams[3].ended)
    assert client.peer.streams[3].reset == REFUSED_STREAM
    assert not stopping.done()
    await client.send(data(1, grpc_message(b"two"), end_stream=True))  # the open stream runs to its end
    await client.until(lambda peer: peer.streams[1].ended)
    assert client.peer.streams[1].messages == [b"one", b"two"] and client.peer.streams[1].status == OK
    await asyncio.wait_for(stopping, 10)  # done once the last stream ended, long before the grace
    await client.closed()
    await client.close()


async def test_a_stream_opened_before_the_client_read_the_goaway_is_served_and_later_ones_refused(
    served: Served,
) -> None:
    # RFC 9113 6.8's graceful GOAWAY: the first names the highest stream id, then a PING; the final one,
    # with the last stream opened, once the PING's answer shows the client has read the first. A single
    # GOAWAY with the last stream seen refused the stream a busy client had on the wire (Envoy's ext_proc
    # then answered its request 500: seen with --workers' rebalancing).
    client = await Client.connect(served.port)
    client.answer_pings = False
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"one"), end_stream=True))
    await client.until(lambda peer: 1 in peer.streams and peer.streams[1].ended)
    assert served.server.goaway_busiest() == 1
    await client.until(lambda peer: peer.goaway is not None and peer.ping_requests)
    assert client.peer.goaway[:2] == (0x7FFF_FFFF, NO_ERROR)  # type: ignore[index]
    await client.send(client.requests.open(3, ECHO) + data(3, grpc_message(b"crossed"), end_stream=True))
    await client.until(lambda peer: 3 in peer.streams and peer.streams[3].ended)
    assert client.peer.streams[3].messages == [b"crossed"] and client.peer.streams[3].status == OK
    await client.send(frame(PING, ACK, 0, client.peer.ping_requests.pop()))
    await client.until(lambda peer: peer.goaway is not None and peer.goaway[0] == 3)
    assert client.peer.goaway[:2] == (3, NO_ERROR)  # type: ignore[index]
    await client.send(client.requests.open(5, ECHO))
    await client.until(lambda peer: 5 in peer.streams and peer.streams[5].ended)
    assert client.peer.streams[5].reset == REFUSED_STREAM
    await client.close()


async def test_goaway_busiest_picks_the_connection_that_carried_the_most_streams_not_the_most_open(
    served: Served,
) -> None:
    busy = await Client.connect(served.port)  # sequential calls: none open when the owner asks
    quiet = await Client.connect(served.port)  # one long call, open throughout
    await quiet.send(quiet.requests.open(1, ECHO) + data(1, grpc_message(b"long")))
    for stream in (1, 3, 5):
        await busy.send(busy.requests.open(stream, ECHO) + data(stream, grpc_message(b"x"), end_stream=True))
        await busy.until(lambda peer, stream=stream: stream in peer.streams and peer.streams[stream].ended)
    await quiet.until(lambda peer: 1 in peer.streams and peer.streams[1].messages)
    assert served.server.goaway_busiest() == 3
    await busy.until(lambda peer: peer.goaway is not None)
    assert quiet.peer.goaway is None
    # Counted from the previous call: nothing carried since, so nothing is shed (an open call stays put).
    assert served.server.goaway_busiest() == 0
    await asyncio.sleep(0.05)
    assert quiet.peer.goaway is None
    for client in (busy, quiet):
        await client.close()


async def test_calls_left_after_the_grace_are_cancelled_and_the_port_is_free_again() -> None:
    running = await _serve()
    client = await Client.connect(running.port)
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"one")))
    await client.until(lambda peer: peer.streams.get(1) is not None and peer.streams[1].messages)
    idle = await Client.connect(running.port)  # a connection with no stream: closed at once
    await running.server.stop(0.2)
    await eventually(lambda: running.recorder.by_id(1).cancelled == 1, "the call cancelled")
    await client.closed()
    await idle.closed()
    with pytest.raises(OSError):
        await Client.connect(running.port)
    bind_socket("127.0.0.1", running.port).close()  # the port is free again
    for c in (client, idle):
        await c.close()


async def test_stop_with_no_connections_returns_at_once() -> None:
    running = await _serve()
    await asyncio.wait_for(running.server.stop(30), 5)


# -- TLS -------------------------------------------------------------------------------------------------


async def test_a_grpc_c_core_client_over_tls(served_tls: Served, certificate: tuple[bytes, bytes]) -> None:
    served_tls.health.set("", SERVING)
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate[0])
    options = [("grpc.ssl_target_name_override", "localhost")]
    async with grpc.aio.secure_channel(f"127.0.0.1:{served_tls.port}", credentials, options=options) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        call = channel.stream_stream(ECHO)(iter([b"x" * 70_000, b"y"]))
        assert [m async for m in call] == [b"x" * 70_000, b"y"]


async def test_a_raw_client_over_tls(served_tls: Served, certificate: tuple[bytes, bytes]) -> None:
    client = await Client.connect(served_tls.port, ssl_context=_client_context(certificate))
    assert client.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
    await _echo(client, 1, b"over tls")
    await client.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "epp.wire.server" and r.levelno == logging.WARNING]


async def _plaintext_on(port: int) -> bytes:
    client = await Client.connect(port)
    raw = await client.closed()
    await client.close()
    return raw


async def test_plaintext_on_the_tls_port_is_closed_and_said_once_a_minute(
    served_tls: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "epp.wire.server")
    assert await _plaintext_on(served_tls.port) == b""  # closed, nothing written
    await _plaintext_on(served_tls.port)
    (warning,) = _warnings(caplog)
    assert "--grpc-port 1234 serves TLS" in warning and "plaintext HTTP/2" in warning
    assert "transport_socket" in warning and "--secure-serving=false" in warning
    served_tls.server._mismatches._last["plaintext-on-tls"] -= 61  # a minute later
    await _plaintext_on(served_tls.port)
    assert len(_warnings(caplog)) == 2
    assert "(1 more such connections in the last minute)" in _warnings(caplog)[1]


async def test_tls_on_the_plaintext_port_is_closed_and_said_once_a_minute(
    served: Served, certificate: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "epp.wire.server")
    for _ in range(3):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await Client.connect(served.port, ssl_context=_client_context(certificate))
    (warning,) = _warnings(caplog)
    assert "--grpc-port 1234 serves plaintext" in warning and "TLS handshake" in warning
    assert "--secure-serving=true" in warning and "transport_socket" in warning
    await eventually(lambda: served.server.connections == 0, "the TLS clients' connections closed")


async def test_http1_on_the_plaintext_port_is_closed_and_said(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "epp.wire.server")
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: picker\r\n\r\n")
    await asyncio.wait_for(reader.read(), 10)  # to the end: the server closed it
    writer.close()
    (warning,) = _warnings(caplog)
    assert "GET /health" in warning and "speaks gRPC (HTTP/2)" in warning


async def test_a_client_that_says_nothing_on_the_tls_port_is_closed_after_the_timeout(served_tls: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served_tls.port)
    assert await asyncio.wait_for(reader.read(), 10) == b""  # first_bytes_timeout=0.5
    writer.close()


async def test_a_client_that_says_nothing_on_the_plaintext_port_is_closed_after_the_timeout() -> None:
    running = await _serve(first_bytes_timeout=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
    await asyncio.wait_for(reader.read(), 10)  # our SETTINGS, then the end
    writer.close()
    await eventually(lambda: running.server.connections == 0, "the silent connection forgotten")
    client = await Client.connect(running.port)  # one that speaks is not closed
    await asyncio.sleep(1)
    await _echo(client, 1, b"in time")
    await client.close()
    await running.server.stop(0)


async def test_a_partial_preface_on_the_tls_port_is_waited_for_without_spinning(served_tls: Served) -> None:
    calls = 0
    real = served_tls.server._first_bytes

    def counted(*args: object) -> None:
        nonlocal calls
        calls += 1
        real(*args)  # type: ignore[arg-type]

    with unittest.mock.patch.object(served_tls.server, "_first_bytes", counted):
        reader, writer = await asyncio.open_connection("127.0.0.1", served_tls.port)
        writer.write(PREFACE[:10])
        await asyncio.sleep(0.3)
        assert calls < 100, f"the first-bytes reader ran {calls} times in 0.3 s: it spins on a peeked socket"
        writer.write(PREFACE[10:])
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then said and closed
    writer.close()


async def test_a_failed_tls_handshake_is_said_and_closed(served_tls: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "epp.wire.server")
    reader, writer = await asyncio.open_connection("127.0.0.1", served_tls.port)
    writer.write(b"\x16\x03\x01\x00\x05hello" + bytes(100))  # a TLS record that is no ClientHello
    await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await eventually(lambda: bool(_warnings(caplog)), "the handshake failure said")
    assert "TLS handshake" in _warnings(caplog)[0]


# -- the picker's ext_proc calls on the wire -----------------------------------------------------------------

Mode = processing_mode_pb2.ProcessingMode
POOL = "10.0.0.1:8000,10.0.0.2:8000"


@pytest.fixture
async def picker() -> AsyncIterator[EndpointPicker]:
    running = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints(POOL)), max_request_body_bytes=1_000_000, scrape_metrics=False
        )
    )
    await running.start()
    yield running
    await running.stop(0)


def _request(stream_id: int, client: Client) -> bytes:
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v)
                    for k, v in {
                        ":method": b"POST",
                        ":path": b"/v1/completions",
                        "x-request-id": b"r%d" % stream_id,
                    }.items()
                ]
            )
        )
    )
    headers.protocol_config.request_body_mode = Mode.FULL_DUPLEX_STREAMED
    headers.protocol_config.response_body_mode = Mode.FULL_DUPLEX_STREAMED
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
    return (
        client.requests.open(stream_id, PATH)
        + data(stream_id, grpc_message(headers.SerializeToString()))
        + data(stream_id, grpc_message(body.SerializeToString()))
    )


def _in_flight(picker: EndpointPicker) -> int:
    return sum(e.inflight.requests for e in picker.datastore.endpoints())


@pytest.fixture
def finishes() -> AsyncIterator[list[Outcome]]:
    outcomes: list[Outcome] = []
    real = RoutedRequest.finish

    def counted(routed: RoutedRequest, outcome: Outcome = "complete") -> None:
        outcomes.append(outcome)
        real(routed, outcome)

    with unittest.mock.patch.object(RoutedRequest, "finish", counted):
        yield outcomes  # type: ignore[misc]


async def _routed(client: Client, picker: EndpointPicker, stream_ids: tuple[int, ...]) -> None:
    await client.send(b"".join(_request(i, client) for i in stream_ids))
    await client.until(lambda peer: all(i in peer.streams and len(peer.streams[i].messages) >= 2 for i in stream_ids))
    assert _in_flight(picker) == len(stream_ids)


async def test_rst_stream_from_envoy_finishes_the_request_as_cancelled(
    picker: EndpointPicker, finishes: list[Outcome]
) -> None:
    client = await Client.connect(picker.grpc_port)
    await _routed(client, picker, (1,))
    response_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    await client.send(data(1, grpc_message(response_headers.SerializeToString())) + rst_stream(1))
    await eventually(lambda: _in_flight(picker) == 0, "in-flight back to 0")
    assert finishes == ["cancelled"]
    await client.close()


async def test_the_connection_dropping_cancels_every_request_on_it(
    picker: EndpointPicker, finishes: list[Outcome]
) -> None:
    client = await Client.connect(picker.grpc_port)
    await _routed(client, picker, (1, 3, 5))
    await client.close()
    await eventually(lambda: _in_flight(picker) == 0, "in-flight back to 0")
    assert finishes == ["cancelled"] * 3


async def test_the_picker_s_streamed_response_is_echoed_byte_for_byte(
    picker: EndpointPicker, finishes: list[Outcome]
) -> None:
    client = await Client.connect(picker.grpc_port)
    await _routed(client, picker, (1,))
    chunks = [b'data: {"n": %d}\n\n' % i for i in range(30)]
    headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    out = data(1, grpc_message(headers.SerializeToString()))
    out += b"".join(data(1, grpc_message(chunk_message(c))) for c in chunks)
    out += data(1, grpc_message(chunk_message(b"data: [DONE]\n\n", end_of_stream=True)))
    await client.send(out)
    await client.until(lambda peer: peer.streams[1].ended)
    answers = client.peer.streams[1].messages
    assert answers[-31:] == [upb_answer(c) for c in chunks] + [upb_answer(b"data: [DONE]\n\n", True)]
    assert client.peer.streams[1].status == OK
    assert finishes == ["complete"] and _in_flight(picker) == 0
    await client.close()


async def test_calls_left_after_the_grace_on_tls_are_cancelled(
    served_tls: Served, certificate: tuple[bytes, bytes]
) -> None:
    client = await Client.connect(served_tls.port, ssl_context=_client_context(certificate))
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"one")))
    await client.until(lambda peer: peer.streams.get(1) is not None and peer.streams[1].messages)
    await served_tls.server.stop(0.2)
    await eventually(lambda: served_tls.recorder.by_id(1).cancelled == 1, "the call cancelled", timeout=5)
    await client.closed(timeout=5)
    await client.close()


async def test_calls_left_after_the_grace_on_tls_are_cancelled_even_if_the_client_reads_nothing(
    served_tls: Served, certificate: tuple[bytes, bytes]
) -> None:
    client = await Client.connect(served_tls.port, ssl_context=_client_context(certificate))
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"one")))
    await client.until(lambda peer: peer.streams.get(1) is not None and peer.streams[1].messages)
    client.writer.transport.pause_reading()  # from now on the client reads nothing, so never answers TLS's close
    await served_tls.server.stop(0.2)
    await eventually(lambda: served_tls.recorder.by_id(1).cancelled == 1, "the call cancelled", timeout=5)
    client.writer.transport.abort()
