"""The pool gauges upstream's dashboards and autoscalers read, computed at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from epp.datalayer.poolmetrics import PoolCollector
from epp.framework import Endpoint, Metrics
from epp.server.metrics import Metrics as ServiceMetrics


def _pod(name: str, queue: int, kv: float, *, stale: bool = False) -> Endpoint:
    return Endpoint(name, "10.0.0.1", 8000, metrics=Metrics(waiting_queue_size=queue, kv_cache_usage=kv, stale=stale))


def test_averages_and_per_pod_queues_over_fresh_endpoints() -> None:
    pods = [_pod("a", 2, 0.2), _pod("b", 6, 0.6), _pod("gone", 100, 1.0, stale=True)]
    registry = CollectorRegistry()
    registry.register(PoolCollector(lambda: pods, "pool"))
    value = registry.get_sample_value
    assert value("inference_pool_average_queue_size", {"name": "pool"}) == 4.0
    assert value("inference_pool_average_kv_cache_utilization", {"name": "pool"}) == 0.4
    assert value("inference_pool_per_pod_queue_size", {"model_server_pod": "b", "name": "pool"}) == 6
    assert value("inference_pool_per_pod_queue_size", {"model_server_pod": "gone", "name": "pool"}) is None


def test_an_empty_or_all_stale_pool_reports_no_average() -> None:
    registry = CollectorRegistry()
    registry.register(PoolCollector(lambda: [_pod("x", 3, 0.5, stale=True)], "pool"))
    assert registry.get_sample_value("inference_pool_average_queue_size", {"name": "pool"}) is None


def test_the_service_exports_build_info_and_process_metrics() -> None:
    metrics = ServiceMetrics()
    value = metrics.registry.get_sample_value
    assert value("inference_extension_info", {"commit": "", "build_ref": "v0.1.0"}) == 1
    assert (value("process_resident_memory_bytes") or 0) > 0
    assert value("process_open_fds") is not None


def test_the_build_info_takes_the_images_build_arguments(monkeypatch) -> None:
    monkeypatch.setenv("EPP_BUILD_COMMIT", "5fe57ab")
    monkeypatch.setenv("EPP_BUILD_REF", "")  # the Dockerfile's empty default: the version stays
    value = ServiceMetrics().registry.get_sample_value
    assert value("inference_extension_info", {"commit": "5fe57ab", "build_ref": "v0.1.0"}) == 1
