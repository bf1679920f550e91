"""The KV-event subscriber: ZMQ SUB sockets that follow each pod's event stream into a KVEventIndex.

Identity. Every message is attributed to a pod the *pool* names (``ip:port`` of its server, ``@rank``
appended for a data-parallel rank > 0 of one server), never to a topic alone. Two directions, as
vLLM's endpoint setting implies:

* **connect** (:meth:`KVEventSubscriber.follow`): the pod binds ``tcp://*:PORT`` (rank r on PORT + r) and
  the subscriber connects one SUB socket per pod, so the socket says which pod sent a message. The
  topic is checked all the same: one that does not start with ``topic_filter`` is dropped (vLLM's
  default topic is ``""``, llm-d's ``kv@<pod ip>@<model>``), and one that names another address
  than the pod's is applied to the socket's pod but counted; both are logged (at most once a minute
  per pod and reason) and counted in ``stats.rejected[reason]``, so a misconfigured pod is a log line
  and a metric, not scores silently stuck at 0.
* **bind** (``bind=...``): pods connect to the subscriber's one bound socket; a message is accepted only
  when its topic ``kv@<ip>[:<port>]@<model>`` (or ``kv@<pod name>@<model>``) names a pod the pool
  has (:meth:`allow`) *and* the TCP peer address is that pod's ip. A topic with the ip alone (llm-d's)
  names the pool's one endpoint on that ip, or, when the pool has one endpoint per data-parallel
  rank on that ip, the rank's (by port order). Anything else is dropped, logged and counted
  (``unknown_pod``, ``peer``, ``ambiguous``, ``topic``).

Order. Per pod (and rank) the 8-byte seq must grow by one. A seq not above the last one is a publisher
restart: the pod's blocks are cleared and the stream followed from there (``resets``). A seq that skips
is a gap (``gaps``): with a replay endpoint for the pod (vLLM's ROUTER ``replay_endpoint``) the missing
batches are asked for (``[b"", start seq]``, answered ``[b"", topic, seq, payload]``… then an empty
seq / ``-1`` end marker) and applied in order (``replays``), batches arriving meanwhile held back;
without one, or when the replay does not cover the hole, the pod's blocks are dropped
(:meth:`KVEventIndex.mark_unknown`). A lost connection (socket monitor) marks the pod unknown until
fresh events arrive; its next message is then taken as the start of a new stream. A batch that does
not decode is counted in ``decode_errors`` and skipped: a broken publisher never stops the subscriber.

Late starts. A SUB socket misses what its publisher sent before the subscription reached it (the
subscriber started after the server, or the server published before it connected: one real run's
first delivered seq was 281). Where the pod has a replay endpoint, each connection to its publisher
(the monitor's handshake event: the subscription is on its way by then) asks for the publisher's
whole buffer (``[b"", 0]``, open-ended, up to the end marker) before any batch of the stream is
applied, and live batches arriving meanwhile are held back; after it, a held batch whose seq and
timestamp equal a replayed one is the same batch and skipped, anything else goes through the usual
checks (a lower seq with another timestamp is a restart). Asking at connection time, not when a
first live message shows that the stream started late, matters for a pod that published and then
stayed quiet: no later message would reveal what it holds. Only the buffer can be had (vLLM keeps its
last ``buffer_steps`` batches): blocks stored before it are missing, as they would be for any late
subscriber, and a removal of a block the index never had is a no-op. Should the replay's connection
overtake the subscription on its way (a sub-millisecond window on one host), a batch in between is
seen as a gap by the next one and replayed then. Without a replay endpoint, a late start is taken as
it comes: the stream is followed from its first delivered batch. In bind mode a pod's replay endpoint
comes with :meth:`allow` (rank r's at its port + r, as vLLM binds them). vLLM's rank r also *connects*
to the configured port + r, so the socket binds the bound port + r too, for as many ranks as the pool
has endpoints on one ip, or as a server says it runs behind one endpoint (:meth:`expect_ranks`, from
:mod:`epp.prefix.kvsources`) (``rank_endpoints``; a port already taken is logged, and that rank's
events are lost). A connection accepted from a
pod's ip asks, 50 ms later (the peer's handshake and this socket's subscription done by then), for
the buffer of each pod on that ip whose stream is not known yet (rank 0's: which rank connected
cannot be told; a later rank's first message starts its replay), and gaps are replayed as above.

Event loop. Sockets are plain (synchronous) pyzmq sockets whose file descriptors are watched by the
asyncio loop (``add_reader``): one wake-up drains every message waiting, decoding and applying each,
until the socket is empty or ``budget_s`` (1 ms) of work is spent; then the rest waits for the next
loop turn (``call_soon``), so an event storm delays a request's scheduling by at most one slice. The
index is touched only from that loop. The first version awaited ``recv_multipart`` once per message
(one future, one loop wake-up and a task switch each): at 10k events/s its lag was P50 132.6 ms, P99
707.8 ms. ``lag`` is the time from a batch's publisher timestamp to its application (clocks of pod
and picker must agree).

Measured (``python bench/kvevents_lag.py``: the publisher in its own process, 10 events of one
16-token block per batch, a batch each millisecond; a request probe on the same loop every 2 ms
looking an 8k-token prompt up; 2 shared cores, medians of 3 rounds of 5 s):

============================  =========  ==========  ===========  ===============  ===================
load average (other sessions)  events/s  lag P50     lag P99      CPU per event    probe P99 (idle)
============================  =========  ==========  ===========  ===============  ===================
~10 (3 rounds)                 7,644      0.18 ms     5.84 ms      10.9 µs          11.0 ms (3.9 ms)
~1.5 (one round of 4 s)        9,985      0.15 ms     0.83 ms      12.3 µs          0.9 ms (1.3 ms)
============================  =========  ==========  ===========  ===============  ===================

(CPU per event: the subscriber's process above its idle rate, ZMQ's I/O thread included; the
index's own decode + apply is ~2 µs of it, the rest the per-message wake-up and ZMQ. At load ~10
the publisher, starved too, sent 7.6k of its 10k events a second.) A *storm* of 51k blocks stored
and 51k removed a second (512-block batches every 10 ms) gave lag P99 6.3 ms and a probe P99 of
4.4 ms against 1.3 ms idle at load ~1.5, and lag P99 44 ms, probe P99 111 ms at load ~10, where the
operating system's scheduling of three busy processes on two cores dominates.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.framework.helpers import LogLimiter
from epp.prefix.kvindex import KVEventIndex, PodId
from epp.prefix.kvwire import EventBatch, WireError, decode_batch, decode_seq, rank_endpoint

__all__ = ["KVEventSubscriber", "SubscriberStats", "pod_id", "topic_address"]

_log = logging.getLogger(__name__)
_REPLAY_TIMEOUT_S = 2.0
_LAG_SAMPLES = 4096
_BUDGET_S = 0.001  # work per loop turn before yielding to requests: a scheduling pass is ~0.1-1 ms
_RCVHWM = 100_000  # messages a SUB socket queues before ZMQ drops (vLLM's publisher hwm): a gap then
_HELD_BACK = 100_000  # batches kept while a replay runs; past that the replay is given up
_END_SEQ = 2**64 - 1  # vLLM's end-of-replay marker, -1 as 8 big-endian bytes
_ACCEPTED_CATCH_UP_S = 0.05  # bind mode: from a pod's connection to its catch-up replay


def pod_id(address: str, rank: int | None = None) -> PodId:
    """The index's name for a pod's stream: ``ip:port`` of its server, ``@rank`` for rank > 0."""
    return f"{address}@{rank}" if rank else address


def topic_address(topic: str) -> str:
    """The pod address a topic names: ``kv@10.0.0.1:8000@model`` -> ``10.0.0.1:8000``, ``kv@10.0.0.1@m``
    -> ``10.0.0.1``; ``""`` when the topic has no ``@``-separated address."""
    parts = topic.split("@")
    return parts[1] if len(parts) >= 2 else ""


def _peer_ip(fd: int) -> str | None:
    """The normalised ip of the peer of the TCP socket ``fd`` (None if it is gone or not TCP)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as sock:
            peer = sock.getpeername()
    except (OSError, ValueError):
        return None
    if not isinstance(peer, tuple):
        return None
    try:
        address = ipaddress.ip_address(peer[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket's IPv4 peer
    return str(address)


def _split(address: str) -> tuple[str, int | None]:
    """``ip`` or ``ip:port`` or ``[v6]:port`` -> (normalised ip, port or None); ("", None) if not an ip."""
    host, port = address, None
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    elif address.count(":") == 1:
        host, _, port_text = address.partition(":")
        port = int(port_text) if port_text.isdigit() else None
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return "", None


@dataclass(slots=True)
class SubscriberStats:
    events: int = 0
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    resets: int = 0
    decode_errors: int = 0
    disconnects: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> messages dropped (or flagged)
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=_LAG_SAMPLES), repr=False)  # recent, s

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


