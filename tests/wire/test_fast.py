"""epp.wire._fast: the C read path's echo of ext_proc response body chunks.

The C path must be invisible but for its cost: its answer is byte-for-byte what upb serializes, it
takes only the messages it can answer exactly (everything else reaches the call, in order), and its
tally and windows agree with what Python would have kept.
"""

from __future__ import annotations

from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.wire._fast import StreamBase, echo_answer
from epp.wire.http2 import Connection, Stream
from tests.wire.rawh2 import (
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    PATH,
    WINDOW_UPDATE,
    BodyEcho,
    BodyWatch,
    Frame,
    Loopback,
    chunk_message,
    data,
    fill,
    grpc,
    observed_message,
    upb_answer,
    window_update,
)
from tests.wire.rawh2 import (
    settings as settings_frame,
)

# Each level of the answer (StreamedBodyResponse, BodyMutation, CommonResponse, BodyResponse,
# ProcessingResponse) adds a tag and a length varint: a chunk size near a varint boundary puts one
# of the five lengths on either side of it.
BOUNDARIES = (1 << 7, 1 << 14, 1 << 21)
NEAR_BOUNDARIES = sorted({n for b in BOUNDARIES for n in range(b - 24, b + 9)})


class Counting(Connection):
    """A connection that counts the frames its C loop hands to Python."""

    python_frames = 0

    def _frame(self, data: bytes, position: int) -> int:
        self.python_frames += 1
        return super()._frame(data, position)


class EchoSetup:
    """One connection with one ext_proc-like stream (id 1) on it."""

    def __init__(self, *, echo: bool = True, **options: Any) -> None:
        self.calls: list[BodyEcho] = []

        def handler(stream: Stream) -> BodyEcho:
            call = BodyEcho(stream, echo=echo)
            self.calls.append(call)
            return call

        self.loop = Loopback({PATH: handler}, connection_class=Counting, **options)
        self.loop.open(1, PATH)
        (self.call,) = self.calls
        self.stream = self.loop.connection.streams[1]

    def chunk(self, chunk: bytes, **options: Any) -> list[Frame]:
        return self.loop.send(data(1, grpc(chunk_message(chunk, **options))))

    @property
    def answers(self) -> list[bytes]:
        return self.loop.response(1).messages


# -- the answer's bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", NEAR_BOUNDARIES)
def test_the_echo_answer_is_upbs_serialization_at_every_varint_boundary(size: int) -> None:
    chunk = fill(size)
    assert echo_answer(chunk) == upb_answer(chunk)


@settings(max_examples=300, deadline=None)
@given(size=st.one_of(st.sampled_from(NEAR_BOUNDARIES), st.integers(1, 70_000)), seed=st.binary(min_size=1, max_size=9))
def test_the_echo_answer_is_upbs_serialization(size: int, seed: bytes) -> None:
    chunk = fill(size, seed)
    assert echo_answer(chunk) == upb_answer(chunk)


@settings(max_examples=60, deadline=None)
@given(size=st.one_of(st.sampled_from([n for n in NEAR_BOUNDARIES if n < 1 << 20]), st.integers(1, (1 << 20) - 64)))
async def test_a_chunk_echoed_on_the_wire_is_upbs_answer_in_one_frame(size: int) -> None:
    # The peer takes frames of up to 16 MiB and opens its windows wide: every middle chunk is C's.
    setup = EchoSetup(initial_window=2**31 - 1, max_frame=2**24 - 1)
    setup.loop.send(window_update(0, 2**31 - 1 - 65_535))
    setup.chunk(b"first")
    chunk = fill(size, bytes((size % 251,)))
    frames = setup.chunk(chunk)
    assert len(setup.call.seen) == 1  # C answered
    answer = upb_answer(chunk)
    (reply,) = [f for f in frames if f.kind == 0]
    assert reply.payload == grpc(answer)  # the frame's payload: the gRPC prefix and upb's bytes
    assert setup.answers == [upb_answer(b"first"), answer]


def test_an_empty_chunk_is_never_echoed_because_upb_omits_the_empty_body() -> None:
    # echo_answer(b"") would carry an explicit empty body field, which upb leaves out: C must not take it.
    assert echo_answer(b"") != upb_answer(b"")


