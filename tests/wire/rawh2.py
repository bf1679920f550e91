"""A raw HTTP/2 client for epp.wire's tests: frames built and parsed by hand, header blocks with hpack.

Why not the ``h2`` library: these tests must send what a correct client never would (a frame
interrupting a header block, even or reused stream ids, WINDOW_UPDATE of 0, bad SETTINGS, DATA on a
stream never opened), split a recorded byte stream at any offset, and see every frame the server
writes, byte for byte. h2's state machine refuses the first and hides the last, so it would be a
second protocol implementation to fight. ``hpack`` (already epp.wire's dependency) encodes and
decodes the header blocks; the frames (RFC 9113 section 4.1) are 9 bytes of header, built here.

Three pieces:

* builders (:func:`frame`, :func:`data`, :func:`settings`, :class:`Requests` ...) for the bytes a client sends;
* :class:`Peer`, the client's reading of what the server wrote: its frames, each stream's response
  (headers, gRPC messages, trailers or reset), the GOAWAY; and checks, as it reads, that the server
  kept to the client's flow-control windows and frame size and wrote nothing on a stream it had ended;
* :class:`Loopback`, a server :class:`~epp.wire.http2.Connection` driven in memory (no socket) by
  calling its ``data_received``, and :class:`Client`, the same over a real TCP (or TLS) socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import hpack
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.extproc.answers import streamed_body
from epp.wire.http2 import Connection, Handler, Stream

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9

HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 2, 3, 4, 5

MAX_WINDOW = 2**31 - 1


# -- what a client sends -------------------------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | kind, flags, stream_id) + payload


def settings(*pairs: tuple[int, int], ack: bool = False) -> bytes:
    return frame(SETTINGS, ACK if ack else 0, 0, b"".join(struct.pack(">HI", key, value) for key, value in pairs))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">I", code))


def ping(payload: bytes = b"12345678", *, ack: bool = False) -> bytes:
    return frame(PING, ACK if ack else 0, 0, payload)


def goaway(last_stream: int = 0, code: int = NO_ERROR) -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream, code))


def grpc(message: bytes, *, compressed: bool = False) -> bytes:
    """One gRPC length-prefixed message."""
    return struct.pack(">BI", 1 if compressed else 0, len(message)) + message


def data(stream_id: int, payload: bytes, *, end_stream: bool = False, pad: int | None = None) -> bytes:
    """A DATA frame; ``pad``: padded with that many zero bytes (PADDED flag)."""
    flags = END_STREAM if end_stream else 0
    if pad is not None:
        flags |= PADDED
        payload = bytes((pad,)) + payload + bytes(pad)
    return frame(DATA, flags, stream_id, payload)


class Requests:
    """Header blocks of gRPC requests, from one HPACK encoder (the connection's: its table carries over)."""

    def __init__(self) -> None:
        self.encoder = hpack.Encoder()

    def block(self, path: str, extra: Iterable[tuple[str, str]] = ()) -> bytes:
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "picker"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
        return bytes(self.encoder.encode(headers))

    def trailers(self, pairs: Iterable[tuple[str, str]] = (("x-trailer", "1"),)) -> bytes:
        return bytes(self.encoder.encode(list(pairs)))

    def open(
        self,
        stream_id: int,
        path: str,
        *,
        end_stream: bool = False,
        extra: Iterable[tuple[str, str]] = (),
        pieces: int = 1,
        pad: int | None = None,
        priority: bool = False,
    ) -> bytes:
        """HEADERS opening ``stream_id`` on ``path``; ``pieces`` > 1 splits the block into CONTINUATION frames."""
        return headers_frames(
            stream_id, self.block(path, extra), end_stream=end_stream, pieces=pieces, pad=pad, priority=priority
        )


def headers_frames(
    stream_id: int,
    block: bytes,
    *,
    end_stream: bool = False,
    pieces: int = 1,
    pad: int | None = None,
    priority: bool = False,
) -> bytes:
    """A header block as HEADERS (+ CONTINUATION frames when ``pieces`` > 1)."""
    size = -(-len(block) // pieces) if block else 0
    parts = [block[i : i + size] for i in range(0, len(block), size)] if size else [b""]
    while len(parts) < pieces:
        parts.append(b"")
    first = parts[0]
    flags = END_STREAM if end_stream else 0
    if len(parts) == 1:
        flags |= END_HEADERS
    if priority:
        flags |= PRIORITY_FLAG
        first = struct.pack(">IB", 0x80000000 | 0, 15) + first  # exclusive, on stream 0, weight 16
    if pad is not None:
        flags |= PADDED
        first = bytes((pad,)) + first + bytes(pad)
    out = frame(HEADERS, flags, stream_id, first)
    for index, part in enumerate(parts[1:], start=2):
        out += frame(CONTINUATION, END_HEADERS if index == len(parts) else 0, stream_id, part)
    return out


# -- what the server wrote, read as a client ---------------------------------------------------------


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes


@dataclass
class Response:
    """One stream's answer as the client reads it."""

    headers: dict[bytes, bytes] | None = None
    messages: list[bytes] = field(default_factory=list)
    trailers: dict[bytes, bytes] | None = None
    reset: int | None = None  # the server's RST_STREAM code
    buffer: bytes = b""  # a gRPC message not yet whole
    data_frames: int = 0
    reset_after_trailers: bool = False  # the RST_STREAM(NO_ERROR) a server may send after its trailers

    @property
    def ended(self) -> bool:
        return self.trailers is not None or self.reset is not None

    @property
    def status(self) -> int | None:
        """grpc-status, from the trailers (or a trailers-only response)."""
        if self.trailers is None:
            return None
        return int(self.trailers[b"grpc-status"])

    @property
    def message(self) -> str:
        return (self.trailers or {}).get(b"grpc-message", b"").decode()


class ProtocolViolation(AssertionError):
    """The server wrote something a client must reject."""


class Peer:
    """The client side's reading of the server's bytes, with the checks a strict client makes.

    ``window``/``max_frame`` are the client's settings (what the server may send); tell the peer of every
    WINDOW_UPDATE and SETTINGS the client sends (:meth:`sent`) so it can check the server's DATA against them.
    """

    def __init__(self, *, initial_window: int = 65_535, max_frame: int = 16_384) -> None:
        self.frames: list[Frame] = []
        self.streams: dict[int, Response] = {}
        self.goaway: tuple[int, int, bytes] | None = None
        self.settings: dict[int, int] = {}
        self.settings_acks = 0
        self.pings: list[bytes] = []
        self.ping_requests: list[bytes] = []  # the server's PINGs (a graceful GOAWAY sends one), not answered yet
        self.window_updates: dict[int, int] = {}  # stream (0: connection) -> total increment the server gave
        self.raw = bytearray()  # every byte the server wrote
        self._buffer = bytearray()
        self._decoder = hpack.Decoder()
        self._initial_window = initial_window
        self._max_frame = max_frame
        self.connection_window = 65_535  # what the server may still send on the connection
        self._windows: dict[int, int] = {}  # per stream, what the server may still send
        self._closed: set[int] = set()  # streams the server ended (trailers or reset)
        self._sent = bytearray()  # the client's bytes not yet read as whole frames
        self._unacknowledged: list[bytes] = []  # the client's SETTINGS the server has not acknowledged yet
        self._preface_sent = False

    # the client's own frames, for flow-control accounting
    def sent(self, data: bytes) -> None:
        """Account for the client's bytes: WINDOW_UPDATEs and SETTINGS change what the server may send."""
        self._sent += data
        if not self._preface_sent:
            if len(self._sent) < len(PREFACE):
                return
            self._preface_sent = True
            del self._sent[: len(PREFACE)]
        for item in parse(self._sent):
            if item.kind == WINDOW_UPDATE and len(item.payload) == 4:
                increment = int.from_bytes(item.payload) & 0x7FFFFFFF
                if item.stream_id == 0:
                    self.connection_window += increment
                else:
                    self._windows[item.stream_id] = self._window(item.stream_id) + increment
            elif item.kind == SETTINGS and not item.flags & ACK:
                self._unacknowledged.append(item.payload)  # in force once the server acknowledges them

    def _acknowledged(self) -> None:
        """The server acknowledged our oldest SETTINGS: what it writes from now on keeps to them."""
        if not self._unacknowledged:
            raise ProtocolViolation("a SETTINGS acknowledgement for nothing")
        payload = self._unacknowledged.pop(0)
        for offset in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == INITIAL_WINDOW_SIZE:
                delta = value - self._initial_window
                self._initial_window = value
                for stream_id in self._windows:
                    self._windows[stream_id] += delta
            elif key == MAX_FRAME_SIZE:
                self._max_frame = value

    def _window(self, stream_id: int) -> int:
        return self._windows.get(stream_id, self._initial_window)

    def feed(self, data: bytes) -> list[Frame]:
        self.raw += data
        self._buffer += data
        frames = parse(self._buffer)
        for item in frames:
            self._read(item)
        return frames

    def _read(self, item: Frame) -> None:
        self.frames.append(item)
        if len(item.payload) > self._max_frame:
            raise ProtocolViolation(f"a frame of {len(item.payload)} bytes, over our max frame size {self._max_frame}")
        if item.stream_id in self._closed and not (item.kind == RST_STREAM and self._rst_after_trailers(item)):
            raise ProtocolViolation(f"{item} on stream {item.stream_id}, which the server had ended")
        if item.kind == DATA:
            self._data(item)
        elif item.kind == HEADERS:
            if not item.flags & END_HEADERS:
                raise ProtocolViolation("the server's header blocks come in one frame")
            headers = dict(self._decoder.decode(item.payload, raw=True))
            response = self.streams.setdefault(item.stream_id, Response())
            if response.headers is None and b":status" in headers:
                response.headers = headers
                if item.flags & END_STREAM:  # trailers-only
                    response.trailers = headers
            elif item.flags & END_STREAM:
                response.trailers = headers
            else:
                raise ProtocolViolation(f"a second header block without END_STREAM on {item.stream_id}")
            if item.flags & END_STREAM:
                if response.buffer:
                    raise ProtocolViolation("trailers inside a gRPC message")
                self._closed.add(item.stream_id)
        elif item.kind == RST_STREAM:
            response = self.streams.setdefault(item.stream_id, Response())
            if response.trailers is None:
                response.reset = int.from_bytes(item.payload)
                self._closed.add(item.stream_id)
        elif item.kind == SETTINGS:
            if item.flags & ACK:
                self.settings_acks += 1
                self._acknowledged()
            else:
                for offset in range(0, len(item.payload), 6):
                    key, value = struct.unpack_from(">HI", item.payload, offset)
                    self.settings[key] = value
        elif item.kind == PING:
            if item.flags & ACK:
                self.pings.append(item.payload)
            else:
                self.ping_requests.append(item.payload)
        elif item.kind == GOAWAY:
            last, code = struct.unpack_from(">II", item.payload)
            self.goaway = (last, code, item.payload[8:])
        elif item.kind == WINDOW_UPDATE:
            increment = int.from_bytes(item.payload) & 0x7FFFFFFF
            if increment == 0:
                raise ProtocolViolation("a WINDOW_UPDATE of 0")
            self.window_updates[item.stream_id] = self.window_updates.get(item.stream_id, 0) + increment
        else:
            raise ProtocolViolation(f"the server sent a frame of type {item.kind}")

    def _rst_after_trailers(self, item: Frame) -> bool:
        response = self.streams.get(item.stream_id)
        if response is None or response.trailers is None or response.reset_after_trailers:
            return False
        if int.from_bytes(item.payload) != NO_ERROR:
            raise ProtocolViolation(f"a reset with code {int.from_bytes(item.payload)} after the trailers")
        response.reset_after_trailers = True
        return True

    def _data(self, item: Frame) -> None:
        size = len(item.payload)
        self.connection_window -= size
        window = self._window(item.stream_id) - size
        self._windows[item.stream_id] = window
        if self.connection_window < 0:
            raise ProtocolViolation(f"the server overran the connection window by {-self.connection_window}")
        if window < 0:
            raise ProtocolViolation(f"the server overran stream {item.stream_id}'s window by {-window}")
        response = self.streams.setdefault(item.stream_id, Response())
        if response.headers is None:
            raise ProtocolViolation(f"DATA before the response headers on stream {item.stream_id}")
        response.data_frames += 1
        buffer = response.buffer + item.payload
        position = 0
        while len(buffer) - position >= 5:
            compressed, length = struct.unpack_from(">BI", buffer, position)
            if compressed:
                raise ProtocolViolation("a compressed message from the server")
            if len(buffer) - position - 5 < length:
                break
            response.messages.append(bytes(buffer[position + 5 : position + 5 + length]))
            position += 5 + length
        response.buffer = bytes(buffer[position:])
        if item.flags & END_STREAM:
            raise ProtocolViolation("a gRPC server ends a stream with trailers, not DATA")

    def answers(self) -> list[tuple[int, bytes]]:
        """Every gRPC message of every stream, (stream, message), in the order the server wrote them."""
        out: list[tuple[int, bytes]] = []
        buffers: dict[int, bytes] = {}
        for item in self.frames:
            if item.kind != DATA:
                continue
            buffer = buffers.get(item.stream_id, b"") + item.payload
            while len(buffer) >= 5 and len(buffer) - 5 >= int.from_bytes(buffer[1:5]):
                length = int.from_bytes(buffer[1:5])
                out.append((item.stream_id, buffer[5 : 5 + length]))
                buffer = buffer[5 + length :]
            buffers[item.stream_id] = buffer
        return out


def parse(buffer: bytearray) -> list[Frame]:
    """The whole frames at the start of ``buffer`` (removed from it)."""
    frames = []
    position = 0
    while len(buffer) - position >= 9:
        length_type, flags, stream_id = struct.unpack_from(">IBI", buffer, position)
        length = length_type >> 8
        if len(buffer) - position - 9 < length:
            break
        payload = bytes(buffer[position + 9 : position + 9 + length])
        frames.append(Frame(length_type & 0xFF, flags, stream_id & 0x7FFFFFFF, payload))
        position += 9 + length
    del buffer[:position]
    return frames


# -- a server connection in memory ------------------------------------------------------------------


class FakeTransport:
    """A :class:`Connection`'s transport, in memory; ``close`` delivers connection_lost soon, as asyncio's do."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        self.protocol = protocol
        self.written = bytearray()
        self.writes = 0
        self.closed = False
        self._lost = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after close"
        self.written += data
        self.writes += 1

    def writelines(self, pieces: Iterable[bytes]) -> None:
        assert not self.closed, "a write after close"
        for piece in pieces:
            self.written += piece
        self.writes += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.lose)

    def lose(self, exc: Exception | None = None) -> None:
        """The connection went away (the peer closed it, or we did): connection_lost, once."""
        if not self._lost:
            self._lost = True
            self.closed = True
            self.protocol.connection_lost(exc)

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def take(self) -> bytes:
        out = bytes(self.written)
        self.written.clear()
        return out


class Loopback:
    """A server :class:`Connection` and a client :class:`Peer`, joined in memory.

    ``send`` delivers client bytes to the connection's ``data_received`` (optionally split into
    reads at ``cuts``) and feeds what the server wrote to the peer.
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        *,
        max_message: int = 4 * 1024 * 1024,
        initial_window: int | None = None,
        max_frame: int | None = None,
        preface: bool = True,
        connection_class: type[Connection] = Connection,
    ) -> None:
        self.connection = connection_class(handlers, max_message=max_message)
        self.transport = FakeTransport(self.connection)
        self.peer = Peer()
        self.requests = Requests()
        self.connection.connection_made(self.transport)
        self.pump()
        if preface:
            pairs = []
            if initial_window is not None:
                pairs.append((INITIAL_WINDOW_SIZE, initial_window))
            if max_frame is not None:
                pairs.append((MAX_FRAME_SIZE, max_frame))
            self.send(PREFACE + settings(*pairs))

    def send(self, data: bytes, cuts: Iterable[int] = ()) -> list[Frame]:
        """Deliver ``data`` as reads split at ``cuts``; the frames the server wrote in answer."""
        self.peer.sent(data)
        start = 0
        for cut in [*sorted(set(cuts)), len(data)]:
            if start < cut <= len(data):
                self.connection.data_received(data[start:cut])
                start = cut
        return self.pump()

    def pump(self) -> list[Frame]:
        return self.peer.feed(self.transport.take())

    async def settle(self) -> list[Frame]:
        """Let scheduled writes (a write outside a read) and connection_lost happen; what was written."""
        for _ in range(3):
            await asyncio.sleep(0)
        return self.pump()

    def open(self, stream_id: int, path: str, **options: Any) -> list[Frame]:
        return self.send(self.requests.open(stream_id, path, **options))

    def response(self, stream_id: int) -> Response:
        return self.peer.streams.setdefault(stream_id, Response())


