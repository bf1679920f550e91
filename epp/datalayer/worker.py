"""The scrape worker: :class:`epp.datalayer.loops.ScrapeLoops` in a child process, and the parent's client.

Why a process: see :mod:`epp.datalayer.scraper`. The two ends talk over a socketpair, one
length-prefixed message per frame:

* parent -> worker, pickles (both ends are this same code, started together, so pickle's reach is
  not a concern; these messages are rare): ``("start", engines, settings, default_engine)`` once,
  then ``("add", Target)`` / ``("remove", name)`` as the pool changes, and ``("wake", name)`` when the
  picker sent a request to an endpoint whose loop had slowed down (:meth:`ScrapeLoops.wake`);
* worker -> parent, msgpack: lists of :class:`~epp.datalayer.loops.ScrapeResult`, the loops'
  reports as they make them, decoded into the same typed messages. msgspec encodes a list of them
  several times faster than pickle does a list of tuples, and decodes them as fast. One list per
  10 ms at most, so the request loop is woken ~100 times a second rather than once per scrape.
  Each wake-up of the picker process costs far more than applying one result (bench/scrape_cost.py
  at 100 pods: the request-path process used ~0.045 core with 5 ms batches, ~0.024 with 20 ms);
  10 ms is the compromise with freshness. A result's age on arrival does not skew the picker:
  scorers add the requests sent since the scrape's own time (``updated_at``), not since its arrival.
  A result that says nothing new (``unchanged``: the pod's numbers and state as before, only the
  scrape's time moved on) waits up to ``_LAZY_DELAY`` (250 ms) instead, riding with the next one that
  does: an idle pool then wakes the request loop a few times a second instead of ~100 (100 idle pods
  scraped every 50 ms: the request-path process used 0.011 core instead of 0.022; bench/scrape_cost.py
  --modes "no backoff" against the previous code). Its lateness costs nothing: nothing changed, and
  ``updated_at`` is the scrape's own time.

The worker runs at a lower CPU priority (nice 10): scraping is background work, and when the
machine is contended the request path should not wait behind it.

The worker lives exactly as long as its parent wants it: it exits when the socket closes (parent
stopped or died; no orphan scrapes), ignores SIGINT and SIGTERM (Ctrl-C, or a SIGTERM sent to the
whole process group, reaches it too, and would otherwise end it before the parent's own clean stop,
which then read as a crash: "restarting it"; the parent decides, and kills it if it must), and if it
dies the parent marks every endpoint stale and starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import msgspec

from epp.datalayer.engines import EngineMapping
from epp.datalayer.loops import ScrapeLoops, ScrapeResult, ScrapeSettings, Sink, Target

__all__ = ["WorkerClient"]

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
_BATCH_DELAY = 0.01  # seconds a result may wait for others to share its wake-up of the parent (see above)
_LAZY_DELAY = 0.25  # seconds an unchanged result may wait (see above); at most a quarter of the staleness threshold
_RESTART_DELAY = 1.0
_NICENESS = 10

_encode_results = msgspec.msgpack.Encoder().encode
_decode_results = msgspec.msgpack.Decoder(list[ScrapeResult]).decode


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def _control(message: tuple[Any, ...]) -> bytes:
    return _frame(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class _Frames(asyncio.Protocol):
    """Splits the byte stream into frames, each handed to ``on_frame``."""

    def __init__(self, on_frame: Callable[[bytes], None], on_lost: Callable[[Exception | None], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's: a read-write Transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= 4:
            (size,) = _LENGTH.unpack_from(buffer, start)
            if len(buffer) - start - 4 < size:
                break
            frame = bytes(buffer[start + 4 : start + 4 + size])
            start += 4 + size
            self._on_frame(frame)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


class WorkerClient:
    """The parent's side: starts the worker, forwards membership, hands results to ``sink``."""

    def __init__(
        self,
        engines: Mapping[str, EngineMapping],
        settings: ScrapeSettings,
        sink: Sink,
        *,
        default_engine: str = "vllm",
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self._start_message = ("start", dict(engines), settings, default_engine)
        self._sink = sink
        self._on_lost = on_lost
        self._targets: dict[str, Target] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._transport: asyncio.Transport | None = None
        self._stopping = False
        self._restart: asyncio.TimerHandle | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        parent, child = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "epp.datalayer.worker", str(child.fileno())],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_unix_connection(lambda: _Frames(self._results, self._lost), sock=parent)
        self._transport = transport
        transport.write(_control(self._start_message))
        for target in self._targets.values():
            transport.write(_control(("add", target)))

    def add(self, target: Target) -> None:
        self._targets[target.name] = target
        self._send(("add", target))

    def remove(self, name: str) -> None:
        if self._targets.pop(name, None) is not None:
            self._send(("remove", name))

    def wake(self, name: str) -> None:
        """The loop of ``name`` goes back to the fast cadence (:meth:`ScrapeLoops.wake`)."""
        if name in self._targets:
            self._send(("wake", name))

    async def stop(self) -> None:
        self._stopping = True
        if self._restart is not None:
            self._restart.cancel()
        if self._transport is not None:
            self._transport.close()  # the worker sees EOF and exits
        process = self._process
        if process is not None:
            try:
                await asyncio.to_thread(process.wait, 5)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_control(message))

    def _results(self, frame: bytes) -> None:
        sink, targets = self._sink, self._targets
        for result in _decode_results(frame):
            if result.endpoint in targets:  # not one removed while its result was on its way
                sink(result)

    def _lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._stopping:
            return
        status = self._process.poll() if self._process is not None else None
        log.error("the metrics scrape worker stopped (exit status %s); restarting it", status)
        if self._on_lost is not None:
            self._on_lost("the metrics scrape worker stopped")
        loop = asyncio.get_running_loop()
        self._restart = loop.call_later(_RESTART_DELAY, lambda: loop.create_task(self._restart_worker()))

    async def _restart_worker(self) -> None:
        if self._stopping:
            return
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            await asyncio.to_thread(self._process.wait)
        await self.start()


