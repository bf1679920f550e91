"""Saturation detectors: upstream's formulas, table-driven, and strict factories."""

from __future__ import annotations

import pytest

from epp.flowcontrol.saturation import (
    ConcurrencyConfig,
    ConcurrencyDetector,
    InFlightLoad,
    SaturationDetector,
    UtilizationConfig,
    UtilizationDetector,
    from_config,
)
from epp.framework import Endpoint, Metrics

NOW = 1000.0  # the detectors' clock in these tests


def pod(i: int, *, queue: int = 0, kv: float = 0.0, running: int = 0, age: float = 0.0, stale: bool = False, never: bool = False) -> Endpoint:
    metrics = Metrics(
        waiting_queue_size=queue,
        running_requests=running,
        kv_cache_usage=kv,
        updated_at=0.0 if never else NOW - age,
        stale=stale,
    )
    return Endpoint(f"pod-{i}", f"10.0.0.{i}", 8000, metrics=metrics)


def utilization(config: UtilizationConfig | None = None, in_flight=None) -> UtilizationDetector:
    return UtilizationDetector(config or UtilizationConfig(), in_flight=in_flight, clock=lambda: NOW)


# Defaults: queueDepthThreshold 5, kvCacheUtilThreshold 0.8, metricsStalenessThreshold 200ms.
@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        ([], 1.0),  # an empty pool cannot take work
        ([dict()], 0.0),
        ([dict(queue=5)], 1.0),  # exactly at the queue threshold
        ([dict(queue=2, kv=0.4)], 0.5),  # max(2/5, 0.4/0.8)
        ([dict(queue=1, kv=0.72)], 0.9),  # the KV term wins
        ([dict(kv=0.9)], 1.125),  # above the set point: oversubscribed
        ([dict(queue=10), dict()], 1.0),  # the average over pods: (2 + 0) / 2
        ([dict(queue=3), dict(kv=0.2), dict(queue=0)], (0.6 + 0.25 + 0.0) / 3),
        ([dict(stale=True), dict()], 0.5),  # a stale pod counts as saturated (1.0)
        ([dict(age=0.3), dict()], 0.5),  # metrics older than 200ms are stale too
        ([dict(age=0.19), dict()], 0.0),  # within the threshold: fresh
        ([dict(never=True)], 1.0),  # never scraped
        ([dict(stale=True), dict(stale=True)], 1.0),
    ],
)
def test_utilization_saturation(pods: list[dict], expected: float) -> None:
    endpoints = [pod(i, **spec) for i, spec in enumerate(pods)]
    detector = utilization()
    assert detector.saturation(endpoints) == pytest.approx(expected)
    assert detector.is_saturated(endpoints) is (expected >= 1.0)


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        ([dict(stale=True), dict(queue=5)], 1.0),  # the stale pod leaves the average
        ([dict(stale=True), dict(queue=1)], 0.2),
        ([dict(stale=True), dict(age=1.0)], 0.0),  # every pod stale: fail open, as upstream
        ([], 1.0),  # but an empty pool is still saturated
    ],
)
def test_utilization_staleness_policy_ignore(pods: list[dict], expected: float) -> None:
    endpoints = [pod(i, **spec) for i, spec in enumerate(pods)]
    assert utilization(UtilizationConfig(staleness_policy="ignore")).saturation(endpoints) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("queue", "running", "in_flight", "expected"),
    [
        (1, 2, 6, (1 + 3) / 5),  # 3 requests sent since the scrape: they count as waiting
        (1, 2, 3, 1 / 5),  # the scrape already sees everything in flight: no credit
        (1, 2, 0, 1 / 5),  # never negative
        (0, 0, 5, 1.0),  # a burst the scrape has not seen yet saturates the pod
    ],
)
def test_utilization_scrape_lag_credit(queue: int, running: int, in_flight: int, expected: float) -> None:
    detector = utilization(in_flight=lambda endpoint: InFlightLoad(in_flight, 0))
    assert detector.saturation([pod(0, queue=queue, running=running)]) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("pods", "headroom", "kept"),
    [
        ([dict(queue=4), dict(queue=5), dict(kv=0.79), dict(kv=0.8)], 0.0, [0, 2]),  # strictly below the thresholds
        ([dict(queue=5), dict(queue=6), dict(kv=0.95), dict(kv=0.96)], 0.2, [0, 2]),  # limits 6 and 0.96
        ([dict(kv=0.99), dict(kv=1.0)], 1.0, [0]),  # the KV limit never exceeds 1.0
        ([dict(stale=True), dict(queue=1)], 0.0, [1]),  # stale pods are filtered out
        ([dict(queue=9), dict(stale=True)], 0.0, [0, 1]),  # nothing qualifies: fail open, all candidates
    ],
)
def test_utilization_filter_headroom(pods: list[dict], headroom: float, kept: list[int]) -> None:
    endpoints = [pod(i, **spec) for i, spec in enumerate(pods)]
    detector = utilization(UtilizationConfig(headroom=headroom))
    assert [e.name for e in detector.filter(None, endpoints)] == [f"pod-{i}" for i in kept]
    # headroom never moves the saturation signal
    assert detector.saturation(endpoints) == utilization().saturation(endpoints)


