"""Prometheus metrics of the picker, under the upstream Endpoint Picker's names where they exist.

All metrics live on one registry per service (no process-global state), served on
``--metrics-port`` by :func:`start_metrics_server`. The series are defined by the packages that
write them (:mod:`epp.requestcontrol.metrics`, :mod:`epp.scheduling.metrics`, flow control's, the
plugins' own through :class:`epp.framework.PluginMetrics`); :class:`Metrics` puts them together.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from epp.requestcontrol.metrics import RequestMetrics
from epp.scheduling.metrics import PluginCallMetrics

__all__ = ["Metrics", "start_metrics_server"]


class Metrics:
    """Every series of the service, on one registry: each part is owned by the package that writes it."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = RequestMetrics(r)
        self.plugins = PluginCallMetrics(r)
        self.ready_pods = Gauge(
            "inference_pool_ready_pods", "Endpoints in the pool that can take requests.", ["name"], registry=r
        )


def start_metrics_server(metrics: Metrics, port: int, address: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` on a background thread (scrapes never touch the event loop)."""
    start_http_server(port, addr=address, registry=metrics.registry)
