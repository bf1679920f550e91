"""Prometheus metrics of the picker, under the upstream Endpoint Picker's names where they exist.

All metrics live in one :class:`Metrics` object with its own registry (no process-global state),
served on ``--metrics-port`` by :func:`start_metrics_server`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics", "ModelMetrics", "start_metrics_server"]

# Model names come from clients; past this many, series are still recorded but not cached.
_MAX_CACHED_MODELS = 1024

# Scheduling takes tens of microseconds to a few milliseconds: resolve that range finely.
_SCHEDULER_BUCKETS = (
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)
# Request bodies from a few bytes to the 16 MiB default limit (upstream's size buckets, roughly x4 apart).
_SIZE_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_total = Counter(
            "inference_objective_request_total",
            "Requests the picker handled, by requested and target model.",
            ["model_name", "target_model_name"],
            registry=r,
        )
        self.request_error_total = Counter(
            "inference_objective_request_error_total",
            "Requests the picker answered with an error, by model and error code.",
            ["model_name", "target_model_name", "error_code"],
            registry=r,
        )
        self.request_outcome_total = Counter(
            "epp_requests_total",
            "ext_proc request streams by outcome: routed, or the reason they were refused.",
            ["outcome"],
            registry=r,
        )
        self.request_sizes = Histogram(
            "inference_objective_request_sizes",
            "Request body size in bytes.",
            ["model_name", "target_model_name"],
            buckets=_SIZE_BUCKETS,
            registry=r,
        )
        self.running_requests = Gauge(
            "inference_objective_running_requests",
            "Requests routed whose response has not finished, by model.",
            ["model_name"],
            registry=r,
        )
        self.scheduler_e2e = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency: from a complete request to a pick.",
            buckets=_SCHEDULER_BUCKETS,
            registry=r,
        )
        self.scheduler_attempts = Counter(
            "inference_extension_scheduler_attempts_total",
            "Scheduling attempts by result: success (an endpoint was picked) or failure.",
            ["status"],
            registry=r,
        )
        self.plugin_duration = Histogram(
            "inference_extension_plugin_duration_seconds",
            "Time spent in each plugin call, by extension point, plugin type and plugin name.",
            ["extension_point", "plugin_type", "plugin_name"],
            buckets=_SCHEDULER_BUCKETS,
            registry=r,
        )
        self.ready_pods = Gauge(
            "inference_pool_ready_pods", "Endpoints in the pool that can take requests.", ["name"], registry=r
        )
        self.routed = self.request_outcome_total.labels("routed")
        self._per_model: dict[str, ModelMetrics] = {}

    def plugin_timer(self, extension_point: str, plugin_type: str, plugin_name: str) -> Callable[[float], None]:
        """The ``observe`` of one plugin's duration series (bound once, at configuration time)."""
        return self.plugin_duration.labels(extension_point, plugin_type, plugin_name).observe

    def for_model(self, model: str) -> ModelMetrics:
        """The per-model series of ``model``, resolved once: ``labels()`` costs microseconds per call."""
        found = self._per_model.get(model)
        if found is None:
            found = ModelMetrics(
                requests=self.request_total.labels(model, model),
                sizes=self.request_sizes.labels(model, model),
                running=self.running_requests.labels(model),
            )
            if len(self._per_model) < _MAX_CACHED_MODELS:
                self._per_model[model] = found
        return found


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    requests: Counter
    sizes: Histogram
    running: Gauge


def start_metrics_server(metrics: Metrics, port: int, address: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` on a background thread (scrapes never touch the event loop)."""
    start_http_server(port, addr=address, registry=metrics.registry)
