"""epp.wire's I/O thread (epp/wire/_fast.c, "The I/O thread").

A connection whose open streams all echo (at most four answered ones; observed ones up to 32) is lent
to a native thread, which answers their middle response body chunks (a TLS connection too: its session
is C's, epp.wire._fast.TlsTransport, and the thread decrypts and encrypts its records); any other
frame, the peer's end, or an answer the socket or the peer's windows cannot take hands it back, and
the event loop takes it back before it touches the connection itself. What must hold: the client sees
exactly what the event loop alone would have sent (byte for byte, in order, within its windows: the
raw client's peer checks every frame), the calls see what they would have seen, and the thread did
answer the middle chunks. Real sockets on 127.0.0.1, on both event loops (tests/wire/conftest.py); the
tests that take the ``lending`` fixture run over plaintext and over TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import select
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from epp.server.tls import self_signed_certificate, ssl_context_from_pem
from epp.wire._fast import TlsTransport, set_lend_after
from epp.wire.http2 import Connection, Stream
from epp.wire.server import GrpcServer, bind_socket
from tests.conftest import eventually
from tests.wire.rawh2 import (
    INITIAL_WINDOW_SIZE,
    PATH,
    BodyEcho,
    BodyWatch,
    Client,
    Recorder,
    chunk_message,
    data,
    grpc,
    observed_message,
    ping,
    settings,
    trusting,
    upb_answer,
    window_update,
)

ECHO = "/test.Echo/Echo"


@dataclass
class Lending:
    server: GrpcServer
    client: Client
    calls: dict[int, BodyEcho]
    recorder: Recorder
    sent: dict[int, list[bytes]]  # per stream, the chunks sent (their answers expected in order)

    @property
    def connection(self) -> Connection:
        (connection,) = self.server._connections
        return connection

    async def start(self, stream_id: int) -> None:
        """Open an ext_proc-like stream and send its first chunk; the connection is then lent."""
        self.sent[stream_id] = []
        await self.client.send(self.client.requests.open(stream_id, PATH))
        await self.chunk(stream_id, b"data: first\n\n")

    async def chunk(self, stream_id: int, body: bytes, *, wait: bool = True, end: bool = False) -> None:
        self.sent[stream_id].append(body)
        await self.client.send(data(stream_id, grpc(chunk_message(body, end_of_stream=end))))
        if wait:
            await self.answered(stream_id)

    async def answered(self, stream_id: int) -> None:
        count = len(self.sent[stream_id])
        await self.client.until(
            lambda peer: stream_id in peer.streams and len(peer.streams[stream_id].messages) >= count
        )

    async def end(self, stream_id: int) -> None:
        await self.chunk(stream_id, b"data: [DONE]\n\n", wait=False, end=True)
        await self.client.until(lambda peer: stream_id in peer.streams and peer.streams[stream_id].status is not None)
        self.check(stream_id)

    def check(self, stream_id: int) -> None:
        sent = self.sent[stream_id]
        expected = [
            upb_answer(body, index == len(sent) - 1 and body == b"data: [DONE]\n\n") for index, body in enumerate(sent)
        ]
        assert self.client.peer.streams[stream_id].messages == expected


@pytest.fixture(autouse=True)
def lend_at_once() -> Iterator[None]:
    """Lend as soon as every stream echoes (the default waits for 32 chunks a stream; its own test below)."""
    previous = set_lend_after(1)
    yield
    set_lend_after(previous)


def _tls() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a fresh self-signed certificate, and a client context that trusts it."""
    certificate, key = self_signed_certificate()
    return ssl_context_from_pem(certificate, key), trusting(certificate)


@contextlib.asynccontextmanager
async def _serving(*, client_ssl: ssl.SSLContext | None = None, **options: Any) -> AsyncIterator[Lending]:
    """A server of ext_proc-like streams (and a unary echo), and a raw client connected to it."""
    calls: dict[int, BodyEcho] = {}

    def handler(stream: Stream) -> BodyEcho:
        calls[stream.id] = call = BodyEcho(stream)
        return call

    recorder = Recorder()
    server = GrpcServer({PATH: handler, ECHO: recorder}, flag="--grpc-port test", **options)  # type: ignore[arg-type]
    port = server.serve_socket(bind_socket("127.0.0.1", 0))
    client = await Client.connect(port, ssl_context=client_ssl)
    try:
        yield Lending(server, client, calls, recorder, {})
    finally:
        await client.close()
        await server.stop(0)


