"""Prometheus series of admission and flow control, under the upstream names.

==============================================================  =========  ===========================
name                                                            type       labels
==============================================================  =========  ===========================
inference_extension_flow_control_queue_size                     gauge      priority, inference_pool
inference_extension_flow_control_queue_bytes                    gauge      priority, inference_pool
inference_extension_flow_control_request_queue_duration_seconds histogram  priority, outcome, inference_pool
inference_extension_flow_control_pool_saturation                gauge      inference_pool
llm_d_epp_flow_control_requests_total                           counter    outcome, priority, inference_pool
==============================================================  =========  ===========================

Upstream also labels the queue series by ``fairness_id`` and model; the fairness id comes from a
client header (unbounded cardinality), so here they are per band. ``outcome`` values are
:class:`epp.flowcontrol.outcomes.Outcome` values. The requests counter exists upstream only under
llm-d's ``llm_d_epp_`` prefix, so it keeps that name.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.flowcontrol.outcomes import Outcome
from epp.framework.histogram import Histogram

__all__ = ["FlowControlMetrics"]

# Upstream's buckets for the queue-wait histogram (100 µs .. 60 s).
_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FlowControlMetrics:
    """Creates the series in ``registry``; the controller calls the ``record_*`` hooks."""

    def __init__(self, registry: CollectorRegistry, pool_name: str = "") -> None:
        self.pool_name = pool_name
        self.queue_size = Gauge(
            "inference_extension_flow_control_queue_size",
            "Requests currently held in the flow-control queue, by priority band.",
            ["priority", "inference_pool"],
            registry=registry,
        )
        self.queue_bytes = Gauge(
            "inference_extension_flow_control_queue_bytes",
            "Bytes of the requests currently held in the flow-control queue, by priority band.",
            ["priority", "inference_pool"],
            registry=registry,
        )
        self.queue_duration = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time requests spent in flow control, from admission to their outcome.",
            ["priority", "outcome", "inference_pool"],
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )
        self.pool_saturation = Gauge(
            "inference_extension_flow_control_pool_saturation",
            "Pool saturation as last evaluated (1.0 is the dispatch set point; an empty pool reads 1.0).",
            ["inference_pool"],
            registry=registry,
        )
        self.requests_total = Counter(
            "llm_d_epp_flow_control_requests_total",
            "Requests that reached an admission outcome, by outcome and priority.",
            ["outcome", "priority", "inference_pool"],
            registry=registry,
        )
        self._saturation = self.pool_saturation.labels(pool_name)
        # labels() costs microseconds; priorities and outcomes are few, so resolve each series once.
        self._band_series: dict[int, tuple[Any, Any]] = {}
        self._outcome_series: dict[tuple[int, Outcome], tuple[Any, Any]] = {}

    def record_queued(self, priority: int, count: int, byte_size: int) -> None:
        """A band's queue changed by ``count`` requests and ``byte_size`` bytes (negative: left)."""
        series = self._band_series.get(priority)
        if series is None:
            label = str(priority)
            series = self._band_series[priority] = (
                self.queue_size.labels(label, self.pool_name),
                self.queue_bytes.labels(label, self.pool_name),
            )
        series[0].inc(count)
        series[1].inc(byte_size)

    def record_outcome(self, priority: int, outcome: Outcome, waited: float) -> None:
        series = self._outcome_series.get((priority, outcome))
        if series is None:
            label = str(priority)
            series = self._outcome_series[(priority, outcome)] = (
                self.requests_total.labels(outcome.value, label, self.pool_name),
                self.queue_duration.labels(label, outcome.value, self.pool_name),
            )
        series[0].inc()
        series[1].observe(waited)

    def record_saturation(self, value: float) -> None:
        self._saturation.set(value)
