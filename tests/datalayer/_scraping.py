"""What the scrape tests share: a model server that misbehaves on demand, fast settings, waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

from aiohttp import web

from epp.datalayer.datastore import Datastore
from epp.datalayer.engines import builtin_engines
from epp.datalayer.loops import ScrapeSettings
from epp.datalayer.metrics import ScrapeMetrics
from epp.datalayer.scraper import Scraper
from epp.datalayer.static import parse_endpoint
from epp.framework import Endpoint

FAST = ScrapeSettings(interval=0.02, staleness=0.3, timeout=0.15)

VLLM_PAGE = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",waiting_lora_adapters="a2"} 1.7e9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0
"""


@dataclass
class FakeServer:
    """A model server whose /metrics behaviour a test changes on the fly."""

    respond: Callable[[], web.StreamResponse] = lambda: web.Response(body=VLLM_PAGE)
    delay: float = 0.0
    queries: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    connections: set[object] = field(default_factory=set)
    requests: int = 0
    times: list[float] = field(default_factory=list)  # time.monotonic() of each request's arrival
    port: int = 0
    runner: web.AppRunner | None = None

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.times.append(time.monotonic())
        self.queries.append(request.query_string)
        self.paths.append(request.path)
        self.connections.add(request.transport)
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.respond()

    @property
    def endpoint(self) -> Endpoint:
        return parse_endpoint(f"127.0.0.1:{self.port}")


async def running(
    datastore: Datastore, scrape_metrics: ScrapeMetrics, settings: ScrapeSettings = FAST, *, in_process: bool = True
) -> Scraper:
    scraper = Scraper(datastore, builtin_engines(), settings, scrape_metrics, in_process=in_process)
    await scraper.start()
    return scraper


async def until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


class RawServer:
    """A plain TCP server on 127.0.0.1 for the scrape tests that need bytes no HTTP framework sends; a
    subclass says what each connection gets (``_serve``). ``async with`` starts and stops it."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