def loads(*pairs: tuple[int, int]):
    table = {f"pod-{i}": InFlightLoad(*pair) for i, pair in enumerate(pairs)}
    return [pod(i) for i in range(len(pairs))], (lambda endpoint: table[endpoint.name])


@pytest.mark.parametrize(
    ("mode", "pairs", "expected"),
    [
        ("requests", [], 1.0),  # no capacity at all
        ("requests", [(0, 0)], 0.0),
        ("requests", [(5, 0), (15, 0)], 1.0),  # aggregate: 20 / (2 * 10)
        ("requests", [(3, 0), (1, 0)], 0.2),
        ("requests", [(30, 0)], 3.0),
        ("tokens", [(50, 600), (0, 400)], 0.5),  # 1000 / (2 * 1000); request counts ignored
        ("hybrid", [(5, 100), (5, 100)], 0.5),  # requests 10/20 beat tokens 200/2000
        ("hybrid", [(1, 1500), (1, 500)], 1.0),  # tokens 2000/2000 beat requests 2/20
    ],
)
def test_concurrency_saturation(mode: str, pairs: list[tuple[int, int]], expected: float) -> None:
    endpoints, in_flight = loads(*pairs)
    detector = ConcurrencyDetector(ConcurrencyConfig(max_concurrency=10, max_token_concurrency=1000, mode=mode), in_flight)
    assert detector.saturation(endpoints) == pytest.approx(expected)
    assert detector.is_saturated(endpoints) is (expected >= 1.0)


@pytest.mark.parametrize(
    ("mode", "headroom", "pairs", "kept"),
    [
        ("requests", 0.0, [(9, 0), (10, 0)], [0]),
        ("requests", 0.5, [(14, 0), (15, 0)], [0]),  # limit int(10 * 1.5) = 15
        ("requests", 0.0, [(10, 0), (11, 0)], []),  # no fail-open, as upstream
        ("tokens", 0.0, [(99, 999), (0, 1000)], [0]),
        ("hybrid", 0.0, [(10, 0), (0, 1000), (9, 999)], [2]),  # either dimension at its limit drops it
    ],
)
def test_concurrency_filter(mode: str, headroom: float, pairs: list[tuple[int, int]], kept: list[int]) -> None:
    endpoints, in_flight = loads(*pairs)
    config = ConcurrencyConfig(max_concurrency=10, max_token_concurrency=1000, mode=mode, headroom=headroom)
    detector = ConcurrencyDetector(config, in_flight)
    assert [e.name for e in detector.filter(None, endpoints)] == [f"pod-{i}" for i in kept]