class _Stream:
    """What the subscriber knows of one pod's (one rank's) sequence."""

    __slots__ = ("held_back", "last", "replaying", "started")

    def __init__(self) -> None:
        self.last: int | None = None
        self.started = False  # a first message was seen (a late start is replayed once)
        self.replaying = False
        self.held_back: list[tuple[int, EventBatch]] = []


class _Source:
    """One SUB socket: a pod's (connect mode, ``pod`` set) or the shared bound one."""

    __slots__ = ("endpoint", "fd", "monitor", "monitor_fd", "pod", "scheduled", "sock")

    def __init__(self, sock: zmq.Socket, pod: PodId | None, endpoint: str) -> None:
        self.sock = sock
        self.pod = pod
        self.endpoint = endpoint
        self.fd = int(sock.getsockopt(zmq.FD))
        self.monitor: zmq.Socket | None = None
        self.monitor_fd = -1
        self.scheduled = False


class KVEventSubscriber:
    """Follows pods' KV-event streams into ``index``; start with :meth:`start`, stop with :meth:`close`.

    ``on_reject(reason)`` is called for each message dropped or flagged (the producer counts them in a
    metric); ``on_lag(seconds)`` for each batch applied.
    """

    def __init__(
        self,
        index: KVEventIndex,
        *,
        topic_filter: str = "kv@",
        bind: str | None = None,
        clock: Callable[[], float] = time.time,
        budget_s: float = _BUDGET_S,
        on_reject: Callable[[str], None] | None = None,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.index = index
        self.stats = SubscriberStats()
        self._topic = topic_filter
        self._topic_bytes = topic_filter.encode()
        self._bind = bind
        self._clock = clock
        self._budget = budget_s
        self._on_reject = on_reject
        self._on_lag = on_lag
        self._ctx = zmq.Context()
        self._actx: zmq.asyncio.Context | None = None  # replay requests only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[PodId, _Stream] = {}
        self._replay: dict[PodId, str] = {}
        self._addresses: dict[PodId, str] = {}  # connect mode: pod -> its ip:port, for the topic check
        self._allowed: dict[str, list[tuple[int, str]]] = {}  # bind mode: ip -> [(port, hostport)], by port
        self._named: dict[str, str] = {}  # bind mode: a pod's name -> its hostport
        self._rank_binds: dict[int, str | None] = {}  # bind mode: rank > 0 -> its bound endpoint (None: failed)
        self._ranks_reported = 1  # bind mode: the most ranks a server said it runs (expect_ranks)
        self._sources: dict[str, _Source] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._warnings = LogLimiter(60.0)  # a line per (reason, publisher) a minute at most
        self._closed = False

    # -- configuration --------------------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def start(self) -> None:
        """In bind mode, bind the shared socket (raises zmq.ZMQError naming the endpoint if it cannot)."""
        if self._bind is not None and "bind" not in self._sources:
            sock = self._socket()
            sock.setsockopt(zmq.SUBSCRIBE, self._topic_bytes)
            # Watched before it binds: a publisher waiting to connect does so at once.
            monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED)
            try:
                sock.bind(self._bind)
            except zmq.ZMQError as error:
                sock.disable_monitor()
                monitor.close(0)
                sock.close(0)
                raise zmq.ZMQError(error.errno, f"cannot bind KV-event endpoint {self._bind}: {error}") from None
            source = _Source(sock, None, sock.getsockopt_string(zmq.LAST_ENDPOINT))  # (before any rank's bind)
            source.monitor = monitor
            source.monitor_fd = int(monitor.getsockopt(zmq.FD))
            self._watch("bind", source)
            loop = self._running_loop()
            loop.add_reader(source.monitor_fd, self._monitor_readable, source)
            loop.call_soon(self._monitor_readable, source)
            _log.info("KV events: listening on %s for the pool's pods", self.bound_endpoint)
            self._bind_ranks()

    def _bind_ranks(self) -> None:
        """Bind mode: vLLM's data-parallel rank r connects to the configured port + r, so the socket also
        binds the bound port + r for every rank the pool may have: as many as it has endpoints on one ip
        (one per rank: see :meth:`allow`), or a server said it runs (:meth:`expect_ranks`). A port that
        cannot be bound loses that rank's events: logged."""
        source = self._sources.get("bind")
        if source is None:
            return
        base = source.endpoint
        ranks = max([self._ranks_reported, *(len(entries) for entries in self._allowed.values())])
        for rank in range(1, ranks):
            endpoint = rank_endpoint(base, rank)
            if rank in self._rank_binds or endpoint == base:
                continue
            try:
                source.sock.bind(endpoint)
            except zmq.ZMQError as error:
                self._rank_binds[rank] = None
                _log.error("KV events: cannot bind %s for data-parallel rank %d (its events will not arrive): %s",
                           endpoint, rank, error)  # fmt: skip
            else:
                self._rank_binds[rank] = endpoint
                _log.info("KV events: listening on %s for data-parallel rank %d", endpoint, rank)

    def expect_ranks(self, count: int) -> None:
        """Bind mode: a server of the pool runs ``count`` data-parallel ranks behind one endpoint
        (:mod:`epp.prefix.kvsources`); bind a port for each."""
        if count > self._ranks_reported:
            self._ranks_reported = count
            self._bind_ranks()

    @property
    def rank_endpoints(self) -> dict[int, str | None]:
        """Bind mode: the endpoint bound for each data-parallel rank past 0 (None: it could not be)."""
        return dict(self._rank_binds)

    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        return sock

    def _watch(self, name: str, source: _Source) -> None:
        loop = self._running_loop()
        self._sources[name] = source
        loop.add_reader(source.fd, self._readable, source)
        # The descriptor is edge-triggered: messages queued before the reader was added would never
        # signal it. One drain now catches them.
        self._schedule(source)

    @property
    def bound_endpoint(self) -> str | None:
        source = self._sources.get("bind")
        return None if source is None else source.endpoint

    def allow(self, address: str, names: tuple[str, ...] = (), replay_endpoint: str | None = None) -> None:
        """Accept messages for pod ``ip:port`` on the bound socket; ``names`` are other names its topic
        may give it instead of its ip (its pod's name: llm-d's guides also write ``kv@$(POD_NAME)@model``);
        ``replay_endpoint``: its publisher's ROUTER (``tcp://ip:port``), for late starts and gaps."""
        ip, port = _split(address)
        if not ip or port is None:
            raise ValueError(f"pod address {address!r} is not ip:port")
        if replay_endpoint:
            self._replay[pod_id(address)] = replay_endpoint  # rank 0's; a rank r's is derived when it appears
        entries = self._allowed.setdefault(ip, [])
        if (port, address) not in entries:
            entries.append((port, address))
            entries.sort()
        for name in names:
            self._named[name] = address
        self._bind_ranks()

    def disallow(self, address: str) -> None:
        for name in [n for n, a in self._named.items() if a == address]:
            del self._named[name]
        for pod in [p for p in self._replay if p == address or p.startswith(address + "@")]:
            del self._replay[pod]
        ip, _ = _split(address)
        entries = self._allowed.get(ip)
        if entries is not None:
            entries[:] = [e for e in entries if e[1] != address]
            if not entries:
                del self._allowed[ip]

    def follow(
        self, pod: PodId, endpoint: str, replay_endpoint: str | None = None, *, address: str | None = None
    ) -> None:
        """Connect to ``pod``'s publisher at ``endpoint`` (``tcp://ip:port``). ``address`` is the pod's
        ``ip:port`` for the topic check (default: ``pod`` without its rank)."""
        if replay_endpoint:
            self._replay[pod] = replay_endpoint
        self._addresses[pod] = address or pod.split("@", 1)[0]
        if pod in self._sources:
            return
        sock = self._socket()
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # the socket carries this pod only; topics are checked here
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        source = _Source(sock, pod, endpoint)
        source.monitor = monitor
        source.monitor_fd = int(monitor.getsockopt(zmq.FD))
        self._watch(pod, source)
        loop = self._running_loop()
        loop.add_reader(source.monitor_fd, self._monitor_readable, source)
        loop.call_soon(self._monitor_readable, source)  # edge-triggered, as the data socket
        _log.info("KV events: following %s at %s%s", pod, endpoint,
                  f" (replay {replay_endpoint})" if replay_endpoint else "")

    def unfollow(self, pod: PodId) -> None:
        """Stop following ``pod`` (it left the pool) and drop its blocks."""
        source = self._sources.pop(pod, None)
        if source is not None:
            self._close_source(source)
        self._streams.pop(pod, None)
        self._replay.pop(pod, None)
        self._addresses.pop(pod, None)
        self.index.remove_pod(pod)

    def forget(self, pod: PodId) -> None:
        """Drop the blocks and stream state of ``pod`` (bind mode: it left the pool)."""
        self._streams.pop(pod, None)
        self.index.remove_pod(pod)

    def _close_source(self, source: _Source) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(source.fd)
            if source.monitor is not None:
                loop.remove_reader(source.monitor_fd)
        if source.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                source.sock.disable_monitor()
            source.monitor.close(0)
        source.sock.close(0)

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for source in self._sources.values():
            self._close_source(source)
        self._sources.clear()
        if self._actx is not None:
            self._actx.term()
        self._ctx.term()

    def last_seq(self, pod: PodId) -> int | None:
        """The seq of ``pod``'s last batch applied (None before the first, or after a lost connection)."""
        stream = self._streams.get(pod)
        return None if stream is None else stream.last

    # -- receiving ------------------------------------------------------------------------------

    def _readable(self, source: _Source) -> None:
        if not source.scheduled:  # else a drain is already due this turn
            self._drain(source)

    def _schedule(self, source: _Source) -> None:
        if not source.scheduled:
            source.scheduled = True
            self._running_loop().call_soon(self._drain, source)

    def _drain(self, source: _Source) -> None:
        """Receive, decode and apply what is waiting, for at most ``budget_s``; the rest next turn."""
        source.scheduled = False
        if self._closed or source.sock.closed:
            return
        sock = source.sock
        deadline = time.perf_counter() + self._budget
        bound = source.pod is None
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=not bound)
            except zmq.Again:
                return  # empty: the descriptor signals the next message
            except zmq.ZMQError as error:
                _log.debug("KV events on %s: %s", source.endpoint, error)
                return
            if len(frames) != 3:
                self.stats.decode_errors += 1
            elif bound:
                self._receive_bound(frames)  # type: ignore[arg-type]
            else:
                self._receive_connected(source.pod, frames)  # type: ignore[arg-type]
            if time.perf_counter() > deadline:
                self._schedule(source)
                return

    def _receive_connected(self, pod: PodId, frames: list[bytes]) -> None:
        topic = frames[0]
        if not topic.startswith(self._topic_bytes):
            self._reject("topic", pod, f"topic {topic.decode('utf-8', 'replace')!r} does not start with the "
                         f"filter {self._topic!r} (set the server's --kv-events-config topic, e.g. "
                         f"kv@<pod ip>@<model>, or the producer's kvEventsConfig.topicFilter)")
            return
        named = topic_address(topic.decode("utf-8", "replace"))
        ip, port = _split(named)
        if ip:  # a topic naming the pod otherwise (its pod name) cannot be checked here
            own_ip, own_port = _split(self._addresses.get(pod, pod))
            if ip != own_ip or (port is not None and port != own_port):
                # The socket says which pod this is; the topic disagrees: applied, but flagged.
                self._reject("identity", pod, f"topic names {named!r}, the pool has this publisher as {pod}; "
                             "events applied to the pool's pod")
        self._receive(pod, frames[1], frames[2])

    def _receive_bound(self, frames: list[zmq.Frame]) -> None:
        topic = frames[0].bytes.decode("utf-8", "replace")
        named = topic_address(topic)
        ip, port = _split(named)
        if not ip and named in self._named:  # the pod's name, not its ip
            named = self._named[named]
            ip, port = _split(named)
        if not ip:
            self._reject("topic", topic, f"topic {topic!r} names no pool pod (expected kv@<ip>[:<port>]@<model> "
                         "or kv@<pod name>@<model>)")
            return
        entries = self._allowed.get(ip)
        if not entries:
            self._reject("unknown_pod", topic, f"topic {topic!r}: the pool has no endpoint on {ip}")
            return
        peer = frames[0].get("Peer-Address")
        if peer is None or _split(str(peer))[0] != ip:
            self._reject("peer", topic, f"topic {topic!r} came from {peer}, not from the pod's address {ip}")
            return
        try:
            seq_frame, payload = frames[1].bytes, frames[2].bytes
            batch = decode_batch(payload)
        except WireError as error:
            self.stats.decode_errors += 1
            _log.debug("KV events for %s: %s", topic, error)
            return
        rank = batch.data_parallel_rank or 0
        address: str | None = None
        rank_in_id: int | None = None
        if port is not None:
            address = next((a for p, a in entries if p == port), None)
            rank_in_id = rank
        elif len(entries) == 1:
            address, rank_in_id = entries[0][1], rank
        elif rank < len(entries):
            address = entries[rank][1]  # one endpoint per rank on this ip: the rank's, by port order
        elif entries:
            self._reject("ambiguous", topic, f"topic {topic!r} (rank {rank}) names no single endpoint of the "
                         f"pool's {len(entries)} on {ip}; put the port in the topic (kv@<ip>:<port>@<model>)")
            return
        if address is None:
            self._reject("unknown_pod", topic, f"topic {topic!r}: the pool has no endpoint {named}")
            return
        pod = pod_id(address, rank_in_id)
        if rank_in_id and pod not in self._replay and address in self._replay:
            self._replay[pod] = rank_endpoint(self._replay[address], rank_in_id)
        self._receive(pod, seq_frame, batch)

    def _reject(self, reason: str, who: str, message: str) -> None:
        self.stats.rejected[reason] += 1
        if self._on_reject is not None:
            self._on_reject(reason)
        held = self._warnings.allow((reason, who))
        if held is not None:
            _log.warning("KV events for %s: %s%s", who, message, f" ({held} more in the last minute)" if held else "")

    def _receive(self, pod: PodId, seq_frame: bytes, payload: bytes | EventBatch) -> None:
        try:
            seq = decode_seq(seq_frame)
            batch = payload if isinstance(payload, EventBatch) else decode_batch(payload)
        except WireError as error:
            self.stats.decode_errors += 1
            _log.debug("KV events from %s: %s", pod, error)
            return
        stream = self._streams.get(pod)
        if stream is None:
            stream = self._streams[pod] = _Stream()
        if stream.replaying:
            if len(stream.held_back) >= _HELD_BACK:
                _log.warning("KV events from %s: a replay is taking too long; its blocks are dropped", pod)
                stream.replaying = False
                stream.held_back.clear()
                stream.last = None
                self.index.mark_unknown(pod)
            else:
                stream.held_back.append((seq, batch))
                return
        self._sequence(pod, stream, seq, batch)

    def _sequence(self, pod: PodId, stream: _Stream, seq: int, batch: EventBatch) -> None:
        last = stream.last
        if last is None and seq > 0 and pod in self._replay and not stream.started:
            # The stream's first message is not its first batch (we subscribed late, or the server
            # published before we connected): what it stored before can still be had.
            stream.started = True
            self._start_replay(pod, stream, 0, seq, batch)
            return
        stream.started = True
        if last is not None and seq <= last:
            self.stats.resets += 1
            self.index.clear_pod(pod)
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            if pod in self._replay:
                self._start_replay(pod, stream, last + 1, seq, batch)
                return
            self.index.mark_unknown(pod)
        self._apply(pod, stream, seq, batch)

    def _apply(self, pod: PodId, stream: _Stream, seq: int, batch: EventBatch) -> None:
        self.index.apply(pod, batch.events)
        stream.last = seq
        stats = self.stats
        stats.batches += 1
        stats.events += len(batch.events)
        lag = self._clock() - batch.ts
        lag = lag if lag > 0.0 else 0.0
        stats.lags.append(lag)
        if self._on_lag is not None:
            self._on_lag(lag)

    # -- gaps -----------------------------------------------------------------------------------

    def _start_replay(
        self, pod: PodId, stream: _Stream, start: int, stop: int | None, batch: EventBatch | None
    ) -> None:
        """Replay seqs [start, stop) before ``batch`` (seq ``stop``) and what arrives meanwhile; with
        ``stop`` None, the publisher's whole buffer from ``start`` (a connection's catch-up)."""
        stream.replaying = True
        stream.held_back = [] if batch is None else [(stop, batch)]  # type: ignore[list-item]
        task = self._running_loop().create_task(self._replay_then_resume(pod, stream, start, stop))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replay_then_resume(self, pod: PodId, stream: _Stream, start: int, stop: int | None) -> None:
        got = await self._fetch(pod, start, stop)
        if self._streams.get(pod) is not stream or not stream.replaying:
            return  # unfollowed, or given up meanwhile
        if got is None:
            if stop is not None:
                self.index.mark_unknown(pod)
        elif got:
            self.stats.replays += 1
            deadline = time.perf_counter() + self._budget
            seq = min(got) if stop is None else start
            while seq in got:  # a closed range is whole (else None); the buffer is one run
                self._apply(pod, stream, seq, got[seq])
                seq += 1
                if time.perf_counter() > deadline:  # a long replay: a slice per loop turn, as draining
                    await asyncio.sleep(0)
                    if self._streams.get(pod) is not stream or not stream.replaying:
                        return
                    deadline = time.perf_counter() + self._budget
        # What arrived during the replay, in order, through the usual checks.
        while stream.held_back:
            held, stream.held_back = stream.held_back, []
            stream.replaying = False
            for i, (seq, batch) in enumerate(held):
                if stream.replaying:  # another hole started another replay: hold the rest for it
                    stream.held_back.extend(held[i:])
                    return
                replayed = got.get(seq) if got else None
                if replayed is not None and replayed.ts == batch.ts and stream.last is not None and seq <= stream.last:
                    continue  # delivered live and in the replay: already applied
                self._sequence(pod, stream, seq, batch)
            if stream.replaying:
                return
        stream.replaying = False

    def _catch_up_ip(self, ip: str) -> None:
        """Bind mode: a publisher on ``ip`` connected; catch up each pool pod there with a replay endpoint."""
        for _, address in self._allowed.get(ip, ()):
            self._catch_up(pod_id(address))

    def _catch_up(self, pod: PodId) -> None:
        """A connection to ``pod``'s publisher is up: replay its buffer if nothing of the stream is known."""
        if pod not in self._replay or self._closed:
            return
        stream = self._streams.get(pod)
        if stream is None:
            stream = self._streams[pod] = _Stream()
        if stream.last is None and not stream.replaying:
            stream.started = True  # the late-start replay of a first live message is this one
            self._start_replay(pod, stream, 0, None, None)

    async def _fetch(self, pod: PodId, start: int, stop: int | None) -> dict[int, EventBatch] | None:
        """Seqs [start, stop) from the pod's replay endpoint; None when they could not all be had.
        With ``stop`` None, whatever the publisher holds from ``start`` on (possibly nothing)."""
        endpoint = self._replay.get(pod)
        if endpoint is None:
            return None
        if self._actx is None:
            self._actx = zmq.asyncio.Context()
        sock = self._actx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: dict[int, EventBatch] = {}
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), _REPLAY_TIMEOUT_S)
                if len(frames) != 4 or len(frames[2]) != 8:
                    break  # the end marker (an empty or -1 seq), or something else: stop
                seq = decode_seq(frames[2])
                if seq == _END_SEQ:
                    break
                if stop is None:
                    if seq >= start:
                        got[seq] = decode_batch(frames[3])
                    continue
                if start <= seq < stop:
                    got[seq] = decode_batch(frames[3])
                if seq >= stop - 1:
                    break
        except (TimeoutError, WireError, zmq.ZMQError) as error:
            _log.info("KV-event replay for %s from %s failed: %s", pod, endpoint, error)
            return None
        finally:
            sock.close(0)
        if stop is not None and len(got) != stop - start:
            return None
        return got

    # -- connections ----------------------------------------------------------------------------

    def _monitor_readable(self, source: _Source) -> None:
        monitor = source.monitor
        if monitor is None or monitor.closed or self._closed:
            return
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if event["event"] == zmq.EVENT_ACCEPTED and source.pod is None:
                ip = _peer_ip(int(event["value"]))
                if ip is not None:
                    self._running_loop().call_later(_ACCEPTED_CATCH_UP_S, self._catch_up_ip, ip)
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and source.pod is not None:
                self._catch_up(source.pod)
            elif event["event"] == zmq.EVENT_DISCONNECTED and source.pod is not None:
                self.stats.disconnects += 1
                stream = self._streams.pop(source.pod, None)
                if stream is not None:
                    stream.replaying = False
                self.index.mark_unknown(source.pod)