# -- the same over a socket ---------------------------------------------------------------------------


class Client:
    """A raw HTTP/2 client on a real socket: send bytes, read frames into a :class:`Peer`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.peer = Peer()
        self.requests = Requests()
        self.eof = False
        self.answer_pings = True  # as a client does (False: the test answers them, or not)

    @classmethod
    async def connect(
        cls, port: int, *, preface: bool = True, ssl_context: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> Client:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ssl_context, server_hostname="localhost" if ssl_context else None
        )
        client = cls(reader, writer)
        if preface:
            await client.send(PREFACE + settings())
        return client

    async def send(self, data: bytes) -> None:
        self.peer.sent(data)
        self.writer.write(data)
        await self.writer.drain()

    async def until(self, predicate: Callable[[Peer], object], timeout: float = 10.0) -> None:
        """Read until ``predicate(peer)`` holds; AssertionError if the connection ends or time runs out first."""
        async with asyncio.timeout(timeout):
            while not predicate(self.peer):
                chunk = await self.reader.read(1 << 16)
                if not chunk:
                    self.eof = True
                    if predicate(self.peer):
                        return
                    raise AssertionError("the server closed the connection first")
                self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        """Read ``chunk``, and answer the server's PINGs in it, as a client does."""
        self.peer.feed(chunk)
        requests = self.peer.ping_requests
        while requests and self.answer_pings:
            answer = ping(requests.pop(0), ack=True)
            self.peer.sent(answer)
            self.writer.write(answer)

    async def closed(self, timeout: float = 10.0) -> bytes:
        """Read to the end of the connection (the server closes it); what came before the end (read by the peer too)."""
        out = bytearray()
        async with asyncio.timeout(timeout):
            while chunk := await self.reader.read(1 << 16):
                out += chunk
                self._feed(chunk)
        self.eof = True
        return bytes(out)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()