# -- what C takes, what reaches the call ---------------------------------------------------------------


async def test_an_envoy_stream_s_middle_chunks_are_answered_in_c_and_tallied() -> None:
    setup = EchoSetup()
    chunks = [f"data: {{'token': {i}}}\n\n".encode() for i in range(20)]
    setup.chunk(chunks[0])  # the first chunk: Python's (the response-start signal), which turns the echo on
    assert setup.stream.echo == 1
    middle = b"".join(data(1, grpc(chunk_message(c))) for c in chunks[1:])
    writes = setup.loop.transport.writes
    setup.loop.send(middle)
    assert len(setup.call.seen) == 1  # the call never saw the middle chunks
    assert setup.loop.transport.writes == writes + 1  # one read, one write of all their answers
    assert setup.stream.response_chunks == 20
    assert setup.stream.response_bytes == sum(map(len, chunks))
    assert setup.stream.tail() == chunks[-4:]
    setup.chunk(b"data: [DONE]\n\n", end_of_stream=True)  # the last chunk: Python's (end_of_stream, usage)
    assert [m.response_body.body for m in setup.call.seen] == [chunks[0], b"data: [DONE]\n\n"]
    assert setup.stream.tail() == [*chunks[-3:], b"data: [DONE]\n\n"]
    assert setup.answers == [upb_answer(c) for c in chunks] + [upb_answer(b"data: [DONE]\n\n", True)]
    assert setup.loop.response(1).status == 0


async def test_the_c_loop_hands_python_no_frame_for_a_read_of_middle_chunks() -> None:
    setup = EchoSetup()
    setup.chunk(b"first")
    connection = setup.loop.connection
    assert isinstance(connection, Counting)
    before = connection.python_frames
    setup.loop.send(b"".join(data(1, grpc(chunk_message(b"x" * i))) for i in range(1, 50)))
    assert connection.python_frames == before
    assert len(setup.call.seen) == 1


async def test_a_message_with_attributes_or_protocol_config_is_still_echoed() -> None:
    # Fields the response phase does not read (metadata_context, attributes, protocol_config) do not stop C.
    message = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"abc"))
    message.metadata_context.SetInParent()
    message.attributes["envoy.filters.http.ext_proc"].SetInParent()
    message.protocol_config.SetInParent()
    setup = EchoSetup()
    setup.chunk(b"first")
    setup.loop.send(data(1, grpc(message.SerializeToString())))
    assert len(setup.call.seen) == 1
    assert setup.answers[-1] == upb_answer(b"abc")


def _unknown_field(chunk: bytes) -> bytes:
    return chunk_message(chunk) + b"\x98\x06\x01"  # field 99, a varint: unknown to the protocol today


async def test_an_observed_stream_s_middle_chunks_are_taken_in_c_and_never_answered() -> None:
    calls: list[BodyWatch] = []
    loop = Loopback({PATH: lambda stream: calls.append(BodyWatch(stream)) or calls[-1]}, connection_class=Counting)
    loop.open(1, PATH)
    chunks = [f"data: {{'token': {i}}}\n\n".encode() for i in range(12)]
    loop.send(data(1, grpc(observed_message(chunks[0]))))  # the first: Python's
    stream = loop.connection.streams[1]
    assert stream.echo == 2
    frames = loop.send(b"".join(data(1, grpc(observed_message(c))) for c in chunks[1:]))
    assert len(calls[0].seen) == 1  # C took the middle chunks
    assert stream.response_chunks == 12 and stream.response_bytes == sum(map(len, chunks))
    assert stream.tail() == chunks[-4:]
    assert not [f for f in frames if f.kind == 0]  # and answered none (Envoy reads no answer here)
    assert loop.response(1).messages == []
    # A chunk without observability_mode on an observed stream is not C's to take (nor the reverse:
    # NOT_FOR_C's "observability_mode" case, on an answering stream).
    loop.send(data(1, grpc(chunk_message(b"plain"))))
    assert len(calls[0].seen) == 2


def _twice(chunk: bytes) -> bytes:  # response_body twice: protobuf merges them, C must not choose
    return chunk_message(chunk, metadata=False) + chunk_message(b"", metadata=False)


