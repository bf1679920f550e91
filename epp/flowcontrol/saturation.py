"""Saturation detectors: is the pool too busy to take more work right now?

Design
------
A detector reads one immutable snapshot of the pool (a sequence of :class:`epp.datalayer.datastore.Endpoint`)
and answers with one number, the pool's *saturation*: 0.0 is idle, 1.0 is the set point, above 1.0
is oversubscribed. The pool is saturated when ``saturation >= 1.0``
(:data:`SATURATION_THRESHOLD`, upstream's static usage limit). Admission (sheddable requests are
refused while saturated) and flow control (nothing is dispatched while saturated) both read it. An
empty pool reads 1.0: requests wait for a pod instead of failing.

Two detectors, with the upstream Endpoint Picker's type names, parameters and formulas:

``utilization-detector`` (closed loop, from scraped model-server metrics)
    Per endpoint: ``max(waiting_queue / queueDepthThreshold, kv_cache_usage / kvCacheUtilThreshold)``
    (whichever resource is closer to its limit); the pool's saturation is the *unweighted average*
    over endpoints. An endpoint whose metrics are stale (flagged by the scraper, never scraped, or
    older than ``metricsStalenessThreshold``) scores 1.0, so losing telemetry halts dispatch rather
    than admitting blind (``stalenessPolicy: ignore`` leaves such endpoints out of the average
    instead). Scrapes lag: between two of them the waiting queue misses what the picker itself just
    sent. When an in-flight source is given, the queue term is corrected as upstream does:
    ``credit = max(0, in_flight_requests - (waiting + running))`` is added to the waiting queue.

``concurrency-detector`` (open loop, from what the picker itself dispatched)
    ``sum(in-flight load) / (len(endpoints) * maxConcurrency)`` counting requests
    (``concurrencyMode: requests``), estimated tokens (``tokens``, against ``maxTokenConcurrency``)
    or the larger of the two ratios (``hybrid``). The in-flight counts come from a callable the
    caller passes in (the director's tracker): ``in_flight(endpoint) -> (requests, tokens)``.

``headroom`` never moves the saturation signal; it only relaxes the per-endpoint limits of the
detector's scheduling *filter* (upstream's "burst above the ideal target"):
utilization keeps an endpoint whose metrics are fresh and ``queue < queueDepthThreshold * (1 + h)``
and ``kv < min(1, kvCacheUtilThreshold * (1 + h))``, and returns every candidate when none
qualifies (fail open, so scorers pick the least bad); concurrency keeps an endpoint whose load is
below ``int(max * (1 + h))`` (no fail-open, as upstream). Both detectors therefore also satisfy the
scheduling framework's ``Filter`` role (``name`` and ``filter(request, candidates)``).

Factories: :func:`from_config` builds a detector from its type name and parameter mapping,
validating strictly (an unknown parameter is a ValueError naming it and listing the valid ones).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from epp.framework import (
    DEFAULT_SATURATION_DETECTOR,
    Endpoint,
    check_parameters,
    duration_parameter,
    float_parameter,
    int_parameter,
    str_parameter,
)

__all__ = [
    "CONCURRENCY_DETECTOR",
    "DETECTOR_TYPES",
    "SATURATION_THRESHOLD",
    "UTILIZATION_DETECTOR",
    "ConcurrencyConfig",
    "ConcurrencyDetector",
    "InFlight",
    "InFlightLoad",
    "SaturationDetector",
    "UtilizationConfig",
    "UtilizationDetector",
    "from_config",
]

UTILIZATION_DETECTOR = "utilization-detector"
CONCURRENCY_DETECTOR = "concurrency-detector"
DETECTOR_TYPES = (UTILIZATION_DETECTOR, CONCURRENCY_DETECTOR)

# Upstream's static usage-limit policy: dispatch (and sheddable admission) stops at saturation >= 1.0.
SATURATION_THRESHOLD = 1.0


class InFlightLoad(NamedTuple):
    """What the picker has dispatched to one endpoint and not yet seen finish."""

    requests: int = 0
    tokens: int = 0


# The in-flight tracker, as detectors see it: ``in_flight(endpoint) -> (requests, tokens)``.
InFlight = Callable[[Endpoint], "InFlightLoad | tuple[int, int]"]


@runtime_checkable
class SaturationDetector(Protocol):
    """What admission and flow control need from a detector."""

    name: str

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """The pool's saturation (0 idle, >= 1.0 saturated); 1.0 for an empty pool."""
        ...

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool: ...


