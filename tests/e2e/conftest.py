"""Fixtures for end-to-end tests: a real Envoy, echo backends and an in-process picker on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest

from epp.datalayer.static import parse_endpoints
from epp.envoy.bootstrap import BootstrapOptions, render
from epp.framework import Endpoint, InferenceRequest, SchedulingResult
from epp.server.server import EndpointPicker
from epp.sim import EngineConfig, SimulatedPool
from epp.testing.backends import EchoServer, start_echo_servers
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import wait_for_picker
from tests.pickers import loopback_settings


class RecordingScheduler:
    """Wraps the configured scheduler and remembers each pick by x-request-id."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.picks: dict[str, list[Endpoint]] = {}

    def run(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> SchedulingResult:
        result = self.inner.run(request, candidates)
        self.picks[request.request_id] = result.endpoints
        return result

    def __getattr__(self, name: str) -> Any:  # the lifecycle hooks
        return getattr(self.inner, name)


@dataclass
class Stack:
    envoy: EnvoyProcess
    picker: EndpointPicker | None
    backends: list[EchoServer]
    recorder: RecordingScheduler | None
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    def backend_by_port(self, port: int) -> EchoServer:
        return next(b for b in self.backends if b.port == port)


@pytest.fixture
async def backends() -> AsyncIterator[list[EchoServer]]:
    servers = await start_echo_servers(3, token_interval=0.05)
    yield servers
    for server in servers:
        await server.stop()


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack(backends: list[EchoServer]) -> AsyncIterator[StackFactory]:
    """Build Envoy + picker + backends; every piece is stopped at teardown."""
    envoys: list[EnvoyProcess] = []
    pickers: list[EndpointPicker] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(
        *,
        picker: bool = True,
        tls: bool = False,
        fail_open: bool = False,
        request_body_mode: str = "FULL_DUPLEX_STREAMED",
        pool: Sequence[EchoServer] | None = None,
        config_text: str | None = None,
        max_request_body_bytes: int | None = None,
        picker_port: int | None = None,
        observe_responses: bool = False,
    ) -> Stack:
        pool = backends[:2] if pool is None else pool
        recorder = None
        running = None
        port = picker_port or 0
        if picker:
            settings = loopback_settings(
                endpoints=tuple(parse_endpoints(",".join(b.hostport for b in pool))),
                grpc_port=port,
                secure_serving=tls,
                config_text=config_text,
                shutdown_grace_seconds=1.0,
            )
            if max_request_body_bytes is not None:
                settings = replace(settings, max_request_body_bytes=max_request_body_bytes)
            running = EndpointPicker(settings)
            recorder = RecordingScheduler(running.scheduler)
            running.director.scheduler = recorder  # type: ignore[assignment]
            await running.start()
            pickers.append(running)
            port = running.grpc_port
        assert port, "a stack without a picker needs picker_port (an unused port)"
        options = BootstrapOptions(
            listen_address="127.0.0.1",
            listen_port=0,
            admin_port=0,
            picker_port=port,
            picker_tls=tls,
            fail_open=fail_open,
            pool_endpoints=tuple(b.hostport for b in pool),
            request_body_mode=request_body_mode,
            observe_responses=observe_responses,
        )
        envoy = EnvoyProcess(render(options), concurrency=1)
        envoys.append(envoy)
        await asyncio.to_thread(envoy.start)
        await asyncio.to_thread(wait_for_picker, envoy, healthy=picker)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        sessions.append(session)
        return Stack(envoy=envoy, picker=running, backends=backends, recorder=recorder, session=session)

    yield make
    for session in sessions:
        await session.close()
    for envoy in envoys:
        await asyncio.to_thread(envoy.stop)
    for running in pickers:
        await running.stop(0)


# -- the simulator stack: simulated vLLM pods + the picker in-process + a real Envoy ---------------


@dataclass
class SimPicker:
    pool: SimulatedPool
    picker: EndpointPicker
    envoy: EnvoyProcess

    async def stop(self) -> None:
        await asyncio.to_thread(self.envoy.stop)
        await self.picker.stop(0)
        await self.pool.stop()


async def start_sim_picker(
    configs: Sequence[EngineConfig],
    config_text: str | None = None,
    *,
    members: int | None = None,
    before_start: Callable[[EndpointPicker], None] | None = None,
    settings: Mapping[str, Any] | None = None,
    observe_responses: bool = False,
) -> SimPicker:
    """Start one simulated pod per config, the picker (static pool: the first ``members`` pods, all
    by default; scraping in-process) and an Envoy in front; return once Envoy sees the picker
    healthy and every pool member has been scraped. ``before_start`` may wrap the scheduler;
    ``settings`` overrides fields of the picker's :class:`Settings`; ``observe_responses``: Envoy's
    (:class:`BootstrapOptions`)."""
    pool = SimulatedPool(len(configs), list(configs))
    await pool.start()
    ports = pool.ports if members is None else pool.ports[:members]
    picker_settings = loopback_settings(
        endpoints=tuple(Endpoint(f"127.0.0.1:{port}", "127.0.0.1", port) for port in ports),
        config_text=config_text,
        shutdown_grace_seconds=1.0,
        metrics_scraper_process=False,
        **(settings or {}),
    )
    picker = EndpointPicker(picker_settings)
    if before_start is not None:
        before_start(picker)
    await picker.start()
    options = BootstrapOptions(
        listen_address="127.0.0.1",
        listen_port=0,
        admin_port=0,
        picker_port=picker.grpc_port,
        observe_responses=observe_responses,
    )
    envoy = EnvoyProcess(render(options), concurrency=1)
    parts = SimPicker(pool, picker, envoy)
    try:
        await asyncio.to_thread(envoy.start)
        await asyncio.to_thread(wait_for_picker, envoy)
        deadline = time.monotonic() + 15.0
        while any(e.metrics.stale for e in picker.datastore.endpoints()):
            if time.monotonic() > deadline:
                raise AssertionError("timed out waiting until every pod is scraped")
            await asyncio.sleep(0.02)
    except BaseException:
        await parts.stop()
        raise
    return parts
