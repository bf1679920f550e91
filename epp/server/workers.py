"""``--workers N``: N ext_proc worker processes in front of one owner process (our extension; upstream has none).

Why
---
One Python process is one core: the picker served ~1,200-1,570 req/s of 1 KB requests whatever the
pod's CPU limit (issue 14). Most of a request's CPU is per-message work that needs nothing shared:
HTTP/2 and gRPC framing, protobuf, the body's JSON (msgspec), the answers, and the response path
(every streamed chunk). Routing needs everything shared: the datastore and its scraping, flow
control's queue, the scheduler and its plugins' state (the prefix index learns from this picker's
own picks), in-flight accounting, the metrics.

Design
------
The process ``epp serve`` starts stays the **owner**: datastore, scraping, discovery, admission and
flow control, the scheduler and plugins, the prefix index, in-flight accounting, the metrics
registry and ``/metrics``, the health port. It binds the ext_proc port (never ``SO_REUSEPORT``) and
starts N **workers** (``python -m epp.server.workers``, spawned rather than forked: the owner has a
running event loop and threads by then).

Connections, not requests, are what can be spread: an HTTP/2 connection's streams share one
HPACK state and one byte stream, so one process serves all of a connection, and Envoy opens one
connection to the picker per worker thread and keeps it. Three things spread the load:

1. Each worker announces ``SETTINGS_MAX_CONCURRENT_STREAMS`` (:data:`STREAMS_PER_CONNECTION`, 8):
   Envoy honours it and opens another connection when one is full (measured, Envoy 1.40: one
   worker thread, 32 concurrent requests, a limit of 8 -> 5 connections to the picker).
2. The owner accepts each connection itself and hands its descriptor (``SCM_RIGHTS`` over a second
   socketpair) to the worker with the fewest requests in flight, then the fewest connections.
   Letting the workers accept on the shared listening socket was measured first: Envoy with two
   worker threads opened two connections, and the kernel gave both to the same worker (2,340
   requests to one, 0 to the other).
3. Envoy does not spread streams evenly over its connections (it fills the one it used last), and
   connections outlive the burst that opened them, so evenly spread connections can still carry
   uneven loads. Every 2 s the owner compares the requests each worker routed; a worker that carried
   more than twice the least busy one's (and 20 more), twice in a row, is told to GOAWAY its busiest
   connection (its open streams finish there; Envoy puts new ones on another connection, or opens
   one, which the owner hands to another worker), at most once per 10 s.

A worker runs the same :mod:`epp.extproc` stream handling as one process, with a
:class:`~epp.requestcontrol.remote.RemoteDirector` as its director: a parsed request goes to the
owner over the worker's unix socketpair (:mod:`epp.requestcontrol.ipc`), the owner routes it
(:mod:`epp.requestcontrol.owner`) and answers with the pick; the response's events flow back one way.
Health checks on the ext_proc port (Envoy's active check) are answered by the worker that holds the
connection, from the statuses the owner pushes on every change; ``GET /v1/models`` from the pool's
union, pushed when a list changes (checked every second).

* ``--workers 0`` (the default) is today's single process, exactly: nothing here runs. ``--workers 1``
  is one owner and one worker (the owner's core then only routes); ``epp serve`` takes up to 256,
  but workers beyond the cores add only context switches (and the owner caps the gain: see below).
* A worker that dies is restarted (at once if it had lived 10 s, else after a growing delay up to
  5 s); its streams fail at Envoy (the connection is gone), and the owner finishes every request it
  held as ``error`` (in-flight accounting released). The other workers go on serving.
* The owner's readiness waits for every worker's first ``Ready``; a worker that cannot start stops
  start-up. A worker exits when the owner goes away (EOF on its socket).
* Shutdown (SIGTERM to the owner; workers ignore SIGINT and SIGTERM, the owner decides): the
  owner's health goes NOT_SERVING (pushed to the workers), admission closes (queued requests 503),
  then each worker is told to drain: it stops accepting, GOAWAYs its connections, gives open
  streams the grace period, reports their ends and exits. Workers still running after the grace
  period and 5 s more are killed, and the owner finishes what they held.
* Tracing works across the processes (see :mod:`epp.requestcontrol.remote`): each process exports
  its own spans; a request's are one trace.
* Observed responses (``epp envoy-config --observe-responses``): Envoy sends a request's response on
  a second stream, on a cluster and connections of its own, which the owner hands out like the
  others, so a request's routing and observing streams often reach different workers. Each worker
  process's tokens carry a prefix of its own (the owner's random 8 characters, the worker's spawn
  number); the observing worker claims the request through the owner, which moves it to that
  worker and tells the routing one (:mod:`epp.requestcontrol.owner`). A restarted worker's prefix is
  new: an observer of a request its predecessor routed finds nothing (that request was finished as
  ``error`` with it). ``/debug/workers`` counts, per worker, the requests whose response another
  worker observed.
* The request goes to the owner parsed (model, prompt, the fields routing reads), its body only when a
  configured plugin may read ``request.body`` (``reads_body``, :func:`epp.framework.roles.reads_body`:
  ``precise-prefix-cache-producer`` tokenizes it; a third party's plugin that does not say), decided at
  startup (``WorkerSpec.send_body``). Before the body went, precise routing under ``--workers 2``
  tokenized nothing and fell back to the approximate index without a word: ``python
  bench/precise_routing.py --workloads u --policies precise,precise+workers`` at a7ce5d9, hit rate 83.9%
  of the oracle against 99.1% in one process; with it, 99.1% both (232 of 232 prompts tokenized).
* Metrics are the owner's; refusals a worker answers are counted there once each. Ours beyond
  upstream: ``epp_worker_requests_total{worker}`` (requests each worker routed through the owner)
  and ``epp_worker_restarts_total{worker}``; with ``--enable-debug-endpoints``, ``/debug/workers``
  lists each worker's pid, requests, in-flight and restarts. The ``process_*`` series are the
  owner's process alone.

Measured (``python bench/workers.py``, whose docstring has the figures and commands; 1 KB
completions, 2 pods, the default profile, on the shared 2-core development machine):

* CPU per request, ``--workers 2`` against one process: 1.01x-1.11x with the picker driven alone
  (h2load sends each exchange at once); 1.21x-1.38x through Envoy, where each request costs the
  worker one more wake-up (the owner's answer) between its request and response phases; the channel
  alone costs ~20-30 µs a request.
* Routing quality: the prefix-cache hit rate on ``bench/routing_quality.py``'s shared-prefix workload
  was 92.20% with two workers and 92.07% in one process (oracle 92.2%); TTFT the same.
* Observed responses (``epp envoy-config --observe-responses``), at 1351af0: ``python bench/workers.py
  --parts load --variants 0,2,0o,2o --rounds 3`` (medians), picker CPU per 1 KB request at 16 / 64
  connections: one process 0.176 / 0.147 ms, ``--workers 2`` 0.263 / 0.206, one process observed
  0.191 / 0.169, ``--workers 2`` observed 0.272 / 0.231: observing costs two workers about what it
  costs one process (a second stream a request: +3-12%), no error in its 24 runs of 8 s. Streamed, ``python
  bench/streaming_cost.py --events 1024 --streams 1,16 --rounds 3 --observe --picker-arg=--workers=2``:
  picker CPU per SSE chunk (owner and workers) 24.4 / 5.4 µs processed at 1 / 16 streams, 17.1 / 3.5
  observed.
* Throughput could not be measured at saturation here (other benches held the cores: the picker got
  0.3-0.7 of a core either way); the direct runs gave 1.25x with two workers.

The design's limit, on paper. Per request the owner does the routing (the request arrives parsed)
and the channel's share: ``c_o`` ≈ 130 µs (routing ~100, the channel ~30), measured per process; a
worker spends ``c_w`` ≈ 160 µs on each request it carries (HTTP/2, protobuf, parsing, answers, the
response). N workers serve at most ``min(N / c_w, 1 / c_o)`` requests per second, cores permitting:
about 7,500 req/s here, against ~3,700 for one process (1 / 270 µs): 2x, and reached as soon as
N ≈ ``c_w / c_o`` ≈ 1.2, so with two workers already. More workers raise the ceiling only when the
per-request work outside routing grows: every streamed response chunk and every body byte is worker
work (a 1k-event stream multiplies ``c_w``, not ``c_o``), while a larger pool or a longer prompt grows
the owner's (the prefix index hashes and records the prompt: a 16 KB prompt never seen before routed
in ~420 µs in-process with 8 pods, a ceiling of ~2,400 req/s for such requests). Beyond that, the
next steps would take work off the owner: hash the prompt's blocks in the worker that parsed it (the
prefix producer would consume hashes, not text), keep the response metrics' histograms in the
workers and merge them at scrape time, or shard the routing state across several owners (by model or
pool).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from epp.extproc.answers import TOKEN_LENGTH
from epp.extproc.models import models_union
from epp.extproc.processor import ExternalProcessor, Observed
from epp.framework import Endpoint
from epp.requestcontrol import ipc
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.requestcontrol.metrics import RequestMetrics, StreamMetrics
from epp.requestcontrol.owner import WorkerRequests
from epp.requestcontrol.remote import RemoteDirector, RemoteMetrics, RemoteRouted
from epp.requestcontrol.tracing import Tracing
from epp.server.logs import configure_logging
from epp.server.process import freeze_startup_objects, limit_malloc_arenas
from epp.server.tls import CertificateReloader, apply_policy, server_ssl_context, ssl_context_from_pem, tls_policy
from epp.wire.health import Health
from epp.wire.server import GrpcServer

__all__ = ["STREAMS_PER_CONNECTION", "MirroredHealth", "WorkerPool", "WorkerSpec", "main"]

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
_READY_TIMEOUT = 60.0  # a deadline, not a measurement: a loaded 2-core machine starts Python slowly
_DRAIN_MARGIN = 5.0  # seconds past the grace period before a draining worker is killed
_MODELS_INTERVAL = 1.0  # how often the owner checks whether the pool's model lists changed
_STABLE_AFTER = 10.0  # a worker that lived this long is restarted at once when it dies
_MAX_RESTART_DELAY = 5.0
_CONNECTIONS_INTERVAL = 1.0  # how often a worker checks whether its connection count changed
# Rebalancing (see the module docstring): checked every _BALANCE_INTERVAL; a worker is told to GOAWAY
# its busiest connection when it routed more than _IMBALANCE times the least busy worker's requests
# (and _IMBALANCE_FLOOR more) over two checks in a row, at most once per _BALANCE_COOLDOWN.
_BALANCE_INTERVAL = 2.0
_IMBALANCE = 2.0
_IMBALANCE_FLOOR = 20
_BALANCE_COOLDOWN = 10.0
STREAMS_PER_CONNECTION = 8
"""The stream limit each worker announces per connection: small enough that a busy Envoy thread opens
several connections for the owner to spread; with Envoy's default circuit breakers (1,024 requests
and 1,024 connections per cluster) the request limit binds first (8 x 1,024 = 8,192 streams)."""


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a worker needs to serve: the first frame its socket carries (then the channel's messages)."""

    index: int
    max_request_body_bytes: int
    max_message: int
    flag: str  # how log lines name the port ("--grpc-port 9002")
    max_concurrent_streams: int = STREAMS_PER_CONNECTION
    cert_path: str = ""  # TLS from these files
    cert_reload: bool = False  # served anew when they change (--enable-cert-reload)
    tls_min_version: str = ""  # --tls-min-version, --tls-cipher-suites (Go's names: epp.server.tls.tls_policy)
    tls_cipher_suites: list[str] = msgspec.field(default_factory=list)
    subset_filter: bool = True  # honour the gateway's subset hint (--disable-endpoint-subset-filter)
    cert_pem: bytes = b""  # or from this certificate and key (the owner's self-signed pair)
    key_pem: bytes = b""
    tls: bool = False
    io_thread: bool = True
    io_thread_after_chunks: int = 32
    native_tls: bool = True
    tracing: bool = False
    verbosity: int = 1
    log_floor: int = 0
    log_format: str = "console"
    log_time_encoding: str = ""
    log_stacks_from: int = 0
    wait_for_headers: bool = False  # a plugin's response_received hook may set response headers
    send_body: bool = False  # a plugin reads request.body: it goes to the owner with the request
    stream_metrics: bool = False  # post each stream's start and end to the owner (--enable-grpc-stream-metrics)
    token_prefix: str = ""  # this worker process's observed-response tokens' prefix (ipc.TOKEN_PREFIX characters)
    health: dict[str, int] = msgspec.field(default_factory=dict)
    models: list[dict[str, Any]] | None = None


