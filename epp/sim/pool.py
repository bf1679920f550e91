"""Simulated pods on real sockets: one engine and one HTTP server per pod, many pods in one event loop."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from types import TracebackType

from aiohttp import web

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.faults import RequestRecorder
from epp.sim.server import build_app

__all__ = ["SimulatedPod", "SimulatedPool"]

_SHUTDOWN_TIMEOUT_S = 5.0  # handlers end as soon as the engine aborts their requests; this only bounds stragglers


class SimulatedPod:
    """One simulated vLLM pod: an :class:`~epp.sim.engine.Engine` served over HTTP on ``host:port``.

    ``port=0`` picks an ephemeral port; :attr:`port` holds the real one once started. ``fault_control`` and
    ``record`` (a file to append to) are the test-only switches of :mod:`epp.sim.faults`.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        name: str = "pod-0",
        host: str = "127.0.0.1",
        port: int = 0,
        fault_control: bool = False,
        record: str | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.name = name
        self.host = host
        self.port = port
        self.engine = Engine(self.config)
        self.fault_control = fault_control
        self.record = record
        self._recorder: RequestRecorder | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Start the engine and listen."""
        if self._runner is not None:
            raise RuntimeError(f"{self.name} already started")
        self.engine.start()
        if self.record is not None:
            self._recorder = RequestRecorder(self.record, self.name)
        runner = web.AppRunner(
            build_app(self.engine, self.name, fault_control=self.fault_control, recorder=self._recorder),
            access_log=None,
            handler_cancellation=True,  # a client that goes away aborts its request, as on vLLM
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            site = web.SockSite(runner, sock)
            await site.start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            await self.engine.stop()
            self._close_recorder()
            raise
        self.port = sock.getsockname()[1]
        self._runner = runner

    async def stop(self) -> None:
        """Shut down, in this order:

        1. stop accepting connections;
        2. stop the engine, aborting unfinished requests (their handlers answer 503 or end their stream);
        3. close the HTTP server and its connections.
        """
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for site in list(runner.sites):
            await site.stop()
        await self.engine.stop()
        await runner.cleanup()
        self._close_recorder()

    def _close_recorder(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None


class SimulatedPool:
    """``n`` simulated pods named ``pod-0`` .. ``pod-{n-1}`` (or ``names``); an async context manager.

    ``config`` is shared by every pod, or given per pod as a sequence of length ``n``. With ``base_port=0``
    every pod gets an ephemeral port, otherwise pod ``i`` listens on ``base_port + i``. ``fault_control``
    and ``record`` (one file for every pod's lines): see :class:`SimulatedPod`.
    """

    def __init__(
        self,
        n: int = 1,
        config: EngineConfig | Sequence[EngineConfig] | None = None,
        *,
        base_port: int = 0,
        host: str = "127.0.0.1",
        names: Sequence[str] | None = None,
        fault_control: bool = False,
        record: str | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"a pool needs at least one pod, got {n}")
        if config is None or isinstance(config, EngineConfig):
            configs: Sequence[EngineConfig] = [config or EngineConfig()] * n
        else:
            configs = config
        if len(configs) != n:
            raise ValueError(f"{len(configs)} configs for {n} pods")
        if names is None:
            names = [f"pod-{i}" for i in range(n)]
        if len(names) != n:
            raise ValueError(f"{len(names)} names for {n} pods")
        self.pods = [
            SimulatedPod(c, name=name, host=host, port=base_port + i if base_port else 0,
                         fault_control=fault_control, record=record)
            for i, (c, name) in enumerate(zip(configs, names, strict=True))
        ]
        engines = tuple(p.engine for p in self.pods)
        for engine in engines:
            engine.peers = engines

    @property
    def ports(self) -> list[int]:
        """The real ports, in pod order (after :meth:`start`)."""
        return [p.port for p in self.pods]

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.pods]

    def url(self, i: int) -> str:
        """Base URL of pod ``i``."""
        return self.pods[i].url

    def __len__(self) -> int:
        return len(self.pods)

    def __getitem__(self, i: int) -> SimulatedPod:
        return self.pods[i]

    def __iter__(self) -> Iterator[SimulatedPod]:
        return iter(self.pods)

    async def start(self) -> None:
        """Start every pod; if one fails, stop those already started and re-raise."""
        started: list[SimulatedPod] = []
        try:
            for pod in self.pods:
                await pod.start()
                started.append(pod)
        except BaseException:
            for pod in started:
                await pod.stop()
            raise

    async def stop(self) -> None:
        """Stop every pod."""
        for pod in self.pods:
            await pod.stop()

    async def __aenter__(self) -> SimulatedPool:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
