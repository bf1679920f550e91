"""The scrape cadence's backoff (epp.datalayer.loops): idle pods are asked less often, never blindly.

What must hold: a pod whose numbers do not change is scraped at most ``idle_interval`` apart (the
blind time to traffic this picker does not send), and at the fast cadence again at the next beat
after a pick to it, a change on its page, or a failure; a slowed pod does not go stale sooner after
its failures begin than a pod scraped every interval; pods that change, and pools with the backoff
off, are scraped every interval.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import replace

import pytest
from aiohttp import web

from epp.datalayer.datastore import Datastore
from epp.datalayer.engines import builtin_engines
from epp.datalayer.loops import ScrapeLoops, ScrapeResult, ScrapeSettings, Target, _stride
from epp.datalayer.metrics import ScrapeMetrics
from epp.datalayer.scraper import Scraper

from ._scraping import VLLM_PAGE, FakeServer, running, until

# 20 ms beats, backing off to 8 beats (160 ms) apart.
SETTINGS = ScrapeSettings(interval=0.02, staleness=1.0, timeout=0.5, idle_interval=0.16)
# Slack for an event loop on a loaded 2-core machine: timers and answers may come this late.
LATE = 0.15


async def _slowed(loops: ScrapeLoops, name: str) -> None:
    endpoint = loops.endpoints[name]
    await until(lambda: endpoint.stride == loops_max_stride(loops))


def loops_max_stride(loops: ScrapeLoops) -> int:
    return loops._settings.max_stride


@pytest.mark.parametrize(
    ("quiet", "most", "expected"),
    [
        (0, 20, 1),
        (3, 20, 1),  # four steady scrapes at the fast cadence first
        (4, 20, 2),
        (5, 20, 4),
        (7, 20, 16),
        (8, 20, 20),  # capped
        (1000, 20, 20),
        (1000, 1, 1),  # the backoff off
    ],
)
def test_the_stride_doubles_after_four_steady_scrapes_up_to_the_most(quiet: int, most: int, expected: int) -> None:
    assert _stride(quiet, most) == expected


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (ScrapeSettings(), 20),  # 1 s of 50 ms beats
        (ScrapeSettings(idle_interval=0.0), 1),  # off: every interval, as upstream
        (ScrapeSettings(idle_interval=0.03), 1),  # shorter than the interval: off
        (ScrapeSettings(idle_interval=0.12), 2),  # whole beats, rounded down
        (ScrapeSettings(idle_interval=5.0), 20),  # at most half the 2 s staleness threshold
        (ScrapeSettings(idle_interval=5.0, staleness=10.0), 100),
    ],
)
def test_the_longest_gap_is_whole_beats_below_half_the_staleness_threshold(
    settings: ScrapeSettings, expected: int
) -> None:
    assert settings.max_stride == expected


def test_a_negative_idle_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="idle scrape interval cannot be negative"):
        ScrapeLoops(builtin_engines(), replace(SETTINGS, idle_interval=-1.0), lambda result: None)


async def test_an_idle_pod_is_asked_less_often_never_more_than_the_idle_interval_apart(fake: FakeServer) -> None:
    reports: list[ScrapeResult] = []
    loops = ScrapeLoops(builtin_engines(), SETTINGS, reports.append)
    loops.add(Target("pod", "127.0.0.1", fake.port, "vllm"))
    try:
        await _slowed(loops, "pod")
        backed_off = len(fake.times)
        await asyncio.sleep(1.2)
        gaps = [b - a for a, b in zip(fake.times[backed_off - 1 :], fake.times[backed_off:], strict=False)]
    finally:
        await loops.stop()
    assert len(gaps) >= 5
    # The blind-time bound: never longer than the idle interval between two scrapes (plus lateness)...
    assert max(gaps) <= SETTINGS.idle_interval + LATE
    # ...and it is the idle interval that they are apart, not the 20 ms one.
    assert statistics.median(gaps) >= 0.75 * SETTINGS.idle_interval
    # Fresh throughout, each scrape reported with its own time; the steady ones as nothing new.
    assert all(not r.stale and r.error is None for r in reports)
    assert [r.updated_at for r in reports] == sorted({r.updated_at for r in reports})
    assert reports[0].unchanged is False and reports[-1].slow and reports[-1].unchanged


async def test_a_change_on_an_idle_pod_is_seen_within_the_idle_interval_then_scraped_fast(fake: FakeServer) -> None:
    # Another gateway's traffic: the pod's numbers change although this picker sent it nothing.
    reports: list[ScrapeResult] = []
    loops = ScrapeLoops(builtin_engines(), SETTINGS, reports.append)
    loops.add(Target("pod", "127.0.0.1", fake.port, "vllm"))
    endpoint = loops.endpoints["pod"]
    try:
        await _slowed(loops, "pod")
        asked = len(fake.times)
        await until(lambda: len(fake.times) > asked)  # right after a slow scrape: the worst case
        busy = VLLM_PAGE.replace(b'model_name="m"} 7.0', b'model_name="m"} 9.0')
        fake.respond = lambda: web.Response(body=busy)
        changed = time.monotonic()
        await until(lambda: reports[-1].waiting_queue_size == 9)
        seen = reports[-1].updated_at
        assert endpoint.stride == 1 and not reports[-1].slow  # fast again
        asked = len(fake.times)
        await asyncio.sleep(0.2)
    finally:
        await loops.stop()
    assert seen - changed <= SETTINGS.idle_interval + LATE
    assert len(fake.times) - asked >= 4  # the next 200 ms at the 20 ms cadence (at least 4 of its 10 beats)


async def test_a_busy_pod_and_a_pool_with_the_backoff_off_are_scraped_every_interval(fake: FakeServer) -> None:
    pages = iter(range(10**6))
    busy = FakeServer(respond=lambda: web.Response(body=VLLM_PAGE.replace(b"} 7.0", b"} %d.0" % next(pages))))
    fake.respond = busy.respond
    results: dict[str, list[ScrapeResult]] = {"busy": [], "off": []}
    busy_loops = ScrapeLoops(builtin_engines(), SETTINGS, results["busy"].append)
    off_loops = ScrapeLoops(builtin_engines(), replace(SETTINGS, idle_interval=0.0), results["off"].append)
    busy_loops.add(Target("busy", "127.0.0.1", fake.port, "vllm"))
    # Off: a pod serving the same page (the fake's second site: the same server, another loop).
    idle = FakeServer()
    app = web.Application()
    app.router.add_get("/metrics/", idle.handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    off_loops.add(Target("off", "127.0.0.1", runner.addresses[0][1], "vllm"))
    try:
        await until(lambda: len(results["busy"]) >= 20 and len(results["off"]) >= 20)
        assert busy_loops.endpoints["busy"].stride == 1 and off_loops.endpoints["off"].stride == 1
    finally:
        await busy_loops.stop()
        await off_loops.stop()
        await runner.cleanup()
    assert not any(r.slow or r.unchanged for r in results["busy"])
    assert not any(r.slow for r in results["off"])
    assert all(r.unchanged for r in results["off"][1:])  # the same numbers: nothing new but the time


async def _wait_for_backoff(fake: FakeServer, at_least: float) -> None:
    """Until the pod is asked ``at_least`` seconds apart, twice in a row."""
    times = fake.times
    await until(lambda: len(times) >= 3 and min(times[-1] - times[-2], times[-2] - times[-3]) >= at_least, timeout=10)


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "worker-process"])
async def test_a_pick_to_a_slowed_pod_gets_it_scraped_at_the_fast_cadence_at_once(
    fake: FakeServer, scrape_metrics: ScrapeMetrics, in_process: bool
) -> None:
    # 50 ms beats, backing off to 1 s: without the pick the next scrape would be ~1 s away.
    settings = ScrapeSettings(interval=0.05, staleness=3.0, timeout=1.0, idle_interval=1.0)
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics, settings, in_process=in_process)
    name = fake.endpoint.name
    record = datastore.in_flight(name)
    assert record is not None
    try:
        await _wait_for_backoff(fake, 0.8)
        await until(lambda: scraper._slow == {name})  # the result saying so reached the scraper
        asked = len(fake.times)
        await until(lambda: len(fake.times) > asked, timeout=3)  # right after a slow scrape
        picked = time.monotonic()
        record.add(100)  # what the request path does for a pick
        await until(lambda: len(fake.times) > asked + 1, timeout=3)
        first = fake.times[asked + 1]
        await asyncio.sleep(0.25)
        after = [t for t in fake.times if t >= first]
    finally:
        await scraper.stop()
    assert first - picked <= settings.interval + LATE  # the next beat, not ~1 s later
    assert len(after) >= 4  # and the fast cadence after it (5 beats in those 250 ms)


async def test_a_pick_made_before_the_slow_result_arrived_wakes_the_loop_at_once(
    scrape_metrics: ScrapeMetrics,
) -> None:
    # The worker batches results: a pick may come between the scrape that slowed the loop and its result.
    from epp.datalayer.static import parse_endpoint

    endpoint = parse_endpoint("127.0.0.1:9")
    datastore = Datastore([endpoint])
    scraper = Scraper(datastore, builtin_engines(), SETTINGS, scrape_metrics, in_process=True)
    woken: list[str] = []
    scraper._loops.wake = woken.append  # type: ignore[method-assign]
    record = datastore.in_flight(endpoint.name)
    assert record is not None
    scraped = time.monotonic()
    record.add(10)  # after the scrape, before its result
    scraper._apply_result(ScrapeResult(endpoint.name, updated_at=scraped, stale=False, slow=True))
    assert woken == [endpoint.name]
    # The next slow result watches the record instead; a result at the fast cadence forgets the watch.
    scraper._apply_result(ScrapeResult(endpoint.name, updated_at=time.monotonic(), stale=False, slow=True))
    assert woken == [endpoint.name]
    record.add(10)
    assert woken == [endpoint.name] * 2
    scraper._apply_result(ScrapeResult(endpoint.name, updated_at=time.monotonic(), stale=False, slow=True))
    scraper._apply_result(ScrapeResult(endpoint.name, updated_at=time.monotonic(), stale=False, slow=False))
    record.add(10)
    assert woken == [endpoint.name] * 2


@pytest.mark.parametrize("idle_interval", [0.3, 0.0], ids=["slowed", "every-interval"])
async def test_a_slowed_pod_goes_stale_as_long_after_its_failures_begin_as_a_pod_asked_every_interval(
    fake: FakeServer, idle_interval: float
) -> None:
    # --metrics-staleness-threshold (here 0.6 s) is how long a pod's scrapes fail before it goes stale.
    # A pod asked every 300 ms had its last good scrape up to 300 ms before the first failure; that
    # gap was the picker's choice and must not count.
    settings = ScrapeSettings(interval=0.02, staleness=0.6, timeout=0.5, idle_interval=idle_interval)
    reports: list[tuple[float, ScrapeResult]] = []
    loops = ScrapeLoops(builtin_engines(), settings, lambda result: reports.append((time.monotonic(), result)))
    loops.add(Target("pod", "127.0.0.1", fake.port, "vllm"))
    endpoint = loops.endpoints["pod"]
    try:
        if idle_interval:
            await until(lambda: endpoint.stride == settings.max_stride == 15)
        else:
            await until(lambda: len(reports) >= 10)
        asked = len(fake.times)
        await until(lambda: len(fake.times) > asked)  # right after a scrape: the longest gap to the next
        fake.respond = lambda: web.Response(status=500)
        await until(lambda: reports[-1][1].stale, timeout=3)
    finally:
        await loops.stop()
    first_failure = next(at for at, result in reports if result.reason == "http_status")
    went_stale = next(at for at, result in reports if result.stale)
    # Stale once the failures have lasted the threshold (less the one interval a fast pod's last good
    # scrape is ahead of its first failure), not sooner, and not much later.
    assert settings.staleness - 2 * settings.interval <= went_stale - first_failure <= settings.staleness + LATE
    assert all(result.waiting_queue_size == 7 for _, result in reports)  # the last good numbers kept


async def test_a_slowed_pod_that_refuses_connections_is_stale_at_its_next_scrape(scrape_metrics: ScrapeMetrics) -> None:
    server = FakeServer()
    app = web.Application()
    app.router.add_get("/metrics/", server.handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.port = runner.addresses[0][1]
    datastore = Datastore([server.endpoint])
    settings = replace(SETTINGS, staleness=30.0, idle_interval=0.3)  # only the refusal can make it stale
    scraper = await running(datastore, scrape_metrics, settings)
    name = server.endpoint.name
    try:
        loop = scraper.loops.endpoints[name]  # type: ignore[union-attr]  # in process: ScrapeLoops
        await until(lambda: loop.stride == 15)
        await runner.cleanup()  # the pod dies
        died = time.monotonic()
        await until(lambda: datastore.endpoints()[0].metrics.stale, timeout=3)
        assert time.monotonic() - died <= settings.idle_interval + LATE
        assert loop.stride == 1  # a failure is news: asked every interval until it is steady again
    finally:
        await scraper.stop()


async def test_the_worker_lets_results_with_nothing_new_wait_for_company() -> None:
    from epp.datalayer.worker import _BATCH_DELAY, _decode_results, _Worker

    class Transport:
        def __init__(self) -> None:
            self.frames: list[tuple[float, list[ScrapeResult]]] = []

        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            self.frames.append((time.monotonic(), _decode_results(data[4:])))

    loop = asyncio.get_running_loop()
    worker = _Worker(loop)
    transport = Transport()
    worker.transport = transport  # type: ignore[assignment]
    steady = ScrapeResult("a", updated_at=1.0, stale=False, unchanged=True)
    worker._sink(steady)
    await asyncio.sleep(0.1)
    assert transport.frames == []  # still waiting (up to 250 ms)
    news = ScrapeResult("b", waiting_queue_size=3, updated_at=2.0, stale=False)
    sent = time.monotonic()
    worker._sink(news)
    await until(lambda: bool(transport.frames))
    at, frame = transport.frames[0]
    assert frame == [steady, news]  # one frame: the steady result rides with the news
    assert at - sent <= _BATCH_DELAY + LATE
    worker._sink(steady)
    await until(lambda: len(transport.frames) == 2, timeout=1)  # alone, it goes within the lazy delay
