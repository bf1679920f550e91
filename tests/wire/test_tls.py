"""TLS in C (epp.wire._fast.TlsTransport): the handshake, records both ways, and the ends of a session.

What must hold: a TLS client is served exactly as by the event loop's TLS (test_server.py runs its TLS
tests both ways; test_io_thread.py lends TLS connections to the thread); a handshake that fails or
never ends is said and closed, and leaves no connection behind; records that do not decrypt end their
connection only, its calls cancelled; the peer's close_notify is answered with ours; nothing is kept
once a connection is gone. Some tests hold the client's records in hand (an ssl.SSLObject on memory
BIOs), to write what a well-behaved client would not. Real sockets on 127.0.0.1, on both event loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import ssl
from collections.abc import AsyncIterator

import grpc
import pytest

from epp.server.tls import self_signed_certificate, ssl_context_from_pem
from epp.wire import server as server_module
from epp.wire._fast import TlsTransport, set_lend_after, tls_usable
from epp.wire.http2 import Stream
from epp.wire.server import GrpcServer, bind_socket
from tests.conftest import eventually
from tests.wire.rawh2 import PATH, PREFACE, BodyEcho, Client, Recorder, chunk_message, data, settings, trusting
from tests.wire.rawh2 import grpc as grpc_message

ECHO = "/test.Echo/Echo"


@pytest.fixture(scope="module")
def certificate() -> tuple[bytes, bytes]:
    return self_signed_certificate()


class Served:
    def __init__(self, certificate: tuple[bytes, bytes]) -> None:
        self.context = ssl_context_from_pem(*certificate)
        self.recorder = Recorder()
        # (first_bytes_timeout: its timer holds each connection, and so its transport, till then)
        self.server = GrpcServer(
            {ECHO: self.recorder}, ssl_context=self.context, flag="--grpc-port 1234", first_bytes_timeout=0.2
        )
        self.port = self.server.serve_socket(bind_socket("127.0.0.1", 0))


@pytest.fixture
async def served(certificate: tuple[bytes, bytes]) -> AsyncIterator[Served]:
    running = Served(certificate)
    assert running.server.native_tls
    yield running
    await running.server.stop(0)


def _client_context(certificate: tuple[bytes, bytes]) -> ssl.SSLContext:
    return trusting(certificate[0])


class RecordsInHand:
    """A TLS client's reader and writer (for rawh2.Client) whose records the test can also write itself."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tls: ssl.SSLObject,
                 incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO) -> None:  # fmt: skip
        self.reader, self.writer, self.tls, self.incoming, self.outgoing = reader, writer, tls, incoming, outgoing
        self.close_notify_received = False

    @classmethod
    async def connect(cls, port: int, context: ssl.SSLContext) -> RecordsInHand:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
        pipe = cls(reader, writer, tls, incoming, outgoing)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pipe._send_records()
                records = await asyncio.wait_for(reader.read(1 << 16), 10)
                if not records:
                    raise ConnectionError("closed during the handshake") from None
                incoming.write(records)
        pipe._send_records()
        return pipe

    def _send_records(self) -> None:
        records = self.outgoing.read()
        if records:
            self.writer.write(records)

    async def read(self, size: int) -> bytes:
        while True:
            try:
                plaintext = self.tls.read(size)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:  # (the peer's close_notify, after ours)
                self.close_notify_received = True
                return b""
            else:
                self.close_notify_received = not plaintext  # (the peer's close_notify reads as b"")
                return plaintext
            records = await self.reader.read(1 << 16)
            if not records:
                return b""
            self.incoming.write(records)

    def write(self, plaintext: bytes) -> None:
        self.tls.write(plaintext)
        self._send_records()

    def write_records(self, records: bytes) -> None:
        self.writer.write(records)

    async def drain(self) -> None:
        await self.writer.drain()

    def send_close_notify(self) -> None:
        with contextlib.suppress(ssl.SSLWantReadError):  # (the peer's close_notify is read later)
            self.tls.unwrap()
        self._send_records()

    def close(self) -> None:
        self.writer.close()

    async def wait_closed(self) -> None:
        await self.writer.wait_closed()


async def _in_hand(served: Served, certificate: tuple[bytes, bytes]) -> tuple[Client, RecordsInHand]:
    pipe = await RecordsInHand.connect(served.port, _client_context(certificate))
    client = Client(pipe, pipe)  # type: ignore[arg-type]
    await client.send(PREFACE + settings())
    return client, pipe


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "epp.wire.server" and r.levelno == logging.WARNING]


def _transports() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is TlsTransport)


