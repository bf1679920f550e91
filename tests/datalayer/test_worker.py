"""The scrape worker process (epp.datalayer.worker): it follows the pool, exits with its parent, is restarted."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from epp.datalayer.datastore import Datastore
from epp.datalayer.engines import builtin_engines
from epp.datalayer.loops import ScrapeResult, Target
from epp.datalayer.metrics import ScrapeMetrics

from ._scraping import FAST, FakeServer, running, until


async def test_worker_process_scrapes_follows_the_pool_and_exits_with_its_parent(
    fake: FakeServer, scrape_metrics: ScrapeMetrics
) -> None:
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics, in_process=False)
    worker = scraper.loops
    pid = worker.pid
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale, timeout=10)
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7
        datastore.remove(fake.endpoint.name)
        await asyncio.sleep(0.2)
        served = fake.requests
        await asyncio.sleep(0.3)
        assert fake.requests == served  # the worker stopped scraping the removed endpoint
        datastore.upsert(fake.endpoint)
        await until(lambda: fake.requests > served + 3)
    finally:
        await scraper.stop()
    assert worker._process.poll() is not None  # exited, not orphaned
    assert pid is not None


async def test_a_dead_worker_marks_endpoints_stale_and_is_restarted(
    fake: FakeServer, scrape_metrics: ScrapeMetrics
) -> None:
    import os
    import signal

    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics, in_process=False)
    worker = scraper.loops
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale, timeout=10)
        first = worker.pid
        os.kill(first, signal.SIGKILL)
        await until(lambda: datastore.endpoints()[0].metrics.stale)
        assert "scrape worker stopped" in (datastore.endpoints()[0].metrics.error or "")
        await until(lambda: not datastore.endpoints()[0].metrics.stale, timeout=10)
        assert worker.pid != first
    finally:
        await scraper.stop()


def test_results_cross_to_the_parent_unchanged() -> None:
    from epp.datalayer.worker import _decode_results, _encode_results

    results = [
        ScrapeResult("pod-0"),
        ScrapeResult(
            "pod-1", 7, 3, 0.25, frozenset({"a1", "a2"}), frozenset({"w"}), 4, 16, 1000, 12.5, False, "x", "http_status"
        ),
        ScrapeResult("pod-2", kv_cache_usage=1.0, updated_at=3.0, error="HTTP 500 from /metrics", reason="http_status"),
    ]
    decoded = _decode_results(_encode_results(results))
    assert decoded == results
    assert all(type(r.running_adapters) is frozenset and type(r.kv_cache_usage) is float for r in decoded)


def test_results_of_endpoints_removed_meanwhile_are_dropped() -> None:
    from epp.datalayer.worker import WorkerClient, _encode_results

    applied: list[ScrapeResult] = []
    client = WorkerClient(builtin_engines(), FAST, applied.append)
    client.add(Target("kept", "127.0.0.1", 9, "vllm"))
    client.add(Target("gone", "127.0.0.1", 9, "vllm"))
    client.remove("gone")  # the worker may have sent its result before it heard of this
    client._results(_encode_results([ScrapeResult("gone"), ScrapeResult("kept", waiting_queue_size=3)]))
    assert applied == [ScrapeResult("kept", waiting_queue_size=3)]


async def test_the_worker_outlives_a_sigterm_to_the_process_group_until_its_parent_stops(
    fake: FakeServer, scrape_metrics: ScrapeMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    # `kill -TERM -PGID` reaches the worker too; its parent's clean stop must not read as a crash.
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics, in_process=False)
    worker = scraper.loops
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale, timeout=10)
        os.kill(worker.pid, signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert worker._process.poll() is None  # still running: the parent decides
        assert not datastore.endpoints()[0].metrics.stale
    finally:
        await scraper.stop()
    assert worker._process.poll() is not None
    assert "restarting it" not in caplog.text