@pytest.fixture(params=["plaintext", "tls"])
async def lending(request: pytest.FixtureRequest) -> AsyncIterator[Lending]:
    if request.param == "plaintext":
        async with _serving() as running:
            yield running
    else:
        server_context, client_context = _tls()
        async with _serving(ssl_context=server_context, client_ssl=client_context) as running:
            assert running.server.native_tls
            yield running


def _middle(index: int) -> bytes:
    return b'data: {"choices":[{"text":" token %d"}]}\n\n' % index


async def test_middle_chunks_are_answered_by_the_thread_the_first_and_last_by_the_call(lending: Lending) -> None:
    await lending.start(1)
    connection = lending.connection
    assert connection.lent == 1  # lent as soon as its only stream echoes
    for index in range(30):
        await lending.chunk(1, _middle(index))
    assert connection.thread_chunks == 30
    await lending.end(1)
    assert lending.client.peer.streams[1].status == 0
    call = lending.calls[1]
    assert [m.response_body.body for m in call.seen] == [b"data: first\n\n", b"data: [DONE]\n\n"]
    # The tally is whole: what the thread answered counts, and the last chunks are kept.
    assert call.stream.response_chunks == 32
    assert call.stream.response_bytes == sum(map(len, lending.sent[1]))
    assert call.stream.tail() == lending.sent[1][-4:]
    assert connection.lent == 0 and connection.lends == 1


async def test_by_default_a_connection_is_lent_once_its_streams_have_had_32_chunks(lending: Lending) -> None:
    set_lend_after(32)  # the default: a short stream's chunks would not repay a lend and its hand-back
    await lending.start(1)
    connection = lending.connection
    for index in range(30):
        await lending.chunk(1, _middle(index))
    assert connection.lends == 0  # 31 chunks so far
    await lending.chunk(1, _middle(30))
    assert connection.lent == 1  # the 32nd read ends with the connection lent
    for index in range(31, 40):
        await lending.chunk(1, _middle(index))
    assert connection.thread_chunks == 9
    await lending.start(3)  # a new stream: handed back, and not lent again until it has had 32 chunks too
    for index in range(40, 50):
        await lending.chunk(1, _middle(index))
    assert connection.lends == 1 and connection.thread_chunks == 9
    await lending.end(1)
    await lending.end(3)


async def test_chunks_back_to_back_and_a_frame_split_across_reads_are_answered_in_order(lending: Lending) -> None:
    await lending.start(1)
    connection = lending.connection
    burst = [_middle(index) for index in range(50)]
    lending.sent[1] += burst
    await lending.client.send(b"".join(data(1, grpc(chunk_message(body))) for body in burst))
    await lending.answered(1)
    split = data(1, grpc(chunk_message(_middle(50))))
    lending.sent[1].append(_middle(50))
    await lending.client.send(split[:7])  # inside the frame header
    await asyncio.sleep(0.02)
    await lending.client.send(split[7:30])
    await asyncio.sleep(0.02)
    await lending.client.send(split[30:])
    await lending.answered(1)
    assert connection.thread_chunks == 51
    await lending.end(1)


async def test_a_new_stream_hands_the_connection_back_and_is_served(lending: Lending) -> None:
    await lending.start(1)
    connection = lending.connection
    await lending.chunk(1, _middle(0))
    # A unary call on another stream: its HEADERS are not the thread's.
    client = lending.client
    await client.send(client.requests.open(3, ECHO) + data(3, grpc(b"hello"), end_stream=True))
    await client.until(lambda peer: 3 in peer.streams and peer.streams[3].status is not None)
    assert client.peer.streams[3].messages == [b"hello"] and client.peer.streams[3].status == 0
    for index in range(1, 10):
        await lending.chunk(1, _middle(index))
    await lending.end(1)
    # Lent again at the end of the read that ended stream 3: every middle chunk was the thread's.
    assert connection.lends == 2
    assert connection.thread_chunks == 10


async def test_two_streams_share_a_lent_connection(lending: Lending) -> None:
    await lending.start(1)
    await lending.start(3)
    connection = lending.connection
    for index in range(20):
        await lending.chunk(1 if index % 2 else 3, _middle(index))
    assert connection.lent == 1 and connection.thread_chunks >= 18
    await lending.end(1)
    for index in range(20, 25):
        await lending.chunk(3, _middle(index))
    await lending.end(3)


