"""The messages between the owner process and its ext_proc workers, and the channel that carries them.

Design
------
With ``--workers N`` (:mod:`epp.server.workers`) one process, the *owner*, keeps everything a
request's routing shares with the others (datastore, scheduler and plugins, prefix index, in-flight
accounting, flow control, metrics), and N *workers* speak ext_proc to Envoy. A worker's director is a
proxy (:mod:`epp.requestcontrol.remote`) that sends each parsed request here and gets the pick back;
the owner's side is :mod:`epp.requestcontrol.owner`. One unix socketpair per worker carries:

worker -> owner: :class:`Route` (a parsed request, its subset hint and trace context),
:class:`Cancel`, and the response events :class:`Started` and :class:`Finish` (the response headers
ride with the first of them, or go alone as :class:`Headers` when the worker waits for hooks),
:class:`Claim` (the worker observes the response of a request another worker routed), plus
:class:`Refused` (a refusal for the refused-requests metric), :class:`StreamOpened` and
:class:`StreamClosed` (``--enable-grpc-stream-metrics``), :class:`Ready` and :class:`Connections`;

owner -> worker: :class:`Routed` / :class:`Refusal` / :class:`Failed` (the answer to a route),
:class:`HeadersAnswer` (only when a plugin's ``response_received`` hook may set response headers),
:class:`Claimed` (another worker observes the response of a request this one routed), :class:`Health`
and :class:`Models` (state the worker answers from on its own: health checks on the ext_proc port,
``GET /v1/models``), :class:`Rebalance` and :class:`Drain`.

Cost (the point of the design: a worker must not spend its savings on talking). Every message is a
small msgspec struct encoded as a msgpack array (``array_like``, an integer tag first): no field
names on the wire, decoded straight into the typed struct in C. A channel collects what its process
sends during one event-loop turn and writes it as one frame (a 4-byte length, then a msgpack array
of messages) at the turn's end: one ``write`` per turn, not per message, and the peer's read of one
frame dispatches every message in it with no task per message. What nobody waits for (the response
events, refusal counts) is :meth:`Channel.post`-ed: it rides in the next frame that something
urgent (a route, an answer) sends, or goes on its own :data:`LAZY_DELAY` later, so that a busy
worker wakes the owner about once per route instead of twice (each write to a sleeping process is a
wake-up, the costliest part of a message). ``bench/workers.py --parts ipc`` measures a route's
round trip and its events in-process: see its docstring.

Ordering: one socket, one writer per direction, so the messages of a request arrive in the order
they were sent, which is all the protocol relies on (a :class:`Cancel` after the :class:`Route` it
cancels, the events after the :class:`Routed`).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Mapping
from typing import Any, cast

import msgspec

__all__ = [
    "LAZY_DELAY",
    "TOKEN_OWNER",
    "TOKEN_PREFIX",
    "Cancel",
    "Channel",
    "Claim",
    "Claimed",
    "Connections",
    "Drain",
    "Failed",
    "Finish",
    "Headers",
    "HeadersAnswer",
    "Health",
    "Models",
    "OwnerMessage",
    "Ready",
    "Rebalance",
    "Refusal",
    "Refused",
    "Route",
    "Routed",
    "Started",
    "StreamClosed",
    "StreamOpened",
    "WorkerMessage",
    "owner_decoder",
    "worker_decoder",
    "worker_token",
]

log = logging.getLogger(__name__)


# -- worker -> owner ------------------------------------------------------------------------------


class Route(msgspec.Struct, array_like=True, gc=False, tag=1, frozen=True):
    """Route this request (the fields of :class:`epp.framework.InferenceRequest` the edge parsed).

    ``traceparent``: the W3C context of the worker's orchestration span (the owner's admission and
    scheduling spans are its children); None when the request is not traced or not recorded.
    """

    id: int
    request_id: str
    method: str
    path: str
    headers: dict[str, str]
    api: str
    model: str
    prompt: str
    stream: bool
    cache_salt: str | None
    max_tokens: int | None
    body_size: int
    subset: list[str] | None = None
    traceparent: str | None = None
    body: bytes = b""  # the request as received, when a configured plugin reads it (WorkerSpec.send_body)


class Cancel(msgspec.Struct, array_like=True, gc=False, tag=2, frozen=True):
    """The stream went away: stop routing ``id`` (it leaves the flow-control queue), or finish it cancelled."""

    id: int


class Headers(msgspec.Struct, array_like=True, gc=False, tag=3, frozen=True):
    """The response headers of ``id``, sent alone only when the worker waits for a :class:`HeadersAnswer`
    (a plugin's ``response_received`` hook may set response headers); otherwise they ride with
    :class:`Started` or :class:`Finish`."""

    id: int
    headers: dict[str, str]
    wait: bool = False


class Started(msgspec.Struct, array_like=True, gc=False, tag=4, frozen=True):
    """The first response body bytes of ``id`` arrived (after ``headers``, if they were not sent yet)."""

    id: int
    headers: dict[str, str] | None = None


class Finish(msgspec.Struct, array_like=True, gc=False, tag=5, frozen=True):
    """``id``'s stream ended with ``outcome``; ``ended``: the response body's (size, usage) if it ended;
    ``headers``: the response headers, if they arrived and were not sent yet."""

    id: int
    outcome: str
    ended: tuple[int, tuple[int, int] | None] | None = None
    headers: dict[str, str] | None = None


class Refused(msgspec.Struct, array_like=True, gc=False, tag=6, frozen=True):
    """The worker answered a request with a refusal (``epp.errors.Refusal`` value): count it."""

    refusal: str
    model: str | None = None


class Ready(msgspec.Struct, array_like=True, gc=False, tag=7, frozen=True):
    """The worker serves: the owner may hand it connections."""

    pid: int


class Connections(msgspec.Struct, array_like=True, gc=False, tag=8, frozen=True):
    """The worker's open ext_proc connections (sent when the count changes)."""

    count: int


class StreamOpened(msgspec.Struct, array_like=True, gc=False, tag=9, frozen=True):
    """An ext_proc stream opened on the worker (``--enable-grpc-stream-metrics``)."""


class StreamClosed(msgspec.Struct, array_like=True, gc=False, tag=10, frozen=True):
    """An ext_proc stream ended on the worker: the gRPC status it ended with, and how long it was open."""

    code: str
    seconds: float


class Claim(msgspec.Struct, array_like=True, gc=False, tag=11, frozen=True):
    """This worker observes the response of the request ``token`` names, which another worker routed
    (``epp envoy-config --observe-responses``): the owner moves that request to this worker as ``id``,
    whose response events follow, and tells the routing worker (:class:`Claimed`)."""

    token: str
    id: int


WorkerMessage = (
    Route | Cancel | Headers | Started | Finish | Refused | Ready | Connections | StreamOpened | StreamClosed | Claim
)


# -- owner -> worker ------------------------------------------------------------------------------


class Routed(msgspec.Struct, array_like=True, gc=False, tag=21, frozen=True):
    """``id`` is routed: the destination header's value, the primary's name, the request's priority,
    and with ``--emit-endpoint-scores`` the primary profile's scores (``ip:port`` -> total)."""

    id: int
    destination: str
    primary: str
    priority: int = 0
    scores: dict[str, float] | None = None


class Refusal(msgspec.Struct, array_like=True, gc=False, tag=22, frozen=True):
    """``id`` is refused (an :class:`epp.errors.EppError`: refusal value, message, extra headers)."""

    id: int
    refusal: str
    message: str
    headers: dict[str, str] | None = None


class Failed(msgspec.Struct, array_like=True, gc=False, tag=23, frozen=True):
    """Routing ``id`` raised an unexpected exception (logged by the owner)."""

    id: int
    message: str


class HeadersAnswer(msgspec.Struct, array_like=True, gc=False, tag=24, frozen=True):
    """The response headers the plugins' ``response_received`` hooks set for ``id`` (None: none)."""

    id: int
    added: dict[str, str] | None = None


class Health(msgspec.Struct, array_like=True, gc=False, tag=25, frozen=True):
    """Health statuses (``grpc.health.v1`` enum values) by service, as the owner sets them."""

    statuses: dict[str, int]


class Models(msgspec.Struct, array_like=True, gc=False, tag=26, frozen=True):
    """The pool's ``GET /v1/models`` union (model cards), None while no pod's list was read."""

    cards: list[dict[str, Any]] | None


class Drain(msgspec.Struct, array_like=True, gc=False, tag=27, frozen=True):
    """Stop accepting, give open streams ``grace`` seconds, then exit."""

    grace: float


class Rebalance(msgspec.Struct, array_like=True, gc=False, tag=28, frozen=True):
    """This worker carries more than its share: GOAWAY its busiest connection (the gateway then puts new
    streams on other connections, or opens one, which the owner hands to the least-loaded worker)."""


class Claimed(msgspec.Struct, array_like=True, gc=False, tag=29, frozen=True):
    """Another worker observes the response of ``id`` (see :class:`Claim`) and finishes it there: this
    worker lets its routing stream go without finishing the request."""

    id: int


OwnerMessage = Routed | Refusal | Failed | HeadersAnswer | Health | Models | Drain | Rebalance | Claimed

TOKEN_OWNER = 8
"""The first characters of a worker's tokens: its owner process's, random (another replica's differ)."""
TOKEN_PREFIX = 12
"""Characters of an observed response's token (:data:`epp.extproc.answers.TOKEN_LENGTH`) that name the
worker process that routed it, with ``--workers``: the owner's :data:`TOKEN_OWNER` and the worker's spawn
number's 4 (a restarted worker's tokens do not name its predecessor's requests until the number wraps,
65,536 spawns later). The rest is the request's id there."""


def worker_token(prefix: str, request_id: int) -> str:
    """The token of a worker's request ``request_id``, ``prefix`` being the worker's (:data:`TOKEN_PREFIX`)."""
    return f"{prefix}{request_id:012x}"

owner_decoder = msgspec.msgpack.Decoder(list[WorkerMessage])
"""What the owner reads: lists of :data:`WorkerMessage`."""
worker_decoder = msgspec.msgpack.Decoder(list[OwnerMessage])
"""What a worker reads: lists of :data:`OwnerMessage`."""

_LENGTH = struct.Struct("!I")
_encoder = msgspec.msgpack.Encoder()


def _encodable(messages: list[msgspec.Struct]) -> list[msgspec.Struct]:
    """``messages`` but those that do not encode (a programming error), each logged: a frame carries
    many requests' messages, and a bad one lost them all (the other process then waited for answers
    that never came)."""
    kept = []
    for message in messages:
        try:
            _encoder.encode(message)
        except (TypeError, ValueError, OverflowError) as exc:
            log.error("dropped a %s to the other process that does not encode: %s", type(message).__name__, exc)
        else:
            kept.append(message)
    return kept

LAZY_DELAY = 0.002
"""Seconds a posted message may wait for an urgent one to share its frame. The owner then sees a
response's start and end up to 2 ms late: in-flight accounting and admission's wake-up by so much,
against a 50 ms scrape interval and responses of hundreds of milliseconds."""


class Channel(asyncio.Protocol):
    """One end of a socketpair: :meth:`send` batches messages per event-loop turn; frames read are
    decoded with ``decoder`` and each message is handed to ``handlers[type(message)]``.

    ``on_lost`` is called once when the other end closes (its process exited or closed the socket).
    """

    def __init__(
        self,
        decoder: msgspec.msgpack.Decoder[Any],
        handlers: Mapping[type, Callable[[Any], None]],
        on_lost: Callable[[], None],
    ) -> None:
        self._decode = decoder.decode
        self._handlers = dict(handlers)
        self._on_lost = on_lost
        self._buffer = bytearray()
        self._out: list[msgspec.Struct] = []
        self._flushing = False  # a flush is scheduled at the end of this turn
        self._timer: asyncio.TimerHandle | None = None  # a flush of posted messages, LAZY_DELAY on
        self._after: list[Callable[[], object]] = []  # run once the frame being gathered is written
        self._loop: asyncio.AbstractEventLoop | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.sent_frames = 0  # frames written (one per event-loop turn with something to say)

    # -- sending ----------------------------------------------------------------------------------

    def send(self, message: msgspec.Struct) -> None:
        """Queue ``message``; everything queued in this loop turn is written once, at its end."""
        self._out.append(message)
        if not self._flushing and not self.closed:
            self._flushing = True
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self.flush)

    def post(self, message: msgspec.Struct) -> None:
        """Queue ``message``, which nobody waits for: it goes with the next :meth:`send`'s frame, or
        :data:`LAZY_DELAY` from now (order is kept either way)."""
        self._out.append(message)
        if not self._flushing and self._timer is None and not self.closed:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._timer = loop.call_later(LAZY_DELAY, self.flush)

    def after_flush(self, work: Callable[[], object]) -> None:
        """Run ``work`` once what was sent so far is written: after this turn's frame, or at once when
        nothing waits for one (for what the peer's answer need not wait for; an exception is logged)."""
        if self._flushing:
            self._after.append(work)
        else:
            work()

    def flush(self) -> None:
        """Write what is queued now (called at the end of the turn; call it before closing), then run
        what :meth:`after_flush` kept."""
        self._flushing = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        out = self._out
        transport = self.transport
        if out:
            self._out = []
            if transport is not None and not self.closed:
                frame = bytearray(4)
                try:
                    _encoder.encode_into(out, frame, 4)
                except (TypeError, ValueError, OverflowError):  # one bad message must not take the others along
                    frame = bytearray(4)
                    _encoder.encode_into(_encodable(out), frame, 4)
                _LENGTH.pack_into(frame, 0, len(frame) - 4)
                transport.write(frame)
                self.sent_frames += 1
        after = self._after
        while after:
            work = after.pop(0)
            try:
                work()
            except Exception:
                log.exception("work after a frame to the other process failed")

    def close(self) -> None:
        """Flush, then close this end (the peer sees EOF once the last frame is read)."""
        self.flush()
        if self.transport is not None:
            self.transport.close()

    # -- receiving --------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a unix stream connection's transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if buffer:  # the rest of a frame that arrived in parts (large routes, a full socket buffer)
            buffer += data
            if len(buffer) < 4 or len(buffer) < 4 + _LENGTH.unpack_from(buffer)[0]:
                return  # still incomplete: wait for more without copying what is here
            data = bytes(buffer)
            buffer.clear()
        decode, handlers = self._decode, self._handlers
        size = len(data)
        view = memoryview(data)
        position = 0
        while size - position >= 4:
            (length,) = _LENGTH.unpack_from(data, position)
            end = position + 4 + length
            if end > size:
                break
            for message in decode(view[position + 4 : end]):
                try:
                    handlers[type(message)](message)
                except Exception:  # one message's handler must not lose the rest of the frame
                    log.exception("handling %s from the other process failed", type(message).__name__)
            position = end
        if position < size:
            self._buffer += view[position:]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._out.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_lost()
