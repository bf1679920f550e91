"""The scrape loops: one per endpoint, each reading its model server's metrics page every interval
(less often while the numbers on it stay the same).

Design
------
:class:`ScrapeLoops` runs one loop per endpoint. Every ``--refresh-metrics-interval`` (50 ms, as
upstream; see "Cadence" below for pods whose numbers do not change) a loop:

1. GETs the endpoint's metrics page on one keep-alive connection (:mod:`epp.datalayer.httpget`), bounded by a
   per-fetch timeout;
2. extracts the few values the picker uses with the endpoint's engine mapping (vLLM, SGLang,
   trtllm-serve, Triton TRT-LLM, chosen by the pod label ``inference.networking.k8s.io/engine-type``;
   metric names overridable; :mod:`epp.datalayer.engines`) - a targeted reader, not a general parser
   (:mod:`epp.datalayer.page`);
3. hands its sink a :class:`ScrapeResult`: the new numbers, or why the scrape failed.

The GET asks for only the metrics the engine mapping reads (``?name[]=vllm:num_requests_waiting&...``),
which prometheus_client - the exposition library of vLLM and SGLang - honours: the answer is about
2 KB instead of ~50 KB, which is most of what a scrape costs. Where it is honoured is the engine's to
say (:attr:`EngineMapping.filter_path`): vLLM 0.32 ignores the query on ``/metrics`` (an instrumentator
serves it) and honours it on ``/metrics/`` (prometheus_client's app, the same page), so with the default
path a vLLM pod is asked ``/metrics/?name[]=...``; a path given with ``--model-server-metrics-path``
is asked as given. What comes back is checked: a page with more metric families (``# TYPE`` lines)
than names asked ignored the filter. That is counted (``epp_endpoint_scrape_filter_ignored_total``),
logged once for the endpoint, and the page is read as the whole page it is; the endpoint is asked for
the whole page, without the query, from then on. A server that refuses the query (a redirect, 400,
404, 405, 414 or 422) or answers it with nothing usable is asked for the whole page from then on, at
once; a 5xx is the pod's trouble and counts as a failed scrape.

Failures never end a loop: an HTTP error, a timeout, a refused connection, a 200 page with none of
the engine's metrics on it (an HTML page, garbage: ``no_metrics``, a failed scrape) or a page that
lacks some metric (``missing_metrics``: the rest is used) is recorded in the snapshot
(``Metrics.error``); the last good numbers stay, and once no scrape has succeeded for
``--metrics-staleness-threshold`` (2 s) the endpoint is marked stale, which scorers and saturation
detection read as "fully loaded". An endpoint that has never been scraped successfully is stale from
the start, so numbers never read are never taken for an idle pod. A refused connection marks the
endpoint stale at once: nothing listens on the port (the pod died or restarts), which no waiting
will change before the next successful scrape clears it. A GET that meets a reused connection
closed unanswered (the keep-alive race: the server closed it as idle while the request was on its
way) is sent once more on a new connection before it counts as failed (:mod:`epp.datalayer.httpget`).
A loop that falls behind (a slow pod) skips the beats it missed and keeps its phase.

What a scrape costs. At 100 pods that is 2,000 scrapes a second, so the loop is callbacks, not a
task: a timer (``loop.call_at``) per endpoint writes the pre-built request, the connection's
``data_received`` frames the response and, once it is whole, parses it and calls the sink, then
sets the next timer. No task switch, future, ``asyncio.sleep`` or ``asyncio.timeout`` per scrape:
timeouts are one sweeper for all loops, which every ``min(0.1 s, timeout / 4)`` gives up the
requests in flight for longer than the timeout (a fetch fails between ``timeout`` and ``timeout``
plus that period). Connecting, the rare part, is a task. A page identical to the previous one (an
idle pod) is not parsed again. The sink gets a :class:`ScrapeResult`, a typed message that the worker
ships as it is and :class:`~epp.datalayer.scraper.Scraper` turns into the datastore's ``Metrics``.

Phases. Each loop has its own phase, so that a hundred pods are scraped spread over the interval
rather than in one burst - but on a 5 ms grid (``_SLOT``), and the loops of one slot fire in the
same event-loop turn. Their requests go out together and their answers come back together, so one
wake-up of the process serves several scrapes. Measured in the worker process at 100 pods (10 loops
a slot), a scrape cost ~25% less CPU than with phases spread continuously (a 1 ms grid: no gain;
10 ms: a little more, for bursts twice the size). So a new loop takes the first slot that has fewer
than 10 loops (``_SLOT_LOOPS``), and only once every slot has 10 the least busy one: a pool of up
to 10 pods is scraped in one wake-up a beat, 30 pods in three, 100 pods ten to a slot as before.
Spreading a small pool over the slots instead (the fewest-loops rule, before) cost one wake-up per
pod: with busy pods (their numbers change, so the backoff never slows them) the picker spent 0.105
cores at 8 pods and 0.202 at 30, against 0.049 and 0.140 with the slots filled (649 and 334 µs a
scrape against 300 and 231; ``python bench/scrape_cost.py --skip-latency --busy --pods 8,30
--baseline DIR``, 3 alternating rounds, medians). A pod's numbers are as fresh either way (each
is asked every interval); filled, the pool's numbers are all of one moment.

With the callbacks, the one-pass reading of small pages (:mod:`epp.datalayer.page`) and 10 ms
result batches (:mod:`epp.datalayer.worker`), a scrape costs about half the CPU of the earlier
task-per-endpoint loop: at 100 pods ~105 µs instead of ~230 µs, worker and request-path process
together (bench/scrape_cost.py, medians of 3 alternating runs on a shared 2-core machine).

Cadence
-------
An idle pod asked every 50 ms gives the same page twenty times a second, and at 100 pods that was
most of the picker's idle CPU and all of the pods' CPU spent answering it. A loop whose scrape finds
the same numbers as the scrape before (what the picker reads - queue, running, KV usage, adapters,
cache geometry - not the bytes: vLLM's LoRA series carries a timestamp) four times in a row slows
down: the gap to the next scrape doubles with each further steady scrape (100, 200, 400, 800 ms) up
to ``--refresh-metrics-idle-interval`` (1 s; our extension, ``ScrapeSettings.idle_interval``; 0 or
anything under one interval turns it off). The gap is a whole number of beats of the loop's grid
(its *stride*), and a loop at stride k scrapes on the beats that are multiples of k, so steady loops
share beats: their answers share the worker's wake-ups, and their results one message to the
request loop. A loop is back at the fast cadence from the next beat on:

* when this picker sends the pod a request: the scraper watches the in-flight record of each slowed
  pod and wakes its loop at the first pick there (:meth:`ScrapeLoops.wake`,
  :mod:`epp.datalayer.scraper`); four scrapes at the fast cadence follow at least;
* when a scrape finds other numbers than the one before;
* when a scrape fails, and while it keeps failing (a pod that is stale or going stale); a new pod
  starts fast.

Blind time. The numbers of a pod this picker sends nothing to change only through traffic it does
not see (another gateway, another replica of the picker): on a slowed pod such a change is seen at
most one idle interval later (1 s instead of 50 ms; ``tests/datalayer/test_backoff.py`` bounds it),
and the pod is scraped fast again from then on. In that second this picker may take the pod for idle
and pick it - and that pick wakes the loop, so the next scrape (at most 50 ms later) shows the other
traffic: at most one pick per pod and idle interval goes on stale numbers. This picker's own requests
are never blind: the in-flight accounting counts them the moment they are sent, whatever the cadence
(scorers add what was sent since the scrape's own time, ``updated_at``). What is not waited for: the
end of a request (its release) does not wake the loop - the pod's numbers move while it serves, so a
pod with work is not slowed in the first place.

Staleness keeps its meaning: ``--metrics-staleness-threshold`` is how long a pod's scrapes fail before
it goes stale. The threshold counts from the last good scrape, which at the fast cadence is one
interval before the first failed one; a slowed pod was asked less often by the picker's choice, so
it is vouched for until one interval before its first failed scrape was sent, and goes stale as long
after its failures begin as a pod asked every interval (a test compares both). A refused connection
still marks it stale at once, at its next scrape, at most an idle interval after the pod died (a pick
to it is answered by Envoy with a 503 that marks it unreachable at once, and wakes the loop). The
idle interval is capped at half the staleness threshold so that a steady pod's ``updated_at`` never
ages past the threshold between two scrapes (flow control's saturation detector reads that age), and
the 1 s default stays well under the idle keep-alive timeout of the model servers (uvicorn's 5 s in
vLLM and SGLang), so a slowed loop keeps its connection.

Measured (pods serving the same page each scrape, as idle pods do; the picker with its scrape
worker; 3 alternating rounds of 10 s, medians, on a shared 2-core machine)::

                                    8 pods          100 pods
    picker cores, previous code     0.031           0.075
    picker cores, backoff off       0.020           0.061     (unchanged results batched lazily)
    picker cores, backoff (1 s)     0.003           0.006
    stand-in pods, ms/s per pod     1.25 -> <0.13   0.29 -> 0.010   (previous -> backoff)
    scrapes per second              160 -> 8        2000 -> 100

``python bench/scrape_cost.py --skip-latency --farm-nice 10 --baseline DIR`` (DIR: a checkout of the
previous code). The idle interval trades blind time for CPU about linearly: at 100 idle pods 250 ms
cost 0.019 core (4 scrapes a second per pod), 500 ms 0.011, 1 s 0.006, against 0.072 every 50 ms
(``--pods 100 --idle-intervals 250ms,500ms``, one run). 1 s is the default: the lowest pod cost of
the three, with the blind time still half the staleness threshold and only until the first pick.

Against a real vLLM 0.32 server (CPU, idle), its API process spent 22 ms/s above idle answering a
picker without the backoff and 1.0 ms/s with it (1 scrape a second: its numbers do
not change; ``python bench/vllm_scrape_cost.py --modes idle,filtered,picker-backoff,picker-no-backoff``).
Pods that serve a different page each scrape are never slowed, and they are what scraping costs under
load. ``python bench/scrape_cost.py --skip-latency --busy --pods 8,100 --rounds 2`` at 652d5cf (the
farm's filtered page ~2.3 KB: three gauges, four LoRA series, vLLM 0.32's ``cache_config_info``): 0.055
cores at 8 pods (330 µs of CPU a scrape, 160 a second), **0.53 at 100** (264 µs a scrape, 2,000 a
second), the request-path process 0.008 and 0.068 of it. The same bench with 6190fe6's picker beside
(``--pods 100 --baseline``): 0.447 against 0.472 cores, so no regression since; the 0.132-0.136 cores
at 100 busy pods this paragraph quoted before (and a py-spy reading of ~0.11 core, half of it in
uvloop's loop) are not what this bench measures now. ``perf`` of the scrape loops alone (one process,
the same farm): 69% of their CPU in the interpreter, 18% in the kernel, 7% in uvloop; of the Python
samples, reading the page about half (``EngineMapping.parse``: ~58 µs a page in a hot loop on a quiet
machine, spread over a dozen small readings of a few µs each, bytes methods at 0.1-0.5 µs a call here),
the HTTP framing, the sends and the loop's bookkeeping the rest. Fewer parent wake-ups trade freshness
(see :mod:`epp.datalayer.worker`); what would cut the rest is the read and the framing in native code.

Conditional requests were not an option: prometheus_client sends no ``ETag`` and ignores
``If-None-Match`` (its exposition apps, as vLLM 0.32 and SGLang mount them, checked in their sources),
so a server cannot answer "not modified"; it renders and filters the page on every request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args
from urllib.parse import quote

import msgspec

from epp.datalayer.engines import EngineMapping, EngineMetrics
from epp.datalayer.httpget import GetConnection, HttpGetError, connect, request_bytes

__all__ = ["REASONS", "Reason", "ScrapeLoops", "ScrapeResult", "ScrapeSettings", "Sink", "Target"]

log = logging.getLogger(__name__)

Reason = Literal["connection", "timeout", "http_status", "no_metrics", "missing_metrics"]
"""Why a scrape failed or was incomplete; the label values of ``epp_endpoint_scrape_errors_total``."""
REASONS: tuple[Reason, ...] = get_args(Reason)

# Answers of a server that will not take the ?name[]= query (or the engine's filter path, which a
# server may redirect): ask it for the whole page instead.
_FILTER_REFUSED = frozenset({301, 302, 303, 307, 308, 400, 404, 405, 414, 422})
# The path the engine's filter_path stands in for: the default --model-server-metrics-path.
_DEFAULT_PATH = "/metrics"


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    interval: float = 0.05  # --refresh-metrics-interval
    staleness: float = 2.0  # --metrics-staleness-threshold
    timeout: float = 1.0  # per fetch; a pod slower than this is failing
    path: str = "/metrics"  # --model-server-metrics-path
    scheme: str = "http"  # --model-server-metrics-scheme
    port: int = 0  # --model-server-metrics-port; 0: the endpoint's own port
    insecure_skip_verify: bool = True  # --model-server-metrics-https-insecure-skip-verify
    name_filter: bool = True  # ask for only the metrics in use (?name[]=...); whole page if refused
    # --refresh-metrics-idle-interval (our extension): the longest gap between two scrapes of a pod whose
    # numbers do not change (capped at half the staleness threshold); <= interval: every pod every interval.
    idle_interval: float = 1.0

    @property
    def max_stride(self) -> int:
        """The most beats of ``interval`` a backed-off loop lets pass between two scrapes (1: no backoff)."""
        longest = min(self.idle_interval, self.staleness / 2)
        return max(1, int(longest / self.interval + 1e-9))


@dataclass(frozen=True, slots=True)
class Target:
    """What a loop needs to know about an endpoint (picklable: it crosses to the worker)."""

    name: str
    address: str
    port: int
    engine: str


# array_like: encoded as a msgpack array, without field names; gc=False: its fields (numbers,
# strings, frozensets of strings) can hold no reference cycle, so the collector need not track the
# 2,000 made a second at 100 pods. Making one costs about what the equivalent tuple did.
class ScrapeResult(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a loop reports after each scrape: the endpoint's numbers and state, and why it failed.

    The loops make one per scrape, the worker ships it as it is (:mod:`epp.datalayer.worker`), and
    :class:`~epp.datalayer.scraper.Scraper` turns it into the datastore's ``Metrics`` by field name.
    After a failure the numbers are the last good ones (the defaults before any), ``stale`` says
    whether they are older than the staleness threshold, ``error`` says what happened.
    """

    endpoint: str
    waiting_queue_size: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters: int = 0
    block_size: int | None = None  # KV-cache block size, tokens
    num_gpu_blocks: int | None = None
    updated_at: float = 0.0  # time.monotonic() of the last good scrape; 0: never
    stale: bool = True
    error: str | None = None  # why the scrape failed or what the page lacked; None when complete
    reason: Reason | None = None  # the error's kind; None when the scrape was complete
    kv_cache_size_tokens: int | None = None  # the cache's capacity in tokens, when the engine says it
    filter_ignored: bool = False  # this scrape found that the pod ignores ?name[]= (reported once)
    slow: bool = False  # the loop now scrapes this pod less often than every interval (its numbers are steady)
    unchanged: bool = False  # as the endpoint's previous result but for updated_at: nothing new but the time