def _unconnected(message: msgspec.Struct) -> None:
    raise RuntimeError("the worker's channel is not connected yet")


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


class MirroredHealth(Health):
    """The owner's health statuses; every change is pushed to the workers (they answer on the ext_proc port)."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: dict[str, int] = {}
        self.listeners: list[Callable[[dict[str, int]], None]] = []

    def set(self, service: str, status: int) -> None:
        super().set(service, status)
        if self.statuses.get(service) != status:
            self.statuses[service] = status
            for listener in self.listeners:
                listener(dict(self.statuses))


class _Slot:
    """One worker: its process, its channel and the requests the owner holds for it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: subprocess.Popen[bytes] | None = None
        self.channel: ipc.Channel | None = None
        self.handoff: socket.socket | None = None  # connections go to the worker through this
        self.connections = 0  # as the worker last reported, plus those handed since
        self.requests: WorkerRequests | None = None
        self.ready: asyncio.Future[None] | None = None
        self.gone: asyncio.Event = asyncio.Event()
        self.started_at = 0.0
        self.fast_failures = 0
        self.restarts = 0
        self.earlier_requests = 0  # requests routed for this slot's earlier processes
        self.earlier_claimed = 0  # and of those, observed by another worker
        self.token_prefix = ""  # its process's observed-response tokens' prefix (see WorkerPool._spawn)
        self.shedding_until = 0.0  # told to shed a connection: new ones go elsewhere until then

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class WorkerPool:
    """The owner's workers: start them on a listening socket, keep them running, drain them.

    ``spec(index)``: each worker's :class:`WorkerSpec` (health and models are filled in here).
    ``endpoints``: the pool's endpoints (for ``GET /v1/models``). ``registry``: the owner's metrics.
    """

    def __init__(
        self,
        count: int,
        director: Director,
        spec: Callable[[int], WorkerSpec],
        *,
        endpoints: Callable[[], tuple[Endpoint, ...]],
        registry: CollectorRegistry,
        tracing: Tracing | None = None,
        streams: StreamMetrics | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("a worker pool needs at least one worker")
        self._director = director
        self._spec = spec
        self._endpoints = endpoints
        self._tracing = tracing
        self._streams = streams  # --enable-grpc-stream-metrics: the workers' streams, counted in the owner
        self.health = MirroredHealth()
        self.health.listeners.append(self._push_health)
        self._slots = [_Slot(index) for index in range(count)]
        self._listener: socket.socket | None = None
        self._accepting = False
        self.accepted = 0  # connections accepted and handed over
        self._stopping = False
        self._models: list[dict[str, Any]] | None = None
        self._served: tuple[Any, ...] = ()
        self._models_task: asyncio.Task[None] | None = None
        self._balance_task: asyncio.Task[None] | None = None
        self.rebalances = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # Observed responses: each worker process's tokens begin with this process's random 8 characters
        # and the worker's spawn number (epp.requestcontrol.ipc.TOKEN_PREFIX); the owner finds the
        # routing worker of an observed response by them (epp.requestcontrol.owner).
        self._nonce = os.urandom(ipc.TOKEN_OWNER // 2).hex()
        self._spawns = 0
        self._by_prefix: dict[str, WorkerRequests] = {}
        registry.register(_Collector(self._slots))

    @property
    def count(self) -> int:
        return len(self._slots)

    def pids(self) -> list[int | None]:
        return [slot.pid for slot in self._slots]

    async def start(self, listener: socket.socket, timeout: float = _READY_TIMEOUT) -> None:
        """Spawn every worker, wait until each serves, then accept on ``listener`` for them; RuntimeError
        if one cannot start."""
        self._listener = listener
        listener.setblocking(False)
        self._sync_models()
        for slot in self._slots:
            await self._spawn(slot)
        try:
            async with asyncio.timeout(timeout):
                for slot in self._slots:
                    assert slot.ready is not None
                    await slot.ready
        except (TimeoutError, RuntimeError) as exc:
            await self.stop(0)
            raise RuntimeError(f"the ext_proc workers did not start: {exc or 'timed out'}") from None
        self._models_task = asyncio.get_running_loop().create_task(self._watch_models())
        if len(self._slots) > 1:
            self._balance_task = asyncio.get_running_loop().create_task(self._balance())
        self._accept_on()
        log.info(
            "ext_proc served by %d worker process(es) (pids %s) on %d core(s); this process (pid %d) routes",
            len(self._slots),
            ", ".join(str(pid) for pid in self.pids()),
            len(os.sched_getaffinity(0)),
            os.getpid(),
        )

    async def _spawn(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        owner_end, worker_end = socket.socketpair()
        handoff, worker_handoff = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [worker_end.fileno(), worker_handoff.fileno()]
        python = [sys.executable, "-P"] if sys.flags.safe_path else [sys.executable]
        try:
            slot.process = subprocess.Popen(
                [*python, "-m", "epp.server.workers", *map(str, fds)], pass_fds=fds, stdin=subprocess.DEVNULL
            )
        except OSError:
            owner_end.close()
            handoff.close()
            raise
        finally:
            worker_end.close()
            worker_handoff.close()
        handoff.setblocking(False)
        slot.handoff = handoff
        slot.connections = 0
        slot.started_at = time.monotonic()
        slot.ready = loop.create_future()
        slot.gone = asyncio.Event()
        if slot.requests is not None:
            slot.earlier_requests += slot.requests.requests
            slot.earlier_claimed += slot.requests.claimed
        self._spawns += 1
        slot.token_prefix = f"{self._nonce}{self._spawns % 0x10000:04x}"
        requests = WorkerRequests(
            self._director, _unconnected, tracing=self._tracing, streams=self._streams, siblings=self._by_prefix
        )
        self._by_prefix[slot.token_prefix] = requests
        handlers: dict[type, Callable[[Any], None]] = {
            **requests.handlers(),
            ipc.Ready: lambda m: self._ready(slot),
            ipc.Connections: lambda m: setattr(slot, "connections", m.count),
        }
        channel = ipc.Channel(ipc.owner_decoder, handlers, lambda: self._lost(slot))
        owner_end.setblocking(False)
        await loop.create_unix_connection(lambda: channel, sock=owner_end)
        requests.send, requests.post, requests.after_sent = channel.send, channel.post, channel.after_flush
        slot.channel, slot.requests = channel, requests
        spec = msgspec.structs.replace(
            self._spec(slot.index),
            health=dict(self.health.statuses),
            models=self._models,
            token_prefix=slot.token_prefix,
        )
        assert channel.transport is not None
        channel.transport.write(_frame(msgspec.msgpack.encode(spec)))  # the worker reads it before anything else

    def _ready(self, slot: _Slot) -> None:
        if slot.ready is not None and not slot.ready.done():
            slot.ready.set_result(None)
        if self._listener is not None and not self._accepting and not self._stopping:
            self._accept_on()  # a worker serves again after none did

    # -- connections ------------------------------------------------------------------------------

    def _serving(self) -> list[_Slot]:
        return [s for s in self._slots if s.channel is not None and s.ready is not None and s.ready.done()]

    def _accept_on(self) -> None:
        assert self._listener is not None
        if not self._accepting and self._serving():
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)
            self._accepting = True

    def _accept_off(self) -> None:
        if self._accepting and self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
        self._accepting = False

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        for _ in range(64):  # a burst of new connections, bounded per wake-up
            serving = self._serving()
            if not serving:  # none to hand it to: the kernel's backlog keeps it until a worker is back
                self._accept_off()
                return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: try again on the next wake-up
                log.warning("cannot accept an ext_proc connection: %s", exc)
                return
            with sock:
                self._hand_over(sock, serving)

    def _hand_over(self, sock: socket.socket, serving: list[_Slot]) -> None:
        """Give ``sock`` to the serving worker with the fewest requests in flight, then connections."""
        now = time.monotonic()
        for slot in sorted(serving, key=lambda slot: _load(slot, now)):
            assert slot.handoff is not None
            try:
                socket.send_fds(slot.handoff, [b"c"], [sock.fileno()])
            except OSError as exc:  # its process is going away (or not reading): the next one
                log.debug("handing a connection to worker %d failed: %s", slot.index, exc)
                continue
            slot.connections += 1
            self.accepted += 1
            return
        log.warning("no ext_proc worker took a new connection: closed")

    def _lost(self, slot: _Slot) -> None:
        """A worker's socket closed: its process exited (or is about to)."""
        if slot.requests is not None:
            slot.requests.lost()  # its streams are gone with it: finish what it held
        self._by_prefix.pop(slot.token_prefix, None)  # (a claim of its requests now finds none)
        slot.channel = None
        if slot.handoff is not None:
            slot.handoff.close()
            slot.handoff = None
        slot.gone.set()
        self._track(asyncio.get_running_loop().create_task(self._recover(slot)))

    async def _recover(self, slot: _Slot) -> None:
        """Reap a worker that went away (its exit status for the log) and, unless stopping, start another."""
        await self._reap(slot)
        status = _exit_status(slot.process)
        if slot.ready is not None and not slot.ready.done():
            slot.ready.set_exception(RuntimeError(f"worker {slot.index} {status} before serving"))
            slot.ready.exception()  # retrieved here: start() may not be waiting on this one yet
        if self._stopping:
            return
        lived = time.monotonic() - slot.started_at
        slot.fast_failures = 0 if lived >= _STABLE_AFTER else slot.fast_failures + 1
        delay = 0.0 if slot.fast_failures == 0 else min(_MAX_RESTART_DELAY, 0.25 * 2**slot.fast_failures)
        log.error(
            "ext_proc worker %d (pid %s) %s after %.1fs; restarting it%s",
            slot.index,
            slot.pid,
            status,
            lived,
            f" in {delay:.2f}s" if delay else "",
        )
        await asyncio.sleep(delay)
        if self._stopping:
            return
        slot.restarts += 1
        try:
            await self._spawn(slot)
        except OSError as exc:
            log.error("cannot restart ext_proc worker %d: %s", slot.index, exc)

    async def _reap(self, slot: _Slot, timeout: float = 5.0) -> None:
        process = slot.process
        if process is None:
            return
        try:
            await asyncio.to_thread(process.wait, timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _balance(self) -> None:
        """Ask a worker that carries far more than the others to shed its busiest connection."""
        last: dict[int, int] = {}
        uneven = 0
        quiet_until = 0.0
        while True:
            await asyncio.sleep(_BALANCE_INTERVAL)
            serving = self._serving()
            totals = {s.index: s.earlier_requests + (s.requests.requests if s.requests else 0) for s in serving}
            routed = {index: total - last.get(index, total) for index, total in totals.items()}
            last = totals
            if len(routed) < 2:
                uneven = 0
                continue
            busiest = max(routed, key=routed.__getitem__)
            least = min(routed.values())
            if routed[busiest] > _IMBALANCE * least + _IMBALANCE_FLOOR:
                uneven += 1
            else:
                uneven = 0
            now = time.monotonic()
            if uneven >= 2 and now >= quiet_until:
                channel = self._slots[busiest].channel
                if channel is not None:
                    log.debug("worker %d routed %s in %.0fs: shedding a connection", busiest, routed, _BALANCE_INTERVAL)
                    channel.send(ipc.Rebalance())
                    self._slots[busiest].shedding_until = now + _BALANCE_COOLDOWN
                    self.rebalances += 1
                uneven = 0
                quiet_until = now + _BALANCE_COOLDOWN

    # -- state the workers answer from ------------------------------------------------------------

    def _push_health(self, statuses: dict[str, int]) -> None:
        for slot in self._slots:
            if slot.channel is not None:
                slot.channel.send(ipc.Health(statuses))

    def _sync_models(self) -> bool:
        """Recompute the pool's ``GET /v1/models`` union if any endpoint's list changed; True if it did."""
        endpoints = self._endpoints()
        served = tuple((e.name, e.served) for e in endpoints)
        if served == self._served:
            return False
        self._served = served
        cards = models_union(endpoints)
        models = None if cards is None else [dict(card) for card in cards]
        if models == self._models:
            return False
        self._models = models
        return True

    async def _watch_models(self) -> None:
        while True:
            await asyncio.sleep(_MODELS_INTERVAL)
            if self._sync_models():
                for slot in self._slots:
                    if slot.channel is not None:
                        slot.channel.send(ipc.Models(self._models))

    # -- stopping ---------------------------------------------------------------------------------

    async def stop(self, grace: float) -> None:
        """Drain every worker (see the module docstring), then make sure each has exited."""
        self._stopping = True
        self._accept_off()
        if self._listener is not None:
            self._listener.close()  # new connections are refused now, as one process's server.stop() does
        for task in (self._models_task, self._balance_task):
            if task is not None:
                task.cancel()
        for slot in self._slots:
            if slot.channel is not None:
                slot.channel.send(ipc.Drain(grace))
        waiting = [slot.gone.wait() for slot in self._slots if slot.process is not None]
        if waiting:
            try:
                async with asyncio.timeout(max(grace, 0.0) + _DRAIN_MARGIN):
                    await asyncio.gather(*waiting)
            except TimeoutError:
                log.warning("ext_proc workers still running %.0fs after the drain began: killing them", grace)
        for slot in self._slots:
            process = slot.process
            if process is not None and process.poll() is None and not slot.gone.is_set():
                process.kill()
            await self._reap(slot)
            if slot.requests is not None:
                slot.requests.lost()  # anything a killed worker still held
        for task in list(self._tasks):
            task.cancel()

    # -- the debug view ---------------------------------------------------------------------------

    def view(self) -> list[dict[str, Any]]:
        """Each worker: index, pid, alive, requests routed (and of those, how many another worker observed the
        response of), in flight, restarts (for ``/debug/workers``)."""
        views = []
        for slot in self._slots:
            requests = slot.requests
            views.append(
                {
                    "worker": slot.index,
                    "pid": slot.pid,
                    "serving": slot.channel is not None and slot.ready is not None and slot.ready.done(),
                    "connections": slot.connections,
                    "requests": slot.earlier_requests + (requests.requests if requests is not None else 0),
                    "observed_elsewhere": slot.earlier_claimed + (requests.claimed if requests is not None else 0),
                    "in_flight": requests.in_flight if requests is not None else 0,
                    "restarts": slot.restarts,
                }
            )
        return views


class _Collector:
    """``epp_worker_requests_total`` and ``epp_worker_restarts_total``, read from the slots when scraped
    (a counter per request would cost the owner a lock and a call on every route)."""

    def __init__(self, slots: list[_Slot]) -> None:
        self._slots = slots

    def collect(self) -> list[Metric]:
        requests = CounterMetricFamily(
            "epp_worker_requests",
            "Requests each ext_proc worker process (--workers) routed through this process.",
            labels=["worker"],
        )
        restarts = CounterMetricFamily(
            "epp_worker_restarts",
            "ext_proc worker processes (--workers) restarted after they stopped.",
            labels=["worker"],
        )
        for slot in self._slots:
            current = slot.requests.requests if slot.requests is not None else 0
            requests.add_metric([str(slot.index)], slot.earlier_requests + current)
            restarts.add_metric([str(slot.index)], slot.restarts)
        return [requests, restarts]


def _exit_status(process: subprocess.Popen[bytes] | None) -> str:
    code = process.poll() if process is not None else None
    if code is None:
        return "stopped"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _load(slot: _Slot, now: float) -> tuple[bool, int, int, int]:
    """A new connection goes to a worker not shedding connections (one it shed must not come back to
    it), then to the one with the fewest requests in flight, then the fewest connections (counted as
    they are handed, so a burst of new connections alternates)."""
    requests = slot.requests
    in_flight = requests.in_flight if requests is not None else 0
    return (now < slot.shedding_until, in_flight, slot.connections, slot.index)


# --- the worker process --------------------------------------------------------------------------


class _WorkerObserved(Observed):
    """A worker's observed responses (:class:`epp.extproc.processor.Observed`): a token names the
    request in the owner (this worker's prefix, then its id: :func:`epp.requestcontrol.ipc.worker_token`),
    and a response whose request a sibling routed (the owner's part of the prefix, another worker's
    spawn number) is claimed through the owner (:mod:`epp.requestcontrol.owner`)."""

    __slots__ = ("_director", "_owner", "_worker")

    def __init__(self, director: RemoteDirector, prefix: str) -> None:
        super().__init__()
        self._director = director
        self._worker = prefix
        self._owner = prefix[: ipc.TOKEN_OWNER]

    def token(self, routed: RoutedRequest) -> str:
        return ipc.worker_token(self._worker, cast(RemoteRouted, routed).id)

    def claim(self, token: str) -> RoutedRequest | None:
        if len(token) != TOKEN_LENGTH or not token.startswith(self._owner) or token.startswith(self._worker):
            return None  # another replica's (or a picker's before a restart), or this worker's own, ended
        return cast(RoutedRequest, self._director.claim(token))


def _read_spec(sock: socket.socket) -> WorkerSpec:
    """The first frame on the socket, read exactly (what follows is the channel's)."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        raise SystemExit("epp worker: the owner process closed the socket before sending the spec")
    (length,) = _LENGTH.unpack(head)
    body = sock.recv(length, socket.MSG_WAITALL)
    return msgspec.msgpack.decode(body, type=WorkerSpec)


async def _serve(spec: WorkerSpec, sock: socket.socket, handoff: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    tracing = Tracing() if spec.tracing else None
    director = RemoteDirector(tracing=tracing, wait_for_headers=spec.wait_for_headers, send_body=spec.send_body)
    director.datastore.update(spec.models)
    metrics = RemoteMetrics()
    health = Health()
    for service, status in spec.health.items():
        health.set(service, status)
    stop: asyncio.Future[float | None] = loop.create_future()
    closed = asyncio.Event()

    def drain(message: ipc.Drain) -> None:
        if not stop.done():
            stop.set_result(message.grace)

    def mirror(message: ipc.Health) -> None:
        for service, status in message.statuses.items():
            health.set(service, status)

    def lost() -> None:
        director.owner_lost()
        closed.set()
        if not stop.done():
            stop.set_result(None)

    observed = _WorkerObserved(director, spec.token_prefix)

    def claimed(message: ipc.Claimed) -> None:
        observed.taken(ipc.worker_token(spec.token_prefix, message.id))

    def rebalance(message: ipc.Rebalance) -> None:
        shed = server.goaway_busiest()
        log.debug("worker %d: GOAWAY on the connection that carried %d streams since the last time", spec.index, shed)

    handlers: Mapping[type, Callable[[Any], None]] = {
        **director.handlers(),
        ipc.Health: mirror,
        ipc.Drain: drain,
        ipc.Rebalance: rebalance,
        ipc.Claimed: claimed,
    }
    channel = ipc.Channel(ipc.worker_decoder, handlers, lost)
    sock.setblocking(False)
    await loop.create_unix_connection(lambda: channel, sock=sock)
    director.send, director.post, metrics.post = channel.send, channel.post, channel.post
    context = None
    reloading: asyncio.Task[None] | None = None
    if spec.tls:
        if spec.cert_path:
            context = server_ssl_context(spec.cert_path)
            if spec.cert_reload:  # each worker serves from its own context: each watches (epp.server.tls)
                reloading = loop.create_task(CertificateReloader(context, spec.cert_path).run())
        else:
            context = ssl_context_from_pem(spec.cert_pem, spec.key_pem)
        apply_policy(context, tls_policy(spec.tls_min_version, spec.tls_cipher_suites))  # (checked by the owner)
    processor = ExternalProcessor(
        cast(Director, director),  # the edge uses a director's route/tracing/base_models/datastore: see remote.py
        cast(RequestMetrics, metrics),  # and only refused() of the metrics
        max_request_body_bytes=spec.max_request_body_bytes,
        subset_filter=spec.subset_filter,
        streams=metrics if spec.stream_metrics else None,
        observed=observed,
    )
    server = GrpcServer(
        {**processor.methods(), **health.methods()},
        ssl_context=context,
        max_message=spec.max_message,
        flag=spec.flag,
        max_concurrent_streams=spec.max_concurrent_streams,
        io_thread=spec.io_thread,
        io_thread_after_chunks=spec.io_thread_after_chunks,
        native_tls=spec.native_tls,
    )
    reported = [0]

    def report() -> None:
        if server.connections != reported[0]:
            reported[0] = server.connections
            channel.post(ipc.Connections(server.connections))

    def receive() -> None:
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(handoff, 64, 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                fds = []
            if not fds:  # EOF: the owner is gone (its channel says so too)
                loop.remove_reader(handoff.fileno())
                break
            for fd in fds:
                server.serve_connection(socket.socket(fileno=fd))
        loop.call_later(0.05, report)  # once the new connections are set up

    async def watch_connections() -> None:
        while True:
            await asyncio.sleep(_CONNECTIONS_INTERVAL)
            report()

    handoff.setblocking(False)
    loop.add_reader(handoff.fileno(), receive)
    watcher = loop.create_task(watch_connections())
    freeze_startup_objects()  # (a worker is its own process)
    channel.send(ipc.Ready(os.getpid()))
    grace = await stop
    watcher.cancel()
    if reloading is not None:
        reloading.cancel()
    loop.remove_reader(handoff.fileno())
    if grace is None:
        log.error("worker %d: the owner process went away; exiting", spec.index)
        await server.stop(0)
        return
    await server.stop(grace)  # GOAWAY, the open streams get the grace period, the rest are cancelled
    health.stop()
    await asyncio.sleep(0)  # the cancelled calls' last messages are queued
    channel.close()  # flushed, then EOF for the owner
    try:
        async with asyncio.timeout(_DRAIN_MARGIN):
            await closed.wait()
    except TimeoutError:
        pass
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the owner decides when a worker ends (see the module docstring)
    limit_malloc_arenas()  # before any thread allocates (the owner's policy: epp.server.process)
    sock = socket.socket(fileno=int(args[0]))
    handoff = socket.socket(fileno=int(args[1]))
    spec = _read_spec(sock)
    configure_logging(
        spec.verbosity, spec.log_format, spec.log_floor,
        time_encoding=spec.log_time_encoding, stacks_from=spec.log_stacks_from,
    )  # fmt: skip
    try:
        import uvloop
    except ImportError:  # no Windows build
        asyncio.run(_serve(spec, sock, handoff))
    else:
        uvloop.run(_serve(spec, sock, handoff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
