"""The pool's gauges, under upstream's names, computed when Prometheus scrapes (nothing per request).

``inference_pool_average_kv_cache_utilization{name}`` and ``inference_pool_average_queue_size{name}``:
the averages over the pool's endpoints whose metrics are fresh (upstream averages what its pods last
reported); ``inference_pool_per_pod_queue_size{model_server_pod,name}``: each endpoint's waiting
queue as last scraped. Stale endpoints are left out: their numbers are not to be trusted, and an
alert on a pool's average must not fire or clear on a pod that stopped answering. Values are
as scraped (not the picker's in-flight estimates, which :attr:`epp.framework.Endpoint.queue_depth`
adds for scheduling): these gauges report what the model servers say.

The collector reads one immutable snapshot of the datastore (``Datastore.endpoints()``) on the
metrics server's thread; building that snapshot is a single C-level copy under the GIL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.framework import Endpoint

__all__ = ["PoolCollector"]


class PoolCollector(Collector):
    def __init__(self, endpoints: Callable[[], Sequence[Endpoint]], pool_name: str) -> None:
        self._endpoints = endpoints
        self._pool = pool_name

    def collect(self) -> Iterable[Metric]:
        fresh = [e for e in self._endpoints() if not e.metrics.stale]
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "The average KV-cache utilization (0..1) over the pool's endpoints with fresh metrics.",
            labels=["name"],
        )
        queue = GaugeMetricFamily(
            "inference_pool_average_queue_size",
            "The average number of requests waiting in the model servers' queues, over endpoints with fresh metrics.",
            labels=["name"],
        )
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "The requests waiting in each model server's queue, as last scraped.",
            labels=["model_server_pod", "name"],
        )
        if fresh:
            kv.add_metric([self._pool], sum(e.metrics.kv_cache_usage for e in fresh) / len(fresh))
            queue.add_metric([self._pool], sum(e.metrics.waiting_queue_size for e in fresh) / len(fresh))
        for endpoint in fresh:
            per_pod.add_metric([endpoint.name, self._pool], endpoint.metrics.waiting_queue_size)
        return [kv, queue, per_pod]

    def describe(self) -> Iterable[Metric]:
        return []  # the families depend on the pool: collected, never pre-described
