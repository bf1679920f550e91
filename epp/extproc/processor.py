"""The one module that speaks Envoy's ext_proc protocol (``envoy.service.ext_proc.v3.ExternalProcessor``).

Design
------
Each HTTP request is one bidirectional gRPC stream. With the reference Envoy configuration
(header modes SEND, body modes FULL_DUPLEX_STREAMED, trailer modes SEND) a stream runs::

    Envoy -> picker                    picker -> Envoy
    request_headers (eos=false)        (held: the pick needs the body)
    request_body ... (eos=true)        request_headers: set x-gateway-destination-endpoint,
                                         clear_route_cache, dynamic_metadata envoy.lb
                                       request_body: streamed_response chunks of <= 62,000 bytes
    response_headers                   response_headers: continue
    response_body ... (each chunk)     response_body: streamed_response, the chunk unchanged
    response_trailers (if any)         response_trailers: continue

Body-less requests (``request_headers`` with end_of_stream) are routed at once, except
``GET /v1/models``, which the picker answers with the pool's union when it has read a model list
(:mod:`epp.extproc.models`). Envoy announces its body modes in the first message (``protocol_config``); with BUFFERED
request bodies it waits for the headers answer before sending the body, so the picker answers the
headers with "continue" and sets the destination on the (single, whole) body message instead.
Response bodies are answered per chunk as they come, never buffered, so SSE streams token by token.

One :class:`_Stream` object per gRPC stream holds the stream's state (the body modes Envoy
announced, the request headers, the body received so far, the routed request) and has one method per
message kind, each returning the answers to send; a :class:`_Call` moves messages between the wire
and it. Once routed, the request is a :class:`~epp.requestcontrol.lifecycle.RoutedRequest`, which
the stream calls as the response arrives and finishes exactly once in the end (``complete``,
``error`` or ``cancelled``).

Ending: once the response's last message is answered (a body or headers with end_of_stream, or the
trailers) the picker ends the stream itself with OK, rather than wait for Envoy's half-close and reset.

Errors: anything on the request path raises :class:`epp.errors.EppError`; this package alone turns
it into an ImmediateResponse (status and OpenAI-style JSON body from :func:`epp.errors.http_answer`,
plus the refusal's response headers, such as ``x-llm-d-request-dropped-reason``) and ends the
stream; the refusal is counted (:meth:`RequestMetrics.refused`). An unexpected exception becomes a
500 for that request only and is logged. Once the request was routed it is too late for an HTTP
answer: the stream fails instead.

Transport (issue 14). The stream is served by the picker's own gRPC-over-HTTP/2 server
(:mod:`epp.wire`), not grpc.aio. Under grpc.aio every message, a streamed chunk included, went from
grpc's poller thread to the event loop and through a Python generator: ~200 µs of CPU per chunk at
1 stream and ~55 µs at 16 (it was also where memory grew: grpc.aio leaks the native ops of each batch
a reset cancels, grpc/grpc#43360, and Envoy resets every stream it ends). Candidates, side by side
with ``python bench/streaming_cost.py --events 256 --streams 1,16 --baseline-python ...`` (picker CPU
per ext_proc message, above its idle rate, medians of 3 rounds; 2 shared cores under other load):

================================================  ============  =============
transport                                          1 stream      16 streams
================================================  ============  =============
grpc.aio (c519aee)                                 196-208 µs    55-58 µs
epp.wire, every message in Python (54e7340)        83-86 µs      15-19 µs
epp.wire with the C read path (this)               32-37 µs      5.2-5.7 µs
================================================  ============  =============

At one stream each chunk is a wake-up of its own, and what a wake-up costs decides. ``python
bench/wakeup_floor.py`` (one 2 ms-apart message at a time, server CPU per message, medians): an echo
in a C epoll loop 10 µs, the same echo as a uvloop protocol 27 µs, epp.wire answering Envoy-shaped
chunks in its C read path 27 µs, the same chunks through the Python call 87 µs. Python code run once
per wake-up is slow for its cold caches, not its instructions (parsing and answering a chunk with upb
takes ~2 µs in a hot loop). So the connection's read path is C (:mod:`epp.wire._fast`): a read of
response body chunks of a stream whose echo is on runs no bytecode, and costs what uvloop's wake-up
costs; :meth:`_Stream.response_body` turns the echo on at the first chunk (the response-start signal
stays here) and still sees the last (end_of_stream, the usage).

Below uvloop's wake-up: the I/O thread (``--io-thread``, on by default; on TLS ports too, below). A
connection whose open streams all echo, at most 4 of them (of observed ones, up to 32: below) and each
past its 32nd chunk, is lent to a native thread with its own epoll (:mod:`epp.wire._fast`, "The I/O
thread"), which reads the socket and answers the middle chunks with neither the GIL nor the event loop,
and hands the connection back at anything else (a new stream's headers, a last chunk, a WINDOW_UPDATE or
PING, the peer's end, a full socket); the loop also takes it back before it writes anything itself.
``python bench/wakeup_floor.py --servers c-epoll,wire,wire-thread,uvloop --rounds 5`` (3,000 messages 2
ms apart, server CPU per message, medians): a C epoll echo 16.7 µs, the thread 23.3, the loop's C read
path 40.0, a uvloop echo 33.3. Through Envoy, ``python bench/streaming_cost.py --events 256,1024
--streams 1,4,16 --rounds 3 --requests 10 --baseline-python P`` (P: a python wrapper adding
``--io-thread=false``), picker CPU per ext_proc message with the thread / without: 1,024 events at 1
stream 33.7 / 51.9 µs (34.7 / 53.4 ms a request), at 4 streams 11.0 / 20.0, at 16 streams 6.9 / 8.3; 256
events 52.3 / 53.1, 16.5 / 21.6, 6.7 / 7.2 (the first 32 chunks of a stream are the loop's, below).
Lending with up to 64 streams open, at a stream's first chunk, made 16 streams dearer (6.8 against 3.0
µs): a busy connection is handed back and forth for every new stream and last chunk, and its reads carry
several chunks each, which the loop answers as cheaply; hence the limit of 4. A lend and its hand-back
cost wake-ups of the loop, which short streams do not repay: lending at a stream's first chunk made
``python bench/routing_quality.py --cpu-comparison --idle-pods 100 --policies
rr,default,default+io-thread=false,sglang-router --rounds 2`` (16-token streams) cost the picker 2.94
CPU-s per 1,000 requests against 2.77 without the thread; hence the 32 chunks
(``--io-thread-after-chunks``), which such streams never reach. uvloop kept a lent socket in its own
epoll until it next fired there, one more wake-up per lend; the lend now registers it for no event
(0c816f6). Measured again after that, ``--policies
rr,default,default+io-thread-after-chunks=1,sglang-router --rounds 2``: picker above idle 1.90 CPU-s per
1,000 requests at 32 chunks, 2.07 at 1 (request path 1.54 / 1.65): lending at the first chunk still does
not pay, so 32 stays. What is left at one stream is the kernel's: the thread spends ~5% of its CPU in
user space (its /proc stat over a run: 3 ticks user, 53 system, 9,431 wake-ups), and so would any
server: the wake-up of an idle core, the recv, and a send whose loopback TCP work for Envoy's side,
waking Envoy included, is charged to the sender. 15 µs per chunk at one stream is below that floor on
these machines; what would go lower is fewer messages (response body mode NONE, below).

TLS (``--secure-serving=true``, upstream's default, so what most deployments run). Under uvloop's
TLS every message went through its SSL protocol and Python's ssl objects, and a TLS connection could
never be lent: its records were the event loop's SSL object's to decrypt. Now a TLS port's records
are decrypted and encrypted in C (:class:`epp.wire._fast.TlsTransport`: OpenSSL on memory BIOs,
the session made from the server's own ssl.SSLContext, used where ``tls_usable`` finds Python's own
OpenSSL; ``--native-tls=false`` keeps uvloop's), so the C read path takes a TLS connection's chunks
as it does a plaintext one's, and the I/O thread reads and writes a lent connection's records
itself. ``python bench/streaming_cost.py --events 256,1024 --streams 1,4,16 --rounds 3 --requests 8
--tls`` (at c7d5de2, all three pickers in one run), picker CPU per ext_proc message, plaintext / TLS
in C / uvloop's TLS: 1,024 events at 1 stream 20.0 / 32.1 / 56.4 µs (20.6 / 33.0 / 58.0 ms a
request), 4 streams 8.6 / 11.1 / 19.6, 16 streams 5.5 / 8.0 / 9.2; 256 events 29.2 / 38.8 / 48.4,
8.5 / 13.3 / 22.9, 4.2 / 9.0 / 9.0. What TLS still adds at one stream is OpenSSL 3.0's per-record
work (``perf`` of the picker streaming: libcrypto and libssl ~24% of its CPU, spread over many
small functions; AES-GCM itself ~2%; the kernel ~60%). A non-streamed request is as cheap either way (``python
bench/extproc_overhead.py --connections 1 --sizes 1024 --rounds 3 --tls``: 0.321 / 0.313 / 0.329
ms of CPU, P50 added 0.63 / 0.68 / 0.68 ms).

What a non-streamed request's added latency is made of. ``python bench/extproc_overhead.py
--connections 1 --sizes 1024 --rounds 3 --floor`` runs beside the picker a server on this transport
that gives the same answers with no work (``bench/passthrough_picker.py``): P50 added 0.56 ms by the
picker, 0.40 by the floor (0.62 / 0.45 on a busier run) at fd78e38. Two round trips are on the path
(the request's headers and body arrive in one read, the response's headers and body in another;
Envoy's reset after the end is a third read, off it); the floor is the exchange itself, and what is
above it is the picker's own Python work: 82-90 µs of CPU a request in a hot loop at fd78e38
(``python bench/request_path_cpu.py``; ``--profile``: ``Director.route`` about half, the route phase
two thirds). Since then (each
measured side by side, in its commit): the route runs in the read that brought the request and its
answers leave in that read's write, with no task and no turn of the loop when nothing makes it wait
(:mod:`epp.requestcontrol.stepping`); the series it writes take no locks
(:mod:`epp.framework.loopmetrics`); headers are read in C (``epp.wire._fast.header_map``); a JSON
body's usage is decoded at its object's end without a Python loop over its bytes. Together, the
same runs from fd78e38 and from this tree alternating three times: 84.9 / 68.1, 85.8 / 68.6, 84.6 /
67.0 µs a request in the hot loop; through Envoy (``--floor --baseline-python``, 5 rounds) P50 added
0.55 ms against fd78e38's 0.58 and the floor's 0.44, picker CPU 0.243 against 0.284 ms a request
(the floor 0.174). A task's answers (a route that waited) go out in one write with nothing left for
the loop's next turn (``Stream.send_all``: sent one by one outside a read, each scheduled a flush
that the explicit one did not take back; strace counted 3.72 polls a request, 2.78 after).

What Envoy waits for, and what it need not. A read's answers leave in one write at its end, so
whatever ran in the read before that end was on the path, bookkeeping included: the pick's
``pre_request`` hooks (the approximate prefix index's add) and, in the response's read, the
stream's accounting (usage, in-flight release, a dozen series), which the note above took to be
off it. Both now run once the read's write is made (:meth:`epp.wire.http2.Connection.after_write`;
a pick still runs after the hooks of the picks before it: :mod:`epp.requestcontrol.director`).
And each stream's header block, which Envoy sends the same every time, is read once per HPACK
table state (:meth:`epp.wire.http2.Connection._decode`), not by hpack's Python decoder each time.
``python bench/request_path_cpu.py --wire`` (a real connection in memory, one request at a time,
Envoy's header block, each read's CPU time split at its write), 8c26130 and 8288b35 alternating
three times: before the request's write 133.8 / 83.5, 126.3 / 83.1, 128.5 / 84.5 µs; before the
response's 34.7 / 22.3, 33.3 / 22.3, 33.7 / 22.6 µs; after the writes 1.4 / 13.3-13.9 and 1.1 /
12.6-13.0 µs (the work moved there is the same work).

Processing modes, the other lever (measured, not adopted). With response body mode NONE Envoy sends
the picker no chunk at all: ``python bench/streaming_cost.py --events 1024 --streams 1,16 --none``
gave the picker ~0 ms per 1,024-event request (within its idle rate's noise; 34.6 ms in
FULL_DUPLEX_STREAMED at 1 stream, 5.6 at 16) and halved Envoy's own CPU (51 against 101 ms at 1
stream; 22 against 30 at 16). What it costs, checked through Envoy 1.40 (10 streamed and 10 JSON
completions each way): no response size, no usage tokens, no response-start signal (the in-flight
accounting's prefill-time estimate learns nothing), and Envoy ends the stream of a non-streamed
response by a reset, so those requests count as cancelled (0 of 10 with a duration; streamed 10 of
10); in-flight counts are still released at the stream's end. Upstream's reference configuration and
the gateways that implement InferencePool use FULL_DUPLEX_STREAMED, and the bootstraps here keep it;
``epp envoy-config --response-body-mode NONE`` is there for an operator who wants the CPU more.

Observed responses (``epp envoy-config --observe-responses``; our extension, off by default): the
same response accounting without the round trips. The picker's filter skips the response and a
second ext_proc filter in Envoy's observability mode sends the picker the response unanswered
(epp/envoy/bootstrap.py has the configuration and what was verified of Envoy). On a routing stream
whose gRPC metadata announces an observer, the routing answer carries a token for its request
(:func:`~epp.extproc.answers.token_metadata`: dynamic metadata, a few bytes appended to the
serialized answer; a processed response costs nothing of this); the observing stream's first message names it, and
that stream (``_Stream.observed``) takes over the routed request: response headers, the first chunk
(the response-start signal), the middle chunks taken in C without an answer (``echo`` 2 in
:mod:`epp.wire._fast`; the I/O thread takes them too, and a routed stream that waits for nothing but
its end, ``echo`` 3, does not keep a connection from it), the last chunk's usage, and the finish.
Envoy ends the routing stream right after the route; told so by its gRPC metadata, that stream
leaves the finish to its observer, or finishes the request itself after :data:`OBSERVER_WAIT` if no
observer came. With ``--workers`` the two streams of a request often reach different workers (the
owner hands out each connection, the observer's cluster's too): the observer's process claims the
request through the owner (:meth:`Observed.claim`; :mod:`epp.requestcontrol.owner` has the design)
and the routing one lets it go (:meth:`Observed.taken`). An observer whose token names no request of
this picker (another replica's, or a picker's before a restart) ends its stream at once.
Measured side by side, processed / observed (2 shared cores, medians):

* streamed, ``python bench/streaming_cost.py --events 1024 --observe`` (picker CPU per SSE chunk,
  above its idle rate, medians of 3 rounds): at 879605d, before the coalescing below, one stream 27.8
  / 20.9 µs (``--requests 10``). Then the I/O thread reads an observed connection at most every 5
  ms (:mod:`epp.wire._fast`, ``set_observe_coalesce``; the observer has a cluster of its own, so
  such a connection carries no routing stream): strace over 10 s of one stream (a chunk every 2 ms)
  counts 1,871 epoll_wait and as many recvfrom, against 4,498 epoll_wait, recvfrom and sendto each
  processed. Four runs with it (the first two with earlier forms of it: the whole thread asleep,
  then each window's end watched again with epoll_ctl), processed / observed, one stream: 30.2 / 12.7,
  28.8 / 12.7, 27.8 / 16.1 (``--requests 10``), 18.0 / 20.7 (``--requests 16``); 16 streams: 8.8 /
  4.9, 5.4 / 3.0, 4.1 / 3.4 (``--requests 48``). At one stream what is left is the wake-up, whose price on these shared
  virtual cores swings from run to run (no other load: the last pair is the outlier); the medians
  over the runs, 28.3 / 14.4 µs at one stream (a 1,024-token stream ~14.7 ms of picker CPU) and 5.4
  / 3.4 at 16. Envoy's own CPU per 1,024-event request 113-136 / 80-98 ms (no ext_proc: 56-72).
  Envoy multiplexes the observer cluster's streams onto few connections, and a connection was lent
  with four busy streams at most (the limit measured for answered ones), so sixteen observed streams
  were the event loop's, read at every wake-up: on a slower machine (at b1d0451) that cost more than
  answering them, 23.7 against 11.0 µs a chunk (``--events 1024 --streams 16 --rounds 3 --requests 32
  --observe``; strace over 25 s: 14,337 epoll_pwait and reads observed against 8,235 and 6,827 writes
  processed). A connection of observed streams only is now lent with up to 32 of them
  (``LEND_MAX_OPEN`` in :mod:`epp.wire._fast`): the same command, 3.3 against 12.1 µs, and again with
  ``--streams 1,16 --requests 16``: 3.3 against 13.3 at 16 streams, 27.6 against 41.8 at one (one
  stream is not affected).
* non-streamed, ``python bench/extproc_overhead.py --sizes 1024 --connections 1 --rounds 5 --floor
  --observe`` at 879605d: P50 added 0.62 / **0.52 ms** (the no-work floor, which processes
  responses, 0.52), P99 1.41 / 1.25 ms, picker CPU 0.347 / 0.374 ms a request (a second stream, and
  the request's headers parsed on it), 1,061 / 1,162 requests a second. Not reproduced at cd30759 (two
  runs, a busier machine): P50 added 0.62 / 0.63 and 0.66 / 0.62 ms (floor 0.49, 0.53), picker CPU
  0.334 / 0.393 and 0.368 / 0.404 ms: level at P50, observing 8-18% more CPU a short request.
* a timer per waiting routed stream (aac5ee9, before the sweep of :class:`Observed`) held every
  request for the timer's 10 s: at ~1,100 requests a second 5,890 of them alive at once, 171,000
  objects for the collector against 21,500 processed, and its full collections took 13-71 ms
  (``gc.callbacks`` in the picker): P99 15.9-17.4 ms, 0.42-0.51 ms of CPU a request. None since.
* reading every observed connection the event loop reads (not lent: short streams, or more than 4)
  at most once a coalescing window, as the I/O thread reads those it holds (c27c6ec, reverted:
  after each read the socket paused, a 5 ms timer to read it again): **more** CPU, not less. ``python
  bench/routing_quality.py --workloads a,b --policies "default+observe@BASE,default+observe" --rounds
  2`` (16 output tokens, 16-39 requests a second), picker above idle 4.88 against 4.04 CPU-s per 1,000
  requests without it (a 5.52 / 4.62, b 4.23 / 3.52; the request path 3.85 / 3.12). At that rate a
  window rarely holds more than one message a read would have had anyway, and each window costs its
  own wake-up (the timer) and two epoll_ctl; the wake-up a message is not saved, it is moved.

Not the default: upstream's configurations and the gateways process responses, plugins cannot set
response headers on an observed one, and with several picker replicas behind one Envoy cluster a
request's two streams may reach different replicas (see epp/envoy/bootstrap.py).

Security: the picker overwrites ``x-gateway-destination-endpoint`` and removes every other
client-sent ``x-gateway-destination-endpoint*`` header; it only ever names pool members. (The
Envoy configs in deploy/ also strip the header before ext_proc, for when the picker is down.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.envoy.bootstrap import OBSERVED_HEADER
from epp.errors import EppError, Reason
from epp.extproc.answers import (
    BUFFERED,
    CONTINUE_REQUEST_HEADERS,
    CONTINUE_REQUEST_TRAILERS,
    CONTINUE_RESPONSE_BODY,
    CONTINUE_RESPONSE_HEADERS,
    CONTINUE_RESPONSE_TRAILERS,
    END_OF_REQUEST_BODY,
    END_OF_RESPONSE_BODY,
    FULL_DUPLEX,
    MAX_STREAMED_CHUNK,
    NONE,
    headers_of,
    immediate,
    mode_name,
    observed_token,
    response_headers_answer,
    routing_answer,
    streamed_body,
    subset_hint,
    token_metadata,
)
from epp.extproc.models import is_models_request, models_answer
from epp.extproc.parsing import parse_request
from epp.extproc.usage import TAIL_CHUNKS, Usage, usage_of
from epp.framework import LogLimiter, Outcome
from epp.requestcontrol import stepping
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.requestcontrol.metrics import RequestMetrics
from epp.requestcontrol.tracing import RequestTrace
from epp.wire._fast import header_map
from epp.wire.http2 import Handler, Status, Stream

__all__ = ["METHOD", "ExternalProcessor", "Observed"]

log = logging.getLogger(__name__)

_Answers = list[pb.ProcessingResponse]

OBSERVER_WAIT = 10.0
"""Seconds a routed stream of an observed response waits, after it ended, for its observer (which Envoy
opens right after the route): past that the request is finished without it (see _Call._finish)."""
_OBSERVED = OBSERVED_HEADER.encode()


_REQUEST_HEADERS = pb.ProcessingRequest.DESCRIPTOR.fields_by_name["request_headers"].number
_RESPONSE_HEADERS = pb.ProcessingRequest.DESCRIPTOR.fields_by_name["response_headers"].number


def _headers(data: bytes, field: int, parsed: pb.HttpHeaders) -> dict[str, str]:
    """The headers of the message ``data`` at ``field``, read by C from the bytes (a third of the
    time upb's objects take, header by header); from the parsed message when C leaves it (None: a
    message not written plainly, see epp/wire/_fast.c) or there are no bytes (tests' calls)."""
    if data:
        headers = header_map(data, field)
        if headers is not None:
            return headers
    return headers_of(parsed)


class _Stream:
    """The state of one ext_proc stream (one HTTP request), and its answer to each message."""

    __slots__ = (
        "_director",
        "_max_body",
        "_tally",
        "body_ended",
        "chunks",
        "done",
        "headers",
        "hooks",
        "later",
        "model",
        "observed",
        "observer",
        "outcome",
        "pending",
        "request_mode",
        "response_mode",
        "routed",
        "size",
        "sse",
        "subset",
        "subset_filter",
        "token",
        "trace",
    )  # fmt: skip

    def __init__(self, director: Director, max_body: int, tally: Stream, subset_filter: bool = True) -> None:
        self._director = director
        self._max_body = max_body
        self.subset_filter = subset_filter  # honour the gateway's subset hint (--disable-endpoint-subset-filter)
        # The response body's size and last chunks, kept on the wire stream, whose C read path
        # answers and tallies the chunks between the first and the last (see response_body).
        self._tally = tally
        tally.keep_tail(TAIL_CHUNKS)
        self.request_mode = FULL_DUPLEX
        self.response_mode = FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.routed: RoutedRequest | None = None
        self.hooks: Callable[[], object] | None = None  # the pick's pre_request hooks, run once its answers are out
        self.done = False  # the request phase has been answered (routed)
        self.pending: str | None = None  # the message that asked to route: headers, body or trailers
        # A routed request whose response_received hooks run in another process answers the response
        # headers later (epp.requestcontrol.remote): the headers' answer waits on this (see route()).
        self.later: asyncio.Future[Mapping[str, str] | None] | None = None
        self.outcome: Outcome = "cancelled"
        self.model: str | None = None  # known once the body is parsed
        self.sse = False
        self.body_ended = False
        self.trace: RequestTrace | None = None  # only with --tracing (epp.requestcontrol.tracing)
        # Observed responses (see the module docstring): a routed stream's token (when Envoy announced
        # an observer), and the call that observes its response; an observing stream's ``observed``
        # is set (it answers nothing).
        self.token: str | None = None
        self.observer: _Call | None = None
        self.observed = False

    # -- the request phase ---------------------------------------------------------------------

    def request_headers(self, message: pb.ProcessingRequest, data: bytes = b"") -> _Answers | None:
        """The answers to the request headers, or None when the request is to be routed now (:meth:`route`).

        ``data``: the message as it came (its headers are read from it in C: :func:`_headers`)."""
        if self.done:  # routing again would lose the first pick, never finished: fail the stream
            raise RuntimeError("Envoy sent request headers after the request was routed")
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        self.headers = _headers(data, _REQUEST_HEADERS, message.request_headers)
        self.subset = subset_hint(message) if self.subset_filter else None
        tracing = getattr(self._director, "tracing", None)  # a director stand-in (tests) may have none
        if tracing is not None:
            self.trace = tracing.start(self.headers)
        mode = self.request_mode
        if message.request_headers.end_of_stream or mode == NONE:
            if is_models_request(self.headers):  # the pool's union, from the picker (epp.extproc.models)
                union = models_answer(self._director.datastore.endpoints())
                if union is not None:
                    return [union]
            self.pending = "headers"
            return None
        if mode == BUFFERED:
            return [CONTINUE_REQUEST_HEADERS]
        if mode != FULL_DUPLEX:
            raise EppError(
                Reason.UNSUPPORTED,
                f"the gateway sends request bodies in {mode_name(mode)} mode; "
                "the endpoint picker needs FULL_DUPLEX_STREAMED (or BUFFERED)",
            )
        return []  # held: the pick needs the body

    def request_body(self, body: pb.HttpBody) -> _Answers | None:
        """The answers to a body chunk (none until the body is whole), or None to route now."""
        if self.done:
            raise RuntimeError("Envoy sent request body after the request was routed")
        if body.body:
            self.size += len(body.body)
            if self.size > self._max_body:
                raise EppError(
                    Reason.BODY_TOO_LARGE,
                    f"request body exceeds the limit of {self._max_body} bytes (--max-request-body-bytes)",
                )
            self.chunks.append(body.body)
        if not body.end_of_stream:
            return []
        self.pending = "body"
        return None

    def request_trailers(self) -> _Answers | None:
        if self.done:
            return [CONTINUE_REQUEST_TRAILERS]
        self.pending = "trailers"  # trailers end the body
        return None

    async def route(self) -> _Answers:
        """Route the request as the last request message asked (headers, body or trailers); the answers."""
        kind, self.pending = self.pending, None
        if kind == "response_headers":  # hook: the headers' answer from another process (see response_headers)
            later, self.later = self.later, None
            added = await later if later is not None else None
            return [response_headers_answer(added) if added else CONTINUE_RESPONSE_HEADERS]
        if kind == "headers":
            routed = await self._route(b"")
            return [routing_answer(routed, self.headers, "request_headers", self._propagated())]
        answers = await self._release_body(end_of_stream=kind == "body")
        if kind == "trailers":
            answers.append(CONTINUE_REQUEST_TRAILERS)
        return answers

    async def _release_body(self, *, end_of_stream: bool) -> _Answers:
        """Route the whole body received, then the answers that release it to the pick."""
        chunks = self.chunks
        whole = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        routed = await self._route(whole)
        if self.request_mode == BUFFERED:
            # Envoy already has its headers answer; in BUFFERED mode the body answer may still
            # mutate the request headers, and the body itself goes on unchanged.
            return [routing_answer(routed, self.headers, "request_body", self._propagated())]
        answers = [routing_answer(routed, self.headers, "request_headers", self._propagated())]
        size = len(whole)
        if size <= MAX_STREAMED_CHUNK:
            if size:
                answers.append(streamed_body("request_body", whole, end_of_stream))
            elif end_of_stream:
                answers.append(END_OF_REQUEST_BODY)
            return answers
        view = memoryview(whole)
        for start in range(0, size, MAX_STREAMED_CHUNK):
            end = start + MAX_STREAMED_CHUNK
            answers.append(streamed_body("request_body", bytes(view[start:end]), end_of_stream and end >= size))
        return answers

    async def _route(self, body: bytes) -> RoutedRequest:
        director = self._director
        trace = self.trace
        if trace is None:
            request = parse_request(self.headers, body, base_models=director.base_models)
            self.model = request.model  # a refusal after parsing is counted under it
            self.routed = await director.route(request, self.subset, after=self._keep_hooks)
        else:
            trace.parse_started()
            request = parse_request(self.headers, body, base_models=director.base_models)
            self.model = request.model
            trace.parsed(request)
            self.routed = await director.route(request, self.subset, trace, after=self._keep_hooks)
            trace.routed()
        self.done = True
        return self.routed

    def _keep_hooks(self, hooks: Callable[[], object]) -> None:
        self.hooks = hooks  # (the call hands them to the wire once it has sent the pick's answers)

    def _propagated(self) -> dict[str, str] | None:
        """The trace context the model server gets (``traceparent``), when the request is traced."""
        return self.trace.headers if self.trace is not None else None

    # -- the response phase --------------------------------------------------------------------

    def response_headers(self, message: pb.HttpHeaders, data: bytes = b"") -> pb.ProcessingResponse | None:
        """The answer to the response headers, or None when it is to come from :meth:`route` (a future).

        ``data``: the ProcessingRequest as it came (see :meth:`request_headers`)."""
        routed = self.routed
        headers = _headers(data, _RESPONSE_HEADERS, message)
        self.sse = headers.get("content-type", "").startswith("text/event-stream")
        added = routed.response_headers(headers) if routed is not None else None
        if message.end_of_stream:
            self.outcome = "complete"
        if isinstance(added, asyncio.Future):  # hook: hooks in another process decide (epp.requestcontrol.remote)
            self.later = added
            self.pending = "response_headers"
            return None
        return response_headers_answer(added) if added else CONTINUE_RESPONSE_HEADERS

    def response_body(self, body: pb.HttpBody) -> pb.ProcessingResponse:
        chunk = body.body
        routed = self.routed
        tally = self._tally
        if chunk:
            if not tally.response_bytes:  # the first chunk: the response has started
                if routed is not None:
                    routed.response_body_started()
                if self.observed:
                    tally.echo_response_bodies(observed=True)  # the chunks up to the last are taken in C
                elif self.response_mode == FULL_DUPLEX:
                    tally.echo_response_bodies()  # the chunks up to the last are answered in C
            tally.tally(chunk)
        if body.end_of_stream:
            self.outcome = "complete"
            self.body_ended = True  # read its usage once the answer is out (see account_response_end)
        if self.response_mode != FULL_DUPLEX:
            return CONTINUE_RESPONSE_BODY
        if chunk or not body.end_of_stream:
            return streamed_body("response_body", chunk, body.end_of_stream)
        return END_OF_RESPONSE_BODY  # the usual last message: nothing but end_of_stream

    def response_trailers(self) -> pb.ProcessingResponse:
        self.outcome = "complete"
        return CONTINUE_RESPONSE_TRAILERS

    def account_response_end(self) -> None:
        """The ended response's size and usage, to the routed request (after the last answer went out)."""
        routed = self.routed
        if routed is not None and self.body_ended:
            tally = self._tally
            usage = _usage(tally.tail(), self.sse)
            tokens = (usage.prompt_tokens, usage.completion_tokens) if usage else None
            routed.response_ended(tally.response_bytes, tokens)


_unmatched_limit = LogLimiter(60.0)


def _unmatched(token: str) -> None:
    """An observed response names no request of this picker: say so, once a minute at most."""
    held = _unmatched_limit.allow()
    if held is not None:
        log.warning(
            "an observed response (token %r) names no request this picker routed and has not finished: "
            "routed by another replica, or before a restart, or observed too late "
            "(after %.0f s). Its response is not accounted here (sizes, usage, in-flight release at its end)%s",
            token,
            OBSERVER_WAIT,
            f"; {held} more such responses in the last minute" if held else "",
        )


_dropped_headers_logged = False


def _headers_dropped() -> None:
    global _dropped_headers_logged
    if not _dropped_headers_logged:
        _dropped_headers_logged = True
        log.warning(
            "a plugin's response_received hook sets response headers, which an observed response cannot "
            "carry (Envoy's observability mode reads no answer): they are dropped. Process responses "
            "instead (epp envoy-config --observe-responses=false) where the client needs them"
        )


def _usage(tail: list[bytes], sse: bool) -> Usage | None:
    """The response's usage, if its tail has one; never an exception on the response path."""
    if not tail:
        return None
    try:
        return usage_of(tail, stream=sse)
    except Exception:  # a reading bug must not break a response the client is receiving
        log.debug("could not read the response's usage", exc_info=True)
        return None


METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class ExternalProcessor:
    """``envoy.service.ext_proc.v3.ExternalProcessor`` backed by a :class:`epp.requestcontrol.Director`.

    :meth:`methods` is its entry in a :class:`epp.wire.server.GrpcServer`'s method table: each
    stream Envoy opens becomes a :class:`_Call`.
    """

    def __init__(
        self,
        director: Director,
        metrics: RequestMetrics,
        *,
        max_request_body_bytes: int,
        subset_filter: bool = True,
        streams: StreamSink | None = None,
        observed: Observed | None = None,
    ) -> None:
        self._director = director
        self._metrics = metrics
        self._max_body = max_request_body_bytes
        self._subset_filter = subset_filter  # False: every pool endpoint is a candidate, whatever the hint
        self._streams = streams  # --enable-grpc-stream-metrics: told of each stream's start and end
        self._observed = Observed() if observed is None else observed  # (a --workers process's: epp.server.workers)

    def methods(self) -> dict[str, Handler]:
        return {METHOD: self.open}

    def open(self, wire: Stream) -> _Call:
        """A call for the new ext_proc stream ``wire``."""
        stream = _Stream(self._director, self._max_body, wire, self._subset_filter)
        call = _Call(stream, wire, self._metrics, self._observed)
        if self._streams is not None:
            call.count(self._streams)
        return call


class Observed:
    """The routed streams whose responses another stream may observe, by their tokens.

    A token is this process's (a random prefix: a token from a picker before a restart names nothing
    here) and unique in it (a counter), :data:`~epp.extproc.answers.TOKEN_LENGTH` characters. Only a
    routing stream whose gRPC metadata announces an observer gets one; it is here from its routing
    answer until its observer comes (at once, normally) or :data:`OBSERVER_WAIT` has passed after the
    stream ended (:meth:`wait`).

    No timer per request: one sweep a second over the waiting tokens, oldest first, so that an
    observed stream is let go as soon as its observer takes it (a timer holds each routed stream,
    with its request, for the whole wait: measured, its full collections stalled the loop for up to
    71 ms; the module docstring has the figures).

    A ``--workers`` process (:mod:`epp.server.workers`) extends it: its tokens name the request in the
    owner process, :meth:`claim` takes over a request another worker routed, and :meth:`taken` lets
    go of one whose response another worker observes.
    """

    __slots__ = ("_calls", "_counter", "_prefix", "_sweep", "_waiting")

    def __init__(self) -> None:
        self._prefix = os.urandom(4).hex()
        self._counter = itertools.count(1)
        self._calls: dict[str, _Call] = {}
        self._waiting: deque[tuple[float, str]] = deque()  # (deadline, token), oldest first
        self._sweep: asyncio.TimerHandle | None = None

    def token(self, routed: RoutedRequest) -> str:
        """A new token for ``routed``, unique in this process."""
        return f"{self._prefix}{next(self._counter):016x}"

    def claim(self, token: str) -> RoutedRequest | None:
        """The request of ``token``, which no stream of this process routed, when another process of
        this picker did and hands it over (a ``--workers`` sibling); None: nothing to account here."""
        return None

    def add(self, call: _Call, routed: RoutedRequest) -> str:
        token = self.token(routed)
        self._calls[token] = call
        return token

    def pop(self, token: str) -> _Call | None:
        return self._calls.pop(token, None)

    def taken(self, token: str) -> None:
        """A stream of another process observes the response of ``token``'s request and finishes it
        there: its routing stream here lets it go."""
        call = self._calls.pop(token, None)
        if call is not None:
            call.observed_elsewhere()

    def wait(self, token: str) -> None:
        """The routed stream of ``token`` has ended and waits for its observer, until OBSERVER_WAIT has passed."""
        self._waiting.append((time.monotonic() + OBSERVER_WAIT, token))
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(min(1.0, OBSERVER_WAIT), self._expire)

    def _expire(self) -> None:
        self._sweep = None
        waiting, now = self._waiting, time.monotonic()
        while waiting and waiting[0][0] <= now:
            call = self._calls.pop(waiting.popleft()[1], None)
            if call is not None:
                call.not_observed()
        if waiting:
            self._sweep = asyncio.get_running_loop().call_later(min(1.0, OBSERVER_WAIT), self._expire)

    def __len__(self) -> int:
        return len(self._calls)


class StreamSink(Protocol):
    """Where ``--enable-grpc-stream-metrics`` records each ext_proc stream
    (:class:`epp.requestcontrol.metrics.StreamMetrics`, or a worker's relay to its owner)."""

    def opened(self) -> None: ...

    def closed(self, code: str, seconds: float) -> None: ...


class _Call:
    """One ext_proc stream on the wire: decodes each message, answers it, ends the stream.

    Messages are handled in order as they arrive. The response phase's (headers, each body chunk,
    trailers) are answered at once, in the connection's read, with no task and no await. A request
    message that completes the request starts the route (:func:`epp.requestcontrol.stepping.start`):
    it runs at once, in the read, and when nothing makes it wait (admission lets it through, no
    plugin prepares data on a thread) its answers are sent there and leave in the read's own write;
    a route that waits goes on in a task, and the messages arriving meanwhile wait in a queue that
    it then works off.
    """

    __slots__ = (
        "_code", "_finished", "_metrics", "_observed", "_opened", "_queue", "_stream", "_streams", "_task", "_wire",
    )  # fmt: skip

    def __init__(self, stream: _Stream, wire: Stream, metrics: RequestMetrics, observed: Observed) -> None:
        self._stream = stream
        self._wire = wire
        self._metrics = metrics
        self._observed = observed
        self._queue: deque[bytes | None] | None = None  # while a task runs: what came in meanwhile (None: half-close)
        self._task: asyncio.Task[None] | None = None
        self._finished = False
        self._streams: StreamSink | None = None  # (count())
        self._opened = 0.0
        self._code = "Canceled"  # the gRPC status the stream ends with, unless it is ended here (see _finish)

    def count(self, streams: StreamSink) -> None:
        """Tell ``streams`` of this stream: now, and when it ends (with its status and how long it was open)."""
        self._streams = streams
        self._opened = time.monotonic()
        streams.opened()

    # -- what the wire calls ------------------------------------------------------------------

    def message(self, data: bytes) -> None:
        if self._queue is not None:
            self._queue.append(data)
        elif self._handle(data):
            self._queue = deque()
            self._task = stepping.start(self._run())  # None: routed already, in this read (see the class docstring)

    def half_close(self) -> None:
        if self._queue is not None:
            self._queue.append(None)
        else:
            self._half_closed()

    def cancel(self) -> None:
        task = self._task
        if task is not None:
            task.cancel()  # _run's end finishes the request (an admission wait leaves the queue)
        else:
            self._finish()

    # -- handling -----------------------------------------------------------------------------

    def _handle(self, data: bytes) -> bool:
        """Answer one message; True when the request is to be routed now (see :meth:`message`)."""
        stream = self._stream
        try:
            message = pb.ProcessingRequest.FromString(data)
            kind = message.WhichOneof("request")
            if message.observability_mode:  # Envoy watches the response here and reads no answer
                self._observe(message, kind, data)
            elif kind == "response_body":  # the common message of a streamed response first
                self._wire.send(stream.response_body(message.response_body).SerializeToString())
            elif kind == "request_body":
                answers = stream.request_body(message.request_body)
                if answers is None:
                    return True
                self._send(answers)
            elif kind == "request_headers":
                answers = stream.request_headers(message, data)
                if answers is None:
                    return True
                self._send(answers)
            elif kind == "response_headers":
                answer = stream.response_headers(message.response_headers, data)
                if answer is None:  # hook: answered once another process decides, by the route (see _Stream)
                    return True
                self._wire.send(answer.SerializeToString())
            elif kind == "request_trailers":
                answers = stream.request_trailers()
                if answers is None:
                    return True
                self._send(answers)
            elif kind == "response_trailers":
                self._wire.send(stream.response_trailers().SerializeToString())
        except Exception as error:
            self._failed(error)
            return False
        if stream.outcome == "complete":
            # The response's last answer is sent: end the stream (status OK) rather than wait for Envoy.
            self._end()
        return False

    def _observe(self, message: pb.ProcessingRequest, kind: str | None, data: bytes) -> None:
        """A message of an observed response (``epp envoy-config --observe-responses``): the same
        accounting as the response phase's, and no answer. The first names the routed stream."""
        stream = self._stream
        if not stream.observed:
            token = observed_token(message)
            routed_call = self._observed.pop(token) if token else None
            routed = routed_call._stream if routed_call is not None else None
            if routed is not None:  # (a routed stream is here until it is finished, or taken)
                stream.routed, stream.trace, stream.model = routed.routed, routed.trace, routed.model
                routed.observer = self
                routed.trace = None  # (the observer ends the trace with the response)
            else:
                claimed = self._observed.claim(token) if token else None
                if claimed is None:
                    # Not routed by this picker (another replica, a picker before a restart), or already
                    # ended: nothing to account; the stream ends at once rather than carry the response.
                    # No token: a response the picker did not route (its own refusal, Envoy's local
                    # reply when the picker could not be reached), nothing to say.
                    if token:
                        _unmatched(token)
                    self._end()
                    return
                stream.routed = claimed  # a --workers sibling routed it (its process ends its trace)
            stream.observed = True
            stream.done = True
        if kind == "response_body":
            stream.response_body(message.response_body)
        elif kind == "response_headers":
            answer = stream.response_headers(message.response_headers, data)
            if answer is not CONTINUE_RESPONSE_HEADERS:  # (a hook's future or headers: Envoy takes none here)
                stream.pending = stream.later = None
                _headers_dropped()
        elif kind == "response_trailers":
            stream.response_trailers()

    async def _run(self) -> None:
        try:
            await self._route()
            queue = self._queue
            while queue and not self._finished:
                data = queue.popleft()
                if data is None:
                    self._half_closed()
                elif self._handle(data):
                    await self._route()
        except asyncio.CancelledError:
            self._finish()  # the stream was reset (Envoy or its client went away)
        finally:
            self._queue = None
            self._task = None

    async def _route(self) -> None:
        try:
            answers = await self._stream.route()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._failed(error)
            return
        # The routing answer goes now, not after what else this loop turn runs; one write (send_all).
        serialized = [answer.SerializeToString() for answer in answers]
        stream = self._stream
        if stream.routed is not None and stream.token is None and serialized and _OBSERVED in self._wire.headers:
            # Envoy observes the response on another stream (its gRPC metadata says so): the request's
            # token, which that stream's messages will carry. Processed responses need none.
            stream.token = self._observed.add(self, stream.routed)
            serialized[0] += token_metadata(stream.token)
        if stream.response_mode == NONE and stream.routed is not None:
            self._wire.idle()  # (Envoy sends no response here: the I/O thread may hold the connection)
        if stream.outcome == "complete":
            self._end(*serialized)
        else:
            self._wire.send_all(serialized)
            self._after_answers()

    def _send(self, answers: _Answers) -> None:
        send = self._wire.send
        for answer in answers:
            send(answer.SerializeToString())

    def _half_closed(self) -> None:
        if self._stream.done and not self._stream.observed:
            self._stream.outcome = "complete"  # Envoy closed the stream cleanly after the request phase
        # (An observed response completes with its end_of_stream or trailers; its stream closed before
        # that, the HTTP stream went away first.)
        self._end()

    def _failed(self, error: Exception) -> None:
        """An error on the request path: an HTTP answer while there is time, else the stream fails."""
        stream = self._stream
        stream.outcome = "error"
        if stream.done:  # too late for an HTTP answer: fail the stream
            if not isinstance(error, EppError):
                log.error("error after routing request %s: %r", stream.headers.get("x-request-id", "?"), error)
            self._wire.finish(Status.UNKNOWN, f"{type(error).__name__}: {error}")
            self._code = "Unknown"
            self._finish()
            return
        if not isinstance(error, EppError):
            log.error(
                "unexpected error while processing request %s",
                stream.headers.get("x-request-id", "?"),
                exc_info=error,
            )
            error = EppError(Reason.INTERNAL, "internal error in the endpoint picker")
            if stream.trace is not None:
                stream.trace.failed(None)
        elif stream.trace is not None:
            stream.trace.failed(error)
        self._metrics.refused(error, stream.model)
        self._end(immediate(error).SerializeToString())

    def _end(self, *last: bytes) -> None:
        self._wire.send_all(last, end=True)
        self._code = "OK"
        # The request's accounting (usage, in-flight release, series) once the last answers are written:
        # in a read, its write is at the read's end, and Envoy holds the response until they arrive.
        self._wire.after_write(self._finish)

    def _after_answers(self) -> None:
        """The pick's pre_request hooks, now that its answers are sent: they run once those are written
        (at the end of the read, or at once in a task, whose send_all wrote them). A stream that ends
        with its routing answers runs them at its end instead (RoutedRequest.finish runs them first)."""
        stream = self._stream
        hooks = stream.hooks
        if hooks is not None:
            stream.hooks = None
            self._wire.after_write(hooks)

    def _finish(self) -> None:
        """Finish the routed request exactly once, with the stream's outcome (or leave that to the
        stream that observes its response, if that has not ended)."""
        if self._finished:
            return
        self._finished = True
        if self._streams is not None:
            self._streams.closed(self._code, time.monotonic() - self._opened)
        stream = self._stream
        if stream.token is not None and stream.observer is None:
            # Envoy ends this stream once the request is routed; the observing stream opens right
            # after (its request headers) and finishes the request when the response ends.
            self._observed.wait(stream.token)
            return
        observer = stream.observer
        if observer is not None and not observer._finished:
            return  # the observer finishes the request when the response ends
        self._finish_request()

    def observed_elsewhere(self) -> None:
        """Another process's stream observes this routed request's response and finishes the request
        there (``--workers``: :meth:`Observed.taken`): this stream lets it go, ending only its trace."""
        stream = self._stream
        stream.routed = stream.token = None
        trace, stream.trace = stream.trace, None
        if trace is not None:  # (its request span ends here, without the response's: that is in the other process)
            trace.end("observed", None)

    def not_observed(self) -> None:
        """No stream came to observe this routed request's response (it went to another process): the
        request is finished as its own stream ended, without the response's accounting."""
        if self._stream.observer is None:
            self._finish_request()

    def _finish_request(self) -> None:
        stream = self._stream
        if stream.routed is not None:
            stream.account_response_end()
            stream.routed.finish(stream.outcome)
        if stream.trace is not None:
            stream.trace.end(stream.outcome, stream.routed)
