"""The scraper against the simulator and against hand-made model servers that misbehave."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from epp.datalayer.datastore import Datastore
from epp.datalayer.engines import ENGINE_TYPE_LABEL, builtin_engines
from epp.datalayer.loops import REASONS, ScrapeResult, ScrapeSettings
from epp.datalayer.metrics import ScrapeMetrics
from epp.datalayer.static import parse_endpoint
from epp.framework import Endpoint, Metrics
from epp.sim import EngineConfig, SimulatedPool
from epp.sim.request import Sink

from ._scraping import FAST, VLLM_PAGE, FakeServer, RawServer, running, until

SGLANG_PAGE = b"""sglang:num_queue_reqs{model_name="m"} 4
sglang:num_running_reqs{model_name="m"} 2
sglang:token_usage{model_name="m"} 0.5
"""


def _errors(scrape_metrics: ScrapeMetrics, endpoint: str, reason: str) -> float:
    value = scrape_metrics.registry.get_sample_value(
        "epp_endpoint_scrape_errors_total", {"endpoint": endpoint, "reason": reason}
    )
    return value or 0.0


async def test_reads_the_vllm_page_into_the_endpoint_metrics(fake: FakeServer, scrape_metrics: ScrapeMetrics) -> None:
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        metrics = datastore.endpoints()[0].metrics
        assert (metrics.waiting_queue_size, metrics.running_requests, metrics.kv_cache_usage) == (7, 3, 0.25)
        assert metrics.running_adapters == {"a1"} and metrics.waiting_adapters == {"a2"} and metrics.max_adapters == 2
        assert (metrics.block_size, metrics.num_gpu_blocks) == (16, 1000)
        assert metrics.error is None
        await until(lambda: fake.requests >= 5)
        assert len(fake.connections) == 1  # keep-alive: every scrape on one connection
        # The same page again and again (an idle pod): still one fresh snapshot per scrape.
        await until(lambda: datastore.endpoints()[0].metrics.updated_at > metrics.updated_at)
        later = datastore.endpoints()[0].metrics
        assert later == replace(metrics, updated_at=later.updated_at)
    finally:
        await scraper.stop()


async def test_engine_label_selects_the_sglang_names(fake: FakeServer, scrape_metrics: ScrapeMetrics) -> None:
    fake.respond = lambda: web.Response(body=SGLANG_PAGE)
    endpoint = Endpoint(fake.endpoint.name, "127.0.0.1", fake.port, labels={ENGINE_TYPE_LABEL: "sglang"})
    datastore = Datastore([endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        metrics = datastore.endpoints()[0].metrics
        assert (metrics.waiting_queue_size, metrics.running_requests, metrics.kv_cache_usage) == (4, 2, 0.5)
    finally:
        await scraper.stop()


async def test_chunked_pages_are_read(fake: FakeServer, scrape_metrics: ScrapeMetrics) -> None:
    def chunked() -> web.StreamResponse:
        response = web.Response(body=VLLM_PAGE)
        response.enable_chunked_encoding()
        return response

    fake.respond = chunked
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7
    finally:
        await scraper.stop()


@pytest.mark.parametrize(
    ("respond", "reason", "message"),
    [
        (lambda: web.Response(status=500, text="boom"), "http_status", "HTTP 500"),
        # 200 with none of the engine's metrics: a failed scrape (issue 15), no longer a partial page
        (lambda: web.Response(body=b"<html>not metrics</html>"), "no_metrics", "missing from the page"),
        (lambda: web.Response(body=bytes(range(256)) * 20), "no_metrics", "vllm:num_requests_waiting"),
        (lambda: web.Response(body=VLLM_PAGE.replace(b"kv_cache_usage", b"other")), "missing_metrics", "vllm:kv_cache_usage_perc"),
    ],
)
async def test_bad_answers_are_survived_recorded_and_counted(
    fake: FakeServer,
    scrape_metrics: ScrapeMetrics,
    respond: Callable[[], web.StreamResponse],
    reason: str,
    message: str,
) -> None:
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        fake.respond = respond
        name = fake.endpoint.name
        await until(lambda: _errors(scrape_metrics, name, reason) >= 3)
        assert message in (datastore.endpoints()[0].metrics.error or "")
        fake.respond = lambda: web.Response(body=VLLM_PAGE)  # recovers
        await until(lambda: datastore.endpoints()[0].metrics.error is None)
        assert name in scraper.loops.endpoints
    finally:
        await scraper.stop()


async def test_a_slow_pod_times_out_then_goes_stale_and_counts_as_such(
    fake: FakeServer, scrape_metrics: ScrapeMetrics
) -> None:
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    name = fake.endpoint.name
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        fake.delay = 1.0  # far over the 0.15 s timeout
        await until(lambda: _errors(scrape_metrics, name, "timeout") >= 1)
        metrics = datastore.endpoints()[0].metrics
        assert "no answer within" in (metrics.error or "")
        assert metrics.waiting_queue_size == 7  # last good numbers kept...
        await until(lambda: datastore.endpoints()[0].metrics.stale)  # ...until the staleness threshold
        assert scrape_metrics.registry.get_sample_value("epp_endpoint_metrics_stale", {"endpoint": name}) == 1.0
        fake.delay = 0.0
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
    finally:
        await scraper.stop()


async def test_a_pod_that_refuses_connections_is_stale_from_the_start(scrape_metrics: ScrapeMetrics) -> None:
    from epp.testing.envoy import free_port

    endpoint = parse_endpoint(f"127.0.0.1:{free_port()}")
    datastore = Datastore([endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: _errors(scrape_metrics, endpoint.name, "connection") >= 3)
        metrics = datastore.endpoints()[0].metrics
        assert metrics.stale and "Error" in (metrics.error or "")
    finally:
        await scraper.stop()


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(b"<!doctype html><html><body><h1>Welcome</h1></body></html>", id="html"),
        pytest.param(b"# HELP something_else A metric of another program.\nsomething_else 1\n", id="other-metrics"),
        pytest.param(b"", id="empty"),
    ],
)
async def test_a_page_with_none_of_the_engines_metrics_is_a_failed_scrape_and_goes_stale(
    fake: FakeServer, scrape_metrics: ScrapeMetrics, page: bytes
) -> None:
    fake.respond = lambda: web.Response(body=page, content_type="text/html")
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    name = fake.endpoint.name
    try:
        await until(lambda: _errors(scrape_metrics, name, "no_metrics") >= 5)
        metrics = datastore.endpoints()[0].metrics
        # never scraped: stale from the start (read as fully loaded), never an idle pod with queue 0
        assert metrics.stale and metrics.updated_at == 0.0
        assert (metrics.error or "").startswith("not a metrics page: none of the engine's metrics")
        assert scrape_metrics.registry.get_sample_value("epp_endpoint_metrics_stale", {"endpoint": name}) == 1.0
        assert not scrape_metrics.registry.get_sample_value("epp_endpoint_scrapes_total")
        fake.respond = lambda: web.Response(body=VLLM_PAGE)
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7
        # a pod that was fine and then serves HTML keeps its numbers and goes stale after the threshold
        fake.respond = lambda: web.Response(body=page, content_type="text/html")
        await until(lambda: datastore.endpoints()[0].metrics.error is not None)
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7
        await until(lambda: datastore.endpoints()[0].metrics.stale)
    finally:
        await scraper.stop()


async def test_a_refused_connection_marks_the_endpoint_stale_at_once(scrape_metrics: ScrapeMetrics) -> None:
    # The staleness threshold is long (30 s): only the refusal itself can make the endpoint stale here.
    settings = replace(FAST, staleness=30.0)
    server = FakeServer()
    app = web.Application()
    app.router.add_get("/metrics", server.handler)

    async def serve(port: int) -> web.AppRunner:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = await serve(0)
    port = runner.addresses[0][1]
    server.port = port
    datastore = Datastore([server.endpoint])
    scraper = await running(datastore, scrape_metrics, settings)
    name = server.endpoint.name
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        await runner.cleanup()  # the pod dies: its port now refuses connections
        stopped = asyncio.get_running_loop().time()
        await until(lambda: datastore.endpoints()[0].metrics.stale, timeout=2.0)
        assert asyncio.get_running_loop().time() - stopped < 2.0  # far below the 30 s threshold
        metrics = datastore.endpoints()[0].metrics
        assert "ConnectionRefusedError" in (metrics.error or "") and metrics.waiting_queue_size == 7
        assert _errors(scrape_metrics, name, "connection") >= 1
        runner = await serve(port)  # back on the same port: the next good scrape clears it
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        assert datastore.endpoints()[0].metrics.error is None
    finally:
        await scraper.stop()
        await runner.cleanup()


async def test_endpoints_added_and_removed_start_and_stop_their_loops(
    fake: FakeServer, scrape_metrics: ScrapeMetrics
) -> None:
    datastore = Datastore()
    scraper = await running(datastore, scrape_metrics)
    try:
        baseline = len(asyncio.all_tasks())
        datastore.upsert(fake.endpoint)
        assert set(scraper.loops.endpoints) == {fake.endpoint.name}
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        loop = scraper.loops.endpoints[fake.endpoint.name]
        assert loop.connected and not loop.closed
        datastore.remove(fake.endpoint.name)
        assert scraper.loops.endpoints == {}
        assert loop.closed and not loop.connected
        # The server sees its connection closed, and no request after it.
        await until(lambda: all(transport.is_closing() for transport in fake.connections))
        served = fake.requests
        await asyncio.sleep(0.1)
        assert fake.requests == served
        assert len(asyncio.all_tasks()) == baseline  # nothing leaked
        for _ in range(20):  # churn
            datastore.upsert(fake.endpoint)
            datastore.remove(fake.endpoint.name)
        await asyncio.sleep(0.05)
        assert len(asyncio.all_tasks()) == baseline
        stale = scrape_metrics.registry.get_sample_value("epp_endpoint_metrics_stale", {"endpoint": fake.endpoint.name})
        assert stale is None
    finally:
        await scraper.stop()


class SilentServer(RawServer):
    """Accepts connections and never answers (a TLS handshake to it never ends); counts what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.accepted = 0
        self.closed = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while await reader.read(4096):
                pass
        except ConnectionError:
            pass
        self.closed += 1
        writer.close()


