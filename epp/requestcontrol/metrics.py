"""The request path's Prometheus series, under the upstream Endpoint Picker's names.

One :class:`RequestMetrics` per service, on the service's registry; the director and each routed
request's lifecycle record through its methods, and the edge reports refusals to it
(:meth:`RequestMetrics.refused`), so every per-request series is written from this module's methods.

Bounded labels. The ``model_name`` / ``target_model_name`` labels come from the request body, which
a client writes: each new value would create a dozen series that live forever (memory in the picker,
a cardinality bomb in the operator's Prometheus). So a model name becomes a label value only if it is

- a model the pool serves (a base model the director was given, or an adapter a pod reports running
  or waiting in its metrics), up to :data:`MAX_SERVED_MODEL_LABELS`; or
- one of the first :data:`MAX_FIRST_SEEN_MODEL_LABELS` other names seen - so that labels work before
  (or without) anything telling the picker which models are served;

and in both cases at most :data:`MAX_MODEL_LABEL_CHARS` characters long. Every other name is
recorded under the one value :data:`OTHER_MODEL` (``other``). A client can thus add at most 32
series sets, of bounded size, whatever it sends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.errors import EppError
from epp.framework.histogram import Histogram
from epp.framework.loopmetrics import LoopCounter, LoopGauge, LoopHistogram
from epp.scheduling.metrics import SCHEDULER_BUCKETS

__all__ = [
    "MAX_FIRST_SEEN_MODEL_LABELS",
    "MAX_MODEL_LABEL_CHARS",
    "MAX_SERVED_MODEL_LABELS",
    "OTHER_MODEL",
    "STREAM_CODES",
    "ModelMetrics",
    "RequestMetrics",
    "StreamMetrics",
]

OTHER_MODEL = "other"
"""The label value of every model name that gets no label of its own (see the module docstring)."""
MAX_FIRST_SEEN_MODEL_LABELS = 32
"""Names not known to be served that get their own label, first come first served: a deployment
names a handful of models; past 32 the names are a client's invention, not an operator's."""
MAX_SERVED_MODEL_LABELS = 1024
"""Served models (base models, LoRA adapters) with their own label: far above vLLM's adapter slots."""
MAX_MODEL_LABEL_CHARS = 256
"""Longer names are no label: a Hugging Face id (owner/name) is at most about 140 characters."""

# Request bodies from a few bytes to the 16 MiB default limit (upstream's size buckets, roughly x4 apart).
_SIZE_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
# Whole requests, from a few milliseconds to an hour-long generation (upstream's latency buckets).
_DURATION_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45, 60, 120,
    180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
