"""The service's metrics registry and its HTTP endpoint (epp.server.metrics)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import Counter

from epp.server.metrics import Metrics, start_metrics_server


@pytest.fixture(scope="module")
def served() -> tuple[Metrics, int]:
    metrics = Metrics()
    return metrics, start_metrics_server(metrics, 0, "127.0.0.1")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_are_served_on_metrics_only(served: tuple[Metrics, int]) -> None:
    _, port = served
    status, body = _get(port, "/metrics")
    assert status == 200 and "# TYPE inference_pool_ready_pods gauge" in body
    for path in ("/", "/metric", "/metrics/", "/debug", "/favicon.ico"):
        status, body = _get(port, path)
        assert (status, body) == (404, "not found: the picker serves only /metrics on this port\n"), path


def test_the_name_filter_still_works(served: tuple[Metrics, int]) -> None:
    metrics, port = served
    metrics.ready_pods.labels("pool").set(3)
    status, body = _get(port, "/metrics?name[]=inference_pool_ready_pods")
    assert status == 200
    assert [line for line in body.splitlines() if not line.startswith("#")] == ['inference_pool_ready_pods{name="pool"} 3.0']


def test_counters_have_no_created_series(served: tuple[Metrics, int]) -> None:
    metrics, port = served
    Counter("epp_test_events", "A counter with a sample.", ["kind"], registry=metrics.registry).labels("a").inc()
    _, body = _get(port, "/metrics")
    assert 'epp_test_events_total{kind="a"} 1.0' in body
    assert "_created" not in body