async def test_an_endpoint_removed_while_connecting_leaks_nothing(scrape_metrics: ScrapeMetrics) -> None:
    async with SilentServer() as server:
        endpoint = parse_endpoint(f"127.0.0.1:{server.port}")
        datastore = Datastore()
        settings = ScrapeSettings(interval=0.02, staleness=0.3, timeout=5.0, scheme="https")
        scraper = await running(datastore, scrape_metrics, settings)
        try:
            baseline = len(asyncio.all_tasks())
            datastore.upsert(endpoint)
            await until(lambda: server.accepted == 1)  # connected; the TLS handshake hangs
            assert [t.get_name() for t in asyncio.all_tasks()].count(f"connect {endpoint.name}") == 1
            datastore.remove(endpoint.name)
            await until(lambda: server.closed == 1)
            await until(lambda: len(asyncio.all_tasks()) == baseline)  # the server's handler ends too
        finally:
            await scraper.stop()


async def test_a_connection_that_never_completes_times_out_and_is_retried(scrape_metrics: ScrapeMetrics) -> None:
    async with SilentServer() as server:
        endpoint = parse_endpoint(f"127.0.0.1:{server.port}")
        datastore = Datastore([endpoint])
        settings = ScrapeSettings(interval=0.02, staleness=0.3, timeout=0.15, scheme="https")
        scraper = await running(datastore, scrape_metrics, settings)
        try:
            await until(lambda: _errors(scrape_metrics, endpoint.name, "timeout") >= 2)
            assert server.accepted >= 2 and server.closed >= 1  # each attempt given up, then a new one
            metrics = datastore.endpoints()[0].metrics
            assert metrics.stale and "no answer within 0.15s" in (metrics.error or "")
        finally:
            await scraper.stop()
        await until(lambda: server.closed == server.accepted)


