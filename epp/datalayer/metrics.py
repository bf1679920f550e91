"""The scrape series: what the scraper tells Prometheus about each endpoint's scrapes.

The service registers them in its own registry (``ScrapeMetrics(registry)``), so the data layer
needs nothing of the server's metrics. Names, labels and help texts are the picker's public
interface (dashboards and alerts read them): they do not change.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["ScrapeMetrics"]


class ScrapeMetrics:
    """The scrape series, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.scrape_errors = Counter(
            "epp_endpoint_scrape_errors_total",
            "Failed or incomplete metrics scrapes, by endpoint and reason "
            "(connection, timeout, http_status, missing_metrics).",
            ["endpoint", "reason"],
            registry=registry,
        )
        """Failed or incomplete scrapes, by endpoint and :data:`~epp.datalayer.loops.Reason`."""
        self.scrapes = Counter(
            "epp_endpoint_scrapes_total", "Metrics scrapes that returned a page (all endpoints).", registry=registry
        )
        """Scrapes that returned a page, complete or not (all endpoints)."""
        self.endpoint_stale = Gauge(
            "epp_endpoint_metrics_stale",
            "1 while an endpoint's metrics are older than --metrics-staleness-threshold (treated as fully loaded).",
            ["endpoint"],
            registry=registry,
        )
        """1 while an endpoint's metrics are stale, by endpoint."""
        self.filter_ignored = Counter(
            "epp_endpoint_scrape_filter_ignored_total",
            "Metrics pages that came back whole although only some metrics were asked for (?name[]=), "
            "by endpoint; the endpoint is scraped unfiltered from then on.",
            ["endpoint"],
            registry=registry,
        )
        """Pages that ignored the ``?name[]=`` filter, by endpoint (once per scrape loop)."""
