"""A connection nobody waits on is read at most once a coalescing window (Connection._pause).

Envoy's observability mode sends a response's messages and reads no answer; the observer has a
cluster of its own, so such a connection carries observed streams only. After each read of it the
socket is left unread for the window (``set_observe_coalesce``, the I/O thread's window too), and
what came meanwhile is read in one wake-up. A connection on which the picker ever answered is never
put off: someone waits there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from epp.wire._fast import set_observe_coalesce
from epp.wire.server import GrpcServer, bind_socket
from tests.conftest import eventually
from tests.wire.rawh2 import PATH, BodyEcho, BodyWatch, Client, Loopback, chunk_message, data, grpc, observed_message


@pytest.fixture
def window() -> Iterator[float]:
    previous = set_observe_coalesce(20_000)
    yield 0.02
    set_observe_coalesce(previous)


def _watching() -> tuple[Loopback, list[BodyWatch]]:
    calls: list[BodyWatch] = []
    return Loopback({PATH: lambda stream: calls.append(BodyWatch(stream)) or calls[-1]}), calls


async def test_an_observed_connection_is_left_unread_for_the_window_after_each_read(window: float) -> None:
    loop, calls = _watching()
    loop.open(1, PATH)
    assert not loop.transport.pauses  # not known yet: its stream has not said it is observed
    loop.send(data(1, grpc(observed_message(b"data: first\n\n"))))  # the first chunk: observed
    assert loop.transport.paused and loop.transport.pauses == 1
    await asyncio.sleep(window * 3)
    assert not loop.transport.paused  # read again once the window is over
    loop.send(data(1, grpc(observed_message(b"data: middle\n\n"))))  # a read C takes whole pauses too
    assert loop.transport.paused and loop.transport.pauses == 2
    loop.open(3, PATH)  # the next request's observer: the connection is known now, the same holds
    assert loop.transport.pauses == 2  # (paused already: one pause at a time)
    await asyncio.sleep(window * 3)
    loop.send(data(3, grpc(observed_message(b"data: first\n\n"))))
    assert loop.transport.pauses == 3
    assert [len(call.seen) for call in calls] == [1, 1]
    loop.connection.connection_lost(None)  # a pause pending at the end is let go
    assert loop.connection._paused is None


async def test_a_connection_the_picker_answered_on_is_never_left_unread(window: float) -> None:
    calls: list[BodyEcho | BodyWatch] = []
    loop = Loopback(
        {PATH: lambda stream: calls.append(BodyEcho(stream) if not calls else BodyWatch(stream)) or calls[-1]}
    )
    loop.open(1, PATH)
    loop.send(data(1, grpc(chunk_message(b"data: first\n\n"))))  # answered: someone waits on this connection
    assert loop.response(1).messages
    loop.open(3, PATH)
    loop.send(data(3, grpc(observed_message(b"data: first\n\n"))))  # an observed stream beside it
    loop.send(data(3, grpc(observed_message(b"data: middle\n\n"))))
    assert loop.connection.streams[3].echo == 2
    assert loop.transport.pauses == 0


async def test_with_no_window_an_observed_connection_is_read_as_it_comes() -> None:
    previous = set_observe_coalesce(0)
    try:
        loop, _ = _watching()
        loop.open(1, PATH)
        loop.send(data(1, grpc(observed_message(b"data: first\n\n"))))
        loop.send(data(1, grpc(observed_message(b"data: middle\n\n"))))
        assert loop.transport.pauses == 0
    finally:
        set_observe_coalesce(previous)


async def test_what_arrives_during_the_window_is_read_when_it_ends() -> None:
    # Over a socket: a message sent just after a read of the observed connection waits for the window.
    calls: list[BodyWatch] = []
    server = GrpcServer({PATH: lambda stream: calls.append(BodyWatch(stream)) or calls[-1]}, flag="test")  # type: ignore[arg-type, func-returntype]
    port = server.serve_socket(bind_socket("127.0.0.1", 0))
    client = await Client.connect(port)
    previous = set_observe_coalesce(1_000_000)  # 1 s: far longer than a loaded machine's hiccup
    try:
        await client.send(client.requests.open(1, PATH))
        await client.send(data(1, grpc(observed_message(b"data: first\n\n"))))
        await eventually(lambda: len(calls) == 1 and len(calls[0].seen) == 1, "the first chunk is read")
        sent = time.monotonic()
        await client.send(data(1, grpc(observed_message(b"data: [DONE]\n\n", end_of_stream=True))))
        await asyncio.sleep(0.2)
        assert len(calls[0].seen) == 1  # left unread: the window is not over
        await client.until(lambda peer: 1 in peer.streams and peer.streams[1].status is not None)
        assert len(calls[0].seen) == 2 and time.monotonic() - sent > 0.5  # read at the window's end, then ended
        assert client.peer.streams[1].messages == []
    finally:
        set_observe_coalesce(previous)
        await client.close()
        await server.stop(0)