async def test_against_the_simulator_metrics_follow_the_load(scrape_metrics: ScrapeMetrics) -> None:
    config = EngineConfig(max_num_seqs=1, time_scale=0.05, num_gpu_blocks=4096, max_model_len=8192, seed=3)
    async with SimulatedPool(2, config) as pool:
        datastore = Datastore([parse_endpoint(f"127.0.0.1:{port}") for port in pool.ports])
        scraper = await running(datastore, scrape_metrics)
        try:
            await until(lambda: all(not e.metrics.stale for e in datastore.endpoints()))
            assert {e.metrics.num_gpu_blocks for e in datastore.endpoints()} == {4096}
            assert {e.metrics.block_size for e in datastore.endpoints()} == {16}
            # Three long requests on a pod that runs one at a time: two wait.
            engine = pool[0].engine
            for _ in range(3):
                request = engine.new_request(config.model, np.arange(64), max_tokens=2000, ignore_eos=True, sink=Sink())
                engine.submit(request)
            first = datastore.endpoints()[0].name
            await until(lambda: datastore.get(first).metrics.waiting_queue_size == 2)
            assert datastore.get(first).metrics.running_requests == 1
            assert datastore.endpoints()[1].metrics.waiting_queue_size == 0
        finally:
            await scraper.stop()