async def test_five_streams_are_never_lent(lending: Lending) -> None:
    for stream_id in (1, 3, 5, 7, 9):
        await lending.start(stream_id)
    connection = lending.connection
    lends = connection.lends  # (lent while there were four or fewer)
    assert connection.lent == 0
    for stream_id in (1, 3, 5, 7, 9):
        await lending.chunk(stream_id, _middle(stream_id))
    assert connection.lends == lends
    for stream_id in (1, 3, 5, 7, 9):
        await lending.end(stream_id)


async def test_a_ping_on_a_lent_connection_is_answered(lending: Lending) -> None:
    await lending.start(1)
    await lending.chunk(1, _middle(0))
    await lending.client.send(ping(b"pingpong"))
    await lending.client.until(lambda peer: peer.pings == [b"pingpong"])
    await lending.chunk(1, _middle(1))
    await lending.chunk(1, _middle(2))
    await lending.end(1)
    assert lending.connection.lends == 2


async def test_the_call_ending_the_stream_while_lent_ends_it_after_every_answer(lending: Lending) -> None:
    await lending.start(1)
    connection = lending.connection
    for index in range(5):
        await lending.chunk(1, _middle(index))
    assert connection.lent == 1
    lending.calls[1].stream.finish(13, "the picker gave up")  # (say, a timeout of the call's own)
    assert connection.lent == 0  # taken back before the trailers were written
    client = lending.client
    await client.until(lambda peer: 1 in peer.streams and peer.streams[1].status is not None)
    lending.check(1)
    assert client.peer.streams[1].status == 13
    # What the peer still sends on the stream is dropped; the connection serves on.
    await client.send(data(1, grpc(chunk_message(_middle(5)))))
    await client.send(client.requests.open(3, ECHO) + data(3, grpc(b"after"), end_stream=True))
    await client.until(lambda peer: 3 in peer.streams and peer.streams[3].status is not None)
    assert client.peer.streams[3].messages == [b"after"]
    assert client.peer.streams[1].messages == [upb_answer(b) for b in lending.sent[1]]


async def test_the_peer_closing_a_lent_connection_cancels_the_call(lending: Lending) -> None:
    await lending.start(1)
    await lending.chunk(1, _middle(0))
    assert lending.connection.lent == 1
    await lending.client.close()
    await eventually(lambda: lending.calls[1].cancelled, "the call cancelled")
    await eventually(lambda: lending.server.connections == 0, "the connection forgotten")


async def test_an_answer_the_peer_s_window_cannot_take_waits_for_its_window_update(lending: Lending) -> None:
    client = lending.client
    await client.send(settings((INITIAL_WINDOW_SIZE, 700)))
    await client.until(lambda peer: peer.settings_acks >= 1)
    await lending.start(1)
    connection = lending.connection
    chunks = [_middle(index) for index in range(20)]  # ~60 bytes of answer each: the window takes ~10
    lending.sent[1] += chunks
    await client.send(b"".join(data(1, grpc(chunk_message(body))) for body in chunks))
    await eventually(lambda: connection.lent == 0 and connection.thread_chunks > 0, "the thread hands back")
    await asyncio.sleep(0.05)
    assert len(client.peer.streams[1].messages) < 21  # held back by the window, not sent past it
    await client.send(window_update(1, 100_000))
    await lending.answered(1)
    await lending.end(1)


async def test_stopping_the_server_takes_a_lent_connection_back_and_lets_its_stream_finish(lending: Lending) -> None:
    await lending.start(1)
    await lending.chunk(1, _middle(0))
    stopping = asyncio.ensure_future(lending.server.stop(10))
    await lending.client.until(lambda peer: peer.goaway is not None)
    for index in range(1, 4):
        await lending.chunk(1, _middle(index))
    await lending.end(1)
    await asyncio.wait_for(stopping, 10)


