"""The server side of one HTTP/2 connection carrying gRPC calls, as an asyncio protocol.

A connection parses the frames it receives (RFC 9113), decodes header blocks (HPACK, RFC 7541, with
:mod:`hpack`; a block that changed no table is kept decoded while the table stays as it was, and
Envoy sends each ext_proc stream the same such block: see ``_decode``), frames the gRPC messages
of each stream and hands them, whole, to the stream's :class:`Call`. A call answers through its
:class:`Stream`: ``send`` a message, ``finish`` with a status. Everything a call sends while the
connection is reading is collected and written once at the end of the read: one ``write`` for all
the answers to what one read brought in.

What this implements of HTTP/2, and what not:

* flow control both ways. Receiving: the connection and every stream open with a window of 2^31-1
  (SETTINGS_INITIAL_WINDOW_SIZE and one WINDOW_UPDATE at start), topped up once half of it is used;
  the picker reads every message as it arrives, and bounds what it keeps (the request body limit), so
  a window never needs to hold a peer back. Sending: the peer's windows and its SETTINGS_MAX_FRAME_SIZE
  are honoured; what does not fit waits on the stream until the peer's WINDOW_UPDATE.
* PING is answered, SETTINGS acknowledged, GOAWAY from the peer lets the open streams finish.
* No server push, no priorities (PRIORITY frames and fields are read and ignored), no compression
  of gRPC messages (the picker does not announce ``grpc-accept-encoding``; a compressed message is
  refused with UNIMPLEMENTED).
* Our header blocks are literal fields without indexing: nothing in the peer's table depends on us.

A call ends with trailers (``grpc-status``, ``grpc-message``, the latter cut to 8 KiB so that the
block fits any peer's frame size); if the peer has not half-closed by then, an RST_STREAM with
NO_ERROR tells it to stop sending (RFC 9113 section 8.1, as gRPC's servers do). Trailers wait behind
the data still waiting for the peer's window. Frames that arrive later for a stream that ended, or
whose call has finished, are read (they count for the windows) and dropped: a call gets no message
after it finished. A peer's RST_STREAM, or the connection going away or being closed by us (a
connection error, :meth:`Connection.close`), cancels the call at once. So does the transport ending a
stream for the call: a message over the limit (RESOURCE_EXHAUSTED), a compressed one
(UNIMPLEMENTED), the peer's END_STREAM or trailers inside a message (INTERNAL). Each call ends once:
it finishes, or it is cancelled (a call that finished may still be told cancel if the connection
goes before its trailers could).

Errors (RFC 9113 section 5.4): what a client must not send closes the connection with GOAWAY and
the RFC's code (a frame interrupting a header block, even or reused stream ids, frames on streams
never opened, PUSH_PROMISE, frames over our 1 MiB, malformed PING/SETTINGS/RST_STREAM/
WINDOW_UPDATE/GOAWAY, bad padding, bad HPACK); a stream error resets that stream only (DATA after
the client's END_STREAM, a stream WINDOW_UPDATE of 0 or past 2^31-1). Tested in tests/wire.

A connection whose open streams all echo (at most 4, or 32 observed ones; each past its 32nd chunk) is
lent to a native I/O thread (:mod:`epp.wire._fast`, "The I/O thread"; ``io_thread``; on TLS where the
session is C's, a :class:`~epp.wire._fast.TlsTransport`'s, the thread reads and writes its records),
which answers their middle chunks without waking the event loop and hands the connection back at any
other frame; :meth:`Connection._reclaim` takes it back first wherever this side touches the connection
(a send, a finish, a GOAWAY, a close), so that its state has one owner at a time. Why, and what it buys:
:mod:`epp.extproc.processor`, "Transport".

A message split over frames is reassembled in place (a bytearray), and a large answer is sent in
frames cut from a view: both cost the message's size, not its size squared. ``python
bench/wire_reassembly.py``: a 16 MiB message in 16 KiB frames (the default request body limit, one
BUFFERED body) took 1,232 ms of CPU to read and 921 ms to send, the event loop blocked all along,
when each frame copied what came before; now 34 and 23 ms (64 MiB: 84 s and 44 s, now 0.14 and 0.09).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import hpack
from hpack.table import HeaderTable

from epp.wire._fast import ConnectionBase, StreamBase, TlsTransport, event_fd, returned

__all__ = [
    "Call",
    "Connection",
    "Handler",
    "Status",
    "Stream",
]

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags (RFC 9113 section 6).
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
_PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
_MAX_STREAM_ID = 0x7FFF_FFFF
_DRAIN_PING = b"eppdrain"  # the payload of a graceful GOAWAY's PING (see Connection.goaway)
_END_STREAM = 0x1
_ACK = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY_FLAG = 0x20

# Error codes (section 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9

# Settings (section 6.5.2).
_HEADER_TABLE_SIZE, _ENABLE_PUSH, _MAX_CONCURRENT_STREAMS, _INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE = 1, 2, 3, 4, 5

_MAX_WINDOW = 2**31 - 1
# We take frames of up to 1 MiB (a whole request body chunk from Envoy in few frames); the protocol's
# default, and what we send until the peer says otherwise, is 16 KiB.
_OUR_MAX_FRAME = 1 << 20
_DEFAULT_FRAME = 16_384
_OUR_SETTINGS = struct.pack(">HIHI", _INITIAL_WINDOW_SIZE, _MAX_WINDOW, _MAX_FRAME_SIZE, _OUR_MAX_FRAME)

_COMPRESSED = "compressed messages are not supported (no grpc-encoding offered)"
_FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id: the 9-byte frame header
_DATA_MESSAGE = struct.Struct(">IBIBI")  # a DATA frame header followed by a gRPC message prefix (14 bytes)


class Status:
    """gRPC status codes (the subset a server of ours sends)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class Call(Protocol):
    """One RPC as its handler sees it: the peer's messages, its half-close, or its going away."""

    def message(self, data: bytes) -> None:
        """A whole request message (its serialized bytes)."""

    def half_close(self) -> None:
        """The peer sent its last message."""

    def cancel(self) -> None:
        """The peer reset the stream or the connection went away: nothing more can be sent."""