NOT_FOR_C = {
    "end_of_stream": lambda c: data(1, grpc(chunk_message(c, end_of_stream=True))),
    "END_STREAM flag": lambda c: data(1, grpc(chunk_message(c)), end_stream=True),
    "empty chunk": lambda c: data(1, grpc(chunk_message(b""))),
    "unknown field": lambda c: data(1, grpc(_unknown_field(c))),
    "observability_mode": lambda c: data(1, grpc(observed_message(c))),
    "response_body twice": lambda c: data(1, grpc(_twice(c))),
    "split over frames": lambda c: data(1, grpc(chunk_message(c))[:7]) + data(1, grpc(chunk_message(c))[7:]),
    "two in one frame": lambda c: data(1, grpc(chunk_message(c)) + grpc(chunk_message(c))),
    "padded frame": lambda c: data(1, grpc(chunk_message(c)), pad=3),
    "padded frame, no padding": lambda c: data(1, grpc(chunk_message(c)), pad=0),
    "compressed flag": lambda c: data(1, grpc(chunk_message(c), compressed=True)),
    "length prefix too long": lambda c: data(1, grpc(chunk_message(c))[:-1]),
}


@pytest.mark.parametrize("case", NOT_FOR_C)
async def test_what_c_must_not_answer_reaches_python(case: str) -> None:
    setup = EchoSetup()
    setup.chunk(b"first")
    chunk = b"data: {}\n\n"
    seen = len(setup.call.seen)
    setup.loop.send(NOT_FOR_C[case](chunk))
    await setup.loop.settle()
    response = setup.loop.response(1)
    if case == "compressed flag":
        assert response.status == 12  # UNIMPLEMENTED, by the transport
        assert len(setup.call.seen) == seen
        return
    if case == "length prefix too long":
        assert len(setup.call.seen) == seen and setup.stream.buffer  # waiting for the rest of the message
        return
    assert len(setup.call.seen) > seen, "C answered a message it must leave to the call"
    expected = [upb_answer(b"first")] + [
        upb_answer(r.response_body.body, r.response_body.end_of_stream) for r in setup.call.seen[1:]
    ]
    assert setup.answers == expected


async def test_the_first_chunk_reaches_the_call() -> None:
    setup = EchoSetup()
    assert setup.stream.echo == 0
    setup.chunk(b"first")
    assert [m.response_body.body for m in setup.call.seen] == [b"first"]


async def test_a_stream_whose_echo_is_off_sees_every_chunk() -> None:
    setup = EchoSetup(echo=False)
    for i in range(5):
        setup.chunk(b"chunk %d" % i)
    assert len(setup.call.seen) == 5
    assert setup.stream.echo == 0
    assert setup.answers == [upb_answer(b"chunk %d" % i) for i in range(5)]


async def test_while_an_answer_waits_for_the_window_chunks_go_to_python_in_order_then_c_again() -> None:
    setup = EchoSetup(initial_window=60)
    setup.chunk(b"first")  # 5 + 20-odd bytes: fits
    sent = len(setup.answers)
    chunks = [fill(40, bytes((65 + i,))) for i in range(4)]
    for chunk in chunks:
        setup.chunk(chunk)
    # The stream's window ran out: the answers wait, echo is off, every chunk reached the call.
    assert setup.stream.echo == 0 and setup.stream.pending
    assert len(setup.call.seen) == 1 + len(chunks)
    assert len(setup.answers) == sent
    setup.loop.send(window_update(1, 10_000))
    assert setup.answers == [upb_answer(b"first")] + [upb_answer(c) for c in chunks]
    assert setup.stream.echo == 1  # nothing waits any more: C answers again
    setup.chunk(b"later")
    assert len(setup.call.seen) == 1 + len(chunks)
    assert setup.answers[-1] == upb_answer(b"later")


async def test_an_answer_over_the_peer_s_frame_size_is_python_s_and_split() -> None:
    setup = EchoSetup(initial_window=1 << 20)
    setup.loop.send(window_update(0, 1 << 20))
    setup.chunk(b"first")
    chunk = fill(16_384)  # its answer is over 16,384 bytes, the peer's frame size
    frames = setup.chunk(chunk)
    assert len(setup.call.seen) == 2
    assert [len(f.payload) for f in frames if f.kind == 0] == [16_384, len(grpc(upb_answer(chunk))) - 16_384]
    assert setup.answers[-1] == upb_answer(chunk)
    assert setup.stream.echo == 1  # everything went out: C may answer again