@pytest.mark.parametrize("seed", range(6))
async def test_random_interleavings_are_answered_as_the_event_loop_alone_would(lending: Lending, seed: int) -> None:
    rng = random.Random(seed)
    client = lending.client
    open_ids = [1]
    await lending.start(1)
    next_id, unary = 3, 0
    for step in range(120):
        action = rng.random()
        stream_id = rng.choice(open_ids)
        if action < 0.45:
            await lending.chunk(stream_id, _middle(step), wait=rng.random() < 0.5)
        elif action < 0.55:  # a burst in one write
            burst = [_middle(step * 10 + i) for i in range(rng.randint(2, 8))]
            lending.sent[stream_id] += burst
            await client.send(b"".join(data(stream_id, grpc(chunk_message(b))) for b in burst))
        elif action < 0.62:  # a frame in pieces
            body = _middle(step)
            frame = data(stream_id, grpc(chunk_message(body)))
            lending.sent[stream_id].append(body)
            cut = rng.randint(1, len(frame) - 1)
            await client.send(frame[:cut])
            await asyncio.sleep(rng.random() * 0.003)
            await client.send(frame[cut:])
        elif action < 0.68:
            await client.send(ping(b"%08d" % step))
        elif action < 0.72:
            await client.send(window_update(0, 1000))
        elif action < 0.78 and len(open_ids) < 5:
            open_ids.append(next_id)
            await lending.start(next_id)
            next_id += 2
        elif action < 0.83 and len(open_ids) > 1:
            open_ids.remove(stream_id)
            await lending.end(stream_id)
        elif action < 0.88:
            unary_id = next_id
            next_id += 2
            unary += 1
            await client.send(client.requests.open(unary_id, ECHO) + data(unary_id, grpc(b"u"), end_stream=True))
        else:
            await asyncio.sleep(rng.random() * 0.002)
    for stream_id in open_ids:
        await lending.end(stream_id)
    await client.until(
        lambda peer: sum(1 for r in peer.streams.values() if r.messages == [b"u"] and r.status == 0) == unary
    )
    for stream_id in lending.sent:
        lending.check(stream_id)
        assert client.peer.streams[stream_id].status == 0
    for stream_id, call in lending.calls.items():
        assert call.seen[0].response_body.body == b"data: first\n\n"
        assert call.stream.response_bytes == sum(map(len, lending.sent[stream_id]))
    assert lending.connection.thread_chunks > 0


def _registration(epoll: int, fd: int) -> int | None:
    """The events ``fd`` is registered for in the epoll ``epoll`` (from /proc, in hex; the kernel adds
    EPOLLERR and EPOLLHUP to any), None if it is not in it."""
    for line in Path(f"/proc/self/fdinfo/{epoll}").read_text().splitlines():
        fields = line.split()
        if fields[:1] == ["tfd:"] and int(fields[1]) == fd:
            return int(fields[3], 16)
    return None


async def test_a_lent_socket_is_quiet_in_uvloops_epoll_and_watched_again_once_taken_back(lending: Lending) -> None:
    # libuv leaves a paused socket in its epoll until it fires there: the loop would wake for the
    # thread's reads. Lent, the socket is registered for no event; taken back, libuv reads it again.
    epoll = lending.connection._loop_epoll
    if epoll < 0:
        pytest.skip("asyncio's loop: no epoll of its own to quiet")
    fd = lending.connection._fd
    await lending.start(1)
    await lending.chunk(1, _middle(0))
    assert lending.connection.lent == 1
    assert not (_registration(epoll, fd) or 0) & select.EPOLLIN
    await lending.end(1)  # its last chunk: handed back, and with no stream open not lent again
    assert lending.connection.lent == 0
    await eventually(lambda: (_registration(epoll, fd) or 0) & select.EPOLLIN, "the socket watched for reading again")
    await lending.start(3)  # and read by the loop: served
    await lending.end(3)


async def test_a_tls_connection_whose_records_are_uvloops_is_never_lent() -> None:
    server_context, client_context = _tls()
    async with _serving(ssl_context=server_context, client_ssl=client_context, native_tls=False) as lending:
        assert not lending.server.native_tls
        await lending.start(1)
        for index in range(5):
            await lending.chunk(1, _middle(index))
        await lending.end(1)
        assert lending.connection.lends == 0 and lending.connection.thread_chunks == 0


async def test_without_the_io_thread_nothing_is_lent() -> None:
    async with _serving(io_thread=False) as lending:
        await lending.start(1)
        for index in range(5):
            await lending.chunk(1, _middle(index))
        await lending.end(1)
        assert lending.connection.lends == 0


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_lent_streams_and_connections_are_freed_once_done(tls: bool) -> None:
    # The thread holds references while a connection is lent: every one must be let go at the reclaim.
    server_context, client_context = _tls() if tls else (None, None)

    async def serve() -> None:
        async with _serving(  # (first_bytes_timeout: its timer holds the connection till then)
            first_bytes_timeout=0.1, ssl_context=server_context, client_ssl=client_context
        ) as lending:
            await asyncio.sleep(0.15)
            for stream_id in range(1, 41, 2):
                await lending.start(stream_id)
                for index in range(3):
                    await lending.chunk(stream_id, _middle(index))
                await lending.end(stream_id)
            assert lending.connection.lends == 20 and lending.connection.thread_chunks == 60
            server = lending.server
        await eventually(lambda: server.connections == 0, "the connection closed")

    await serve()
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, (Stream, Connection, TlsTransport))]


