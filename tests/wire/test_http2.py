"""epp.wire.http2: one HTTP/2 connection carrying gRPC calls, driven in memory by a raw client.

Each test builds the client's bytes by hand (:mod:`tests.wire.rawh2`), hands them to the
connection's ``data_received`` and reads what the server wrote as a strict client would: the
:class:`~tests.wire.rawh2.Peer` fails a test on the spot if the server overruns a window or the
frame size, or writes on a stream it has ended.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from epp.wire.http2 import Connection, Stream, _ConnectionError
from tests.wire.rawh2 import (
    CONTINUATION,
    DATA,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    MAX_WINDOW,
    PATH,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    BodyEcho,
    FakeTransport,
    Loopback,
    Peer,
    Recorder,
    RecordingCall,
    Requests,
    chunk_message,
    data,
    fill,
    frame,
    goaway,
    grpc,
    headers_frames,
    ping,
    rst_stream,
    upb_answer,
    window_update,
)
from tests.wire.rawh2 import (
    settings as settings_frame,
)

ECHO = "/test.Echo/Echo"
OK, CANCELLED, UNKNOWN, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 1, 2, 8, 12, 13


def echo_loop(**options: object) -> tuple[Loopback, Recorder]:
    """A connection serving ECHO (each message answered with itself, OK on half-close) and ext_proc's PATH."""
    recorder = Recorder()
    loop = Loopback({ECHO: recorder, PATH: BodyEcho}, **options)  # type: ignore[arg-type]
    return loop, recorder


async def connection_error(loop: Loopback, code: int) -> tuple[int, int, bytes]:
    """The connection ended with GOAWAY(code) and was closed; the GOAWAY."""
    await loop.settle()
    assert loop.peer.goaway is not None, "no GOAWAY"
    assert loop.peer.goaway[1] == code, f"GOAWAY code {loop.peer.goaway[1]}, expected {code}: {loop.peer.goaway[2]!r}"
    assert loop.transport.closed, "the connection stays open after a connection error"
    return loop.peer.goaway


@contextmanager
def no_errors_logged() -> Iterator[list[logging.LogRecord]]:
    """Protocol errors are WARNINGs; an ERROR means an exception nobody expected (a bug)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("epp.wire")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "") for r in errors]


# -- reads split anywhere --------------------------------------------------------------------------------


def recorded_stream(*, big: bool) -> bytes:
    """A client's byte stream touching every path of the read loop: preface, SETTINGS, CONTINUATION, C echo, ..."""
    requests = Requests()
    out = PREFACE + settings_frame((INITIAL_WINDOW_SIZE, 1 << 20), (HEADER_TABLE_SIZE, 4096))
    out += window_update(0, 1 << 20)
    out += requests.open(1, PATH, pieces=3)  # a header block over three frames
    out += data(1, grpc(chunk_message(b"first")))  # Python's: turns the echo on
    out += b"".join(data(1, grpc(chunk_message(b"token %d" % i))) for i in range(3))  # C's
    out += ping(b"pingpong")
    out += requests.open(3, ECHO, pieces=2, pad=4, priority=True)
    message = grpc(fill(100))
    out += data(3, grpc(b"hello") + message[:50])  # one message and half of the next
    out += frame(PRIORITY, 0, 3, struct.pack(">IB", 1, 7))
    out += frame(0xFA, 0x3, 3, b"an extension frame")
    out += data(3, message[50:], pad=9)
    if big:
        out += data(1, grpc(chunk_message(fill(40_000))))  # answered in three frames (16 KiB each at most)
    out += data(1, grpc(chunk_message(b"token x")))
    out += requests.open(5, ECHO, end_stream=True)  # headers only: half-closed at once
    out += data(3, b"", end_stream=True)
    out += data(1, grpc(chunk_message(b"last", end_of_stream=True)))
    out += requests.open(7, ECHO)  # the same block again: all table references (the fast decode)
    out += data(7, grpc(b"m"))
    out += headers_frames(7, requests.trailers(), end_stream=True, pieces=2)  # trailers over CONTINUATION
    out += settings_frame((MAX_FRAME_SIZE, 20_000))
    out += ping(b"gnipgnip")
    return out


def _replay(stream: bytes, cuts: list[int]) -> tuple[bytes, list[object]]:
    recorder = Recorder()
    echoes: list[BodyEcho] = []

    def ext_proc(wire: Stream) -> BodyEcho:
        echoes.append(BodyEcho(wire))
        return echoes[-1]

    loop = Loopback({ECHO: recorder, PATH: ext_proc}, preface=False)
    loop.send(stream, cuts)
    assert not loop.transport.closed
    events: list[object] = [(c.stream.id, c.events) for c in recorder.calls]
    events += [(e.stream.id, [m.SerializeToString() for m in e.seen]) for e in echoes]
    return bytes(loop.peer.raw), events


_WHOLE: dict[bool, tuple[bytes, list[object]]] = {}


def _whole(big: bool) -> tuple[bytes, list[object]]:
    if big not in _WHOLE:
        _WHOLE[big] = _replay(recorded_stream(big=big), [])
    return _WHOLE[big]


async def test_the_recorded_stream_gets_every_answer() -> None:
    raw, events = _whole(True)
    peer = Peer(initial_window=1 << 20)
    peer.sent(recorded_stream(big=True))
    peer.feed(raw)
    assert peer.pings == [b"pingpong", b"gnipgnip"]
    assert peer.settings_acks == 2
    assert [peer.streams[i].status for i in (1, 3, 5, 7)] == [OK, OK, OK, OK]
    assert peer.streams[3].messages == [b"hello", fill(100)]
    assert peer.streams[7].messages == [b"m"]
    assert len(peer.streams[1].messages) == 7
    assert (3, [("message", b"hello"), ("message", fill(100)), ("half_close", b"")]) in events
    # The ext_proc call saw only what C does not answer: the first chunk, one whose answer is over the
    # peer's frame size, and the last; the four small middle chunks were C's.
    seen = [chunk_message(b"first"), chunk_message(fill(40_000)), chunk_message(b"last", end_of_stream=True)]
    assert (1, seen) in events