Sink = Callable[[ScrapeResult], None]


class ScrapeLoops:
    """One scrape loop per target, in the running event loop, reporting to ``sink``."""

    def __init__(
        self,
        engines: Mapping[str, EngineMapping],
        settings: ScrapeSettings,
        sink: Sink,
        *,
        default_engine: str = "vllm",
    ) -> None:
        if default_engine not in engines:
            raise ValueError(f"default engine {default_engine!r} is not one of {sorted(engines)}")
        if not (settings.interval > 0 and settings.timeout > 0 and settings.staleness > 0):
            raise ValueError(f"scrape interval, timeout and staleness must be positive, got {settings}")
        if not settings.idle_interval >= 0:
            raise ValueError(f"the idle scrape interval cannot be negative, got {settings.idle_interval}")
        self._engines = engines
        self._default_engine = default_engine
        self._settings = settings
        self._sink = sink
        self._endpoints: dict[str, _EndpointLoop] = {}
        # Phases on a grid (see the module docstring): slot k's loops send at epoch + k * width + n * interval.
        self._slot_width = settings.interval / max(1, round(settings.interval / _SLOT))
        self._slot_load = [0] * max(1, round(settings.interval / _SLOT))
        self._epoch: float | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_every = min(_SWEEP_EVERY, settings.timeout / 4)
        self._tls: ssl.SSLContext | None = None
        if settings.scheme == "https":
            self._tls = ssl.create_default_context()
            if settings.insecure_skip_verify:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE

    @property
    def endpoints(self) -> Mapping[str, _EndpointLoop]:
        """The loops by endpoint name."""
        return self._endpoints

    def add(self, target: Target) -> None:
        """Start scraping ``target`` (restarting its loop if it already had one)."""
        self.remove(target.name)
        engine = self._engines.get(target.engine)
        if engine is None:
            engine = self._engines[self._default_engine]
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._epoch is None:
            self._epoch = now
        load = self._slot_load
        # The first slot with room (see "Phases" in the module docstring); once all are full, the least busy.
        slot = next((k for k, n in enumerate(load) if n < _SLOT_LOOPS), None)
        if slot is None:
            slot = load.index(min(load))
        load[slot] += 1
        phase = self._epoch + slot * self._slot_width
        endpoint = _EndpointLoop(target, engine, self._settings, self._tls, self._sink, loop, slot, phase)
        self._endpoints[target.name] = endpoint
        endpoint.start(max(0, math.ceil((now - phase) / self._settings.interval)))
        if self._sweeper is None:
            self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    def wake(self, name: str) -> None:
        """``name`` was just sent a request: scrape it at the fast cadence again, from the next beat on
        (nothing happens for an endpoint without a loop)."""
        endpoint = self._endpoints.get(name)
        if endpoint is not None:
            endpoint.wake()

    def remove(self, name: str) -> None:
        """Stop scraping ``name`` and close its connection (no result of it is reported after this)."""
        endpoint = self._endpoints.pop(name, None)
        if endpoint is not None:
            endpoint.close()
            self._slot_load[endpoint.slot] -= 1

    async def stop(self) -> None:
        """Stop every loop and close its connection."""
        endpoints = list(self._endpoints.values())
        self._endpoints.clear()
        self._slot_load = [0] * len(self._slot_load)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        connecting = [task for endpoint in endpoints if (task := endpoint.close()) is not None]
        await asyncio.gather(*connecting, return_exceptions=True)

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)  # first: a failing sink cannot stop it
        limit = loop.time() - self._settings.timeout
        for endpoint in [e for e in self._endpoints.values() if e.sent_at is not None and e.sent_at <= limit]:
            endpoint.expire()


