"""The scrape series (epp.datalayer.metrics): their names, labels and help texts are a public interface."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

import epp.datalayer.metrics
from epp.datalayer.metrics import ScrapeMetrics


def test_public_api_is_locked() -> None:
    assert epp.datalayer.metrics.__all__ == ["ScrapeMetrics"]


def test_the_series_are_exposed_under_their_names_labels_and_help_texts() -> None:
    registry = CollectorRegistry()
    metrics = ScrapeMetrics(registry)
    assert metrics.registry is registry
    metrics.scrape_errors.labels("pod-a", "timeout").inc()
    metrics.scrapes.inc(2)
    metrics.endpoint_stale.labels("pod-a").set(1)
    metrics.filter_ignored.labels("pod-a").inc()
    exposed = generate_latest(registry).decode().splitlines()
    assert [line for line in exposed if "_created" not in line] == [
        "# HELP epp_endpoint_scrape_errors_total Failed or incomplete metrics scrapes, by endpoint and reason "
        "(connection, timeout, http_status, missing_metrics).",
        "# TYPE epp_endpoint_scrape_errors_total counter",
        'epp_endpoint_scrape_errors_total{endpoint="pod-a",reason="timeout"} 1.0',
        "# HELP epp_endpoint_scrapes_total Metrics scrapes that returned a page (all endpoints).",
        "# TYPE epp_endpoint_scrapes_total counter",
        "epp_endpoint_scrapes_total 2.0",
        "# HELP epp_endpoint_metrics_stale 1 while an endpoint's metrics are older than "
        "--metrics-staleness-threshold (treated as fully loaded).",
        "# TYPE epp_endpoint_metrics_stale gauge",
        'epp_endpoint_metrics_stale{endpoint="pod-a"} 1.0',
        "# HELP epp_endpoint_scrape_filter_ignored_total Metrics pages that came back whole although only some "
        "metrics were asked for (?name[]=), by endpoint; the endpoint is scraped unfiltered from then on.",
        "# TYPE epp_endpoint_scrape_filter_ignored_total counter",
        'epp_endpoint_scrape_filter_ignored_total{endpoint="pod-a"} 1.0',
    ]


def test_each_registry_gets_its_own_series() -> None:
    # No process-global state: two pickers in one process (tests, the simulator) count apart.
    first, second = ScrapeMetrics(CollectorRegistry()), ScrapeMetrics(CollectorRegistry())
    first.scrapes.inc()
    assert first.registry.get_sample_value("epp_endpoint_scrapes_total") == 1.0
    assert second.registry.get_sample_value("epp_endpoint_scrapes_total") == 0.0
