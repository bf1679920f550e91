"""Model-server telemetry: one scrape loop per endpoint, swapping immutable snapshots into the datastore.

Design
------
The scraper follows the datastore's membership: an endpoint added starts a loop (an asyncio task),
an endpoint removed (or changed) cancels it, so the set of tasks always equals the pool and nothing
outlives its endpoint. Each loop, every ``--refresh-metrics-interval`` (50 ms, as upstream):

1. GETs the endpoint's metrics page on one keep-alive connection (:mod:`epp.httpget`), bounded by
   a per-fetch timeout;
2. extracts the few values the picker uses with the endpoint's engine mapping (vLLM, SGLang,
   trtllm-serve, Triton TRT-LLM; chosen by the pod label ``inference.networking.k8s.io/engine-type``;
   metric names overridable in the config file) - a targeted parser, not a general one
   (:mod:`epp.engine_metrics`);
3. publishes a new :class:`epp.datastore.Metrics` for the endpoint.

Failures never end a loop: an HTTP error, a timeout, a refused connection or a page that lacks a
metric is recorded on the endpoint (``Metrics.error``) and counted
(``epp_endpoint_scrape_errors_total{endpoint,reason}``); the last good numbers stay, and once no
scrape has succeeded for ``--metrics-staleness-threshold`` (2 s) the endpoint is marked stale, which
scorers and saturation detection read as "fully loaded". Scrapes run on the event loop: each costs
tens of microseconds (bench/scrape_cost.py measures the whole at 25/50/100 pods).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, replace

from epp.datastore import ENGINE_TYPE_LABEL, Datastore, Endpoint, Metrics
from epp.engine_metrics import EngineMapping, EngineMetrics
from epp.httpget import HttpGetError, PersistentGet
from epp.metrics import Metrics as ServiceMetrics

__all__ = ["ScrapeSettings", "Scraper"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    interval: float = 0.05  # --refresh-metrics-interval
    staleness: float = 2.0  # --metrics-staleness-threshold
    timeout: float = 1.0  # per fetch; a pod slower than this is failing
    path: str = "/metrics"  # --model-server-metrics-path
    scheme: str = "http"  # --model-server-metrics-scheme
    port: int = 0  # --model-server-metrics-port; 0: the endpoint's own port
    insecure_skip_verify: bool = True  # --model-server-metrics-https-insecure-skip-verify


class Scraper:
    """Keeps every endpoint's :class:`Metrics` fresh; start with :meth:`start`, end with :meth:`stop`."""

    def __init__(
        self,
        datastore: Datastore,
        engines: Mapping[str, EngineMapping],
        settings: ScrapeSettings,
        metrics: ServiceMetrics,
        *,
        default_engine: str = "vllm",
    ) -> None:
        if default_engine not in engines:
            raise ValueError(f"default engine {default_engine!r} is not one of {sorted(engines)}")
        self._datastore = datastore
        self._engines = engines
        self._default_engine = default_engine
        self._settings = settings
        self._metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._tls: ssl.SSLContext | None = None
        if settings.scheme == "https":
            self._tls = ssl.create_default_context()
            if settings.insecure_skip_verify:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE
        self._started = False

    @property
    def tasks(self) -> Mapping[str, asyncio.Task[None]]:
        """The running loops by endpoint name (one per pool member)."""
        return self._tasks

    def start(self) -> None:
        self._started = True
        self._datastore.subscribe(self._pool_changed)
        self._pool_changed(self._datastore.endpoints(), ())

    async def stop(self) -> None:
        self._started = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _pool_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        if not self._started:
            return
        for endpoint in removed:
            task = self._tasks.pop(endpoint.name, None)
            if task is not None:
                task.cancel()
        for endpoint in added:
            old = self._tasks.pop(endpoint.name, None)
            if old is not None:
                old.cancel()
            self._tasks[endpoint.name] = asyncio.get_running_loop().create_task(
                self._loop(endpoint), name=f"scrape {endpoint.name}"
            )

    def _engine(self, endpoint: Endpoint) -> EngineMapping:
        name = endpoint.labels.get(ENGINE_TYPE_LABEL) or self._default_engine
        engine = self._engines.get(name)
        if engine is None:
            log.warning(
                "endpoint %s: unknown engine type %r (label %s); using %s metric names",
                endpoint.name, name, ENGINE_TYPE_LABEL, self._default_engine,
            )  # fmt: skip
            engine = self._engines[self._default_engine]
        return engine

    async def _loop(self, endpoint: Endpoint) -> None:
        settings = self._settings
        engine = self._engine(endpoint)
        client = PersistentGet(endpoint.address, settings.port or endpoint.port, settings.path, tls=self._tls)
        loop = asyncio.get_running_loop()
        name = endpoint.name
        errors = self._metrics.scrape_errors
        scrapes = self._metrics.scrapes
        stale_gauge = self._metrics.endpoint_stale.labels(name)
        last_ok = 0.0
        last_error: str | None = None
        # Each loop keeps its own phase, drawn at random: a hundred loops started together would
        # otherwise scrape in one burst every interval and stall the requests behind it.
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
                now = loop.time()
                previous = self._current(name)
                if reason is None:
                    scrapes.inc()
                    parsed = engine.parse(page)
                    metrics = _snapshot(parsed, now)
                    if parsed.missing:
                        reason = "missing_metrics"
                    last_ok = now
                else:
                    metrics = replace(previous, stale=not last_ok or now - last_ok > settings.staleness, error=detail)
                if reason is not None:
                    errors.labels(name, reason).inc()
                if metrics.error != last_error:
                    if metrics.error:
                        log.warning("endpoint %s: metrics scrape: %s", name, metrics.error)
                    else:
                        log.info("endpoint %s: metrics scrape recovered", name)
                    last_error = metrics.error
                stale_gauge.set(1 if metrics.stale else 0)
                if not self._datastore.update_metrics(name, metrics):
                    return  # the endpoint left the pool; its task is being cancelled
        finally:
            client.close()
            self._metrics.endpoint_stale.remove(name)

    def _current(self, name: str) -> Metrics:
        endpoint = self._datastore.get(name)
        return endpoint.metrics if endpoint is not None else Metrics()


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