_SWEEP_EVERY = 0.1  # seconds between timeout checks at most: a tenth of the default 1 s timeout
_SLOT = 0.005  # seconds between the phases loops may have: a tenth of the default 50 ms interval (measured: see above)
_SLOT_LOOPS = 10  # loops a slot takes before the next slot is used: 100 pods fill the ten of 50 ms evenly


class _EndpointLoop:
    """One endpoint's scrape loop: a timer sends, the response callback parses and reports."""

    __slots__ = (
        "_asked", "_beat_n", "_closed", "_connecting", "_connection", "_current", "_engine", "_filtered", "_host",
        "_interval", "_last_ok", "_last_page", "_last_parsed", "_loop", "_max_stride", "_path", "_phase", "_port",
        "_previous", "_quiet", "_request", "_retried", "_sent_mono", "_settings", "_sink", "_stride", "_timer", "_tls",
        "_vouched", "name", "sent_at", "slot",
    )  # fmt: skip

    def __init__(
        self,
        target: Target,
        engine: EngineMapping,
        settings: ScrapeSettings,
        tls: ssl.SSLContext | None,
        sink: Sink,
        loop: asyncio.AbstractEventLoop,
        slot: int,
        phase: float,
    ) -> None:
        self.name = target.name
        self.slot = slot
        """Which phase of the interval this loop has (see :class:`ScrapeLoops`)."""
        self.sent_at: float | None = None
        """``loop.time()`` when the request in flight (or the connection being opened) was started."""
        self._engine = engine
        self._settings = settings
        self._tls = tls
        self._sink = sink
        self._loop = loop
        self._host = target.address
        self._port = settings.port or target.port
        self._filtered = settings.name_filter
        self._asked = len(engine.metric_names())
        self._path = _filtered_path(settings.path, engine) if self._filtered else settings.path
        self._request = request_bytes(self._host, self._port, self._path)
        self._connection: GetConnection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._retried = False  # the scrape in flight was sent again after the keep-alive race
        self._timer: asyncio.TimerHandle | None = None
        # The cadence (see the module docstring): beat n is at phase + n * interval; the loop scrapes
        # every stride-th beat, 1 unless its numbers have been steady for a while.
        self._phase = phase
        self._interval = settings.interval
        self._max_stride = settings.max_stride
        self._beat_n = 0  # the beat scheduled next, or the one whose scrape is in flight
        self._stride = 1  # beats from the previous scrape to the next one
        self._quiet = 0  # good scrapes in a row that found the same numbers as the one before
        self._previous: EngineMetrics | None = None  # the last scrape's numbers; None after a failure
        self._current = ScrapeResult(target.name)  # never scraped
        self._last_ok = 0.0
        self._vouched = 0.0  # time.monotonic() the staleness threshold counts from (see _failed)
        self._sent_mono = 0.0  # time.monotonic() of the last send
        self._last_page: bytes | None = None
        self._last_parsed: EngineMetrics | None = None
        self._closed = False

    @property
    def connected(self) -> bool:
        """Whether a connection to the endpoint is open."""
        return self._connection is not None and not self._connection.closed

    @property
    def path(self) -> str:
        """The path (and query) this loop asks for now."""
        return self._path

    @property
    def closed(self) -> bool:
        """Whether the loop was stopped (:meth:`close`): it scrapes and reports no more."""
        return self._closed

    @property
    def stride(self) -> int:
        """Beats of the interval between the last scrape and the next: 1 at the fast cadence."""
        return self._stride

    @property
    def next_scrape(self) -> float | None:
        """``loop.time()`` of the next scrape, when one is scheduled (None while one is in flight)."""
        return self._phase + self._beat_n * self._interval if self._timer is not None else None

    def start(self, beat: int) -> None:
        """Scrape at beat ``beat`` (``loop.time()`` phase + beat x interval), then on."""
        self._beat_n = beat
        self._timer = self._loop.call_at(self._phase + beat * self._interval, self._beat)

    def wake(self) -> None:
        """Back to the fast cadence: the next scrape at the next beat, and a few more after it."""
        if self._closed:
            return
        self._quiet = 0
        if self._stride == 1:
            return
        self._stride = 1
        if self._timer is not None:  # waiting for a far beat: the next one instead
            beat = max(0, math.ceil((self._loop.time() - self._phase) / self._interval))
            if beat < self._beat_n:
                self._timer.cancel()
                self.start(beat)
        # else a scrape is in flight: its end schedules the next at stride 1

    def close(self) -> asyncio.Task[None] | None:
        """Stop for good; returns the connecting task it cancelled, if there was one."""
        self._closed = True
        self.sent_at = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        return connecting

    def expire(self) -> None:
        """Give up the request in flight, older than the timeout (called by the sweeper)."""
        self.sent_at = None
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._connection is not None:
            self._connection.close()  # a response may be half-read: start over on a new connection
            self._connection = None
        self._failed("timeout", f"no answer within {self._settings.timeout:g}s")

    def _beat(self) -> None:
        self._timer = None
        self._send(self._loop.time())

    def _send(self, now: float) -> None:
        self.sent_at = now
        self._retried = False
        self._sent_mono = time.monotonic()
        connection = self._connection
        if connection is not None and not connection.closed:
            connection.send(self._request)
        else:
            self._reconnect()

    def _reconnect(self) -> None:
        """Send the request in flight on a new connection (opened by a task: connecting is the rare part)."""
        self._connection = None
        self._connecting = self._loop.create_task(self._connect(), name=f"connect {self.name}")

    async def _connect(self) -> None:
        try:
            connection = await connect(self._host, self._port, self._response, self._error, tls=self._tls)
        except Exception as exc:  # refused, unreachable, TLS handshake...: recorded, never fatal
            self._connecting = None
            self.sent_at = None
            # Refused: nothing listens there now, a fact, not a slow pod (see the module docstring).
            self._failed("connection", f"{type(exc).__name__}: {exc}", stale=isinstance(exc, ConnectionRefusedError))
            return
        self._connecting = None
        if self._closed:  # close() cancels this task first, but a leaked socket would be worse
            connection.close()
            return
        self._connection = connection
        try:
            connection.send(self._request)
        except HttpGetError as exc:  # closed by the server as soon as it was opened
            self._error(exc)

    def _response(self, status: int, page: bytes) -> None:
        """The connection's callback: a whole response arrived."""
        if self.sent_at is None:
            return
        self.sent_at = None
        if status != 200:
            # A server that does not know ?name[]= refuses the query (400/404/422); a 5xx is the
            # pod's trouble, not the filter's, and must not cost it 50 KB pages for good.
            if self._filtered and status in _FILTER_REFUSED:
                self._whole_pages()
            else:
                self._failed("http_status", f"HTTP {status} from {self._settings.path}")
            return
        parsed = self._last_parsed
        ignored = False
        if page != self._last_page or parsed is None:  # an idle pod serves the same page over and over
            if self._filtered and page.count(b"# TYPE ") > self._asked:
                ignored = self._filter_ignored(len(page))
            parsed = self._engine.parse(page)
            self._last_page, self._last_parsed = page, parsed
        if self._filtered and _nothing_read(parsed):
            self._whole_pages()
            return
        if _no_metrics(parsed):
            names = ", ".join(parsed.missing)
            detail = f"not a metrics page: none of the engine's metrics (missing from the page: {names})"
            self._failed("no_metrics", detail)
            return
        # time.monotonic(), not loop.time(): snapshots may cross to another process.
        now = time.monotonic()
        self._last_ok = self._vouched = now
        # The cadence: steady numbers (the same as the last scrape's, a good one too) slow it down.
        previous = self._previous
        same = previous is not None and (parsed is previous or parsed == previous)
        self._previous = parsed
        quiet = self._quiet = self._quiet + 1 if same else 0
        stride = self._stride = _stride(quiet, self._max_stride)
        slow = stride > 1
        last = self._current
        if same and last.slow is slow and not ignored:  # nothing new but the time: only updated_at moves
            self._current = current = msgspec.structs.replace(last, updated_at=now, unchanged=True)
        else:
            missing = parsed.missing
            self._current = current = ScrapeResult(
                endpoint=self.name,
                waiting_queue_size=parsed.waiting_queue_size or 0,
                running_requests=parsed.running_requests or 0,
                kv_cache_usage=parsed.kv_cache_usage or 0.0,
                running_adapters=parsed.running_adapters,
                waiting_adapters=parsed.waiting_adapters,
                max_adapters=parsed.max_adapters or 0,
                block_size=parsed.block_size,
                num_gpu_blocks=parsed.num_gpu_blocks,
                kv_cache_size_tokens=parsed.kv_cache_size_tokens,
                updated_at=now,
                stale=False,
                error=f"metrics missing from the page: {', '.join(missing)}" if missing else None,
                reason="missing_metrics" if missing else None,
                slow=slow,
            )
            if ignored:  # reported by this result alone: the next failure's result copies _current
                self._current = msgspec.structs.replace(current, filter_ignored=False)
                current = msgspec.structs.replace(current, filter_ignored=True)
        try:
            self._sink(current)
        finally:
            self._next()

    def _error(self, exc: Exception) -> None:
        """The connection's callback: the request failed (connection closed, not HTTP/1.1)."""
        if self.sent_at is None:
            return
        if isinstance(exc, HttpGetError) and exc.retryable and not self._retried:
            # The keep-alive race (epp.datalayer.httpget): the server closed the idle connection as the
            # request went out. Once more on a new connection, within the same timeout; a pod that is
            # gone refuses that connection, which marks it stale at once.
            self._retried = True
            self._reconnect()
            return
        self.sent_at = None
        self._failed("connection", f"{type(exc).__name__}: {exc}")

    def _whole_pages(self) -> None:
        # This server refuses or misreads ``?name[]=``: ask for the whole page from now on, at once.
        log.info("endpoint %s: metrics name filter not supported; scraping the whole page", self.name)
        self._unfiltered()
        self._send(self._loop.time())  # now, off the beat; the phase stays

    def _filter_ignored(self, size: int) -> bool:
        # The page came back whole: it is read as it is, and the query, which only costs the server
        # its parsing, is not sent again. Logged once: the loop never asks filtered again.
        log.warning(
            "endpoint %s: %s?name[]=... ignored the metrics name filter (a %d-byte page with more families "
            "than the %d asked for); scraping the whole page from %s",
            self.name, self._path.partition("?")[0], size, self._asked, self._settings.path,
        )  # fmt: skip
        self._unfiltered()
        return True

    def _unfiltered(self) -> None:
        self._filtered = False
        self._path = self._settings.path
        self._request = request_bytes(self._host, self._port, self._path)

    def _failed(self, reason: Reason, detail: str, *, stale: bool = False) -> None:
        if self._closed:
            return
        now = time.monotonic()
        if self._previous is not None:
            # The first failure after a good scrape. The threshold counts from the last good scrape,
            # which at the fast cadence is about one interval before the failed one (then this changes
            # nothing); a pod asked less often (slowed, or woken by a pick just before) is vouched for
            # until one interval before this scrape was sent: it goes stale as long after its failures
            # begin as a pod asked every interval does.
            self._vouched = max(self._last_ok, self._sent_mono - self._interval)
        self._previous = None
        self._quiet = 0
        self._stride = 1  # a failure is news: the fast cadence until scrapes are good and steady again
        stale = stale or not self._last_ok or now - self._vouched > self._settings.staleness
        last = self._current
        # The last good numbers are kept, and their time: scorers age them from updated_at.
        unchanged = last.error == detail and last.reason == reason and last.stale is stale and not last.slow
        self._current = current = msgspec.structs.replace(
            last, stale=stale, error=detail, reason=reason, slow=False, unchanged=unchanged
        )
        try:
            self._sink(current)
        finally:
            self._next()

    def _next(self) -> None:
        if self._closed:
            return
        stride, interval, phase = self._stride, self._interval, self._phase
        beat = (self._beat_n // stride + 1) * stride  # a multiple of the stride: steady loops share beats
        now = self._loop.time()
        if phase + beat * interval < now:  # fell behind (a slow pod): skip the missed beats, keep the phase
            beat = -(-math.ceil((now - phase) / interval) // stride) * stride
        self.start(beat)


# Good scrapes in a row with the same numbers before a loop slows down: 200 ms at the default 50 ms
# interval, so that a pick (which resets it) is followed by that many scrapes at the fast cadence.
_QUIET_SCRAPES = 4


def _stride(quiet: int, most: int) -> int:
    """Beats to the next scrape after ``quiet`` unchanged scrapes in a row: 1 until _QUIET_SCRAPES,
    then doubling with each further one (2, 4, 8, ...) up to ``most``."""
    if quiet < _QUIET_SCRAPES or most <= 1:
        return 1
    return min(most, 1 << min(quiet - _QUIET_SCRAPES + 1, 30))


def _filtered_path(path: str, engine: EngineMapping) -> str:
    """``path`` asking for only ``engine``'s metrics: prometheus_client (vLLM's and SGLang's
    exposition) answers ``?name[]=a&name[]=b`` with those samples alone, ~2 KB instead of ~50 KB.
    The default path is asked at the engine's :attr:`~EngineMapping.filter_path` (vLLM: ``/metrics/``),
    any other as given."""
    query = "&".join(f"name[]={quote(name, safe=':')}" for name in engine.metric_names())
    if not query:
        return path
    if path == _DEFAULT_PATH and engine.filter_path:
        path = engine.filter_path
    return f"{path}{'&' if '?' in path else '?'}{query}"


def _nothing_read(parsed: EngineMetrics) -> bool:
    return parsed.waiting_queue_size is None and parsed.running_requests is None and parsed.kv_cache_usage is None


def _no_metrics(parsed: EngineMetrics) -> bool:
    # Not one value the mapping asks for was found (an HTML page, garbage): a failed scrape, whose
    # zeros must not read as an idle pod. ``missing`` is empty when the mapping asks for nothing.
    return (
        bool(parsed.missing)
        and _nothing_read(parsed)
        and parsed.max_adapters is None
        and parsed.block_size is None
        and parsed.num_gpu_blocks is None
    )