async def test_the_session_is_described_and_h2_negotiated(served: Served, certificate: tuple[bytes, bytes]) -> None:
    client = await Client.connect(served.port, ssl_context=_client_context(certificate))
    assert client.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"hello"), end_stream=True))
    await client.until(lambda peer: 1 in peer.streams and peer.streams[1].ended)
    (connection,) = served.server._connections
    transport = connection.transport
    assert isinstance(transport, TlsTransport)
    assert transport.get_extra_info("alpn_protocol") == "h2"
    assert transport.get_extra_info("sslcontext") is served.context
    name, version, bits = transport.get_extra_info("cipher")
    assert version == "TLSv1.3" and bits >= 128 and name
    assert transport.get_extra_info("peername") == client.writer.get_extra_info("sockname")
    assert transport.get_extra_info("no such thing", "default") == "default"
    await client.close()


async def test_large_messages_cross_many_records_both_ways(served: Served, certificate: tuple[bytes, bytes]) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate[0])
    options = [("grpc.ssl_target_name_override", "localhost"), ("grpc.max_receive_message_length", 8 << 20)]
    big = bytes(range(256)) * 6_000  # 1.5 MB: ~95 records of 16 KB each way, and reads that split them
    async with grpc.aio.secure_channel(f"127.0.0.1:{served.port}", credentials, options=options) as channel:
        call = channel.stream_stream(ECHO)(iter([big, b"y", big[:70_001]]))
        assert [m async for m in call] == [big, b"y", big[:70_001]]


async def test_a_handshake_that_never_ends_is_given_up(
    served: Served, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "_HANDSHAKE_TIMEOUT", 0.3)
    caplog.set_level(logging.WARNING, "epp.wire.server")
    before = _transports()
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"\x16\x03\x01\x02")  # the start of a ClientHello's record, and nothing more
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing written
    writer.close()
    await eventually(lambda: bool(_warnings(caplog)), "the timeout said")
    assert "the TLS handshake with 127.0.0.1:" in _warnings(caplog)[0]
    assert "no handshake in 0.3 s" in _warnings(caplog)[0]
    assert served.server.connections == 0
    await eventually(lambda: _transports() == before, "the transport freed")


async def test_a_client_that_rejects_the_certificate_is_said_and_leaves_nothing_behind(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "epp.wire.server")
    before = _transports()
    untrusting = ssl.create_default_context()  # does not know the self-signed certificate
    untrusting.set_alpn_protocols(["h2"])
    with pytest.raises(ssl.SSLCertVerificationError):
        await Client.connect(served.port, ssl_context=untrusting)
    await eventually(lambda: bool(_warnings(caplog)), "the failure said")
    assert "the TLS handshake with" in _warnings(caplog)[0] and "failed" in _warnings(caplog)[0]
    assert served.server.connections == 0
    await eventually(lambda: _transports() == before, "the transport freed")


async def test_records_that_do_not_decrypt_end_their_connection_only(
    served: Served, certificate: tuple[bytes, bytes]
) -> None:
    client, pipe = await _in_hand(served, certificate)
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"open")))
    await client.until(lambda peer: 1 in peer.streams and peer.streams[1].messages == [b"open"])
    other = await Client.connect(served.port, ssl_context=_client_context(certificate))
    pipe.write_records(b"\x17\x03\x03\x00\x20" + bytes(32))  # application data that does not decrypt
    with pytest.raises(ssl.SSLError, match="BAD_RECORD_MAC"):  # the fatal alert, then the end of the socket
        while await asyncio.wait_for(pipe.read(1 << 16), 10):
            pass  # (what was answered before)
    assert not pipe.close_notify_received
    call = served.recorder.calls[0]
    await eventually(lambda: call.cancelled == 1, "the call cancelled")
    await eventually(lambda: served.server.connections == 1, "the other connection alone left")
    await other.send(other.requests.open(1, ECHO) + data(1, grpc_message(b"still"), end_stream=True))
    await other.until(lambda peer: 1 in peer.streams and peer.streams[1].ended)
    assert other.peer.streams[1].messages == [b"still"]
    pipe.close()
    await other.close()


async def test_the_peers_close_notify_is_answered_with_ours(served: Served, certificate: tuple[bytes, bytes]) -> None:
    client, pipe = await _in_hand(served, certificate)
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"hi"), end_stream=True))
    await client.until(lambda peer: 1 in peer.streams and peer.streams[1].ended)
    pipe.send_close_notify()
    assert await asyncio.wait_for(pipe.read(1 << 16), 10) == b""
    assert pipe.close_notify_received
    await eventually(lambda: served.server.connections == 0, "the connection forgotten")
    pipe.close()


async def test_stopping_the_server_sends_close_notify(certificate: tuple[bytes, bytes]) -> None:
    running = Served(certificate)
    client, pipe = await _in_hand(running, certificate)
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"hi"), end_stream=True))
    await client.until(lambda peer: 1 in peer.streams and peer.streams[1].ended)
    await running.server.stop(0)
    while await asyncio.wait_for(pipe.read(1 << 16), 10):
        pass  # (the GOAWAY)
    assert pipe.close_notify_received
    pipe.close()


