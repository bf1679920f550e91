"""The KV-event subscriber: ZMQ SUB sockets that follow each pod's event stream into a KVEventIndex.

Identity. Every message is attributed to a pod the *pool* names (``ip:port`` of its server, ``@rank``
appended for data-parallel rank > 0), never to a topic alone. Two directions, as vLLM's endpoint setting
implies:

* **connect** (:meth:`KVEventSubscriber.follow`): the pod binds ``tcp://*:PORT`` (rank r on PORT + r) and the
  subscriber connects one SUB socket per pod, so the socket says which pod sent a message.
* **bind** (``bind=...``): pods connect to the subscriber's one bound socket; a message is accepted only
  when its topic ``kv@<ip>:<port>@<model>`` names a pod the pool has (:meth:`allow`) *and* the TCP peer
  address is that pod's ip; anything else is counted in ``rejected`` and dropped.

Order. Per pod (and rank) the 8-byte seq must grow by one. A seq not above the last one is a publisher
restart: the pod's blocks are cleared and the stream followed from there (``resets``). A seq that skips
is a gap (``gaps``): with a replay endpoint for the pod (vLLM's ROUTER ``replay_endpoint``) the missing
batches are asked for (``[b"", start seq]``, answered ``[b"", topic, seq, payload]``… then an empty
seq / ``-1`` end marker) and applied in order (``replays``); without one, or when the replay does not
cover the hole, the pod's blocks are dropped (:meth:`KVEventIndex.mark_unknown`). A lost connection
(socket monitor) marks the pod unknown until fresh events arrive; its next message is then taken as the
start of a new stream. A batch that does not decode is counted in ``decode_errors`` and skipped: a
broken publisher never stops the subscriber.

It runs on the asyncio loop it is started on; the index is touched only from that loop. ``lag`` is the
time from a batch's publisher timestamp to its application (clocks of pod and picker must agree).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.prefix.kvindex import KVEventIndex, PodId
from epp.prefix.kvwire import EventBatch, WireError, decode_batch, decode_seq

__all__ = ["KVEventSubscriber", "SubscriberStats", "pod_id"]

_log = logging.getLogger(__name__)
_REPLAY_TIMEOUT_S = 2.0
_LAG_SAMPLES = 4096


def pod_id(address: str, rank: int | None = None) -> PodId:
    """The index's name for a pod's stream: ``ip:port`` of its server, ``@rank`` for rank > 0."""
    return f"{address}@{rank}" if rank else address


@dataclass(slots=True)
class SubscriberStats:
    events: int = 0
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    resets: int = 0
    decode_errors: int = 0
    rejected: int = 0
    disconnects: int = 0
    lags: list[float] = field(default_factory=list)  # the last few, seconds

    def record_lag(self, lag: float) -> None:
        if len(self.lags) >= _LAG_SAMPLES:
            del self.lags[: _LAG_SAMPLES // 2]
        self.lags.append(lag)


class KVEventSubscriber:
    """Follows pods' KV-event streams into ``index``; start with :meth:`start`, stop with :meth:`close`."""

    def __init__(
        self,
        index: KVEventIndex,
        *,
        topic_filter: str = "kv@",
        bind: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.stats = SubscriberStats()
        self._topic = topic_filter.encode()
        self._bind = bind
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._last: dict[PodId, int] = {}
        self._replay: dict[PodId, str] = {}
        self._allowed: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._closed = False

    # -- configuration --------------------------------------------------------------------------

    def start(self) -> None:
        """In bind mode, bind the shared socket (raises zmq.ZMQError naming the endpoint if it cannot)."""
        if self._bind is not None and "bind" not in self._tasks:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            try:
                sock.bind(self._bind)
            except zmq.ZMQError as error:
                sock.close(0)
                raise zmq.ZMQError(error.errno, f"cannot bind KV-event endpoint {self._bind}: {error}") from None
            self._sockets["bind"] = sock
            self._tasks["bind"] = asyncio.get_running_loop().create_task(self._run_bound(sock))

    @property
    def bound_endpoint(self) -> str | None:
        sock = self._sockets.get("bind")
        return None if sock is None else sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def allow(self, address: str) -> None:
        """Accept messages for pod ``ip:port`` on the bound socket."""
        self._allowed.add(address)

    def follow(self, pod: PodId, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Connect to ``pod``'s publisher at ``endpoint`` (``tcp://ip:port``)."""
        if replay_endpoint:
            self._replay[pod] = replay_endpoint
        if pod in self._tasks:
            return
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        self._sockets[pod] = sock
        loop = asyncio.get_running_loop()
        self._tasks[pod] = loop.create_task(self._run_connected(pod, sock))
        self._tasks[pod + "#monitor"] = loop.create_task(self._run_monitor(pod, monitor))

    def unfollow(self, pod: PodId) -> None:
        """Stop following ``pod`` (it left the pool) and drop its blocks."""
        for name in (pod, pod + "#monitor"):
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
        sock = self._sockets.pop(pod, None)
        if sock is not None:
            sock.close(0)
        self._allowed.discard(pod.split("@", 1)[0])
        self._last.pop(pod, None)
        self._replay.pop(pod, None)
        self.index.remove_pod(pod)

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()
        self._ctx.term()

    # -- receiving ------------------------------------------------------------------------------

    async def _run_connected(self, pod: PodId, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                self.stats.decode_errors += 1
                continue
            await self._receive(pod, frames[1], frames[2])

    async def _run_monitor(self, pod: PodId, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.stats.disconnects += 1
                    self._last.pop(pod, None)
                    self.index.mark_unknown(pod)
        finally:
            monitor.close(0)

    async def _run_bound(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) != 3:
                self.stats.decode_errors += 1
                continue
            topic = frames[0].bytes.decode("utf-8", "replace")
            parts = topic.split("@")
            address = parts[1] if len(parts) >= 2 else ""
            peer = frames[0].get("Peer-Address")
            if address not in self._allowed or peer != address.rsplit(":", 1)[0].strip("[]"):
                self.stats.rejected += 1
                continue
            try:
                batch = decode_batch(frames[2].bytes)
            except WireError:
                self.stats.decode_errors += 1
                continue
            await self._receive(pod_id(address, batch.data_parallel_rank), frames[1].bytes, batch)

    async def _receive(self, pod: PodId, seq_frame: bytes, payload: bytes | EventBatch) -> None:
        try:
            seq = decode_seq(seq_frame)
            batch = payload if isinstance(payload, EventBatch) else decode_batch(payload)
        except WireError as error:
            self.stats.decode_errors += 1
            _log.debug("KV events from %s: %s", pod, error)
            return
        last = self._last.get(pod)
        if last is not None and seq <= last:
            self.stats.resets += 1
            self.index.clear_pod(pod)
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            if not await self._fill(pod, last + 1, seq):
                self.index.mark_unknown(pod)
        self._apply(pod, seq, batch)

    def _apply(self, pod: PodId, seq: int, batch: EventBatch) -> None:
        self.index.apply(pod, batch.events)
        self._last[pod] = seq
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.record_lag(max(0.0, self._clock() - batch.ts))

    async def _fill(self, pod: PodId, start: int, stop: int) -> bool:
        """Replay seqs [start, stop) from the pod's replay endpoint; False when they could not all be had."""
        endpoint = self._replay.get(pod)
        if endpoint is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: dict[int, EventBatch] = {}
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), _REPLAY_TIMEOUT_S)
                if len(frames) != 4 or not frames[2] or len(frames[2]) != 8:
                    break  # the end marker (an empty or -1 seq), or something else: stop
                seq = decode_seq(frames[2])
                if seq == 2**64 - 1:
                    break
                if start <= seq < stop:
                    got[seq] = decode_batch(frames[3])
                if seq >= stop - 1:
                    break
        except (TimeoutError, WireError, zmq.ZMQError) as error:
            _log.info("KV-event replay from %s failed: %s", endpoint, error)
        finally:
            sock.close(0)
        if sorted(got) != list(range(start, stop)):
            return False
        for seq in range(start, stop):
            self._apply(pod, seq, got[seq])
        self.stats.replays += 1
        return True