def test_from_config_defaults_are_upstreams() -> None:
    detector = from_config("utilization-detector", {})
    assert isinstance(detector, UtilizationDetector) and isinstance(detector, SaturationDetector)
    assert detector.config == UtilizationConfig(
        queue_depth_threshold=5, kv_cache_util_threshold=0.8, metrics_staleness_threshold=0.2, headroom=0.0
    )
    concurrency = from_config("concurrency-detector", None, in_flight=lambda e: (0, 0))
    assert isinstance(concurrency, ConcurrencyDetector)
    assert concurrency.config == ConcurrencyConfig(max_concurrency=100, max_token_concurrency=1_000_000, mode="requests")


def test_from_config_reads_every_parameter() -> None:
    detector = from_config(
        "utilization-detector",
        {
            "queueDepthThreshold": 8,
            "kvCacheUtilThreshold": 0.9,
            "metricsStalenessThreshold": "1.5s",
            "headroom": 0.25,
            "stalenessPolicy": "ignore",
            "inFlightLoadProducerName": "tracker",
        },
        name="sat",
    )
    assert detector.name == "sat"
    assert detector.config == UtilizationConfig(8, 0.9, 1.5, 0.25, "ignore", "tracker")
    concurrency = from_config(
        "concurrency-detector",
        {"concurrencyMode": "tokens", "maxConcurrency": 4, "maxTokenConcurrency": 4096, "headroom": 1},
        in_flight=lambda e: (0, 0),
    )
    assert concurrency.config == ConcurrencyConfig(4, 4096, "tokens", 1.0)


@pytest.mark.parametrize(
    ("type_name", "parameters", "message"),
    [
        ("utilization-detector", {"queueDepth": 5}, "unknown parameter(s) ['queueDepth']; valid: ['queueDepthThreshold'"),
        ("concurrency-detector", {"maxConcurency": 5}, "unknown parameter(s) ['maxConcurency']; valid: ['concurrencyMode'"),
        ("utilization-detector", {"queueDepthThreshold": 0}, "queueDepthThreshold must be > 0"),
        ("utilization-detector", {"queueDepthThreshold": "5"}, "queueDepthThreshold must be an integer"),
        ("utilization-detector", {"queueDepthThreshold": True}, "queueDepthThreshold must be an integer"),
        ("utilization-detector", {"kvCacheUtilThreshold": 1.5}, "kvCacheUtilThreshold must be in (0, 1]"),
        ("utilization-detector", {"kvCacheUtilThreshold": 0}, "kvCacheUtilThreshold must be in (0, 1]"),
        ("utilization-detector", {"metricsStalenessThreshold": 200}, "metricsStalenessThreshold must be a Go duration"),
        ("utilization-detector", {"metricsStalenessThreshold": "soon"}, "metricsStalenessThreshold must be a Go duration"),
        ("utilization-detector", {"metricsStalenessThreshold": "0s"}, "metricsStalenessThreshold must be > 0"),
        ("utilization-detector", {"headroom": -0.1}, "headroom must be a finite number >= 0"),
        ("utilization-detector", {"stalenessPolicy": "drop"}, "stalenessPolicy must be one of ['saturated', 'ignore']"),
        ("concurrency-detector", {"concurrencyMode": "bytes"}, "concurrencyMode must be one of ['requests', 'tokens', 'hybrid']"),
        ("concurrency-detector", {"maxConcurrency": -1}, "maxConcurrency must be > 0"),
        ("concurrency-detector", {"maxTokenConcurrency": 0}, "maxTokenConcurrency must be > 0"),
        ("queue-detector", {}, "unknown saturation detector type 'queue-detector'; known: utilization-detector, concurrency-detector"),
    ],
)
def test_from_config_refuses_bad_parameters(type_name: str, parameters: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        from_config(type_name, parameters, in_flight=lambda e: (0, 0))
    assert message in str(excinfo.value)


def test_concurrency_detector_needs_an_in_flight_source() -> None:
    with pytest.raises(ValueError, match="in-flight tracker"):
        from_config("concurrency-detector", {})


def test_detectors_act_as_scheduling_filters() -> None:
    from epp.framework import Filter

    assert isinstance(utilization(), Filter)
    assert isinstance(from_config("concurrency-detector", {}, in_flight=lambda e: (0, 0)), Filter)