def trusting(certificate: bytes) -> ssl.SSLContext:
    """A client TLS context that trusts ``certificate`` (PEM) and offers ALPN h2, as a gRPC client does."""
    context = ssl.create_default_context(cadata=certificate.decode())
    context.set_alpn_protocols(["h2"])
    return context


# -- calls for tests ----------------------------------------------------------------------------------


class Recorder:
    """A handler that records every call's events; each call echoes every message and ends OK on half-close.

    ``on_message(call, data)`` replaces the echo when given (return True to skip it).
    """

    def __init__(
        self, on_message: Callable[[RecordingCall, bytes], object] | None = None, *, answer: bool = True
    ) -> None:
        self.calls: list[RecordingCall] = []
        self.on_message = on_message
        self.answer = answer

    def __call__(self, stream: Stream) -> RecordingCall:
        call = RecordingCall(self, stream)
        self.calls.append(call)
        return call

    def by_id(self, stream_id: int) -> RecordingCall:
        (call,) = [call for call in self.calls if call.stream.id == stream_id]
        return call


class RecordingCall:
    def __init__(self, handler: Recorder, stream: Stream) -> None:
        self.handler = handler
        self.stream = stream
        self.events: list[tuple[str, bytes]] = []
        self.finished = False  # the call ended the stream itself
        self.cancelled = 0

    @property
    def messages(self) -> list[bytes]:
        return [value for kind, value in self.events if kind == "message"]

    def message(self, data: bytes) -> None:
        assert not self.cancelled, "a message after cancel"
        assert not self.finished, "a message after the call finished the stream"
        self.events.append(("message", data))
        if self.handler.on_message is not None and self.handler.on_message(self, data):
            return
        if self.handler.answer:
            self.stream.send(data)

    def half_close(self) -> None:
        assert not self.cancelled, "half_close after cancel"
        assert not self.finished, "half_close after the call finished the stream"
        self.events.append(("half_close", b""))
        if self.handler.answer:
            self.finish()

    def finish(self, status: int = 0, message: str = "") -> None:
        self.finished = True
        self.stream.finish(status, message)

    def cancel(self) -> None:
        self.events.append(("cancel", b""))
        self.cancelled += 1