# A method's handler: called with the new stream, returns the call that receives its messages.
Handler = Callable[["Stream"], Call]


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _hpack_int(value: int, prefix: int) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ":status: 200" is entry 8 of the static table; content-type is entry 31 (a literal with that name).
_RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(16, 7) + b"application/grpc"
_OK_TRAILERS = _literal(b"grpc-status", b"0")


def _percent_encoded(message: str) -> bytes:
    """``grpc-message``'s encoding: printable ASCII but '%' as is, every other byte %XX."""
    out = bytearray()
    for byte in message.encode("utf-8", "replace"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


# grpc-message is cut to this many bytes (encoded): the trailers must fit one frame of the peer's
# smallest allowed SETTINGS_MAX_FRAME_SIZE (16 KiB); we send no CONTINUATION frames.
_MAX_STATUS_MESSAGE = 8192


def _trailers(status: int, message: str) -> bytes:
    if status == Status.OK and not message:
        return _OK_TRAILERS
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        encoded = _percent_encoded(message)
        if len(encoded) > _MAX_STATUS_MESSAGE:
            encoded = encoded[:_MAX_STATUS_MESSAGE]
            cut = encoded.rfind(b"%", -2)  # not inside a %XX escape
            if cut >= 0:
                encoded = encoded[:cut]
        block += _literal(b"grpc-message", encoded)
    return block


_ECHO, _OBSERVE, _IDLE = 1, 2, 3  # StreamBase.echo: C answers chunks, takes them unanswered, expects none


class Stream(StreamBase):
    """The server side of one RPC: what its call sends, and how it ends.

    Its C base (:class:`epp.wire._fast.StreamBase`) holds the flow-control windows and the response
    tally (``tally``, ``response_bytes``, ``tail``); with ``echo_response_bodies`` on, the
    connection's C read path answers the ext_proc response body chunks of this stream itself.
    """

    __slots__ = (
        "_connection",
        "_echo",
        "buffer",
        "call",
        "ended",
        "headers",
        "headers_sent",
        "id",
        "needed",
        "pending",
        "remote_closed",
        "trailers_pending",
    )  # fmt: skip

    def __init__(self, connection: Connection, stream_id: int, headers: Mapping[bytes, bytes], window: int) -> None:
        super().__init__()
        self._connection = connection
        self.id = stream_id
        self.headers = headers  # the request metadata (names lower-case, as HTTP/2 requires)
        self.call: Call | None = None
        self.window = window  # what we may still send on this stream (the peer's flow-control window)
        self.buffer: bytes | bytearray = b""  # a gRPC message not yet whole (a bytearray while it grows)
        self.needed = 0  # the bytes the buffer must hold for its message to be whole (5 while its prefix is not)
        self.headers_sent = False
        self.remote_closed = False
        self.ended = False  # finish() was called: nothing more is sent
        self.pending: deque[bytes | memoryview] = deque()  # framed gRPC messages waiting for the peer's window
        self.trailers_pending: bytes | None = None
        self._echo = 0  # what C is to do with this stream's chunks once it may (the values of ``echo``)

    def echo_response_bodies(self, *, observed: bool = False) -> None:
        """From now on, the connection takes this ext_proc stream's response body chunks in C.

        Each non-empty chunk without end_of_stream, once a first chunk was tallied, is tallied and
        answered with itself as a streamed body mutation, or with nothing if ``observed`` (a stream of
        Envoy's observability mode, whose messages all say so and whose answers Envoy ignores); see
        :mod:`epp.wire._fast`. The rest still reach the call.
        """
        self._echo = _OBSERVE if observed else _ECHO
        self._sync_echo()

    def idle(self) -> None:
        """Nothing but this stream's end is expected: it does not keep its connection from the I/O thread."""
        self._echo = _IDLE
        self._sync_echo()

    def _sync_echo(self) -> None:
        # C may answer only while nothing waits to go out before its answer, the peer still sends, and
        # no message is half read (the next frame continues it).
        self.echo = (
            self._echo if not self.pending and not self.remote_closed and not self.ended and not self.buffer else 0
        )

    @property
    def peer(self) -> str:
        return self._connection.peer

    def send(self, message: bytes) -> None:
        """Send one gRPC message (serialized) on this stream; nothing once it has ended."""
        connection = self._connection
        if connection.lent:
            connection._reclaim()
        if self.ended:
            return
        if not self.headers_sent:
            self.headers_sent = True
            connection.write_frame(_HEADERS, _END_HEADERS, self.id, _RESPONSE_HEADERS)
        size = len(message) + 5
        if not self.pending and size <= connection.max_frame and size <= self.window and size <= connection.window:
            self.window -= size
            connection.window -= size
            connection.out.append(_DATA_MESSAGE.pack(size << 8, 0, self.id, 0, size - 5))
            connection.out.append(message)
            connection.written()
            return
        self.pending.append(struct.pack(">BI", 0, size - 5) + message)
        self.echo = 0
        connection.flush_stream(self)

    def send_all(self, messages: Iterable[bytes], *, end: bool = False) -> None:
        """Send ``messages`` (and end the call with OK if ``end``), and write them now, or at the end
        of the read when called in one (a route that did not wait: epp.requestcontrol.stepping).

        For a call that answers outside a read (a task): each send there would schedule a flush for
        the loop's next turn, which an explicit flush did not take back, so the loop turned
        once more for nothing (a poll and a no-op callback a routed request, seen with strace).
        """
        connection = self._connection
        reading = connection.reading
        connection.reading = 1  # (as in a read: the writes wait in ``out``, for the flush below)
        try:
            for message in messages:
                self.send(message)
            if end:
                self.finish()
        finally:
            connection.reading = reading
        if not reading:
            connection._flush()

    def after_write(self, work: Callable[[], object]) -> None:
        """Run ``work`` once this stream's answers so far are written (:meth:`Connection.after_write`)."""
        self._connection.after_write(work)

    def finish(self, status: int = Status.OK, message: str = "") -> None:
        """End the call with ``status`` (trailers); later sends and finishes do nothing."""
        connection = self._connection
        if connection.lent:
            connection._reclaim()
        if self.ended:
            return
        self.ended = True
        self.echo = 0
        if not self.headers_sent:  # trailers-only: the response headers and the status in one block
            self.headers_sent = True
            block = _RESPONSE_HEADERS + _trailers(status, message)
        else:
            block = _trailers(status, message)
        if self.pending:
            self.trailers_pending = block  # after the data still waiting for the window
            return
        connection.end_stream(self, block)


_KEPT_BLOCK = 1024  # header blocks up to this size are kept decoded (see Connection._decode)...
_KEPT_BLOCKS = 32  # ...this many per connection (Envoy sends one, or a few)


_RESIZE = HeaderTable.maxsize.fset  # type: ignore[attr-defined]


class _CountingTable(HeaderTable):
    """hpack's decoding table, counting its changes: a block decoded at one count reads the same at it."""

    changes = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.changes += 1
        super().add(name, value)

    def _resize(self, size: int) -> None:
        self.changes += 1
        _RESIZE(self, size)

    maxsize = property(HeaderTable.maxsize.fget, _resize)  # type: ignore[attr-defined]


class Connection(ConnectionBase, asyncio.Protocol):
    """One HTTP/2 connection from a gRPC client (Envoy), dispatching each stream to its method's handler.

    Reads go through the C base's ``data_received`` (:mod:`epp.wire._fast`), which answers echoed
    response body chunks itself and hands every other frame to :meth:`_frame`; a read that starts
    with the preface or completes a buffered frame goes to :meth:`_slow`.
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        *,
        max_message: int,
        on_close: Callable[[Connection], None] | None = None,
        on_bad_preface: Callable[[Connection, bytes], None] | None = None,
        max_concurrent_streams: int = 0,
        io_thread: bool = False,
    ) -> None:
        ConnectionBase.__init__(self)  # streams, out, windows
        # Announced (SETTINGS_MAX_CONCURRENT_STREAMS) when given, not enforced: a client that honours it
        # (Envoy does) opens another connection for more streams (epp.server.workers spreads those).
        self._our_settings = _OUR_SETTINGS
        if max_concurrent_streams:
            self._our_settings += struct.pack(">HI", _MAX_CONCURRENT_STREAMS, max_concurrent_streams)
        self._handlers = handlers
        self._max_message = max_message
        self._on_close = on_close
        self._on_bad_preface = on_bad_preface
        self.peer = "?"
        self._last_stream = 0
        self._preface = False
        self._buffer = bytearray()
        self._needed = 0  # bytes the buffer must hold before a frame can be read from it
        self._decoder = hpack.Decoder()
        self._table = self._decoder.header_table = _CountingTable()
        self._decoded: dict[bytes, tuple[int, list[tuple[bytes, bytes]]]] = {}  # block -> (table state, headers)
        self._headers: tuple[int, int, bytearray] | None = None  # (stream, flags, block) awaiting CONTINUATION
        self._stream_window = 65_535  # the peer's initial window for each stream
        self._blocked: dict[int, Stream] = {}  # streams with data waiting for a window
        self.going_away = False  # we sent GOAWAY: no new streams
        self._draining = False  # a graceful GOAWAY waits for its PING's answer (see goaway)
        self.opened_mark = 0  # streams_opened when the server last compared its connections (rebalancing)
        self.idle: asyncio.Event | None = None  # set when going away and the last stream ended
        self._io_thread = io_thread  # lend the socket to the I/O thread while every stream echoes
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_epoll = -1  # the loop's own epoll (uvloop's), where a lent socket is kept quiet
        self._unread: bytes | None = None  # what the I/O thread handed back, read soon (see _reclaim)
        self._after: list[Callable[[], object]] = []  # run at the end of this read, after its write

    @property
    def started(self) -> bool:
        """The client's connection preface has arrived."""
        return self._preface

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports do not subclass asyncio's: the C base takes any
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        sock = transport.get_extra_info("socket")
        # (TLS: lent only where the session is C's, a TlsTransport's; uvloop's SSL records are Python's.)
        plain = isinstance(transport, TlsTransport) or transport.get_extra_info("sslcontext") is None
        if self._io_thread and sock is not None and plain:
            self._fd = sock.fileno()
            self._loop = asyncio.get_running_loop()
            self._loop_epoll = _backend_fd(self._loop)
            self.lend_ok = 1
        # Our SETTINGS, then open the connection's receive window to the maximum.
        self.write_frame(_SETTINGS, 0, 0, self._our_settings)
        self.write_frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", _MAX_WINDOW - 65_535))
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.reclaim()  # (if lent: the thread lets go of it; what it held is of no use now)
        self.lend_ok = 0
        self.closed = 1
        self._cancel_all()
        if self.idle is not None:
            self.idle.set()
        if self._on_close is not None:
            self._on_close(self)

    def _slow(self, data: bytes) -> None:
        """A read the C path does not take as it is: the preface, or data completing a buffered frame."""
        if self._buffer:
            self._buffer += data
            if len(self._buffer) < self._needed:
                return  # a large frame still arriving: nothing to read yet
            data = bytes(self._buffer)
            self._buffer.clear()
        if not self._preface:
            if len(data) < len(PREFACE):
                if PREFACE.startswith(data):
                    self._buffer += data
                    self._needed = len(PREFACE)
                    return
            elif data.startswith(PREFACE):
                self._preface = True
                data = data[len(PREFACE) :]
            if not self._preface:
                if self._on_bad_preface is not None:
                    self._on_bad_preface(self, data[:64])
                self._abort()
                return
        self._update_plain()
        self.reading = 1
        try:
            position = self.frames(data, 0)
            if position < len(data):
                self._keep(data, position)
        except Exception as exc:
            self.reading = 0
            self._error(exc)
            return
        self.reading = 0
        self._flush()
        if self.after_pending:
            self._run_after()
        if self.lend_ok:
            self._check_lend()

    # -- after the answers ------------------------------------------------------------------------

    def after_write(self, work: Callable[[], object]) -> None:
        """Run ``work`` once what this side has sent so far is written: at the end of this read, after
        its one write, or at once (after a write of what waits) outside a read.

        For what a peer's answer need not wait for: a stream's accounting after its last answer, a
        pick's bookkeeping after the pick (on one connection at one stream, the time an answer waits
        is the latency a request sees). Runs in the order given; an exception is logged, not raised
        into the read.
        """
        if self.reading:
            self._after.append(work)
            self.after_pending = 1
            return
        if self.out:
            self._flush()
        work()

    def _run_after(self) -> None:
        """What :meth:`after_write` kept in this read (the C read path's call, after its write)."""
        after = self._after
        while after:  # (work may add more: it runs too, in order)
            work = after.pop(0)
            try:
                work()
            except Exception:
                log.exception("work after the answers to %s failed", self.peer)
        self.after_pending = 0

    # -- the I/O thread (epp.wire._fast) ----------------------------------------------------------

    def _lend(self) -> None:
        """Every open stream echoes, at most 4 (32 observed), each past its 32nd chunk (the C read path's
        call, at the end of a read): from now on the I/O thread reads the socket and answers their middle
        chunks, until a frame it does not answer hands the connection back (:func:`_returns`) or this
        side needs it (:meth:`_reclaim`)."""
        transport = self.transport
        if (
            self._unread is not None
            or self.going_away
            or self.flush_scheduled
            or transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return
        loop = self._loop
        assert loop is not None
        try:
            _watch_returns(loop)
            transport.pause_reading()
            lent = self.lend(self._fd, self._loop_epoll)
        except Exception as exc:  # (an OSError from epoll, say): this connection's chunks stay the loop's
            log.warning("cannot lend the connection from %s to the I/O thread (%s); not trying again", self.peer, exc)
            self.lend_ok = 0
            lent = False
        if not lent:
            transport.resume_reading()

    def _reclaim(self, now: bool = False) -> None:
        """Take the connection back from the I/O thread (nothing if it is not lent): write the answers it
        could not, read the socket again, and read what it handed back, ``now`` or at the loop's next
        turn (not inside whatever call of this side needed the connection)."""
        taken = self.reclaim()
        if taken is None:
            return
        unsent, unread = taken
        transport = self.transport
        if transport is None or self.closed:
            return
        if unsent:  # (on TLS: records the thread encrypted)
            (transport.write_raw if isinstance(transport, TlsTransport) else transport.write)(unsent)
        if not unread:
            transport.resume_reading()
            self._tls_ended()
        elif now:
            transport.resume_reading()
            self.data_received(unread)
            self._tls_ended()
        else:
            self._unread = unread
            asyncio.get_running_loop().call_soon(self._read_unread)

    def _read_unread(self) -> None:
        unread, self._unread = self._unread, None
        if self.closed or unread is None or self.transport is None:
            return
        self.transport.resume_reading()
        self.data_received(unread)
        self._tls_ended()

    def _tls_ended(self) -> None:
        """The I/O thread read the end of the TLS session (the peer's close_notify, or records that do not
        decrypt), once what it read before is handled: the connection closes (aborts on an error)."""
        transport = self.transport
        if isinstance(transport, TlsTransport) and transport.ended and not self.closed:
            if transport.ended < 0:
                self._abort()
            else:
                self.close()

    def _keep(self, data: bytes, position: int) -> None:
        """The start of a frame not yet whole: kept until the rest arrives."""
        self._buffer += data[position:]
        head = len(data) - position
        self._needed = 9 if head < 9 else 9 + (_FRAME.unpack_from(data, position)[0] >> 8)
        self.plain = 0

    def _update_plain(self) -> None:
        self.plain = int(self._preface and not self._buffer and self._headers is None)

    def _error(self, exc: BaseException) -> None:
        """A read failed: a protocol error closes the connection with GOAWAY; anything else is a bug, logged."""
        self.out.clear()
        if isinstance(exc, _ConnectionError):
            log.warning("HTTP/2 connection from %s: %s; closing it", self.peer, exc)
            self.goaway(exc.code, str(exc))
        else:
            log.error("reading from %s failed; closing the connection", self.peer, exc_info=exc)
            self.goaway(INTERNAL_ERROR, "internal error")
        self._flush()
        self._abort()
        if self.after_pending:  # (the stream's bookkeeping still runs: its call is cancelled, not forgotten)
            self._run_after()

    # -- reading frames -------------------------------------------------------------------------

    def _frame(self, data: bytes, position: int) -> int:
        """Read the whole frame at ``position`` of ``data`` (the C loop's call); the next frame's position."""
        length_type, flags, stream_id = _FRAME.unpack_from(data, position)
        length = length_type >> 8
        if length > _OUR_MAX_FRAME:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {length} bytes (our maximum: {_OUR_MAX_FRAME})")
        end = position + 9 + length
        kind = length_type & 0xFF
        stream_id &= 0x7FFFFFFF
        if self._headers is not None and kind != _CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if kind == _DATA:
            self._data(stream_id, flags, data[position + 9 : end], length)
        elif kind == _HEADERS:
            self._header_frame(stream_id, flags, data[position + 9 : end])
        elif kind == _WINDOW_UPDATE:
            self._window_update(stream_id, data[position + 9 : end])
        elif kind == _RST_STREAM:
            if length != 4:
                raise _ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM that is not 4 bytes")
            self._reset(stream_id)
        elif kind == _SETTINGS:
            self._settings(stream_id, flags, data[position + 9 : end])
        elif kind == _PING:
            if length != 8:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a PING that is not 8 bytes")
            if stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "PING on a stream")
            if not flags & _ACK:
                self.write_frame(_PING, _ACK, 0, data[position + 9 : end])
            elif self._draining and data[position + 9 : end] == _DRAIN_PING:
                self._drained()
        elif kind == _CONTINUATION:
            self._continuation(stream_id, flags, data[position + 9 : end])
        elif kind == _GOAWAY:
            if stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream")
            if length < 8:
                raise _ConnectionError(FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
            self._peer_goaway()
        elif kind == _PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored (section 5.5).
        return end

    def _data(self, stream_id: int, flags: int, payload: bytes, length: int) -> None:
        self.received += length
        if self.received > _MAX_WINDOW // 2:
            self.write_frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received))
            self.received = 0
        if flags & _PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ConnectionError(PROTOCOL_ERROR, "DATA padding longer than the frame")
            payload = payload[1 : len(payload) - payload[0]]
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id == 0 or self._idle(stream_id):
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on stream {stream_id}, which was never opened")
            return  # a stream that has ended
        if stream.remote_closed:
            self._stream_error(stream, STREAM_CLOSED)
            return
        stream.received += length
        if stream.received > _MAX_WINDOW // 2 and not flags & _END_STREAM:
            self.write_frame(_WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream.received))
            stream.received = 0
        if stream.ended:  # the call has ended and its answers wait for the window: what comes now is dropped
            if flags & _END_STREAM:
                stream.remote_closed = True  # (no RST_STREAM after the trailers then)
            return
        call = stream.call
        buffer = stream.buffer
        if buffer and payload:  # the rest of a message split over frames
            buffer += payload  # in place (a bytearray): a large message costs its size, not its size squared
            if len(buffer) < stream.needed:
                payload = b""  # still not whole
            else:
                payload = bytes(buffer)
                stream.buffer = b""
                stream._sync_echo()
        if payload:
            # The common case first: exactly one whole, uncompressed message.
            if payload[0] == 0 and len(payload) >= 5 and int.from_bytes(payload[1:5]) == len(payload) - 5:
                if len(payload) - 5 > self._max_message:
                    self._too_large(stream, len(payload) - 5)
                    return
                assert call is not None
                call.message(payload[5:])
            else:
                self._messages(stream, payload)
        if flags & _END_STREAM:
            self._remote_end(stream)

    def _remote_end(self, stream: Stream) -> None:
        """The peer half-closed ``stream`` (END_STREAM on DATA, or trailers)."""
        stream.remote_closed = True
        stream.echo = 0
        if stream.ended:  # its trailers wait behind data; end_stream forgets the stream once they are sent
            return
        if stream.buffer:  # the call never gets the message: its stream is over
            self._refuse(stream, Status.INTERNAL, "the stream ended inside a message")
        elif stream.call is not None:
            stream.call.half_close()

    def _messages(self, stream: Stream, payload: bytes) -> None:
        """Split ``payload`` (the stream's buffer plus a DATA frame) into whole messages; keep the rest."""
        position, size = 0, len(payload)
        call = stream.call
        while size - position >= 5 and not stream.ended:
            if payload[position] != 0:
                self._refuse(stream, Status.UNIMPLEMENTED, _COMPRESSED)
                return
            length = int.from_bytes(payload[position + 1 : position + 5])
            if length > self._max_message:
                self._too_large(stream, length)
                return
            end = position + 5 + length
            if end > size:
                break
            assert call is not None
            call.message(payload[position + 5 : end])
            position = end
        if position < size and not stream.ended:  # a message not yet whole: kept until it is
            rest = bytearray(payload[position:])
            stream.buffer = rest
            stream.needed = 5 + int.from_bytes(rest[1:5]) if len(rest) >= 5 else 5
            stream.echo = 0  # the next frames continue this message: C must not read one as a message of its own

    def _too_large(self, stream: Stream, length: int) -> None:
        message = f"received message larger than max ({length} vs. {self._max_message})"
        self._refuse(stream, Status.RESOURCE_EXHAUSTED, message)

    def _refuse(self, stream: Stream, status: int, message: str) -> None:
        """End ``stream`` for a protocol reason: trailers with ``status``, and its call cancelled (no more comes)."""
        call = stream.call  # finish() forgets the stream, and with it the call
        stream.buffer = b""
        stream.finish(status, message)
        stream.call = call
        self._cancel(stream)

    def _header_frame(self, stream_id: int, flags: int, payload: bytes) -> None:
        if stream_id == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & _PADDED:
            if not payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its padding length")
            start, end = 1, end - payload[0]
        if flags & _PRIORITY_FLAG:
            if len(payload) < start + 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
            start += 5
        if end < start:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS padding longer than the frame")
        block = payload[start:end]
        if flags & _END_HEADERS:
            self._headers_block(stream_id, flags, block)
        else:
            self._headers = (stream_id, flags, bytearray(block))
            self.plain = 0

    def _continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        pending = self._headers
        if pending is None or pending[0] != stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
        pending[2].extend(payload)
        if len(pending[2]) > 1 << 20:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block over 1 MiB")
        if flags & _END_HEADERS:
            self._headers = None
            self._update_plain()
            self._headers_block(stream_id, pending[1], bytes(pending[2]))

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        # A block that changed no table reads the same while the table stays as it was: Envoy 1.40
        # sends every ext_proc stream's headers as one same block (:path a Huffman-coded literal
        # without indexing, the rest references), which hpack's general decoder took ~18 µs to
        # read each time. Decoded once per table state, a lookup after.
        table = self._table
        known = self._decoded.get(block)
        if known is not None and known[0] == table.changes:
            return known[1]
        changes = table.changes
        try:
            headers: list[tuple[bytes, bytes]] = self._decoder.decode(block, raw=True)  # type: ignore[assignment]
        except hpack.HPACKError as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"bad header block: {exc}") from None
        if table.changes != changes:  # (read again, it would change the table again: never kept)
            return headers
        if len(block) <= _KEPT_BLOCK:
            if len(self._decoded) >= _KEPT_BLOCKS:
                self._decoded.clear()
            self._decoded[block] = (table.changes, headers)
        return headers

    def _headers_block(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decode(block)  # always: the table must follow every block, even one we refuse
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: the client's last word on the stream
            if not flags & _END_STREAM:
                raise _ConnectionError(PROTOCOL_ERROR, f"a second header block on stream {stream_id}, not its last")
            if stream.remote_closed:
                self._stream_error(stream, STREAM_CLOSED)
                return
            self._remote_end(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self._last_stream:
            if stream_id <= self._last_stream and stream_id % 2 and flags & _END_STREAM:
                return  # trailers of a stream that has ended (ours may have crossed them)
            raise _ConnectionError(PROTOCOL_ERROR, f"a client may not open stream {stream_id}")
        self._last_stream = stream_id
        if self.going_away and not self._draining:  # (draining: opened before the peer read our GOAWAY)
            self.write_frame(_RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM))
            return
        metadata = dict(headers)
        stream = Stream(self, stream_id, metadata, self._stream_window)
        self.streams[stream_id] = stream
        if flags & _END_STREAM:
            stream.remote_closed = True
        path = metadata.get(b":path", b"").decode("latin-1")
        handler = self._handlers.get(path)
        if handler is None:
            stream.finish(Status.UNIMPLEMENTED, f"unknown method {path}")
            return
        if metadata.get(b"grpc-encoding", b"identity") not in (b"identity", b""):
            stream.finish(Status.UNIMPLEMENTED, _COMPRESSED)
            return
        try:
            stream.call = handler(stream)
        except Exception:
            log.exception("the handler of %s failed to start a call", path)
            stream.finish(Status.INTERNAL, "the server failed to start the call")
            return
        if stream.remote_closed and not stream.ended:
            stream.call.half_close()

    def _idle(self, stream_id: int) -> bool:
        """A stream the client has not opened (nor may: even ids are ours): only HEADERS may come on it."""
        return stream_id % 2 == 0 or stream_id > self._last_stream

    def _reset(self, stream_id: int) -> None:
        if stream_id == 0 or self._idle(stream_id):
            raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on stream {stream_id}, which was never opened")
        stream = self.streams.pop(stream_id, None)
        self._blocked.pop(stream_id, None)
        if stream is not None:
            stream.ended = True
            self._cancel(stream)
            self._check_idle()

    def _settings(self, stream_id: int, flags: int, payload: bytes) -> None:
        if stream_id != 0:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & _ACK:
            if payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == _INITIAL_WINDOW_SIZE:
                if value > _MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
                delta = value - self._stream_window
                self._stream_window = value
                for stream in self.streams.values():
                    stream.window += delta
                    if stream.window > _MAX_WINDOW:
                        raise _ConnectionError(FLOW_CONTROL_ERROR, f"stream {stream.id}'s window above 2^31-1")
            elif key == _MAX_FRAME_SIZE:
                if not _DEFAULT_FRAME <= value <= 2**24 - 1:
                    raise _ConnectionError(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} out of range")
                self.max_frame = value
            elif key == _ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            # The peer's header table size does not matter: our blocks never index.
        self.write_frame(_SETTINGS, _ACK, 0, b"")
        self._resume()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE that is not 4 bytes")
        increment = int.from_bytes(payload) & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.window += increment
            if self.window > _MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection's window above 2^31-1")
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                if self._idle(stream_id):
                    raise _ConnectionError(
                        PROTOCOL_ERROR, f"WINDOW_UPDATE on stream {stream_id}, which was never opened"
                    )
                return  # a stream that has ended
            if increment == 0:
                self._stream_error(stream, PROTOCOL_ERROR)
                return
            stream.window += increment
            if stream.window > _MAX_WINDOW:
                self._stream_error(stream, FLOW_CONTROL_ERROR)
                return
        self._resume()

    def _peer_goaway(self) -> None:
        # The peer opens no more streams; those open run to their end.
        self.going_away = True
        self._check_idle()

    # -- writing --------------------------------------------------------------------------------

    def write_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.lent:
            self._reclaim()
        self.out.append(_FRAME.pack(len(payload) << 8 | kind, flags, stream_id))
        if payload:
            self.out.append(payload)
        self.written()

    def written(self) -> None:
        """Something was added to ``out``: written at the end of this read, or soon if not reading."""
        if not self.reading and not self.flush_scheduled:
            self.flush_scheduled = 1
            asyncio.get_running_loop().call_soon(self._flush)

    def flush_stream(self, stream: Stream) -> None:
        """Send what ``stream`` has waiting, as far as the windows allow, then its trailers if due."""
        pending = stream.pending
        while pending:
            room = min(self.window, stream.window, self.max_frame)
            if room <= 0:
                self._blocked[stream.id] = stream
                return
            head = pending[0]
            if len(head) <= room:
                pending.popleft()
                piece = bytes(head)
            else:  # the rest stays a view: a large message costs its size to send, not its size squared
                view = memoryview(head)
                piece, pending[0] = bytes(view[:room]), view[room:]
            self.window -= len(piece)
            stream.window -= len(piece)
            self.write_frame(_DATA, 0, stream.id, piece)
        self._blocked.pop(stream.id, None)
        stream._sync_echo()
        if stream.trailers_pending is not None:
            block, stream.trailers_pending = stream.trailers_pending, None
            self.end_stream(stream, block)

    def _resume(self) -> None:
        for stream in list(self._blocked.values()):
            self.flush_stream(stream)

    def end_stream(self, stream: Stream, block: bytes) -> None:
        """The trailers that end ``stream``; an RST_STREAM(NO_ERROR) if the peer is still sending."""
        self.write_frame(_HEADERS, _END_HEADERS | _END_STREAM, stream.id, block)
        if not stream.remote_closed:
            self.write_frame(_RST_STREAM, 0, stream.id, struct.pack(">I", NO_ERROR))
        self._forget(stream)

    def _forget(self, stream: Stream) -> None:
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]
            self._blocked.pop(stream.id, None)
            self._check_idle()
        stream.call = None  # nothing more is delivered to it; and no cycle left for the GC to find

    def _stream_error(self, stream: Stream, code: int) -> None:
        self.write_frame(_RST_STREAM, 0, stream.id, struct.pack(">I", code))
        self.streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)  # nothing more is sent on it
        stream.ended = True
        self._cancel(stream)
        self._check_idle()

    def _cancel(self, stream: Stream) -> None:
        stream.ended = True
        call, stream.call = stream.call, None
        if call is not None:
            try:
                call.cancel()
            except Exception:
                log.exception("a call failed to cancel")

    @property
    def streams_opened(self) -> int:
        """How many streams the peer has opened on this connection (client stream ids are 1, 3, 5, ...)."""
        return (self._last_stream + 1) // 2

    def goaway(self, code: int = NO_ERROR, reason: str = "") -> None:
        """Tell the peer to open no more streams (the open ones run to their end).

        NO_ERROR (rebalancing, stopping) is graceful, as RFC 9113 (6.8) advises: a first GOAWAY names
        the highest stream id there is and a PING follows; streams the peer opened before it read them
        are served, and once the PING's answer is in, a second GOAWAY names the last stream opened and
        any later one is refused (REFUSED_STREAM). A single GOAWAY with the last stream seen raced
        the peer's next stream: Envoy's ext_proc fails a refused stream, and the gateway answered 500
        "the endpoint picker could not be reached" (seen with --workers, whose rebalancing GOAWAYs a
        busy connection: 6 requests in 10 runs of 8 s). An error is one GOAWAY, at once."""
        if self.closed or (self.going_away and code == NO_ERROR):
            return
        self.going_away = True  # (write_frame takes the connection back from the I/O thread)
        self._draining = code == NO_ERROR
        if code == NO_ERROR:
            self.write_frame(_GOAWAY, 0, 0, struct.pack(">II", _MAX_STREAM_ID, code) + reason.encode()[:256])
            self.write_frame(_PING, 0, 0, _DRAIN_PING)
        else:
            self.write_frame(_GOAWAY, 0, 0, struct.pack(">II", self._last_stream, code) + reason.encode()[:256])

    def _drained(self) -> None:
        """The peer answered a graceful GOAWAY's PING: it opens no more streams; the final GOAWAY."""
        self._draining = False
        self.write_frame(_GOAWAY, 0, 0, struct.pack(">II", self._last_stream, NO_ERROR))
        self._check_idle()

    def _check_idle(self) -> None:
        if self.going_away and not self._draining and not self.streams and self.idle is not None:
            self.idle.set()

    def close_if_idle(self) -> None:
        """Once going away: mark the connection idle now if no stream is open."""
        self._check_idle()

    def _abort(self) -> None:
        self.reclaim()
        self.lend_ok = 0
        if self.transport is not None and not self.closed:
            self.closed = 1
            self.transport.close()
        self._cancel_all()

    def close(self) -> None:
        """Flush what is written and close the connection; open calls are cancelled now.

        (Not when the transport reports the connection lost: the event loop's TLS transport first waits
        for the peer's answer to its close_notify, up to the loop's SSL shutdown timeout; a
        TlsTransport sends its close_notify and closes.)
        """
        if self.lent:
            self._reclaim()  # (its unsent answers are written before the close)
        self.lend_ok = 0
        self._flush()
        if self.transport is not None and not self.closed:
            self.closed = 1
            self.transport.close()
        self._cancel_all()

    def _cancel_all(self) -> None:
        """Cancel every open call: nothing more is sent on this connection."""
        streams = list(self.streams.values())
        self.streams.clear()
        self._blocked.clear()
        for stream in streams:
            self._cancel(stream)
        self._check_idle()


_watched: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def _backend_fd(loop: asyncio.AbstractEventLoop) -> int:
    """uvloop's epoll (libuv's backend fd), or -1 for a loop that does not say (asyncio's)."""
    backend = getattr(loop, "_get_backend_id", None)
    try:
        return int(backend()) if backend is not None else -1
    except Exception:  # (an older uvloop without it, say)
        return -1


def _watch_returns(loop: asyncio.AbstractEventLoop) -> None:
    """Have ``loop`` reclaim the connections the I/O thread hands back (once per loop)."""
    if loop not in _watched:
        fd = event_fd()
        loop.add_reader(fd, _returns, fd)
        _watched.add(loop)


def _returns(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.read(fd, 8)
    running = asyncio.get_running_loop()
    for connection in returned():
        loop = connection._loop
        if loop is running:
            connection._reclaim(now=True)
        elif loop is not None and not loop.is_closed():  # another loop's connection (another thread)
            loop.call_soon_threadsafe(connection._reclaim, True)


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