async def test_the_server_sets_when_connections_are_lent() -> None:
    set_lend_after(1)
    async with _serving(io_thread_after_chunks=3) as lending:
        await lending.start(1)  # its first chunk
        await lending.chunk(1, _middle(0))
        assert lending.connection.lends == 0  # 2 chunks
        await lending.chunk(1, _middle(1))
        assert lending.connection.lent == 1  # the 3rd read ends with the connection lent
        await lending.end(1)


@pytest.mark.parametrize("coalesce", [0, 20_000])
async def test_an_observed_stream_s_chunks_are_the_thread_s_read_in_batches_or_at_once(coalesce: int) -> None:
    from epp.wire._fast import set_observe_coalesce

    calls: list[BodyWatch] = []
    server = GrpcServer({PATH: lambda stream: calls.append(BodyWatch(stream)) or calls[-1]}, flag="test")  # type: ignore[arg-type, func-returntype]
    port = server.serve_socket(bind_socket("127.0.0.1", 0))
    client = await Client.connect(port)
    previous = set_observe_coalesce(coalesce)
    try:
        await client.send(client.requests.open(1, PATH))
        await client.send(data(1, grpc(observed_message(b"data: first\n\n"))))
        (connection,) = server._connections
        await eventually(lambda: connection.lent == 1, "the observed stream's connection is lent")
        for index in range(40):
            await client.send(data(1, grpc(observed_message(_middle(index)))))
            await asyncio.sleep(0.001)
        await eventually(lambda: connection.thread_chunks == 40, "the thread took every middle chunk")
        await client.send(data(1, grpc(observed_message(b"data: [DONE]\n\n", end_of_stream=True))))
        await client.until(lambda peer: 1 in peer.streams and peer.streams[1].status is not None)
        (call,) = calls
        assert [m.response_body.body for m in call.seen] == [
            b"data: first\n\n",
            b"data: [DONE]\n\n",
        ]  # the first and the last: the call's
        assert call.stream.response_chunks == 42
        assert client.peer.streams[1].messages == []  # nothing answered, by anyone
    finally:
        set_observe_coalesce(previous)
        await client.close()
        await server.stop(0)


async def test_sixteen_observed_streams_share_a_lent_connection() -> None:
    # Answered streams are lent four at most (test_five_streams_are_never_lent); observed ones need no
    # answer, and a connection of them is lent however many it carries (up to LEND_MAX_OPEN): Envoy
    # multiplexes an observer cluster's streams onto few connections, which the event loop read at
    # every wake-up while the thread reads them in batches.
    calls: list[BodyWatch] = []
    server = GrpcServer({PATH: lambda stream: calls.append(BodyWatch(stream)) or calls[-1]}, flag="test")  # type: ignore[arg-type, func-returntype]
    port = server.serve_socket(bind_socket("127.0.0.1", 0))
    client = await Client.connect(port)
    ids = list(range(1, 33, 2))
    try:
        for stream_id in ids:
            await client.send(client.requests.open(stream_id, PATH))
            await client.send(data(stream_id, grpc(observed_message(b"data: first\n\n"))))
        (connection,) = server._connections
        await eventually(lambda: connection.lent == 1, "the sixteen observed streams' connection is lent")
        for index in range(10):
            for stream_id in ids:
                await client.send(data(stream_id, grpc(observed_message(_middle(index)))))
            await asyncio.sleep(0.001)
        await eventually(lambda: connection.thread_chunks == 10 * len(ids), "the thread took every middle chunk")
        for stream_id in ids:
            await client.send(data(stream_id, grpc(observed_message(b"data: [DONE]\n\n", end_of_stream=True))))
        await client.until(lambda peer: all(i in peer.streams and peer.streams[i].status is not None for i in ids))
        assert len(calls) == len(ids)
        for call in calls:
            assert [m.response_body.body for m in call.seen] == [b"data: first\n\n", b"data: [DONE]\n\n"]
            assert call.stream.response_chunks == 12
        assert all(client.peer.streams[i].messages == [] for i in ids)  # nothing answered, by anyone
    finally:
        await client.close()
        await server.stop(0)