# -- ext_proc-shaped calls ----------------------------------------------------------------------------

PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def chunk_message(chunk: bytes, *, end_of_stream: bool = False, metadata: bool = True) -> bytes:
    """A response body chunk as Envoy sends it: response_body, and an empty metadata_context."""
    message = pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))
    if metadata:
        message.metadata_context.SetInParent()
    return message.SerializeToString()


def upb_answer(chunk: bytes, end_of_stream: bool = False) -> bytes:
    return streamed_body("response_body", chunk, end_of_stream).SerializeToString()


def fill(size: int, seed: bytes = b"0123456789abcdef") -> bytes:
    return (seed * (size // len(seed) + 1))[:size]


def observed_message(chunk: bytes, *, end_of_stream: bool = False) -> bytes:
    """A response body chunk as Envoy's observability mode sends it: :func:`chunk_message`'s, flagged."""
    message = pb.ProcessingRequest.FromString(chunk_message(chunk, end_of_stream=end_of_stream))
    message.observability_mode = True
    return message.SerializeToString()


class BodyWatch:
    """A call for an observed response (Envoy's observability mode): its first chunk turns C's taking
    on; it answers nothing, and ends the stream at the response's end."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.seen: list[pb.ProcessingRequest] = []
        stream.keep_tail(4)

    def message(self, data: bytes) -> None:
        request = pb.ProcessingRequest.FromString(data)
        self.seen.append(request)
        body = request.response_body
        if body.body and not self.stream.response_bytes:
            self.stream.echo_response_bodies(observed=True)
        self.stream.tally(body.body)
        if body.end_of_stream:
            self.stream.finish()

    def half_close(self) -> None:
        self.stream.finish()

    def cancel(self) -> None: ...


class BodyEcho:
    """A call that answers response body chunks as epp.extproc's does: its first chunk turns the C echo on."""

    def __init__(self, stream: Stream, *, echo: bool = True) -> None:
        self.stream = stream
        self.echo = echo
        self.seen: list[pb.ProcessingRequest] = []
        self.cancelled = False
        stream.keep_tail(4)

    def message(self, data: bytes) -> None:
        try:
            request = pb.ProcessingRequest.FromString(data)
        except Exception:  # protobuf's DecodeError
            self.stream.finish(13, "not a ProcessingRequest")
            return
        self.seen.append(request)
        body = request.response_body
        if body.body and not self.stream.response_bytes and self.echo:
            self.stream.echo_response_bodies()
        self.stream.tally(body.body)
        self.stream.send(upb_answer(body.body, body.end_of_stream))
        if body.end_of_stream:
            self.stream.finish()

    def half_close(self) -> None:
        self.stream.finish()

    def cancel(self) -> None:
        self.cancelled = True