async def test_c_accounts_both_windows_as_python_does() -> None:
    setup = EchoSetup()
    setup.chunk(b"first")
    connection = setup.loop.connection
    window, stream_window = connection.window, setup.stream.window
    setup.chunk(b"abc")
    size = len(grpc(upb_answer(b"abc")))
    assert (connection.window, setup.stream.window) == (window - size, stream_window - size)
    assert setup.loop.peer.connection_window == connection.window


async def test_c_tops_our_receive_windows_up_past_half() -> None:
    setup = EchoSetup()
    setup.chunk(b"first")
    connection = setup.loop.connection
    connection.received = (1 << 30) - 10  # as if a gigabyte had arrived since the last WINDOW_UPDATE
    setup.stream.received = (1 << 30) - 10
    request = data(1, grpc(chunk_message(b"abc")))
    frames = setup.loop.send(request)
    assert len(setup.call.seen) == 1
    updates = {f.stream_id: int.from_bytes(f.payload) for f in frames if f.kind == WINDOW_UPDATE}
    assert updates == {0: (1 << 30) - 10 + len(request) - 9, 1: (1 << 30) - 10 + len(request) - 9}
    assert connection.received == 0 and setup.stream.received == 0


async def test_echo_stops_when_the_stream_ends() -> None:
    setup = EchoSetup()
    setup.chunk(b"first")
    setup.stream.finish()
    assert setup.stream.echo == 0
    assert 1 not in setup.loop.connection.streams


# -- the stream's tally --------------------------------------------------------------------------------


def test_the_tally_keeps_the_last_chunks_it_is_told_to() -> None:
    stream = StreamBase()
    assert stream.tail() == []
    for i in range(10):
        stream.tally(b"%d" % i)
    stream.tally(b"")  # an empty chunk counts for nothing
    assert (stream.response_chunks, stream.response_bytes) == (10, 10)
    assert stream.tail() == [b"6", b"7", b"8", b"9"]  # four by default
    stream.keep_tail(2)
    assert stream.tail() == []
    stream.tally(b"a")
    stream.tally(b"b")
    stream.tally(b"c")
    assert stream.tail() == [b"b", b"c"]
    stream.keep_tail(0)
    stream.tally(b"d")
    assert stream.tail() == []
    with pytest.raises(ValueError):
        stream.keep_tail(17)
    with pytest.raises(TypeError):
        stream.tally("text")  # type: ignore[arg-type]


async def test_a_peer_settings_change_of_frame_size_reaches_c() -> None:
    setup = EchoSetup(initial_window=1 << 20)
    setup.loop.send(window_update(0, 1 << 20))
    setup.chunk(b"first")
    chunk = fill(20_000)
    setup.loop.send(settings_frame((MAX_FRAME_SIZE, 1 << 16), (INITIAL_WINDOW_SIZE, 1 << 20)))
    frames = setup.chunk(chunk)
    assert len(setup.call.seen) == 1  # fits the new frame size: C's
    assert [len(f.payload) for f in frames if f.kind == 0] == [len(grpc(upb_answer(chunk)))]


async def test_a_frame_that_ends_a_split_message_is_never_taken_for_a_whole_one() -> None:
    # A chunk whose body ends with what looks like a whole framed chunk message: split just there,
    # the second frame alone reads as an echoable message. It is the first message's tail.
    tail = grpc(chunk_message(b"not a message of its own", metadata=False))
    chunk = b"binary body " + tail
    framed = grpc(chunk_message(chunk, metadata=False))
    assert framed.endswith(tail)
    setup = EchoSetup()
    setup.chunk(b"first")
    setup.loop.send(data(1, framed[: -len(tail)]))
    setup.loop.send(data(1, tail))
    assert [m.response_body.body for m in setup.call.seen] == [b"first", chunk]
    assert setup.answers == [upb_answer(b"first"), upb_answer(chunk)]
    assert setup.stream.echo == 1  # nothing buffered any more: C's again
