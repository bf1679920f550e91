"""A simulated pod's KV-cache event publisher, in vLLM 0.32's wire format.

It writes what vLLM's ``ZmqEventPublisher`` writes, from its own code: a PUB socket sending
``[topic, seq (8-byte big-endian, from 0 per process), msgpack [ts, events, data_parallel_rank]]``, events
as maps tagged by ``"type"`` with vLLM 0.32's fields, defaults omitted as its msgspec structs omit them
(``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys`` (one entry per block, ``None`` or a tuple such as the adapter's name), ``group_idx``;
``BlockRemoved``: ``block_hashes, medium, group_idx``; checked by encoding vLLM's own classes);
``array_events=True``: the old arrays, tag first. ``endpoint`` is bound when it has ``*`` or ``::`` or is
``ipc://``/``inproc://`` (vLLM's rule) and connected to otherwise (``bind=True``: bound anyway, so that a
test can bind a loopback address). Data-parallel rank ``r`` uses ``endpoint`` and ``replay_endpoint``
with their tcp port + ``r`` (:func:`epp.prefix.kvwire.rank_endpoint`: an inproc name gets ``_dp<r>``;
a port of ``*`` or 0 is the OS's), as vLLM's publisher offsets them, whether it binds or connects. An
optional ROUTER
``replay_endpoint`` answers ``[b"", start seq]`` with every buffered batch from that seq
(``[b"", topic, seq, payload]``) and the end marker ``[b"", b"", -1 as 8 bytes, b""]``; the last
``buffer_batches`` batches are kept for it. Events are queued by :meth:`stored`, :meth:`removed` and
:meth:`cleared` and sent as one batch by :meth:`flush` (vLLM: once per engine step). :meth:`restart` is
a process restart: the buffer is emptied and seq starts again from 0. The replay socket is served by one
daemon thread; the PUB socket is used only by the caller's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from epp.prefix.kvwire import rank_endpoint

__all__ = ["KVEventPublisher"]

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_encode = msgspec.msgpack.Encoder().encode


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str,
        *,
        replay_endpoint: str | None = None,
        data_parallel_rank: int = 0,
        array_events: bool = False,
        buffer_batches: int = 10_000,
        bind: bool | None = None,
        hwm: int = 100_000,
    ) -> None:
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        endpoint = rank_endpoint(endpoint, data_parallel_rank)
        if replay_endpoint is not None:
            replay_endpoint = rank_endpoint(replay_endpoint, data_parallel_rank)
        self.array_events = array_events
        self.seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        if bind if bind is not None else ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._pending: list[Any] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True)
            self._thread.start()

    def stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        medium: str = "GPU",
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        group_idx: int | None = 0,
    ) -> None:
        """Queue a ``BlockStored``; ``extra_keys`` default to ``None`` per block, as vLLM sends them."""
        if self.array_events:
            self._pending.append(
                ["BlockStored", list(block_hashes), parent_block_hash, list(token_ids), block_size, lora_id, medium]
            )
            return
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(block_hashes),
            "parent_block_hash": parent_block_hash,
            "token_ids": list(token_ids),
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": medium,
            "lora_name": lora_name,
            "extra_keys": list(extra_keys) if extra_keys is not None else [None] * len(block_hashes),
        }
        if group_idx is not None:
            event["group_idx"] = group_idx
        self._pending.append(event)

    def removed(self, block_hashes: Sequence[int], *, medium: str = "GPU", group_idx: int | None = 0) -> None:
        if self.array_events:
            self._pending.append(["BlockRemoved", list(block_hashes), medium])
            return
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}
        if group_idx is not None:
            event["group_idx"] = group_idx
        self._pending.append(event)

    def cleared(self) -> None:
        self._pending.append(["AllBlocksCleared"] if self.array_events else {"type": "AllBlocksCleared"})

    @property
    def pending(self) -> int:
        """Events queued for the next :meth:`flush`."""
        return len(self._pending)

    def flush(self, *, send: bool = True) -> int | None:
        """Send the queued events as one batch; its seq (None when nothing was queued).

        ``send=False`` numbers and buffers the batch without sending it: a batch lost on the way.
        """
        if not self._pending:
            return None
        payload = _encode([time.time(), self._pending, self.rank])
        self._pending = []
        seq = self.seq
        self.seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if send:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """As if the server process restarted: seq from 0, nothing buffered, nothing queued."""
        self._pending = []
        with self._lock:
            self._buffer.clear()
        self.seq = 0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._pub.close(0)
        self._ctx.term()

    def _serve_replay(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start_bytes = frames
                start = int.from_bytes(start_bytes, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for seq, payload in batches:
                    router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", b"", _END_SEQ, b""])
        finally:
            router.close(0)