# Seconds per output token: a fast GPU at ~1 ms, a loaded CPU pod at hundreds.
_NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# Token counts, powers of two up to a million-token context.
_TOKEN_BUCKETS = tuple(2**i for i in range(0, 21, 1))


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """One model's series, resolved once (``labels()`` costs microseconds per call), and their label."""

    label: str
    requests: Counter
    sizes: Histogram
    running: Gauge
    duration: Histogram
    first_byte: Histogram
    ntpot: Histogram
    response_sizes: Histogram
    input_tokens: Histogram
    output_tokens: Histogram


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.request_total = LoopCounter(
            "inference_objective_request_total",
            "Requests the picker handled, by requested and target model.",
            ["model_name", "target_model_name"],
            registry=r,
        )
        self.request_error_total = LoopCounter(
            "inference_objective_request_error_total",
            "Requests the picker answered with an error, by model and error code.",
            ["model_name", "target_model_name", "error_code"],
            registry=r,
        )
        self.request_outcome_total = LoopCounter(
            "epp_requests_total",
            "ext_proc request streams by outcome: routed, or the reason they were refused.",
            ["outcome"],
            registry=r,
        )
        self.request_sizes = LoopHistogram(
            "inference_objective_request_sizes",
            "Request body size in bytes.",
            ["model_name", "target_model_name"],
            buckets=_SIZE_BUCKETS,
            registry=r,
        )
        self.running_requests = LoopGauge(
            "inference_objective_running_requests",
            "Requests routed whose response has not finished, by model.",
            ["model_name"],
            registry=r,
        )
        self.scheduler_e2e = LoopHistogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency: from a complete request to a pick.",
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        )
        self.scheduler_attempts = LoopCounter(
            "inference_extension_scheduler_attempts_total",
            "Scheduling attempts by result: success (an endpoint was picked) or failure.",
            ["status"],
            registry=r,
        )
        model_labels = ["model_name", "target_model_name"]
        self.request_duration = LoopHistogram(
            "inference_objective_request_duration_seconds",
            "Response latency: from the pick to the end of the response.",
            model_labels,
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.first_byte = LoopHistogram(
            "epp_request_time_to_first_byte_seconds",
            "From the pick to the first response body bytes, as the picker sees them (TTFT for streamed answers).",
            model_labels,
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.ntpot = LoopHistogram(
            "inference_objective_normalized_time_per_output_token_seconds",
            "Response latency divided by the output tokens the model server reported.",
            model_labels,
            buckets=_NTPOT_BUCKETS,
            registry=r,
        )
        self.response_sizes = LoopHistogram(
            "inference_objective_response_sizes",
            "Response body size in bytes.",
            model_labels,
            buckets=_SIZE_BUCKETS,
            registry=r,
        )
        self.input_tokens = LoopHistogram(
            "inference_objective_input_tokens",
            "Prompt tokens, as the model server reported them in the response's usage.",
            model_labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = LoopHistogram(
            "inference_objective_output_tokens",
            "Output tokens, as the model server reported them in the response's usage.",
            model_labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.picks = LoopCounter(
            "epp_endpoint_picks_total",
            "Requests routed to each endpoint (the primary of the pick).",
            ["endpoint"],
            registry=r,
        )
        self.routed = self.request_outcome_total.labels("routed")
        self.scheduled = self.scheduler_attempts.labels("success")
        self.unscheduled = self.scheduler_attempts.labels("failure")
        self._per_model: dict[str, ModelMetrics] = {}  # by label value
        self._picks: dict[str, Counter] = {}
        self._served = 0
        self._first_seen = 0

    def for_model(self, model: str, *, served: Callable[[], bool] | None = None) -> ModelMetrics:
        """The per-model series of ``model``: under its own label, or :data:`OTHER_MODEL`.

        ``served()`` says whether the pool serves ``model``; it is asked only for a name that has no
        label yet (see the module docstring).
        """
        found = self._per_model.get(model)
        if found is None:
            found = self._series(self._label(model, served))
        return found

    def _label(self, model: str, served: Callable[[], bool] | None) -> str:
        if len(model) > MAX_MODEL_LABEL_CHARS:
            return OTHER_MODEL
        if served is not None and self._served < MAX_SERVED_MODEL_LABELS and served():
            self._served += 1
            return model
        if self._first_seen < MAX_FIRST_SEEN_MODEL_LABELS:
            self._first_seen += 1
            return model
        return OTHER_MODEL

    def _series(self, label: str) -> ModelMetrics:
        found = self._per_model.get(label)
        if found is None:
            found = self._per_model[label] = ModelMetrics(
                label=label,
                requests=self.request_total.labels(label, label),
                sizes=self.request_sizes.labels(label, label),
                running=self.running_requests.labels(label),
                duration=self.request_duration.labels(label, label),
                first_byte=self.first_byte.labels(label, label),
                ntpot=self.ntpot.labels(label, label),
                response_sizes=self.response_sizes.labels(label, label),
                input_tokens=self.input_tokens.labels(label, label),
                output_tokens=self.output_tokens.labels(label, label),
            )
        return found

    def picked(self, endpoint: str) -> None:
        """One request routed to ``endpoint`` (endpoint names are the pool's: bounded by it)."""
        counter = self._picks.get(endpoint)
        if counter is None:
            counter = self.picks.labels(endpoint)
            if len(self._picks) < 4096:
                self._picks[endpoint] = counter
        counter.inc()

    def refused(self, error: EppError, model: str | None = None) -> None:
        """A request refused with ``error`` (before it was routed); ``model``: as parsed, if the body
        was (a refusal of the body itself has none), counted under its bounded label."""
        self.request_outcome_total.labels(error.reason.value).inc()
        label = "" if model is None else self.for_model(model).label
        self.request_error_total.labels(label, label, error.reason.value).inc()


# The gRPC status names (grpc-go's codes.Code.String(), upstream's label values) a stream ends with here.
STREAM_CODES = ("OK", "Canceled", "Unknown")
_STREAM_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)


class StreamMetrics:
    """``--enable-grpc-stream-metrics`` (upstream's, off by default): the ext_proc streams, as upstream
    counts them: ``llm_d_epp_extproc_streams_inflight`` (open now), ``llm_d_epp_extproc_stream_duration_seconds``
    (how long each stayed open) and ``llm_d_epp_extproc_streams_total{code}`` (ended, by the gRPC status it
    ended with: OK, Canceled when Envoy reset it first, Unknown when it failed after its pick). Written by
    the event loop's thread (one process, or the owner for its workers' streams: epp.requestcontrol.owner)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.inflight = LoopGauge(
            "llm_d_epp_extproc_streams_inflight", "ext_proc gRPC streams open now.", registry=registry
        )
        self.duration = LoopHistogram(
            "llm_d_epp_extproc_stream_duration_seconds",
            "How long each ext_proc gRPC stream stayed open, in seconds.",
            buckets=_STREAM_BUCKETS,
            registry=registry,
        )
        self.ended = LoopCounter(
            "llm_d_epp_extproc_streams",
            "ext_proc gRPC streams ended, by gRPC status code.",
            ["code"],
            registry=registry,
        )
        self._by_code = {code: self.ended.labels(code) for code in STREAM_CODES}

    def opened(self) -> None:
        self.inflight.inc()

    def closed(self, code: str, seconds: float) -> None:
        self.inflight.dec()
        self.duration.observe(seconds)
        self._by_code.get(code, self._by_code["Unknown"]).inc()

    def lost(self, streams: int) -> None:
        """``streams`` open streams went with their worker process: no longer open, and no end to count."""
        self.inflight.dec(streams)