async def test_reads_split_at_every_single_offset_give_the_same_answers() -> None:
    stream = recorded_stream(big=False)
    whole = _whole(False)
    for cut in range(1, len(stream)):
        assert _replay(stream, [cut]) == whole, f"split at byte {cut}"


async def test_reads_of_one_byte_each_give_the_same_answers() -> None:
    stream = recorded_stream(big=True)
    assert _replay(stream, list(range(1, len(stream)))) == _whole(True)


@settings(max_examples=200, deadline=None)
@given(st.data())
async def test_reads_split_anywhere_give_the_same_answers_in_the_same_order(draw: st.DataObject) -> None:
    stream = recorded_stream(big=True)
    cuts = draw.draw(st.lists(st.integers(1, len(stream) - 1), max_size=40))
    assert _replay(stream, cuts) == _whole(True)


# -- flow control ------------------------------------------------------------------------------------------


async def test_a_tiny_stream_window_gets_everything_in_order_after_window_updates_trailers_last() -> None:
    loop, recorder = echo_loop(initial_window=7)
    loop.open(1, ECHO)
    messages = [fill(20 + i, bytes((65 + i,))) for i in range(10)]
    loop.send(b"".join(data(1, grpc(m)) for m in messages) + data(1, b"", end_stream=True))
    call = recorder.by_id(1)
    assert call.finished  # the call ended; its trailers wait behind the data
    response = loop.response(1)
    assert response.trailers is None
    assert sum(len(f.payload) for f in loop.peer.frames if f.kind == DATA and f.stream_id == 1) == 7
    for _ in range(200):
        if response.trailers is not None:
            break
        loop.send(window_update(1, 7))
    assert response.messages == messages
    assert response.status == OK
    assert 1 not in loop.connection.streams


async def test_the_connection_window_holds_every_stream_back_and_releases_them_in_order() -> None:
    loop, _recorder = echo_loop(initial_window=1 << 20)
    size = 30_000
    for stream_id in (1, 3, 5):
        loop.open(stream_id, ECHO)
        loop.send(b"".join(data(stream_id, grpc(fill(size, bytes((stream_id, i))))) for i in range(3)))
    sent = sum(len(f.payload) for f in loop.peer.frames if f.kind == DATA)
    assert sent == 65_535  # the connection's initial window, no more
    loop.send(b"".join(data(i, b"", end_stream=True) for i in (1, 3, 5)))
    for _ in range(100):
        if all(loop.response(i).trailers is not None for i in (1, 3, 5)):
            break
        loop.send(window_update(0, 10_000))
    for stream_id in (1, 3, 5):
        assert loop.response(stream_id).messages == [fill(size, bytes((stream_id, i))) for i in range(3)]
        assert loop.response(stream_id).status == OK


async def test_with_the_echo_on_answers_waiting_for_the_window_are_not_reordered() -> None:
    loop, _ = echo_loop(initial_window=100)
    loop.open(1, PATH)
    chunks = [b"chunk %03d " % i + fill(i % 50) for i in range(60)]
    for i, chunk in enumerate(chunks):
        loop.send(data(1, grpc(chunk_message(chunk))))
        if i % 7 == 0:
            loop.send(window_update(1, 150))
    loop.send(data(1, grpc(chunk_message(b"end", end_of_stream=True))))
    response = loop.response(1)
    for _ in range(500):
        if response.trailers is not None:
            break
        loop.send(window_update(1, 100))
    assert response.messages == [upb_answer(c) for c in chunks] + [upb_answer(b"end", True)]
    assert response.status == OK


async def test_big_answers_are_split_at_the_peer_s_max_frame_size() -> None:
    for max_frame in (16_384, 20_000, 1 << 20):
        loop, _ = echo_loop(initial_window=1 << 24, max_frame=max_frame)
        loop.send(window_update(0, 1 << 24))
        loop.open(1, ECHO)
        message = fill(300_000)
        loop.send(data(1, grpc(message), end_stream=True))
        sizes = [len(f.payload) for f in loop.peer.frames if f.kind == DATA]
        assert max(sizes) == min(max_frame, 300_005)
        assert loop.response(1).messages == [message]


async def test_changing_initial_window_size_mid_connection_adjusts_open_streams() -> None:
    loop, _ = echo_loop(initial_window=0)
    loop.open(1, ECHO)
    loop.open(3, ECHO)
    loop.send(data(1, grpc(fill(500))) + data(3, grpc(fill(500))))
    assert not any(f.kind == DATA for f in loop.peer.frames)  # both windows are 0
    loop.send(settings_frame((INITIAL_WINDOW_SIZE, 300)))
    assert sum(len(f.payload) for f in loop.peer.frames if f.kind == DATA) == 600  # 300 on each
    loop.send(settings_frame((INITIAL_WINDOW_SIZE, 100)))  # shrinks below what was sent: windows go negative
    assert loop.connection.streams[1].window == -200
    loop.send(window_update(1, 200))
    assert sum(len(f.payload) for f in loop.peer.frames if f.kind == DATA) == 600
    loop.send(settings_frame((INITIAL_WINDOW_SIZE, 10_000)))
    assert loop.response(1).messages == [fill(500)] and loop.response(3).messages == [fill(500)]
    loop.open(5, ECHO)  # a new stream opens with the new initial window
    assert loop.connection.streams[5].window == 10_000