async def test_asks_for_only_the_metrics_it_reads_as_prometheus_client_serves_them(
    scrape_metrics: ScrapeMetrics,
) -> None:
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "", ["model_name"], registry=registry).labels("m").set(5)
    Gauge("vllm:num_requests_running", "", ["model_name"], registry=registry).labels("m").set(1)
    Gauge("vllm:kv_cache_usage_perc", "", ["model_name"], registry=registry).labels("m").set(0.5)
    Gauge("vllm:time_to_first_token_seconds_sum", "", registry=registry).set(9)  # not needed: not sent
    queries: list[list[str]] = []

    async def metrics(request: web.Request) -> web.Response:
        names = request.query.getall("name[]", [])
        queries.append(names)
        # What prometheus_client's exposition apps do with ?name[]=.
        body = generate_latest(registry.restricted_registry(names) if names else registry)
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/metrics/", metrics)  # prometheus_client's app: vLLM 0.32 mounts it at /metrics/
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    endpoint = parse_endpoint(f"127.0.0.1:{runner.addresses[0][1]}")
    datastore = Datastore([endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        metrics = datastore.endpoints()[0].metrics
        assert (metrics.waiting_queue_size, metrics.kv_cache_usage) == (5, 0.5)
        assert queries[0] == list(builtin_engines()["vllm"].metric_names())
    finally:
        await scraper.stop()
        await runner.cleanup()


@pytest.mark.parametrize(
    "refusal",
    [
        pytest.param(lambda: web.Response(status=400, text="unknown parameter"), id="http-error"),
        pytest.param(lambda: web.Response(body=b"# nothing here\n"), id="nothing-usable"),
    ],
)
async def test_a_server_that_refuses_the_name_filter_gets_whole_page_requests(
    fake: FakeServer, scrape_metrics: ScrapeMetrics, refusal: Callable[[], web.StreamResponse]
) -> None:
    whole = fake.respond
    fake.respond = lambda: refusal() if fake.queries[-1] else whole()
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7
        await until(lambda: len(fake.queries) >= 4)
        assert fake.queries[0] != "" and set(fake.queries[1:]) == {""}  # asked once with the filter, then whole pages
        for reason in ("http_status", "missing_metrics"):
            assert _errors(scrape_metrics, fake.endpoint.name, reason) == 0  # a fallback, not an error
    finally:
        await scraper.stop()


async def test_a_transient_server_error_keeps_the_name_filter(fake: FakeServer, scrape_metrics: ScrapeMetrics) -> None:
    whole = fake.respond
    failures = iter(range(2))
    fake.respond = lambda: web.Response(status=503) if next(failures, None) is not None else whole()
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        await until(lambda: len(fake.queries) >= 4)
        assert all(query != "" for query in fake.queries)  # every scrape still asks for the few metrics it reads
        assert _errors(scrape_metrics, fake.endpoint.name, "http_status") == 2
    finally:
        await scraper.stop()


async def test_a_server_that_closes_every_connection_is_scraped_without_errors(
    fake: FakeServer, scrape_metrics: ScrapeMetrics
) -> None:
    fake.respond = lambda: web.Response(body=VLLM_PAGE, headers={"Connection": "close"})
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    name = fake.endpoint.name
    try:
        await until(lambda: fake.requests >= 4)
        assert len(fake.connections) >= 3  # a new connection for each scrape
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7
        assert all(_errors(scrape_metrics, name, reason) == 0 for reason in REASONS)
    finally:
        await scraper.stop()


async def test_https_with_the_certificate_unverified_by_default(
    tmp_path: Path, scrape_metrics: ScrapeMetrics
) -> None:
    import ssl

    from epp.server.tls import self_signed_certificate

    certificate, key = self_signed_certificate()
    (tmp_path / "cert.pem").write_bytes(certificate)
    (tmp_path / "key.pem").write_bytes(key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server = FakeServer()
    app = web.Application()
    app.router.add_get("/metrics", server.handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    server.port = runner.addresses[0][1]
    datastore = Datastore([server.endpoint])
    scraper = await running(datastore, scrape_metrics, replace(FAST, scheme="https"))
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7
        await until(lambda: server.requests >= 4)
        assert len(server.connections) == 1  # keep-alive over TLS too
    finally:
        await scraper.stop()
        await runner.cleanup()


def test_a_result_becomes_the_datastore_metrics_field_by_field() -> None:
    from epp.datalayer.scraper import _metrics

    result = ScrapeResult(
        "pod", 7, 3, 0.25, frozenset({"a"}), frozenset({"w"}), 4, 16, 1000, 12.5, False, "why", "missing_metrics", 16_000
    )
    metrics = _metrics(result)
    # Every field of Metrics comes from the field of the same name (values all differ from the defaults).
    for field in fields(Metrics):
        assert getattr(metrics, field.name) == getattr(result, field.name) != getattr(Metrics(), field.name), field.name


async def test_an_unknown_engine_label_falls_back_to_the_default_names_with_one_warning(
    fake: FakeServer, scrape_metrics: ScrapeMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    labels = {ENGINE_TYPE_LABEL: "tgi"}
    datastore = Datastore([Endpoint(f"pod-{i}", "127.0.0.1", fake.port, labels=labels) for i in range(2)])
    with caplog.at_level("WARNING", logger="epp.datalayer.scraper"):
        scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: all(not endpoint.metrics.stale for endpoint in datastore.endpoints()))
        assert {endpoint.metrics.waiting_queue_size for endpoint in datastore.endpoints()} == {7}  # vLLM's names
        warnings = [record.getMessage() for record in caplog.records if "unknown engine type" in record.getMessage()]
        assert len(warnings) == 1 and "'tgi'" in warnings[0] and "using vllm metric names" in warnings[0]
    finally:
        await scraper.stop()


# The whole page: more metric families than the six the vLLM mapping asks for, as vLLM's /metrics serves.
_WHOLE_PAGE = VLLM_PAGE + (
    b"# HELP python_gc_objects_collected_total Objects collected during gc\n"
    b"# TYPE python_gc_objects_collected_total counter\n"
    b'python_gc_objects_collected_total{generation="0"} 1234.0\n'
    b"# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
    b"# TYPE process_cpu_seconds_total counter\n"
    b"process_cpu_seconds_total 12.5\n"
)


def _filter_ignored(scrape_metrics: ScrapeMetrics, endpoint: str) -> float:
    value = scrape_metrics.registry.get_sample_value("epp_endpoint_scrape_filter_ignored_total", {"endpoint": endpoint})
    return value or 0.0


async def test_against_the_simulator_vllm_pods_are_asked_filtered_pages_at_metrics_slash(
    scrape_metrics: ScrapeMetrics,
) -> None:
    # The simulator, as vLLM 0.32, honours ?name[]= on /metrics/ only (issue 13).
    config = EngineConfig(time_scale=0.05, num_gpu_blocks=4096, max_model_len=8192)
    async with SimulatedPool(1, config) as pool:
        datastore = Datastore([parse_endpoint(f"127.0.0.1:{pool.ports[0]}")])
        scraper = await running(datastore, scrape_metrics)
        try:
            await until(lambda: scrape_metrics.registry.get_sample_value("epp_endpoint_scrapes_total") >= 5)
            name = datastore.endpoints()[0].name
            loop = scraper.loops.endpoints[name]  # type: ignore[union-attr]  # in process: ScrapeLoops
            assert loop.path.startswith("/metrics/?name[]=vllm:num_requests_waiting&")
            assert _filter_ignored(scrape_metrics, name) == 0
            assert datastore.endpoints()[0].metrics.num_gpu_blocks == 4096
        finally:
            await scraper.stop()


async def test_a_page_that_ignored_the_filter_is_read_counted_logged_once_then_asked_whole(
    fake: FakeServer, scrape_metrics: ScrapeMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    # The fake answers every query with the whole vLLM page, as vLLM's /metrics does.
    fake.respond = lambda: web.Response(body=_WHOLE_PAGE)
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    name = fake.endpoint.name
    try:
        with caplog.at_level("WARNING", logger="epp.datalayer.loops"):
            await until(lambda: len(fake.queries) >= 5)
        assert fake.queries[0] != "" and set(fake.queries[1:]) == {""}  # filtered once, whole pages since
        assert fake.paths[0] == "/metrics/" and set(fake.paths[1:]) == {"/metrics"}
        assert datastore.endpoints()[0].metrics.waiting_queue_size == 7  # the first page was read all the same
        assert _filter_ignored(scrape_metrics, name) == 1
        assert all(_errors(scrape_metrics, name, reason) == 0 for reason in REASONS)  # a fallback, not an error
        warnings = [r.getMessage() for r in caplog.records if "ignored the metrics name filter" in r.getMessage()]
        assert len(warnings) == 1 and name in warnings[0] and "/metrics/?name[]=..." in warnings[0]
    finally:
        await scraper.stop()


async def test_the_filter_ignored_is_counted_across_the_worker_process(
    fake: FakeServer, scrape_metrics: ScrapeMetrics
) -> None:
    fake.respond = lambda: web.Response(body=_WHOLE_PAGE)
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics, in_process=False)
    try:
        await until(lambda: len(fake.queries) >= 4, timeout=10)
        await until(lambda: _filter_ignored(scrape_metrics, fake.endpoint.name) == 1)
        assert set(fake.queries[1:]) == {""}
    finally:
        await scraper.stop()


async def test_a_redirect_of_the_filter_path_gets_whole_page_requests(
    fake: FakeServer, scrape_metrics: ScrapeMetrics
) -> None:
    whole = fake.respond
    fake.respond = lambda: web.Response(status=307, headers={"Location": "/metrics"}) if fake.queries[-1] else whole()
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics)
    try:
        await until(lambda: not datastore.endpoints()[0].metrics.stale)
        await until(lambda: len(fake.queries) >= 4)
        assert set(fake.queries[1:]) == {""}
        assert all(_errors(scrape_metrics, fake.endpoint.name, reason) == 0 for reason in REASONS)
    finally:
        await scraper.stop()


async def test_a_user_given_path_is_asked_as_given(fake: FakeServer, scrape_metrics: ScrapeMetrics) -> None:
    fake.respond = lambda: web.Response(body=_WHOLE_PAGE)
    datastore = Datastore([fake.endpoint])
    scraper = await running(datastore, scrape_metrics, replace(FAST, path="/metrics/"))
    try:
        await until(lambda: len(fake.queries) >= 3)
        assert set(fake.paths) == {"/metrics/"}  # filtered first (ignored by the fake), then whole, both there
        assert fake.queries[0] != "" and set(fake.queries[1:]) == {""}
    finally:
        await scraper.stop()


async def test_against_the_simulator_a_128_token_block_pod_reports_its_cache_in_tokens(
    scrape_metrics: ScrapeMetrics,
) -> None:
    # vLLM on CPU uses 128-token blocks; its cache_config_info says kv_cache_size_tokens (issue 13).
    config = EngineConfig(time_scale=0.05, block_size=128, num_gpu_blocks=23, max_model_len=2048)
    async with SimulatedPool(1, config) as pool:
        datastore = Datastore([parse_endpoint(f"127.0.0.1:{pool.ports[0]}")])
        scraper = await running(datastore, scrape_metrics)
        try:
            await until(lambda: not datastore.endpoints()[0].metrics.stale)
            metrics = datastore.endpoints()[0].metrics
            assert (metrics.block_size, metrics.num_gpu_blocks, metrics.kv_cache_size_tokens) == (128, 23, 2944)
            assert metrics.cache_tokens == 2944 and metrics.error is None
        finally:
            await scraper.stop()
