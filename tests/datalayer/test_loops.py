"""The scrape loops (epp.datalayer.loops) on their own: what they report, their phases, their settings."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import fields, replace

import msgspec
import pytest
from aiohttp import web

from epp.datalayer.engines import builtin_engines
from epp.datalayer.loops import REASONS, ScrapeLoops, ScrapeResult, Target
from epp.framework import Metrics

from ._scraping import FAST, VLLM_PAGE, FakeServer, RawServer, until


async def test_the_loops_report_a_result_with_every_metrics_field(fake: FakeServer) -> None:
    # What ScrapeLoops hands its sink (and the worker ships): a ScrapeResult, with a field of the same
    # name for each of Metrics' (the scraper copies them by name), and the endpoint and reason.
    reports: list[ScrapeResult] = []
    loops = ScrapeLoops(builtin_engines(), FAST, reports.append)
    loops.add(Target("pod", "127.0.0.1", fake.port, "vllm"))
    try:
        await until(lambda: len(reports) >= 2)
    finally:
        await loops.stop()
    result = reports[-1]
    assert (result.endpoint, result.reason) == ("pod", None)
    assert {field.name for field in fields(Metrics)} <= set(ScrapeResult.__struct_fields__)
    assert (result.waiting_queue_size, result.num_gpu_blocks, result.stale, result.error) == (7, 1000, False, None)
    assert loops.endpoints == {}


async def test_a_failed_scrape_keeps_the_last_good_numbers_and_their_time(fake: FakeServer) -> None:
    reports: list[ScrapeResult] = []
    loops = ScrapeLoops(builtin_engines(), FAST, reports.append)
    loops.add(Target("pod", "127.0.0.1", fake.port, "vllm"))
    try:
        await until(lambda: len(reports) >= 1)
        fake.respond = lambda: web.Response(status=500)
        await until(lambda: reports[-1].reason == "http_status")
    finally:
        await loops.stop()
    good = [result for result in reports if result.reason is None][-1]
    failed = reports[-1]
    assert failed.error == "HTTP 500 from /metrics"
    # The same numbers and time as the last good scrape (stale, too, once the threshold has passed).
    assert msgspec.structs.replace(failed, stale=False, error=None, reason=None) == good


def test_reasons_are_the_error_counters_label_values() -> None:
    assert REASONS == ("connection", "timeout", "http_status", "no_metrics", "missing_metrics")


def test_a_result_before_any_scrape_is_stale_and_empty() -> None:
    never = ScrapeResult("pod")
    assert (never.stale, never.updated_at, never.error, never.reason) == (True, 0.0, None, None)
    assert (never.waiting_queue_size, never.running_adapters, never.block_size) == (0, frozenset(), None)


async def test_loops_share_a_slot_until_it_is_full_then_spread_evenly() -> None:
    # 20 ms at 5 ms a slot: 4 phases. A new loop takes the first slot with room (10 loops), so that a
    # small pool is scraped in one wake-up a beat; once every slot is full, the least busy one.
    loops = ScrapeLoops(builtin_engines(), FAST, lambda *report: None)

    def slots() -> Counter[int]:
        return Counter(endpoint.slot for endpoint in loops.endpoints.values())

    try:
        for i in range(8):
            loops.add(Target(f"pod-{i}", "127.0.0.1", 9, "vllm"))
        assert slots() == {0: 8}
        for i in range(8, 40):
            loops.add(Target(f"pod-{i}", "127.0.0.1", 9, "vllm"))
        assert slots() == {0: 10, 1: 10, 2: 10, 3: 10}
        loops.add(Target("pod-40", "127.0.0.1", 9, "vllm"))
        assert sorted(slots().values()) == [10, 10, 10, 11]
        moved = loops.endpoints["pod-15"].slot
        loops.remove("pod-15")
        loops.remove("pod-40")
        loops.add(Target("pod-41", "127.0.0.1", 9, "vllm"))
        assert loops.endpoints["pod-41"].slot == moved  # the slot that lost a loop: the first with room
        assert slots() == {0: 10, 1: 10, 2: 10, 3: 10}
    finally:
        await loops.stop()


@pytest.mark.parametrize("bad", [{"interval": 0.0}, {"timeout": -1.0}, {"staleness": 0.0}])
def test_settings_that_cannot_work_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        ScrapeLoops(builtin_engines(), replace(FAST, **bad), lambda *report: None)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/metrics", "/metrics?name[]=sglang:num_queue_reqs&name[]=sglang:num_running_reqs"),
        ("/metrics?x=1", "/metrics?x=1&name[]=sglang:num_queue_reqs&name[]=sglang:num_running_reqs"),
    ],
)
def test_the_name_filter_asks_for_each_metric_the_engine_reads(path: str, expected: str) -> None:
    from epp.datalayer.engines import engine_from_config
    from epp.datalayer.loops import _filtered_path

    engine = engine_from_config(
        "e", {"queuedRequestsSpec": "sglang:num_queue_reqs", "runningRequestsSpec": 'sglang:num_running_reqs{a="b"}'}
    )
    assert _filtered_path(path, engine) == expected


_VLLM_QUERY = (
    "name[]=vllm:num_requests_waiting&name[]=vllm:num_requests_running&name[]=vllm:kv_cache_usage_perc"
    "&name[]=vllm:gpu_cache_usage_perc&name[]=vllm:lora_requests_info&name[]=vllm:cache_config_info"
)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        # vLLM 0.32 ignores ?name[]= on /metrics (an instrumentator) and honours it on /metrics/
        ("/metrics", f"/metrics/?{_VLLM_QUERY}"),
        # a path the user gave is asked as given
        ("/metrics/", f"/metrics/?{_VLLM_QUERY}"),
        ("/vllm/metrics", f"/vllm/metrics?{_VLLM_QUERY}"),
        ("/metrics?x=1", f"/metrics?x=1&{_VLLM_QUERY}"),
    ],
)
def test_vllm_is_asked_for_the_filter_where_it_honours_it(path: str, expected: str) -> None:
    from epp.datalayer.loops import _filtered_path

    assert _filtered_path(path, builtin_engines()["vllm"]) == expected
    assert _filtered_path(path, builtin_engines()["sglang"]).startswith(path)  # SGLang: as given


class _ClosingServer(RawServer):
    """A raw HTTP/1.1 server answering the metrics page; ``close_unanswered(n, k)`` says whether it closes
    connection ``n`` without a word when its ``k``-th request arrives (as a keep-alive timeout does)."""

    def __init__(self, close_unanswered: Callable[[int, int], bool]) -> None:
        super().__init__()
        self.close_unanswered = close_unanswered
        self.connections = 0
        self.answered = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        try:
            for k in itertools.count():
                await reader.readuntil(b"\r\n\r\n")
                if self.close_unanswered(number, k):
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(VLLM_PAGE), VLLM_PAGE))
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_keep_alive_close_racing_the_request_is_retried_on_a_new_connection() -> None:
    # Every connection is closed by the server as its second request arrives: each scrape on a reused
    # connection meets the race, and is sent again on a new one - no failure is reported.
    reports: list[ScrapeResult] = []
    async with _ClosingServer(lambda n, k: k == 1) as server:
        loops = ScrapeLoops(builtin_engines(), FAST, reports.append)
        loops.add(Target("pod", "127.0.0.1", server.port, "vllm"))
        try:
            await until(lambda: server.answered >= 6)
        finally:
            await loops.stop()
    assert server.connections >= 5  # the race was met again and again
    assert reports and all(result.reason is None for result in reports), [r.error for r in reports]


async def test_a_server_that_closes_every_request_unanswered_fails_each_scrape_once() -> None:
    # The first connection answers once; from then on the server closes every connection unanswered, the
    # fresh ones too. The scrape that met the race is retried once and fails; later scrapes, each on a
    # fresh connection, fail without a retry: one connection per failed scrape, no endless retries.
    reports: list[ScrapeResult] = []
    async with _ClosingServer(lambda n, k: n > 0 or k > 0) as server:
        loops = ScrapeLoops(builtin_engines(), FAST, reports.append)
        loops.add(Target("pod", "127.0.0.1", server.port, "vllm"))
        try:
            await until(lambda: sum(result.reason == "connection" for result in reports) >= 3)
        finally:
            await loops.stop()
        connections = server.connections
    failed = [result for result in reports if result.reason == "connection"]
    assert reports[0].reason is None and "connection closed" in (failed[0].error or "")
    assert server.answered == 1
    assert connections <= len(failed) + 2  # the first connection, the one retry, then one per failure