async def test_nothing_is_kept_once_connections_are_gone(served: Served, certificate: tuple[bytes, bytes]) -> None:
    before = _transports()
    for round_ in range(20):
        client = await Client.connect(served.port, ssl_context=_client_context(certificate))
        await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"%d" % round_), end_stream=True))
        await client.until(lambda peer: 1 in peer.streams and peer.streams[1].ended)
        await client.close()
    await eventually(lambda: served.server.connections == 0, "every connection forgotten")
    served.recorder.calls.clear()  # (the test's record of each call holds its stream, and so its connection)
    await eventually(lambda: _transports() == before, "every transport freed")


def test_only_contexts_of_pythons_own_openssl_are_used(certificate: tuple[bytes, bytes]) -> None:
    assert tls_usable(ssl_context_from_pem(*certificate))
    assert not tls_usable(object())
    with pytest.raises(TypeError):
        TlsTransport(object(), lambda: None, lambda *_: None)


async def test_a_context_tls_usable_refuses_is_served_by_the_event_loop(
    certificate: tuple[bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "tls_usable", lambda context: False)
    running = Served(certificate)
    assert not running.server.native_tls and not running.server._io_thread
    client = await Client.connect(running.port, ssl_context=_client_context(certificate))
    await client.send(client.requests.open(1, ECHO) + data(1, grpc_message(b"uv"), end_stream=True))
    await client.until(lambda peer: 1 in peer.streams and peer.streams[1].ended)
    (connection,) = running.server._connections
    assert not isinstance(connection.transport, TlsTransport)
    await client.close()
    await running.server.stop(0)


@contextlib.asynccontextmanager
async def _lending_after_one_chunk(certificate: tuple[bytes, bytes]) -> AsyncIterator[tuple[GrpcServer, int, list[BodyEcho]]]:
    """A TLS server of body-echoing calls whose connections may be lent after a stream's first chunk:
    the server, its port, and the calls it made."""
    calls: list[BodyEcho] = []

    def handler(stream: Stream) -> BodyEcho:
        calls.append(BodyEcho(stream))
        return calls[-1]

    server = GrpcServer({PATH: handler}, ssl_context=ssl_context_from_pem(*certificate), flag="--grpc-port 1234")
    port = server.serve_socket(bind_socket("127.0.0.1", 0))
    previous = set_lend_after(1)
    try:
        yield server, port, calls
    finally:
        set_lend_after(previous)
        await server.stop(0)


async def test_records_that_do_not_decrypt_on_a_lent_connection_end_it_and_cancel_its_call(
    certificate: tuple[bytes, bytes],
) -> None:
    async with _lending_after_one_chunk(certificate) as (server, port, calls):
        pipe = await RecordsInHand.connect(port, _client_context(certificate))
        client = Client(pipe, pipe)  # type: ignore[arg-type]
        await client.send(PREFACE + settings() + client.requests.open(1, PATH))
        for count, chunk in enumerate((b"data: first\n\n", b"data: middle\n\n"), start=1):
            await client.send(data(1, grpc_message(chunk_message(chunk))))
            await client.until(lambda peer, count=count: 1 in peer.streams and len(peer.streams[1].messages) == count)
        (connection,) = server._connections
        assert connection.lent == 1 and connection.thread_chunks == 1  # the thread reads its records now
        pipe.write_records(b"\x17\x03\x03\x00\x20" + bytes(32))
        with pytest.raises(ssl.SSLError, match="BAD_RECORD_MAC"):  # the thread's alert, then the end
            while await asyncio.wait_for(pipe.read(1 << 16), 10):
                pass
        await eventually(lambda: calls[0].cancelled, "the call cancelled")
        await eventually(lambda: server.connections == 0, "the connection forgotten")
        pipe.close()


async def test_a_close_notify_read_with_frames_that_would_lend_the_connection_keeps_it(
    certificate: tuple[bytes, bytes],
) -> None:
    # One read holds a stream's first chunk (after which the connection may be lent) and the peer's
    # close_notify: the loop, which read the end, closes the connection; the session is not lent first.
    async with _lending_after_one_chunk(certificate) as (server, port, _):
        pipe = await RecordsInHand.connect(port, _client_context(certificate))
        client = Client(pipe, pipe)  # type: ignore[arg-type]
        await client.send(PREFACE + settings())
        await client.until(lambda peer: peer.settings_acks >= 1)
        (connection,) = server._connections
        request = client.requests.open(1, PATH) + data(1, grpc_message(chunk_message(b"data: first\n\n")))
        client.peer.sent(request)
        pipe.tls.write(request)
        with contextlib.suppress(ssl.SSLWantReadError):
            pipe.tls.unwrap()  # the close_notify, in the same write as the frames
        pipe.write_records(pipe.outgoing.read())
        while await asyncio.wait_for(pipe.read(1 << 16), 10):
            pass
        assert pipe.close_notify_received
        assert connection.lends == 0
        await eventually(lambda: server.connections == 0, "the connection forgotten")
        pipe.close()
