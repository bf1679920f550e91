"""The request path's Prometheus series, under the upstream Endpoint Picker's names.

One :class:`RequestMetrics` per service, on the service's registry; the director and each routed
request's lifecycle record through its methods, and the edge reports refusals to it
(:meth:`RequestMetrics.refused`), so every per-request series is written from this module's methods.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.errors import EppError
from epp.scheduling.metrics import SCHEDULER_BUCKETS

__all__ = ["ModelMetrics", "RequestMetrics"]

# Model names come from clients; past this many, series are still recorded but not cached.
_MAX_CACHED_MODELS = 1024

# Request bodies from a few bytes to the 16 MiB default limit (upstream's size buckets, roughly x4 apart).
_SIZE_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """One model's series, resolved once (``labels()`` costs microseconds per call)."""

    requests: Counter
    sizes: Histogram
    running: Gauge


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry(auto_describe=True)
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
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        )
        self.scheduler_attempts = Counter(
            "inference_extension_scheduler_attempts_total",
            "Scheduling attempts by result: success (an endpoint was picked) or failure.",
            ["status"],
            registry=r,
        )
        self.routed = self.request_outcome_total.labels("routed")
        self.scheduled = self.scheduler_attempts.labels("success")
        self.unscheduled = self.scheduler_attempts.labels("failure")
        self._per_model: dict[str, ModelMetrics] = {}

    def for_model(self, model: str) -> ModelMetrics:
        """The per-model series of ``model``."""
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

    def refused(self, error: EppError) -> None:
        """A request refused with ``error`` (before it was routed)."""
        self.request_outcome_total.labels(error.reason.value).inc()
        # No model label: the body, where the model is named, may be what is wrong.
        self.request_error_total.labels("", "", error.reason.value).inc()