# --- the worker process -------------------------------------------------------------------------


class _Worker:
    """The child's side: runs the loops as the parent says, batches their results back to it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loops: ScrapeLoops | None = None
        self._pending: list[ScrapeResult] = []
        self._flush_at = 0.0  # loop.time() of the flush scheduled, when _flush_timer is set
        self._flush_timer: asyncio.TimerHandle | None = None
        self._lazy_delay = _LAZY_DELAY
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = loop.create_future()

    def on_frame(self, frame: bytes) -> None:
        message = pickle.loads(frame)
        kind = message[0]
        if kind == "start":
            _, engines, settings, default_engine = message
            self._loops = ScrapeLoops(engines, settings, self._sink, default_engine=default_engine)
            self._lazy_delay = max(_BATCH_DELAY, min(_LAZY_DELAY, settings.staleness / 4))
        elif self._loops is None:
            raise RuntimeError(f"{kind!r} before 'start'")
        elif kind == "add":
            self._loops.add(message[1])
        elif kind == "remove":
            self._loops.remove(message[1])
        elif kind == "wake":
            self._loops.wake(message[1])

    def on_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def stop(self) -> None:
        if self._loops is not None:
            await self._loops.stop()

    def _sink(self, result: ScrapeResult) -> None:
        self._pending.append(result)
        at = self._loop.time() + (self._lazy_delay if result.unchanged else _BATCH_DELAY)
        timer = self._flush_timer
        if timer is None or at < self._flush_at:  # none scheduled, or this one cannot wait that long
            if timer is not None:
                timer.cancel()
            self._flush_at = at
            self._flush_timer = self._loop.call_at(at, self._flush)

    def _flush(self) -> None:
        self._flush_timer = None
        transport = self.transport
        if self._pending and transport is not None and not transport.is_closing():
            transport.write(_frame(_encode_results(self._pending)))
        self._pending.clear()


async def _work(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    worker = _Worker(loop)
    transport, _ = await loop.create_unix_connection(lambda: _Frames(worker.on_frame, worker.on_lost), sock=sock)
    worker.transport = transport
    await worker.done
    await worker.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the parent decides when scraping ends (see the module docstring)
    # Background work: when the CPU is contended, the request path (the parent) goes first.
    os.nice(_NICENESS)
    sock = socket.socket(fileno=int(args[0]))
    try:
        import uvloop

        uvloop.run(_work(sock))
    except ImportError:
        asyncio.run(_work(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
