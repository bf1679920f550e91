"""Model-server telemetry: keeps every pool endpoint's metrics fresh in the datastore.

:class:`Scraper` follows the datastore's membership (an endpoint added starts a loop, removed or
changed cancels it) and applies every result the loops report (a
:class:`~epp.datalayer.loops.ScrapeResult`) to the datastore, to the scrape series
(:class:`~epp.datalayer.metrics.ScrapeMetrics`, which the service registers in its registry) and,
on a change of state, to the log.

Where the loops run. By default the loops (:mod:`epp.datalayer.loops`) run in a child process
(:mod:`epp.datalayer.worker`): 100 pods at 50 ms are 2,000 scrapes a second, and sharing the request
path's event loop with that work raised request P99 by several milliseconds (bench/scrape_cost.py).
The child sends results back in small batches; applying one costs the request loop a few
microseconds. ``in_process=True`` runs the loops in the caller's loop instead (tests, tiny pools).
If the worker dies, every endpoint is marked stale until its replacement reports.

Waking a slowed loop. A loop scrapes a pod whose numbers stay the same less and less often
(:mod:`epp.datalayer.loops`, up to ``--refresh-metrics-idle-interval``) and says so in its results
(``slow``). For each such pod the scraper watches the pod's in-flight record
(:meth:`~epp.datalayer.inflight.InFlight.on_next_add`): the first request this picker sends there
wakes the loop (:meth:`ScrapeLoops.wake`, across the worker's socket), which scrapes it at the next
beat of the fast cadence. A pick made between the slow scrape and the arrival of its result (up to
the worker's 10 ms batch) is seen by the in-flight record too (``since`` the scrape's time). Per
request this costs one attribute test; per slowed pod, one message to the worker at its next pick.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping
from dataclasses import replace

from epp.datalayer.datastore import Datastore
from epp.datalayer.engines import ENGINE_TYPE_LABEL, EngineMapping
from epp.datalayer.loops import REASONS, ScrapeLoops, ScrapeResult, ScrapeSettings, Target
from epp.datalayer.metrics import ScrapeMetrics
from epp.datalayer.worker import WorkerClient
from epp.framework import Endpoint, Metrics

# ScrapeSettings is re-exported: it is what Scraper is configured with.
__all__ = ["ScrapeSettings", "Scraper"]

log = logging.getLogger(__name__)


class Scraper:
    """Keeps every pool endpoint's :class:`Metrics` fresh; :meth:`start` it, :meth:`stop` it."""

    def __init__(
        self,
        datastore: Datastore,
        engines: Mapping[str, EngineMapping],
        settings: ScrapeSettings,
        metrics: ScrapeMetrics,
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
        self._slow: set[str] = set()  # endpoints whose loop slowed down: the next pick there wakes it
        self._started = False
        self._loops: ScrapeLoops | WorkerClient
        if in_process:
            self._loops = ScrapeLoops(engines, settings, self._apply_result, default_engine=default_engine)
        else:
            self._loops = WorkerClient(
                engines, settings, self._apply_result, default_engine=default_engine, on_lost=self.mark_all_stale
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

    def _apply_result(self, result: ScrapeResult) -> None:
        name = result.endpoint
        self._apply(name, _metrics(result), result.reason)
        if result.filter_ignored:  # once per scrape loop: the loop logged it and asks unfiltered since
            self._metrics.filter_ignored.labels(name).inc()
        if result.slow is not (name in self._slow):
            self._watch(name, result)

    def _watch(self, name: str, result: ScrapeResult) -> None:
        """Wake the loop of ``name`` at the next request sent there while it is slow (see the docstring)."""
        record = self._datastore.in_flight(name)
        if not result.slow:
            self._slow.discard(name)
            if record is not None:
                record.on_next_add(None)
            return
        if record is None:
            return  # left the pool
        self._slow.add(name)
        if record.since(result.updated_at)[0]:  # sent there after the scrape that slowed the loop
            self._picked(name)
        else:
            record.on_next_add(functools.partial(self._picked, name))

    def _picked(self, name: str) -> None:
        # On the request path (InFlight.add): never raises.
        self._slow.discard(name)
        try:
            self._loops.wake(name)
        except Exception:  # the worker's socket went away: its replacement starts every loop fast anyway
            log.debug("could not wake the scrape loop of %s", name, exc_info=True)

    def _apply(self, name: str, metrics: Metrics, reason: str | None) -> None:
        """One loop's result: to the datastore, the counters and (on a change of state) the log."""
        if not self._datastore.update_metrics(name, metrics):
            return  # left the pool while the result was on its way
        series = self._metrics
        if reason is None or reason == "missing_metrics":
            series.scrapes.inc()
        if reason is not None:
            series.scrape_errors.labels(name, reason).inc()
        if self._stale.get(name) is not metrics.stale:  # labels() costs microseconds: only on a change
            self._stale[name] = metrics.stale
            series.endpoint_stale.labels(name).set(1 if metrics.stale else 0)
        if self._errors.get(name, "") != metrics.error:
            if metrics.error:
                log.warning("endpoint %s: metrics scrape: %s", name, metrics.error)
            elif name in self._errors:
                log.info("endpoint %s: metrics scrape recovered", name)
            self._errors[name] = metrics.error

    def _forget(self, name: str) -> None:
        self._errors.pop(name, None)
        self._stale.pop(name, None)
        self._slow.discard(name)  # its in-flight record, which may hold the watch, left with it
        series = self._metrics
        with contextlib.suppress(KeyError):  # never scraped, or never failed for that reason
            series.endpoint_stale.remove(name)
        with contextlib.suppress(KeyError):
            series.filter_ignored.remove(name)
        for reason in REASONS:
            with contextlib.suppress(KeyError):
                series.scrape_errors.remove(name, reason)

    def mark_all_stale(self, why: str) -> None:
        """Every endpoint's metrics become stale now (the scrape worker died)."""
        for name in self._slow:  # a new worker starts every loop at the fast cadence
            record = self._datastore.in_flight(name)
            if record is not None:
                record.on_next_add(None)
        self._slow.clear()
        for endpoint in self._datastore.endpoints():
            self._apply(endpoint.name, replace(endpoint.metrics, stale=True, error=why), "connection")


def _metrics(result: ScrapeResult) -> Metrics:
    """The datastore's snapshot of what a loop reported."""
    return Metrics(
        waiting_queue_size=result.waiting_queue_size,
        running_requests=result.running_requests,
        kv_cache_usage=result.kv_cache_usage,
        running_adapters=result.running_adapters,
        waiting_adapters=result.waiting_adapters,
        max_adapters=result.max_adapters,
        block_size=result.block_size,
        num_gpu_blocks=result.num_gpu_blocks,
        updated_at=result.updated_at,
        stale=result.stale,
        error=result.error,
        kv_cache_size_tokens=result.kv_cache_size_tokens,
    )