class _Counter:
    """A call that counts what it receives and keeps nothing."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.messages = 0
        self.bytes = 0

    def message(self, data: bytes) -> None:
        self.messages += 1
        self.bytes += len(data)

    def half_close(self) -> None:
        self.stream.send(struct.pack(">Q", self.bytes))
        self.stream.finish()

    def cancel(self) -> None:
        pass


async def test_our_receive_windows_are_topped_up_a_gigabyte_and_more_over_one_stream() -> None:
    counters: list[_Counter] = []
    loop = Loopback({ECHO: lambda s: counters.append(_Counter(s)) or counters[-1]}, max_frame=1 << 20)
    # What the server lets us send: its SETTINGS_INITIAL_WINDOW_SIZE per stream, its WINDOW_UPDATE for the connection.
    stream_window = loop.peer.settings[INITIAL_WINDOW_SIZE]
    connection_window = 65_535 + loop.peer.window_updates[0]
    assert stream_window == connection_window == MAX_WINDOW
    loop.open(1, ECHO)
    size = (1 << 20) - 5  # one message per 1 MiB frame (the server's maximum)
    block = data(1, grpc(bytes(size))) * 16
    total = 0
    updates = {0: loop.peer.window_updates[0], 1: 0}
    for _ in range(70):  # 70 x 16 MiB: 1.09 GiB
        assert len(block) - 16 * 9 <= min(stream_window, connection_window), "the client would block"
        loop.connection.data_received(block)
        frames = loop.pump()
        total += len(block) - 16 * 9
        stream_window -= len(block) - 16 * 9
        connection_window -= len(block) - 16 * 9
        for f in frames:
            if f.kind == WINDOW_UPDATE:
                increment = int.from_bytes(f.payload)
                updates[f.stream_id] += increment
                if f.stream_id == 0:
                    connection_window += increment
                else:
                    stream_window += increment
    assert total > 1 << 30
    assert counters[0].messages == 70 * 16 and counters[0].bytes == 70 * 16 * size
    assert updates[1] > 0 and updates[0] > MAX_WINDOW
    assert stream_window <= MAX_WINDOW and connection_window <= MAX_WINDOW  # never past the protocol's maximum
    loop.send(data(1, b"", end_stream=True))
    assert loop.response(1).messages == [struct.pack(">Q", 70 * 16 * size)]


# -- frames --------------------------------------------------------------------------------------------------


async def test_ping_is_answered_and_a_ping_ack_is_not() -> None:
    loop, _ = echo_loop()
    loop.send(ping(b"abcdefgh") + ping(b"12345678", ack=True))
    assert loop.peer.pings == [b"abcdefgh"]


async def test_settings_are_acknowledged_each_time() -> None:
    loop, _ = echo_loop()
    loop.send(settings_frame((HEADER_TABLE_SIZE, 0)) + settings_frame() + settings_frame(ack=True))
    assert loop.peer.settings_acks == 3  # the preface's SETTINGS, and these two
    assert loop.peer.settings == {INITIAL_WINDOW_SIZE: MAX_WINDOW, MAX_FRAME_SIZE: 1 << 20}


async def test_unknown_frame_types_and_priority_frames_are_ignored() -> None:
    loop, _recorder = echo_loop()
    loop.open(1, ECHO)
    loop.send(frame(0x0B, 0, 0, b"x") + frame(0xFF, 0xFF, 1, b"ignored") + frame(PRIORITY, 0, 1, bytes(5)))
    loop.send(frame(PRIORITY, 0, 9, bytes(5)))  # on a stream never opened: still only a priority
    loop.send(data(1, grpc(b"hi"), end_stream=True))
    assert loop.response(1).messages == [b"hi"]
    assert loop.response(1).status == OK
    assert loop.peer.goaway is None


@pytest.mark.parametrize(("pad", "priority"), [(0, False), (5, False), (None, True), (200, True)])
async def test_headers_with_padding_and_priority_open_the_stream(pad: int | None, priority: bool) -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO, pad=pad, priority=priority)
    loop.send(data(1, grpc(b"hi"), end_stream=True))
    assert recorder.by_id(1).stream.headers[b":path"] == ECHO.encode()
    assert loop.response(1).messages == [b"hi"]


async def test_a_header_block_in_several_continuation_frames() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO, pieces=6, extra=[("x-long", "v" * 300)])
    assert recorder.by_id(1).stream.headers[b"x-long"] == b"v" * 300
    loop.send(data(1, grpc(b"hi"), end_stream=True))
    assert loop.response(1).status == OK


@pytest.mark.parametrize(
    "interruption",
    [ping(), data(1, grpc(b"x")), settings_frame(), frame(PRIORITY, 0, 1, bytes(5)), frame(0xFA, 0, 0, b"")],
    ids=["PING", "DATA", "SETTINGS", "PRIORITY", "unknown"],
)
async def test_a_frame_interrupting_a_header_block_is_a_connection_error(interruption: bytes) -> None:
    loop, recorder = echo_loop()
    block = loop.requests.block(ECHO)
    loop.send(frame(HEADERS, 0, 1, block[:5]) + interruption + frame(CONTINUATION, END_HEADERS, 1, block[5:]))
    await connection_error(loop, PROTOCOL_ERROR)
    assert not recorder.calls


async def test_a_continuation_for_another_stream_is_a_connection_error() -> None:
    loop, _ = echo_loop()
    block = loop.requests.block(ECHO)
    loop.send(frame(HEADERS, 0, 1, block[:5]) + frame(CONTINUATION, END_HEADERS, 3, block[5:]))
    await connection_error(loop, PROTOCOL_ERROR)


async def test_a_continuation_without_headers_is_a_connection_error() -> None:
    loop, _ = echo_loop()
    loop.send(frame(CONTINUATION, END_HEADERS, 1, b"\x82"))
    await connection_error(loop, PROTOCOL_ERROR)


async def test_an_even_stream_id_is_a_connection_error_and_cancels_the_open_calls() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.open(2, ECHO)
    last, _, reason = await connection_error(loop, PROTOCOL_ERROR)
    assert last == 1 and b"stream 2" in reason
    assert recorder.by_id(1).events == [("cancel", b"")]


async def test_a_lower_stream_id_than_one_already_opened_is_a_connection_error() -> None:
    loop, _recorder = echo_loop()
    loop.open(5, ECHO)
    loop.open(3, ECHO)
    await connection_error(loop, PROTOCOL_ERROR)


async def test_reopening_a_finished_stream_is_a_connection_error() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.send(data(1, grpc(b"a"), end_stream=True))
    assert loop.response(1).status == OK
    loop.open(1, ECHO)  # the same id again, as a new request
    await connection_error(loop, PROTOCOL_ERROR)
    assert len(recorder.calls) == 1


async def test_late_trailers_of_a_stream_we_ended_are_ignored() -> None:
    # We may end a stream (trailers, RST_STREAM NO_ERROR) while the client's trailers are on their way.
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    recorder.by_id(1).finish()
    loop.send(headers_frames(1, loop.requests.trailers(), end_stream=True) + data(1, grpc(b"late"), end_stream=True))
    assert loop.peer.goaway is None
    loop.open(3, ECHO)
    loop.send(data(3, grpc(b"b"), end_stream=True))
    assert loop.response(3).messages == [b"b"]


@pytest.mark.parametrize("stream_id", [0, 9])
async def test_data_on_a_stream_never_opened_is_a_connection_error(stream_id: int) -> None:
    loop, _ = echo_loop()
    loop.open(1, ECHO)
    loop.send(data(stream_id, grpc(b"x")))
    await connection_error(loop, PROTOCOL_ERROR)


async def test_data_after_the_client_half_closed_resets_the_stream() -> None:
    loop, recorder = echo_loop()
    recorder.answer = False
    loop.open(1, ECHO, end_stream=True)
    loop.send(data(1, grpc(b"x")))
    assert loop.response(1).reset == STREAM_CLOSED
    assert recorder.by_id(1).events == [("half_close", b""), ("cancel", b"")]
    assert loop.peer.goaway is None


async def test_push_promise_from_a_client_is_a_connection_error() -> None:
    loop, _ = echo_loop()
    loop.open(1, ECHO)
    loop.send(frame(PUSH_PROMISE, END_HEADERS, 1, struct.pack(">I", 2) + b"\x82"))
    await connection_error(loop, PROTOCOL_ERROR)


async def test_a_frame_over_our_max_frame_size_is_a_connection_error_as_soon_as_its_header_arrives() -> None:
    loop, _ = echo_loop()
    loop.open(1, ECHO)
    loop.send(struct.pack(">IBI", ((1 << 20) + 1) << 8 | DATA, 0, 1))  # the header alone: 1 MiB + 1 announced
    await connection_error(loop, FRAME_SIZE_ERROR)


async def test_a_whole_frame_over_our_max_frame_size_is_a_connection_error_even_for_an_echoing_stream() -> None:
    # The peer may take big frames (16 MiB): an oversized request frame is still refused, not echoed in C.
    loop, _ = echo_loop(initial_window=MAX_WINDOW, max_frame=(1 << 24) - 1)
    loop.send(window_update(0, MAX_WINDOW - 65_535))
    loop.open(1, PATH)
    loop.send(data(1, grpc(chunk_message(b"first"))))
    loop.send(data(1, grpc(chunk_message(fill(1 << 20)))))
    await connection_error(loop, FRAME_SIZE_ERROR)


async def test_a_window_update_of_zero_on_the_connection_is_a_connection_error() -> None:
    loop, _ = echo_loop()
    loop.send(window_update(0, 0))
    await connection_error(loop, PROTOCOL_ERROR)


async def test_a_window_update_of_zero_on_a_stream_resets_that_stream() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.open(3, ECHO)
    loop.send(window_update(1, 0))
    assert loop.response(1).reset == PROTOCOL_ERROR
    assert recorder.by_id(1).events == [("cancel", b"")]
    loop.send(data(3, grpc(b"x"), end_stream=True))  # the connection goes on
    assert loop.response(3).messages == [b"x"]


async def test_a_window_over_2_31_is_a_flow_control_error() -> None:
    loop, _ = echo_loop()
    loop.send(window_update(0, MAX_WINDOW))
    await connection_error(loop, FLOW_CONTROL_ERROR)


async def test_a_stream_window_over_2_31_resets_that_stream() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.send(window_update(1, MAX_WINDOW))
    assert loop.response(1).reset == FLOW_CONTROL_ERROR
    assert recorder.by_id(1).events == [("cancel", b"")]
    assert loop.peer.goaway is None


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (settings_frame((INITIAL_WINDOW_SIZE, MAX_WINDOW + 1)), FLOW_CONTROL_ERROR),
        (settings_frame((MAX_FRAME_SIZE, 16_383)), PROTOCOL_ERROR),
        (settings_frame((MAX_FRAME_SIZE, 1 << 24)), PROTOCOL_ERROR),
        (settings_frame((ENABLE_PUSH, 2)), PROTOCOL_ERROR),
        (frame(SETTINGS, 0, 0, b"\x00\x04\x00\x00\x00"), FRAME_SIZE_ERROR),
        (frame(SETTINGS, 0, 1, b""), PROTOCOL_ERROR),
        (frame(SETTINGS, 1, 0, b"\x00\x04\x00\x00\x00\x01"), FRAME_SIZE_ERROR),
        (frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
        (frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
        (frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), FRAME_SIZE_ERROR),
        (frame(RST_STREAM, 0, 0, bytes(4)), PROTOCOL_ERROR),
        (frame(RST_STREAM, 0, 1, bytes(3)), FRAME_SIZE_ERROR),
        (rst_stream(11), PROTOCOL_ERROR),  # a stream never opened
        (frame(GOAWAY, 0, 1, bytes(8)), PROTOCOL_ERROR),
        (frame(HEADERS, END_HEADERS, 0, b"\x82"), PROTOCOL_ERROR),
        (frame(HEADERS, END_HEADERS | 0x8, 3, b"\x05\x82"), PROTOCOL_ERROR),  # padding longer than the frame
        (frame(HEADERS, END_HEADERS | 0x28, 3, b"\x01" + bytes(5)), PROTOCOL_ERROR),  # padding eats the priority
        (frame(HEADERS, END_HEADERS | 0x20, 3, bytes(4)), FRAME_SIZE_ERROR),  # no room for the priority fields
        (frame(DATA, 0x8, 1, b"\x04abc"), PROTOCOL_ERROR),
        (frame(DATA, 0x8, 1, b""), PROTOCOL_ERROR),
        (frame(HEADERS, END_HEADERS, 3, b"\xfe"), 0x9),  # a table index that does not exist: COMPRESSION_ERROR
        (frame(HEADERS, END_HEADERS, 3, b"\x3f\xe1\x3f"), 0x9),  # a table size over what we allow
    ],
    ids=lambda value: value.hex()[:28] if isinstance(value, bytes) else str(value),
)
async def test_each_malformed_frame_gets_its_connection_error(bad: bytes, code: int) -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    with no_errors_logged():
        loop.send(bad)
        await connection_error(loop, code)
    assert recorder.by_id(1).events == [("cancel", b"")]


async def test_goaway_from_the_client_lets_open_streams_finish_and_refuses_new_ones() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.send(goaway(1))
    loop.open(3, ECHO)
    assert loop.response(3).reset == REFUSED_STREAM
    loop.send(data(1, grpc(b"x"), end_stream=True))
    assert loop.response(1).messages == [b"x"] and loop.response(1).status == OK
    assert [c.stream.id for c in recorder.calls] == [1]


async def test_a_bad_preface_closes_the_connection_and_says_so() -> None:
    seen: list[bytes] = []
    connection = Connection({}, max_message=100, on_bad_preface=lambda c, head: seen.append(head))
    transport = FakeTransport(connection)
    connection.connection_made(transport)
    connection.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert transport.closed
    assert seen == [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]


# -- gRPC -----------------------------------------------------------------------------------------------


async def test_an_unknown_method_is_answered_unimplemented_trailers_only() -> None:
    loop, _ = echo_loop()
    frames = loop.open(1, "/no.Such/Method")
    response = loop.response(1)
    assert [f.kind for f in frames] == [HEADERS, RST_STREAM]
    assert frames[0].flags & END_STREAM
    assert response.headers is not None and response.headers[b":status"] == b"200"
    assert response.headers[b"content-type"] == b"application/grpc"
    assert response.status == UNIMPLEMENTED and "/no.Such/Method" in response.message
    assert response.reset_after_trailers  # RST_STREAM(NO_ERROR): the client need not send the rest
    loop.send(data(1, grpc(b"ignored"), end_stream=True))  # what was on its way is dropped quietly
    assert loop.peer.goaway is None


async def test_a_long_error_message_still_fits_the_peer_s_frame_size() -> None:
    loop, _ = echo_loop()
    loop.open(1, "/" + "x" * 40_000)  # the path goes into grpc-message
    response = loop.response(1)
    assert response.status == UNIMPLEMENTED


async def test_grpc_message_is_percent_encoded() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    recorder.by_id(1).finish(INTERNAL, "100% über\nbroken")
    await loop.settle()
    assert loop.response(1).trailers[b"grpc-message"] == b"100%25 %C3%BCber%0Abroken"  # type: ignore[index]


async def test_grpc_encoding_is_refused_with_unimplemented() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO, extra=[("grpc-encoding", "gzip")])
    assert loop.response(1).status == UNIMPLEMENTED
    assert not recorder.calls
    loop.open(3, ECHO, extra=[("grpc-encoding", "identity")])
    assert recorder.by_id(3)


@pytest.mark.parametrize("split", [False, True])
async def test_a_compressed_message_is_unimplemented_and_cancels_the_call(split: bool) -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    message = grpc(b"hello", compressed=True)
    loop.send(data(1, message[:3]) + data(1, message[3:]) if split else data(1, message))
    assert loop.response(1).status == UNIMPLEMENTED
    assert recorder.by_id(1).events == [("cancel", b"")]
    assert 1 not in loop.connection.streams


@pytest.mark.parametrize("split", [False, True])
async def test_a_message_over_the_limit_is_resource_exhausted_and_cancels_the_call(split: bool) -> None:
    loop, recorder = echo_loop(max_message=1000)
    loop.open(1, ECHO)
    loop.send(data(1, grpc(b"x" * 1000)))  # at the limit: fine
    message = grpc(b"x" * 1001)
    loop.send(data(1, message[:500]) + data(1, message[500:]) if split else data(1, message))
    response = loop.response(1)
    assert response.messages == [b"x" * 1000]
    assert response.status == RESOURCE_EXHAUSTED and "1001" in response.message
    assert recorder.by_id(1).events == [("message", b"x" * 1000), ("cancel", b"")]


async def test_a_message_over_the_limit_is_refused_from_its_prefix_alone() -> None:
    loop, recorder = echo_loop(max_message=1000)
    loop.open(1, ECHO)
    loop.send(data(1, struct.pack(">BI", 0, 1 << 30) + b"x" * 100))  # says 1 GiB is coming
    assert loop.response(1).status == RESOURCE_EXHAUSTED
    assert recorder.by_id(1).events == [("cancel", b"")]


async def test_rst_stream_from_the_client_cancels_the_call_and_later_frames_are_dropped() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.open(3, ECHO)
    loop.send(data(1, grpc(b"a")) + rst_stream(1))
    assert recorder.by_id(1).events == [("message", b"a"), ("cancel", b"")]
    assert 1 not in loop.connection.streams
    recorder.by_id(1).stream.send(b"after the reset")  # a call that answers late: nothing is written
    loop.send(data(1, grpc(b"late")) + window_update(1, 100))
    assert loop.response(1).messages == [b"a"]
    loop.send(data(3, grpc(b"b"), end_stream=True))
    assert loop.response(3).messages == [b"b"]  # the other stream is untouched


async def test_a_reset_stream_with_answers_waiting_sends_none_of_them() -> None:
    loop, _recorder = echo_loop(initial_window=10)
    loop.open(1, ECHO)
    loop.send(data(1, grpc(fill(100))) + rst_stream(1) + window_update(1, 1000))
    assert sum(len(f.payload) for f in loop.peer.frames if f.kind == DATA) == 10
    assert not loop.connection._blocked


async def test_the_connection_dropping_mid_stream_cancels_every_call() -> None:
    loop, recorder = echo_loop(initial_window=10)
    for stream_id in (1, 3, 5):
        loop.open(stream_id, ECHO)
        loop.send(data(stream_id, grpc(fill(100))))
    loop.send(data(5, b"", end_stream=True))  # 5 has finished, its trailers wait behind its data
    loop.transport.lose(ConnectionResetError())
    assert [c.events[-1] for c in recorder.calls] == [("cancel", b"")] * 3
    assert all(c.cancelled == 1 for c in recorder.calls)
    assert not loop.connection.streams


async def test_end_stream_inside_a_message_is_internal_and_cancels_the_call() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.send(data(1, grpc(b"hello")[:4], end_stream=True))
    response = loop.response(1)
    assert response.status == INTERNAL
    assert recorder.by_id(1).events == [("cancel", b"")]
    assert 1 not in loop.connection.streams


async def test_trailers_inside_a_message_are_internal_and_cancel_the_call() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.send(data(1, grpc(b"hello")[:4]) + headers_frames(1, loop.requests.trailers(), end_stream=True))
    assert loop.response(1).status == INTERNAL
    assert recorder.by_id(1).events == [("cancel", b"")]


async def test_client_trailers_half_close_the_call() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    loop.send(data(1, grpc(b"a")) + headers_frames(1, loop.requests.trailers(), end_stream=True))
    assert recorder.by_id(1).events == [("message", b"a"), ("half_close", b"")]
    assert loop.response(1).status == OK


async def test_trailers_after_end_stream_reset_the_stream_and_the_call_half_closes_once() -> None:
    loop, recorder = echo_loop()
    recorder.answer = False  # the call goes on after the half-close
    loop.open(1, ECHO)
    loop.send(data(1, grpc(b"a"), end_stream=True))
    loop.send(headers_frames(1, loop.requests.trailers(), end_stream=True))
    assert loop.response(1).reset == STREAM_CLOSED
    assert recorder.by_id(1).events == [("message", b"a"), ("half_close", b""), ("cancel", b"")]
    assert loop.peer.goaway is None


async def test_a_stream_reset_for_data_after_end_stream_sends_none_of_its_waiting_answers() -> None:
    loop, recorder = echo_loop(initial_window=1 << 20)
    recorder.answer = False
    loop.open(1, ECHO, end_stream=True)
    recorder.by_id(1).stream.send(fill(70_000))  # 65,535 bytes go (the connection's window), the rest waits
    await loop.settle()
    loop.send(data(1, grpc(b"x")))  # DATA after the client's END_STREAM: the stream is reset
    assert loop.response(1).reset == STREAM_CLOSED
    loop.send(window_update(0, 10_000))  # the Peer fails on any DATA after the reset
    assert sum(len(f.payload) for f in loop.peer.frames if f.kind == DATA) == 65_535


async def test_a_second_header_block_without_end_stream_is_a_connection_error() -> None:
    loop, _ = echo_loop()
    loop.open(1, ECHO)
    loop.send(headers_frames(1, loop.requests.trailers()))
    await connection_error(loop, PROTOCOL_ERROR)


async def test_messages_after_the_call_finished_do_not_reach_it() -> None:
    # The call ended while its answer waits for the window: what the client still sends is dropped.
    loop, recorder = echo_loop(initial_window=10)
    loop.open(1, ECHO)
    loop.send(data(1, grpc(fill(100))))
    recorder.by_id(1).finish()
    loop.send(data(1, grpc(b"more")) + data(1, grpc(b"and more"), end_stream=True))
    assert recorder.by_id(1).events == [("message", fill(100))]
    loop.send(window_update(1, 1000))
    assert loop.response(1).messages == [fill(100)]
    assert loop.response(1).status == OK
    assert not loop.response(1).reset_after_trailers  # the client had half-closed: no reset needed


async def test_a_handler_that_fails_to_start_gets_internal_and_the_connection_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(stream: Stream) -> RecordingCall:
        raise RuntimeError("boom")

    loop = Loopback({"/broken": broken, ECHO: Recorder()})
    loop.open(1, "/broken")
    assert loop.response(1).status == INTERNAL
    loop.open(3, ECHO)
    loop.send(data(3, grpc(b"x"), end_stream=True))
    assert loop.response(3).messages == [b"x"]
    assert "boom" in caplog.text


async def test_a_call_that_answers_outside_a_read_is_written_soon_in_one_write() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    stream = recorder.by_id(1).stream
    writes = loop.transport.writes
    stream.send(b"one")
    stream.send(b"two")
    stream.finish()
    assert loop.pump() == []  # nothing yet: the write happens on the loop's next turn
    await loop.settle()
    assert loop.transport.writes == writes + 1
    assert loop.response(1).messages == [b"one", b"two"] and loop.response(1).status == OK


async def test_send_all_outside_a_read_writes_at_once_and_leaves_the_loop_nothing_to_do() -> None:
    # The routing task's answers: sent one by one, each would schedule a flush for the loop's next
    # turn, which the explicit flush after them did not take back (a turn of the loop for nothing).
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    stream = recorder.by_id(1).stream
    await loop.settle()  # (what opening it scheduled)
    writes = loop.transport.writes
    stream.send_all([b"one", b"two"], end=True)
    assert loop.transport.writes == writes + 1  # one write, now
    assert not stream._connection.flush_scheduled
    ready = asyncio.get_running_loop()._ready  # type: ignore[attr-defined]  # (asyncio's loop: these tests')
    assert not ready, f"scheduled for the loop's next turn: {list(ready)}"
    loop.pump()
    assert loop.response(1).messages == [b"one", b"two"] and loop.response(1).status == OK


async def test_send_all_inside_a_read_waits_for_the_end_of_the_read() -> None:
    # A route that did not wait answers in the read of its request (epp.requestcontrol.stepping): two
    # such calls in one read are written together, once, when the read ends, not once each.
    def answer_now(call: RecordingCall, data: bytes) -> bool:
        call.stream.send_all([b"routed " + data], end=True)
        return True

    loop = Loopback({ECHO: Recorder(answer_now)})
    requests = loop.requests
    both = requests.open(1, ECHO) + data(1, grpc(b"a")) + requests.open(3, ECHO) + data(3, grpc(b"b"))
    writes = loop.transport.writes
    loop.send(both)
    assert loop.transport.writes == writes + 1
    assert not loop.connection.flush_scheduled
    assert loop.response(1).messages == [b"routed a"] and loop.response(1).status == OK
    assert loop.response(3).messages == [b"routed b"] and loop.response(3).status == OK


# -- fuzzing ----------------------------------------------------------------------------------------------


_ACTIONS = st.sampled_from(
    ["open", "open", "data", "data", "data", "chunk", "chunk", "end", "trailers", "rst", "window", "window",
     "settings", "ping", "priority", "unknown", "goaway", "bad"]
)  # fmt: skip


@st.composite
def _frames(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """A valid-ish client byte stream: mostly right, with now and then a frame a client must not send."""
    requests = Requests()
    out = PREFACE + settings_frame(
        (INITIAL_WINDOW_SIZE, draw(st.sampled_from([0, 1, 100, 65_535, 1 << 20]))),
        (MAX_FRAME_SIZE, draw(st.sampled_from([16_384, 1 << 20]))),
    )
    opened: list[int] = []
    next_id = 1
    paths = st.sampled_from([ECHO, ECHO, PATH, "/unknown"])
    for _ in range(draw(st.integers(1, 25))):
        action = "open" if not opened else draw(_ACTIONS)
        if action == "bad" and draw(st.integers(0, 3)):  # one frame in ~60 is one a client must not send
            action = "ping"
        stream_id = draw(st.sampled_from(opened)) if opened else 1
        if action == "open":
            out += requests.open(
                next_id,
                draw(paths),
                end_stream=draw(st.booleans()),
                pieces=draw(st.integers(1, 3)),
                pad=draw(st.none() | st.integers(0, 20)),
                priority=draw(st.booleans()),
            )
            opened.append(next_id)
            next_id += 2
        elif action == "data":
            message = grpc(draw(st.binary(max_size=300)))
            cut = draw(st.integers(0, len(message)))
            pad = draw(st.none() | st.integers(0, 10))
            out += data(stream_id, message[:cut], pad=pad) + data(
                stream_id, message[cut:], end_stream=draw(st.booleans())
            )
        elif action == "chunk":
            out += data(
                stream_id, grpc(chunk_message(draw(st.binary(max_size=200)), end_of_stream=draw(st.booleans())))
            )
        elif action == "end":
            out += data(stream_id, b"", end_stream=True)
        elif action == "trailers":
            out += headers_frames(stream_id, requests.trailers(), end_stream=True)
        elif action == "rst":
            out += rst_stream(stream_id)
        elif action == "window":
            out += window_update(draw(st.sampled_from([0, stream_id])), draw(st.integers(1, 1 << 20)))
        elif action == "settings":
            out += settings_frame((INITIAL_WINDOW_SIZE, draw(st.integers(0, 1 << 20))))
        elif action == "ping":
            out += ping()
        elif action == "priority":
            out += frame(PRIORITY, 0, stream_id, bytes(5))
        elif action == "unknown":
            out += frame(draw(st.integers(10, 255)), draw(st.integers(0, 255)), stream_id, draw(st.binary(max_size=20)))
        elif action == "goaway":
            out += goaway(next_id - 2 if next_id > 1 else 0)
        else:
            out += draw(
                st.sampled_from(
                    [
                        window_update(stream_id, 0),
                        frame(HEADERS, END_HEADERS, next_id + 1, b"\x82"),  # an even id
                        data(next_id + 40, b"x"),  # never opened
                        frame(CONTINUATION, END_HEADERS, stream_id, b"\x82"),
                        frame(PING, 0, 0, b"short"),
                        settings_frame((MAX_FRAME_SIZE, 5)),
                        frame(DATA, 0x8, stream_id, b"\xff"),
                        window_update(0, MAX_WINDOW),
                    ]
                )
            )
    cuts = draw(st.lists(st.integers(1, len(out) - 1), max_size=8))
    return out, cuts


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(stream=_frames(), answer=st.booleans(), grant=st.booleans())
async def test_fuzz_frame_sequences_raise_nothing_and_end_every_stream_exactly_once(
    stream: tuple[bytes, list[int]], answer: bool, grant: bool
) -> None:
    out, cuts = stream
    recorder = Recorder(answer=answer)
    echoes: list[BodyEcho] = []

    def ext_proc(wire: Stream) -> BodyEcho:
        echoes.append(BodyEcho(wire))
        return echoes[-1]

    with no_errors_logged():
        loop = Loopback({ECHO: recorder, PATH: ext_proc}, preface=False)
        loop.send(out, cuts)  # the Peer raises on anything a strict client would reject
        if grant and not loop.transport.closed:  # open every window: everything waiting goes out
            loop.send(settings_frame((INITIAL_WINDOW_SIZE, 1 << 24)) + window_update(0, 1 << 30))
        await loop.settle()
        ended_by_server = loop.transport.closed
        loop.transport.lose()  # the client goes away
        await loop.settle()
    event("the server closed the connection" if ended_by_server else "the connection stayed open")
    event(f"calls: {min(len(recorder.calls) + len(echoes), 5)}")
    event(f"finished by the call: {min(sum(c.finished for c in recorder.calls), 3)}")
    for call in recorder.calls:
        assert call.cancelled <= 1, f"stream {call.stream.id} cancelled {call.cancelled} times"
        assert call.finished or call.cancelled, f"stream {call.stream.id} never ended"
        response = loop.peer.streams.get(call.stream.id)
        if grant and not ended_by_server and call.finished and not call.cancelled:
            assert response is not None and response.trailers is not None, (
                f"stream {call.stream.id}'s trailers never sent"
            )
    for echo in echoes:
        assert echo.cancelled or echo.stream.ended
    assert not loop.connection.streams


_GARBAGE_FRAME = st.builds(
    frame,
    st.integers(0, 12),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]),
    st.binary(max_size=40),
)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    garbage=st.one_of(
        st.binary(min_size=1, max_size=200), st.lists(_GARBAGE_FRAME, min_size=1, max_size=12).map(b"".join)
    ),
    cuts=st.lists(st.integers(1, 480), max_size=4),
)
async def test_garbage_after_the_preface_never_raises_and_ends_in_a_goaway_or_a_wait(
    garbage: bytes, cuts: list[int]
) -> None:
    with no_errors_logged():
        loop, recorder = echo_loop()
        loop.open(1, ECHO)
        loop.send(data(1, grpc(b"before")))
        loop.send(garbage, cuts)  # nothing escapes data_received; what the server wrote is still HTTP/2 a client reads
        await loop.settle()
        if loop.transport.closed:
            assert loop.peer.goaway is not None  # a connection error, said
        loop.transport.lose()
        await loop.settle()
    assert all(c.cancelled <= 1 for c in recorder.calls)
    assert not loop.connection.streams


# -- work after the answers (Connection.after_write) --------------------------------------------------------


async def test_work_after_the_answers_runs_once_the_read_s_one_write_is_made_in_order() -> None:
    seen: list[tuple[str, int]] = []

    def answer_then_defer(call: RecordingCall, message: bytes) -> bool:
        call.stream.send(message)
        call.stream.after_write(lambda: seen.append((message.decode(), loop.transport.writes)))
        return True

    recorder = Recorder(answer_then_defer)
    loop = Loopback({ECHO: recorder})
    loop.open(1, ECHO)
    loop.open(3, ECHO)
    writes = loop.transport.writes
    # Two streams' messages in one read: both answers leave in its one write, then the work runs, in order.
    loop.send(data(1, grpc(b"a")) + data(3, grpc(b"b")))
    assert seen == [("a", writes + 1), ("b", writes + 1)]
    assert loop.response(1).messages == [b"a"] and loop.response(3).messages == [b"b"]
    assert not loop.connection.after_pending


async def test_work_after_the_answers_outside_a_read_writes_what_waits_then_runs_at_once() -> None:
    loop, recorder = echo_loop()
    loop.open(1, ECHO)
    stream = recorder.by_id(1).stream
    stream.send(b"later")  # outside a read: its write is scheduled, not made
    writes = loop.transport.writes
    ran: list[int] = []
    stream.after_write(lambda: ran.append(loop.transport.writes))
    assert ran == [writes + 1]
    loop.pump()
    assert loop.response(1).messages == [b"later"]


async def test_work_after_the_answers_that_fails_is_logged_and_the_rest_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def defer(call: RecordingCall, message: bytes) -> bool:
        call.stream.send(message)
        if message == b"bad":
            call.stream.after_write(lambda: 1 / 0)
        call.stream.after_write(lambda: ran.append(message.decode()))
        return True

    loop = Loopback({ECHO: Recorder(defer)})
    loop.open(1, ECHO)
    with caplog.at_level(logging.ERROR, logger="epp.wire"):
        loop.send(data(1, grpc(b"bad")) + data(1, grpc(b"good")))
    assert ran == ["bad", "good"]
    assert loop.response(1).messages == [b"bad", b"good"]
    assert any("work after the answers" in r.getMessage() for r in caplog.records)
    loop.send(data(1, grpc(b"next")))  # the connection reads on
    assert ran == ["bad", "good", "next"]


async def test_work_after_the_answers_of_a_read_that_breaks_the_protocol_still_runs() -> None:
    ran: list[bytes] = []

    def defer(call: RecordingCall, message: bytes) -> bool:
        call.stream.after_write(lambda: ran.append(message))
        return True

    loop = Loopback({ECHO: Recorder(defer)})
    loop.open(1, ECHO)
    loop.send(data(1, grpc(b"a")) + data(2, grpc(b"b")))  # an even stream id: a connection error
    await connection_error(loop, PROTOCOL_ERROR)
    assert ran == [b"a"]


# -- header blocks read again (Connection._decode keeps what a block that changed no table decoded to) -------

_NAMES = st.sampled_from([b":path", b":authority", b"content-type", b"te", b"x-envoy-internal", b"x-forwarded-for", b"x-a"])
_FIELD = st.tuples(_NAMES, st.sampled_from([b"", b"trailers", b"epp", b"application/grpc", b"/a/B", b"true", b"v" * 90]))
_STEP = st.one_of(
    st.tuples(st.just("encode"), st.lists(st.tuples(_FIELD, st.booleans()), max_size=6)),  # (field, never indexed)
    st.tuples(st.just("again"), st.integers(0, 50)),  # a block sent before, sent again as it was (Envoy's way)
    st.tuples(st.just("size"), st.sampled_from([0, 64, 200, 4096])),  # a table size update in the next block
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_STEP, max_size=25))
def test_header_blocks_read_again_decode_as_hpack_decodes_them_in_step(steps: list[tuple[str, Any]]) -> None:
    connection = Connection({}, max_message=1 << 20)
    reference = hpack.Decoder()
    encoder = hpack.Encoder()
    sent: list[bytes] = []
    for kind, value in steps:
        if kind == "again":
            if not sent:
                continue
            block = sent[value % len(sent)]
        else:
            if kind == "size":
                encoder.header_table_size = value
                fields: list[Any] = [(b":path", b"/x")]
            else:
                fields = [hpack.NeverIndexedHeaderTuple(*f) if never else f for f, never in value]
            block = encoder.encode(fields)
            sent.append(block)
        try:
            expected = [tuple(field) for field in reference.decode(block, raw=True)]
        except hpack.HPACKError:  # (an old block naming an entry since evicted): both refuse it, and stop here
            with pytest.raises(_ConnectionError):
                connection._decode(block)
            return
        assert [tuple(field) for field in connection._decode(block)] == expected
