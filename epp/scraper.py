"""Model-server telemetry: one scrape loop per endpoint, feeding immutable snapshots to the datastore.

Design
------
:class:`ScrapeLoops` runs one loop (an asyncio task) per endpoint. Every
``--refresh-metrics-interval`` (50 ms, as upstream) a loop:

1. GETs the endpoint's metrics page on one keep-alive connection (:mod:`epp.httpget`), bounded by a
   per-fetch timeout;
2. extracts the few values the picker uses with the endpoint's engine mapping (vLLM, SGLang,
   trtllm-serve, Triton TRT-LLM, chosen by the pod label ``inference.networking.k8s.io/engine-type``;
   metric names overridable) - a targeted parser, not a general one (:mod:`epp.engine_metrics`);
3. hands a new :class:`epp.datastore.Metrics` (and why the scrape failed, if it did) to its sink.

The GET asks for only the metrics the engine mapping reads (``?name[]=vllm:num_requests_waiting&...``),
which prometheus_client - the exposition library of vLLM and SGLang - honours: the answer is about
1 KB instead of ~50 KB, which is most of what a scrape costs. A server that refuses the query or
answers it with nothing usable is asked for the whole page from then on.

Failures never end a loop: an HTTP error, a timeout, a refused connection or a page that lacks a
metric is recorded in the snapshot (``Metrics.error``); the last good numbers stay, and once no
scrape has succeeded for ``--metrics-staleness-threshold`` (2 s) the endpoint is marked stale,
which scorers and saturation detection read as "fully loaded". Loops keep random phases, so a
hundred pods are scraped evenly over each interval rather than in one burst.

Where the loops run. :class:`Scraper` follows the datastore's membership (an endpoint added
starts a loop, removed or changed cancels it) and applies every result to the datastore, the
Prometheus counters and the log. By default the loops themselves run in a child process
(:mod:`epp.scrape_worker`): 100 pods at 50 ms are 2,000 scrapes and ~100 MB of text a second, about
a third of a core, and sharing the request path's event loop with that work raised request P99 by
several milliseconds (bench/scrape_cost.py). The child sends results back in small batches; applying
one costs the request loop a few microseconds. ``in_process=True`` runs the loops in the caller's
loop instead (tests, tiny pools).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from urllib.parse import quote

from epp.datastore import ENGINE_TYPE_LABEL, Datastore, Endpoint, Metrics
from epp.engine_metrics import EngineMapping, EngineMetrics
from epp.httpget import HttpGetError, PersistentGet
from epp.metrics import Metrics as ServiceMetrics
from epp.scrape_worker import WorkerClient

__all__ = ["ScrapeLoops", "ScrapeSettings", "Scraper", "Target"]

log = logging.getLogger(__name__)

# Why a scrape failed; the label values of epp_endpoint_scrape_errors_total.
REASONS = ("connection", "timeout", "http_status", "missing_metrics")


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


@dataclass(frozen=True, slots=True)
class Target:
    """What a loop needs to know about an endpoint (picklable: it crosses to the worker)."""

    name: str
    address: str
    port: int
    engine: str


# (endpoint name, its new metrics, why the scrape failed or None)
Sink = Callable[[str, Metrics, "str | None"], None]


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
        self._engines = engines
        self._default_engine = default_engine
        self._settings = settings
        self._sink = sink
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._tls: ssl.SSLContext | None = None
        if settings.scheme == "https":
            self._tls = ssl.create_default_context()
            if settings.insecure_skip_verify:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE

    @property
    def tasks(self) -> Mapping[str, asyncio.Task[None]]:
        """The running loops by endpoint name."""
        return self._tasks

    def add(self, target: Target) -> None:
        """Start scraping ``target`` (restarting its loop if it already had one)."""
        self.remove(target.name)
        engine = self._engines.get(target.engine)
        if engine is None:
            engine = self._engines[self._default_engine]
        self._tasks[target.name] = asyncio.get_running_loop().create_task(
            self._loop(target, engine), name=f"scrape {target.name}"
        )

    def remove(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, target: Target, engine: EngineMapping) -> None:
        settings = self._settings
        port = settings.port or target.port
        filtered = settings.name_filter
        path = _filtered_path(settings.path, engine) if filtered else settings.path
        client = PersistentGet(target.address, port, path, tls=self._tls)
        loop = asyncio.get_running_loop()
        sink = self._sink
        current = Metrics()
        last_ok = 0.0
        # Each loop keeps its own phase, drawn at random: a hundred loops started together would
        # otherwise scrape in one burst every interval.
        deadline = loop.time() + random.uniform(0, settings.interval)
        try:
            while True:
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                started = loop.time()
                deadline += settings.interval
                if deadline < started:  # fell behind (a slow pod): skip the missed beats, keep the phase
                    deadline += (started - deadline) // settings.interval * settings.interval + settings.interval
                reason: str | None = None
                try:
                    async with asyncio.timeout(settings.timeout):
                        status, page = await client.get()
                    if status != 200:
                        reason, detail = "http_status", f"HTTP {status} from {settings.path}"
                except TimeoutError:
                    reason, detail = "timeout", f"no answer within {settings.timeout:g}s"
                except (OSError, HttpGetError) as exc:
                    reason, detail = "connection", f"{type(exc).__name__}: {exc}"
                # time.monotonic(), not loop.time(): snapshots may cross to another process.
                now = time.monotonic()
                if filtered and (reason == "http_status" or reason is None and _nothing_read(engine.parse(page))):
                    # This server refuses or misreads ``?name[]=``: ask for the whole page from now on.
                    log.info("endpoint %s: metrics name filter not supported; scraping the whole page", target.name)
                    filtered = False
                    client.close()
                    client = PersistentGet(target.address, port, settings.path, tls=self._tls)
                    deadline = loop.time()
                    continue
                if reason is None:
                    parsed = engine.parse(page)
                    current = _snapshot(parsed, now)
                    if parsed.missing:
                        reason = "missing_metrics"
                    last_ok = now
                else:
                    current = replace(current, stale=not last_ok or now - last_ok > settings.staleness, error=detail)
                sink(target.name, current, reason)
        finally:
            client.close()


def _filtered_path(path: str, engine: EngineMapping) -> str:
    """``path`` asking for only ``engine``'s metrics: prometheus_client (vLLM's and SGLang's
    exposition) answers ``?name[]=a&name[]=b`` with those samples alone, ~1 KB instead of ~50 KB."""
    query = "&".join(f"name[]={quote(name, safe=':')}" for name in engine.metric_names())
    return f"{path}{'&' if '?' in path else '?'}{query}" if query else path


def _nothing_read(parsed: EngineMetrics) -> bool:
    return parsed.waiting_queue_size is None and parsed.running_requests is None and parsed.kv_cache_usage is None


def _snapshot(parsed: EngineMetrics, now: float) -> Metrics:
    return Metrics(
        waiting_queue_size=parsed.waiting_queue_size or 0,
        running_requests=parsed.running_requests or 0,
        kv_cache_usage=parsed.kv_cache_usage or 0.0,
        running_adapters=parsed.running_adapters,
        waiting_adapters=parsed.waiting_adapters,
        max_adapters=parsed.max_adapters or 0,
        block_size=parsed.block_size,
        num_gpu_blocks=parsed.num_gpu_blocks,
        updated_at=now,
        stale=False,
        error=f"metrics missing from the page: {', '.join(parsed.missing)}" if parsed.missing else None,
    )


class Scraper:
    """Keeps every pool endpoint's :class:`Metrics` fresh; :meth:`start` it, :meth:`stop` it."""

    def __init__(
        self,
        datastore: Datastore,
        engines: Mapping[str, EngineMapping],
        settings: ScrapeSettings,
        metrics: ServiceMetrics,
        *,
        default_engine: str = "vllm",
        engine_label: str = ENGINE_TYPE_LABEL,
        in_process: bool = False,
    ) -> None:
        self._datastore = datastore
        self._engines = engines
        self._default_engine = default_engine
        self._engine_label = engine_label
        self._metrics = metrics
        self._warned_engines: set[str] = set()
        self._errors: dict[str, str | None] = {}
        self._stale: dict[str, bool] = {}
        self._started = False
        self._loops: ScrapeLoops | WorkerClient
        if in_process:
            self._loops = ScrapeLoops(engines, settings, self._apply, default_engine=default_engine)
        else:
            self._loops = WorkerClient(
                engines, settings, self._apply, default_engine=default_engine, on_lost=self.mark_all_stale
            )

    @property
    def loops(self) -> ScrapeLoops | WorkerClient:
        """Where the loops run: a :class:`ScrapeLoops` here, or the client of the worker process."""
        return self._loops

    async def start(self) -> None:
        self._started = True
        if not isinstance(self._loops, ScrapeLoops):
            await self._loops.start()
        self._datastore.subscribe(self._pool_changed)
        self._pool_changed(self._datastore.endpoints(), ())

    async def stop(self) -> None:
        self._started = False
        await self._loops.stop()

    def _pool_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        if not self._started:
            return
        added_names = {endpoint.name for endpoint in added}
        for endpoint in removed:
            if endpoint.name not in added_names:
                self._loops.remove(endpoint.name)
                self._forget(endpoint.name)
        for endpoint in added:
            self._loops.add(self._target(endpoint))

    def _target(self, endpoint: Endpoint) -> Target:
        engine = endpoint.labels.get(self._engine_label) or self._default_engine
        if engine not in self._engines:
            if engine not in self._warned_engines:
                self._warned_engines.add(engine)
                log.warning(
                    "unknown engine type %r (label %s on %s); using %s metric names",
                    engine, self._engine_label, endpoint.name, self._default_engine,
                )  # fmt: skip
            engine = self._default_engine
        return Target(endpoint.name, endpoint.address, endpoint.port, engine)

    def _apply(self, name: str, metrics: Metrics, reason: str | None) -> None:
        """One loop's result: to the datastore, the counters and (on a change of state) the log."""
        if not self._datastore.update_metrics(name, metrics):
            return  # left the pool while the result was on its way
        service = self._metrics
        if reason is None or reason == "missing_metrics":
            service.scrapes.inc()
        if reason is not None:
            service.scrape_errors.labels(name, reason).inc()
        if self._stale.get(name) is not metrics.stale:  # labels() costs microseconds: only on a change
            self._stale[name] = metrics.stale
            service.endpoint_stale.labels(name).set(1 if metrics.stale else 0)
        if self._errors.get(name, "") != metrics.error:
            if metrics.error:
                log.warning("endpoint %s: metrics scrape: %s", name, metrics.error)
            elif name in self._errors:
                log.info("endpoint %s: metrics scrape recovered", name)
            self._errors[name] = metrics.error

    def _forget(self, name: str) -> None:
        self._errors.pop(name, None)
        self._stale.pop(name, None)
        service = self._metrics
        try:
            service.endpoint_stale.remove(name)
        except KeyError:
            pass
        for reason in REASONS:
            try:
                service.scrape_errors.remove(name, reason)
            except KeyError:
                pass

    def mark_all_stale(self, why: str) -> None:
        """Every endpoint's metrics become stale now (the scrape worker died)."""
        for endpoint in self._datastore.endpoints():
            self._apply(endpoint.name, replace(endpoint.metrics, stale=True, error=why), "connection")
