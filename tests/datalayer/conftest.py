"""Fixtures shared by the data layer's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

import epp.datalayer.page
from epp.datalayer.metrics import ScrapeMetrics

from ._scraping import FakeServer


@pytest.fixture(params=["index", "search"])
def page_reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test that uses it runs twice: as configured (small pages read by the one-pass index, the
    rest searched), then with every page searched, so that both ways of reading are held to the same tables."""
    if request.param == "search":
        monkeypatch.setattr(epp.datalayer.page, "_INDEX_MAX_BYTES", -1)
    return str(request.param)


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    app = web.Application()
    app.router.add_get("/metrics", server.handler)
    app.router.add_get("/metrics/", server.handler)  # vLLM serves its page at both (see test_scraper)
    server.runner = web.AppRunner(app, access_log=None)
    await server.runner.setup()
    site = web.TCPSite(server.runner, "127.0.0.1", 0)
    await site.start()
    server.port = server.runner.addresses[0][1]
    yield server
    await server.runner.cleanup()


@pytest.fixture
def scrape_metrics() -> ScrapeMetrics:
    return ScrapeMetrics(CollectorRegistry())