# --- utilization-detector ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UtilizationConfig:
    # Defaults: upstream's utilization detector (llm-d-router saturationdetector/utilization/config.go).
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold: float = 0.2  # seconds (upstream "200ms")
    headroom: float = 0.0
    staleness_policy: str = "saturated"  # or "ignore": stale endpoints leave the average
    in_flight_load_producer_name: str = ""  # accepted for upstream configs; the tracker is passed in

    def __post_init__(self) -> None:
        errors = []
        if self.queue_depth_threshold <= 0:
            errors.append(f"queueDepthThreshold must be > 0, got {self.queue_depth_threshold}")
        if not 0.0 < self.kv_cache_util_threshold <= 1.0:
            errors.append(f"kvCacheUtilThreshold must be in (0, 1], got {self.kv_cache_util_threshold}")
        if not self.metrics_staleness_threshold > 0:
            errors.append(f"metricsStalenessThreshold must be > 0, got {self.metrics_staleness_threshold}s")
        if not self.headroom >= 0 or math.isinf(self.headroom):
            errors.append(f"headroom must be a finite number >= 0, got {self.headroom}")
        if self.staleness_policy not in _STALENESS_POLICIES:
            errors.append(f"stalenessPolicy must be one of {list(_STALENESS_POLICIES)}, got {self.staleness_policy!r}")
        if errors:
            raise ValueError("; ".join(errors))


_STALENESS_POLICIES = ("saturated", "ignore")


class UtilizationDetector:
    """``utilization-detector``: average over endpoints of the tighter of queue and KV-cache ratios."""

    type_name = UTILIZATION_DETECTOR
    # Upstream's default detector: admission uses it when the config names none.
    default_for = (DEFAULT_SATURATION_DETECTOR,)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Any) -> UtilizationDetector:
        """The ``utilization-detector`` plugin factory; ``handle.in_flight`` enables scrape-lag compensation."""
        detector = from_config(
            UTILIZATION_DETECTOR, parameters, name=name, in_flight=getattr(handle, "in_flight", None)
        )
        assert isinstance(detector, UtilizationDetector)
        return detector

    def __init__(
        self,
        config: UtilizationConfig = UtilizationConfig(),
        *,
        name: str = UTILIZATION_DETECTOR,
        in_flight: InFlight | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.config = config
        self._in_flight = in_flight
        self._clock = clock
        # Filter limits: the ideal thresholds relaxed by the headroom (upstream README).
        self._queue_limit = config.queue_depth_threshold * (1.0 + config.headroom)
        self._kv_limit = min(1.0, config.kv_cache_util_threshold * (1.0 + config.headroom))

    def _fresh(self, endpoint: Endpoint, now: float) -> bool:
        m = endpoint.metrics
        return not m.stale and m.updated_at > 0 and now - m.updated_at <= self.config.metrics_staleness_threshold

    def endpoint_saturation(self, endpoint: Endpoint, now: float | None = None) -> float | None:
        """One endpoint's score; None when its metrics are stale (see ``stalenessPolicy``)."""
        if not self._fresh(endpoint, self._clock() if now is None else now):
            return None
        m = endpoint.metrics
        waiting = m.waiting_queue_size
        if self._in_flight is not None:
            # Scrape-lag compensation: requests the picker sent that the last scrape did not see yet.
            waiting += max(0, int(self._in_flight(endpoint)[0]) - (m.waiting_queue_size + m.running_requests))
        return max(waiting / self.config.queue_depth_threshold, m.kv_cache_usage / self.config.kv_cache_util_threshold)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0  # an empty pool cannot take work: requests wait for a pod (or their TTL)
        now = self._clock()
        total, counted = 0.0, 0
        for endpoint in endpoints:
            score = self.endpoint_saturation(endpoint, now)
            if score is None:
                if self.config.staleness_policy == "ignore":
                    continue
                score = 1.0
            total += score
            counted += 1
        return total / counted if counted else 0.0  # "ignore" with every endpoint stale: fail open, as upstream

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        return self.saturation(endpoints) >= SATURATION_THRESHOLD

    def filter(self, request: object, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Endpoints with fresh metrics under the headroom-relaxed limits; all candidates if none is."""
        now = self._clock()
        kept = [
            e
            for e in candidates
            if self._fresh(e, now)
            and e.metrics.waiting_queue_size < self._queue_limit
            and e.metrics.kv_cache_usage < self._kv_limit
        ]
        return kept if kept else candidates


# --- concurrency-detector ---------------------------------------------------------------------


_CONCURRENCY_MODES = ("requests", "tokens", "hybrid")


@dataclass(frozen=True, slots=True)
class ConcurrencyConfig:
    # Defaults: upstream's concurrency detector (llm-d-router saturationdetector/concurrency/config.go).
    max_concurrency: int = 100
    max_token_concurrency: int = 1_000_000
    mode: str = "requests"
    headroom: float = 0.0
    in_flight_load_producer_name: str = ""

    def __post_init__(self) -> None:
        errors = []
        if self.max_concurrency <= 0:
            errors.append(f"maxConcurrency must be > 0, got {self.max_concurrency}")
        if self.max_token_concurrency <= 0:
            errors.append(f"maxTokenConcurrency must be > 0, got {self.max_token_concurrency}")
        if self.mode not in _CONCURRENCY_MODES:
            errors.append(f"concurrencyMode must be one of {list(_CONCURRENCY_MODES)}, got {self.mode!r}")
        if not self.headroom >= 0 or math.isinf(self.headroom):
            errors.append(f"headroom must be a finite number >= 0, got {self.headroom}")
        if errors:
            raise ValueError("; ".join(errors))


class ConcurrencyDetector:
    """``concurrency-detector``: in-flight load the picker dispatched, over the pool's capacity."""

    type_name = CONCURRENCY_DETECTOR

    def __init__(self, config: ConcurrencyConfig, in_flight: InFlight, *, name: str = CONCURRENCY_DETECTOR) -> None:
        self.name = name
        self.config = config
        self._in_flight = in_flight
        self._request_limit = int(config.max_concurrency * (1.0 + config.headroom))
        self._token_limit = int(config.max_token_concurrency * (1.0 + config.headroom))

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        requests = tokens = 0
        for endpoint in endpoints:
            load = self._in_flight(endpoint)
            requests += int(load[0])
            tokens += int(load[1])
        by_requests = requests / (len(endpoints) * self.config.max_concurrency)
        by_tokens = tokens / (len(endpoints) * self.config.max_token_concurrency)
        if self.config.mode == "requests":
            return by_requests
        if self.config.mode == "tokens":
            return by_tokens
        return max(by_requests, by_tokens)

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        return self.saturation(endpoints) >= SATURATION_THRESHOLD

    def filter(self, request: object, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Endpoints whose in-flight load is below the headroom-relaxed limit (may be empty)."""
        mode = self.config.mode
        kept = []
        for endpoint in candidates:
            load = self._in_flight(endpoint)
            if mode != "tokens" and int(load[0]) >= self._request_limit:
                continue
            if mode != "requests" and int(load[1]) >= self._token_limit:
                continue
            kept.append(endpoint)
        return kept


# --- factories --------------------------------------------------------------------------------

_UTILIZATION_PARAMETERS = (
    "queueDepthThreshold",
    "kvCacheUtilThreshold",
    "metricsStalenessThreshold",
    "headroom",
    "stalenessPolicy",
    "inFlightLoadProducerName",
)
_CONCURRENCY_PARAMETERS = (
    "concurrencyMode",
    "maxConcurrency",
    "maxTokenConcurrency",
    "headroom",
    "inFlightLoadProducerName",
)


def from_config(
    type_name: str,
    parameters: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    in_flight: InFlight | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> UtilizationDetector | ConcurrencyDetector:
    """Build the detector ``type_name`` from its upstream parameters, strictly.

    ``in_flight`` is the director's in-flight tracker: required by ``concurrency-detector``, and
    enables scrape-lag compensation in ``utilization-detector``. Raises ValueError naming what is wrong.
    """
    name = name or type_name
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, Mapping):
        raise ValueError(f"{name}: parameters must be a mapping, got {type(parameters).__name__}")
    if type_name == UTILIZATION_DETECTOR:
        check_parameters(name, parameters, _UTILIZATION_PARAMETERS)
        config = _build(
            name,
            UtilizationConfig,
            queue_depth_threshold=int_parameter(name, parameters, "queueDepthThreshold", 5),
            kv_cache_util_threshold=float_parameter(name, parameters, "kvCacheUtilThreshold", 0.8),
            metrics_staleness_threshold=duration_parameter(name, parameters, "metricsStalenessThreshold", 0.2),
            headroom=float_parameter(name, parameters, "headroom", 0.0),
            staleness_policy=str_parameter(name, parameters, "stalenessPolicy", "saturated"),
            in_flight_load_producer_name=str_parameter(
                name, parameters, "inFlightLoadProducerName", "", allow_empty=True
            ),
        )
        return UtilizationDetector(config, name=name, in_flight=in_flight, clock=clock)
    if type_name == CONCURRENCY_DETECTOR:
        check_parameters(name, parameters, _CONCURRENCY_PARAMETERS)
        config = _build(
            name,
            ConcurrencyConfig,
            max_concurrency=int_parameter(name, parameters, "maxConcurrency", 100),
            max_token_concurrency=int_parameter(name, parameters, "maxTokenConcurrency", 1_000_000),
            mode=str_parameter(name, parameters, "concurrencyMode", "requests"),
            headroom=float_parameter(name, parameters, "headroom", 0.0),
            in_flight_load_producer_name=str_parameter(
                name, parameters, "inFlightLoadProducerName", "", allow_empty=True
            ),
        )
        if in_flight is None:
            raise ValueError(f"{name}: concurrency-detector needs the picker's in-flight tracker, and none was given")
        return ConcurrencyDetector(config, in_flight, name=name)
    raise ValueError(f"unknown saturation detector type {type_name!r}; known: {', '.join(DETECTOR_TYPES)}")


def _build(name: str, cls: type, **fields: Any) -> Any:
    try:
        return cls(**fields)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
