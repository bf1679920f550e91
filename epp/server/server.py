"""The running service: gRPC ext_proc + health servers, metrics, and their lifecycle.

:class:`EndpointPicker` wires the pieces (datastore -> scheduler -> director -> ext_proc servicer)
and owns every server. :func:`serve` runs one until SIGTERM/SIGINT (or ``shutdown_trigger``).

Admission (:mod:`epp.flowcontrol`) sits in the director: the config's detector and flow-control
settings build it, its metrics go to the service's registry, and it is woken on every metrics
update and pool change (and by the director when a response ends). InferenceObjectives come from
the config file and, with an InferencePool, from the cluster (:mod:`epp.kube.objectives`).

Health (the standard ``grpc.health.v1`` service) is served on the health port, plaintext, for the
kubelet's gRPC probes, and on the main port too, over the same TLS as ext_proc, for Envoy's
active health check. Services: ``liveness`` (SERVING while the process runs), ``readiness``,
``envoy.service.ext_proc.v3.ExternalProcessor`` and ``""`` (SERVING only while the pool has an
endpoint that has answered a metrics scrape, or any endpoint when scraping is off, and the picker is
not shutting down: a pod that never answered is not known to serve, and requests sent there fail).
``inference_pool_ready_pods`` counts the same endpoints. With flow control on, an empty pool is ready too:
requests then wait in the queue for a pod (``noEndpointRequestTTL``), which is how a pool scaled
to zero is woken, instead of Envoy failing them before they reach the picker.

With ``--workers N`` (:mod:`epp.server.workers`) this process is the owner: it binds the ext_proc
port and N worker processes serve it, routing every request through this process's director; the
health statuses set here are mirrored to them (Envoy's health check reaches a worker).

The metrics port is guarded by ``--metrics-endpoint-auth`` (:mod:`epp.server.metrics_auth`) when
the pool comes from Kubernetes: the reviews go through discovery's API client, on this event loop.

Shutdown, in order:
 1. every health service but liveness goes NOT_SERVING (load balancers stop sending new streams);
 2. admission closes: queued requests are answered 503 (``rejected-shutting-down``) at once, and
    new ones too (they would otherwise wait out the grace period for nothing); health Watches end
    (UNAVAILABLE), as they would otherwise hold the drain for its whole grace;
 3. the ext_proc server stops accepting streams and in-flight ones get ``shutdown_grace_seconds``
    to finish; any still open after that are cancelled (with ``--workers``, each worker drains so
    and exits);
 4. the health server stops, discovery's watches and the scrape loops are cancelled and awaited;
    the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from epp.datalayer.datastore import Datastore
from epp.datalayer.engines import ENGINE_TYPE_LABEL, EngineMapping, builtin_engines, engine_from_config
from epp.datalayer.metrics import ScrapeMetrics
from epp.datalayer.poolmetrics import PoolCollector
from epp.datalayer.scraper import Scraper, ScrapeSettings
from epp.datalayer.served import ModelPoller
from epp.extproc.processor import ExternalProcessor
from epp.flowcontrol import FlowControlMetrics, build_admission
from epp.flowcontrol.objectives import Objectives
from epp.framework import Endpoint, Handle, PluginMetrics, ResponseReceived
from epp.framework.roles import reads_body
from epp.kube.discovery import Discovery
from epp.kube.pods import PoolSpec
from epp.requestcontrol.director import Director
from epp.requestcontrol.metrics import StreamMetrics
from epp.requestcontrol.tracing import Tracing
from epp.scheduling.config import PickerConfig, load_config
from epp.scheduling.registry import load_registry
from epp.server.debug import DebugViews
from epp.server.metrics import Metrics, start_metrics_server
from epp.server.metrics_auth import MetricsAuth
from epp.server.process import freeze_startup_objects
from epp.server.settings import Settings
from epp.server.tls import (
    CertificateReloader,
    apply_policy,
    metrics_ssl_context,
    self_signed_certificate,
    server_ssl_context,
    ssl_context_from_pem,
    tls_policy,
)
from epp.server.workers import WorkerPool, WorkerSpec
from epp.wire.health import NOT_SERVING, SERVING, Health
from epp.wire.server import GrpcServer, bind_socket

__all__ = ["EXT_PROC_SERVICE", "EndpointPicker", "StartupError", "serve"]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# "inference-extension": the service the upstream chart's single-replica probes ask for.
_READINESS_SERVICES = ("", "readiness", "inference-extension", EXT_PROC_SERVICE)
# Envoy may send a whole request body in one message: leave room above the body limit for the
# message's other fields.
_MESSAGE_HEADROOM = 1024 * 1024


def _max_message(settings: Settings) -> int:
    """The largest gRPC message the ext_proc port takes: --grpc-max-recv-msg-size when given, else room
    for a whole request body of --max-request-body-bytes in one message (BUFFERED mode) and its other fields."""
    return settings.grpc_max_recv_message or settings.max_request_body_bytes + _MESSAGE_HEADROOM


class StartupError(Exception):
    """The service cannot start for a reason outside the config (a port in use, an unreadable certificate)."""


def _listen(flag: str, address: str, port: int) -> socket.socket:
    """A listening socket on ``address:port``; a StartupError naming ``flag`` and the port when it is taken.

    Never with SO_REUSEPORT: a second picker on the same port fails here instead of silently taking
    half of Envoy's streams.
    """
    try:
        return bind_socket(address, port)
    except OSError as exc:
        raise StartupError(
            f"{flag} {port}: cannot listen on {address}:{port} ({exc.strerror or exc}; in use by another process?)"
        ) from None


# Upstream's vLLM metric-name flags -> the core-metrics-extractor engineConfigs key they set.
_FLAG_KEYS = {
    "total-queued-requests-metric": "queuedRequestsSpec",
    "total-running-requests-metric": "runningRequestsSpec",
    "kv-cache-usage-percentage-metric": "kvUsageSpec",
    "lora-info-metric": "loraSpec",
    "cache-info-metric": "cacheInfoSpec",
}


def engines_from_flags(overrides: tuple[tuple[str, str], ...]) -> dict[str, EngineMapping]:
    """The built-in engine mappings, with vLLM's metric names changed by the upstream flags given."""
    engines = builtin_engines()
    if overrides:
        changes = {_FLAG_KEYS[flag]: value for flag, value in overrides}
        engines["vllm"] = engine_from_config("vllm", changes, base=engines["vllm"])
    return engines


def _scraper(settings: Settings, config: PickerConfig, datastore: Datastore, metrics: ScrapeMetrics) -> Scraper:
    """The scraper the flags and the config file's data layer describe (the config file wins)."""
    source, extractor = config.metrics_source, config.metrics_extractor
    scrape = ScrapeSettings(
        interval=settings.refresh_metrics_interval,
        staleness=settings.metrics_staleness_threshold,
        path=source.path if source else settings.model_server_metrics_path,
        scheme=source.scheme if source else settings.model_server_metrics_scheme,
        port=settings.model_server_metrics_port,
        insecure_skip_verify=source.insecure_skip_verify
        if source
        else settings.model_server_metrics_insecure_skip_verify,
        name_filter=settings.model_server_metrics_name_filter,
        idle_interval=settings.refresh_metrics_idle_interval,
    )
    return Scraper(
        datastore,
        extractor.engines if extractor else engines_from_flags(settings.metric_overrides),
        scrape,
        metrics,
        default_engine=extractor.default_engine if extractor else "vllm",
        engine_label=extractor.engine_label_key if extractor else ENGINE_TYPE_LABEL,
        in_process=not settings.metrics_scraper_process,
    )


def _discovery(settings: Settings, datastore: Datastore, objectives: Objectives) -> Discovery:
    """The discovery the flags ask for: the Pods --endpoint-selector matches if given, else the InferencePool."""
    spec = None
    if settings.endpoint_selector:
        spec = PoolSpec(selector=settings.endpoint_selector, target_ports=settings.endpoint_target_ports)
    return Discovery(
        datastore,
        namespace=settings.pool_namespace,
        pool_name="" if spec else settings.pool_name,
        spec=spec,
        kubeconfig=settings.kubeconfig,
        objectives=objectives,
    )


class EndpointPicker:
    """One picker: build it, ``await start()``, ``await stop()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.datastore = Datastore(settings.endpoints)
        registry = load_registry(settings.disabled_plugins, log_sources=True)
        config = load_config(
            settings.config_text,
            registry,
            Handle(self.datastore, metrics=PluginMetrics(self.metrics.registry)),
            metrics=self.metrics.plugins,
            feature_gates=settings.feature_gates,
        )
        for name, (type_name, _) in config.plugins.items():
            log.info("plugin %s: type %s from %s", name, type_name, registry.source(type_name))
        self.scheduler = config.scheduler
        self.config = config
        assert config.detector is not None  # load_config always chooses one
        self.detector = config.detector
        self.flow_control_metrics = FlowControlMetrics(self.metrics.registry, settings.pool_label)
        self.metrics.registry.register(PoolCollector(self.datastore.endpoints, settings.pool_label))
        self.admission = build_admission(
            config.admission, self.detector, self.datastore.endpoints, metrics=self.flow_control_metrics
        )
        self.objectives = Objectives(config.objectives)
        log.info(
            "admission: flow control %s, saturation detector %s%s",
            "on" if config.admission.flow_control_enabled else "off",
            getattr(self.detector, "type_name", type(self.detector).__name__),
            f", {len(config.objectives)} configured objective(s)" if config.objectives else "",
        )
        self.tracing = _tracing(settings)
        self.director = Director(
            self.datastore,
            self.scheduler,
            self.metrics.requests,
            admission=self.admission,
            objectives=self.objectives,
            tracing=self.tracing,
            emit_scores=settings.emit_endpoint_scores,
        )
        # --enable-grpc-stream-metrics: upstream's ext_proc stream series (a worker's streams are counted here too).
        self.streams = StreamMetrics(self.metrics.registry) if settings.grpc_stream_metrics else None
        self.processor = ExternalProcessor(
            self.director,
            self.metrics.requests,
            max_request_body_bytes=settings.max_request_body_bytes,
            subset_filter=settings.subset_filter,
            streams=self.streams,
        )
        # The scrape series are served whether scraping is on or not (a counter at 0 when it is off).
        scrape_metrics = ScrapeMetrics(self.metrics.registry)
        self.scraper: Scraper | None = None
        if settings.scrape_metrics:
            self.scraper = _scraper(settings, config, self.datastore, scrape_metrics)
        # What each pod serves (GET /v1/models every 30 s): the served-model filter, base models, GET /v1/models.
        self.models: ModelPoller | None = ModelPoller(self.datastore) if settings.scrape_metrics else None
        # Kubernetes discovery fills the datastore; None for a static pool.
        self.discovery = _discovery(settings, self.datastore, self.objectives) if settings.kube_discovery else None
        # Capacity may have changed: a queued request may go (cheap when nothing is queued).
        self.datastore.on_metrics(lambda name: self.admission.wake())
        self.datastore.subscribe(lambda added, removed: self.admission.wake())
        self._answered: set[str] = set()  # endpoints that have answered a scrape: see _update_readiness
        if self.scraper is not None:
            self.datastore.on_metrics(self._first_answer)
        # --workers: the ext_proc port is served by worker processes that route through this one.
        self.workers: WorkerPool | None = None
        if settings.workers:
            self.workers = WorkerPool(
                settings.workers,
                self.director,
                self._worker_spec,
                endpoints=self.datastore.endpoints,
                registry=self.metrics.registry,
                tracing=self.tracing,
                streams=self.streams,
            )
        self.health = self.workers.health if self.workers is not None else Health()
        self._pem: tuple[bytes, bytes] = (b"", b"")  # a self-signed pair the workers serve too
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._reloading: asyncio.Task[None] | None = None  # --enable-cert-reload's watch
        self._server: GrpcServer | None = None
        self._health_server: GrpcServer | None = None
        self._sockets: tuple[socket.socket, ...] = ()
        self.grpc_port = 0
        self.grpc_health_port = 0
        self.metrics_port = 0  # the port /metrics really listens on (0: none)

    async def start(self) -> None:
        settings = self.settings
        if self.discovery is not None:
            await self.discovery.connect()  # a bad kubeconfig stops startup here, before anything runs
        context = None
        if settings.secure_serving:
            try:
                if self.workers is not None and not settings.cert_path:
                    self._pem = self_signed_certificate()  # one certificate for every worker
                    context = ssl_context_from_pem(*self._pem)
                else:
                    context = server_ssl_context(settings.cert_path)
                apply_policy(context, tls_policy(settings.tls_min_version, settings.tls_cipher_suites))
            except ValueError as exc:
                raise StartupError(str(exc)) from None
        main = _listen("--grpc-port", settings.bind_address, settings.grpc_port)
        try:
            health_socket = _listen("--grpc-health-port", settings.bind_address, settings.grpc_health_port)
        except StartupError:
            main.close()
            raise
        self._sockets = (main, health_socket)
        self.grpc_port = main.getsockname()[1]
        self.grpc_health_port = health_socket.getsockname()[1]
        if self.workers is None:
            self._server = GrpcServer(
                {**self.processor.methods(), **self.health.methods()},
                ssl_context=context,
                max_message=_max_message(settings),
                flag=f"--grpc-port {self.grpc_port}",
                io_thread=settings.io_thread,
                io_thread_after_chunks=settings.io_thread_after_chunks,
                native_tls=settings.native_tls,
            )
        self._health_server = GrpcServer(
            self.health.methods(), flag=f"--grpc-health-port {self.grpc_health_port}", io_thread=False
        )
        # Every port is bound before anything else starts (the scrape worker, discovery's watches),
        # so a clash stops startup with nothing to clean up.
        if settings.metrics_port >= 0:
            try:
                routes = DebugViews(self.datastore.endpoints, self.config, settings.config_text).routes()
                if self.workers is not None:
                    routes["/debug/workers"] = self._workers_view
                tls = None
                if settings.metrics_cert_dir:
                    try:
                        tls = metrics_ssl_context(settings.metrics_cert_dir, settings.metrics_client_ca_file)
                    except ValueError as exc:
                        for sock in self._sockets:
                            sock.close()
                        raise StartupError(str(exc)) from None
                self.metrics_port = start_metrics_server(
                    self.metrics,
                    settings.metrics_port,
                    settings.bind_address,
                    routes=routes if settings.enable_debug_endpoints else None,
                    guard=self._metrics_guard(),
                    tls=tls,
                )
            except OSError as exc:
                for sock in self._sockets:
                    sock.close()
                raise StartupError(
                    f"--metrics-port {settings.metrics_port}: cannot listen on "
                    f"{settings.bind_address}:{settings.metrics_port} ({exc.strerror or exc})"
                ) from None

        if self.workers is not None:
            try:
                await self.workers.start(main)
            except (RuntimeError, OSError) as exc:
                for sock in self._sockets:
                    sock.close()
                raise StartupError(f"--workers {settings.workers}: {exc}") from None
        if self.scraper is not None:
            await self.scraper.start()
        if self.models is not None:
            self.models.start()
        self.health.set("liveness", SERVING)
        self.datastore.subscribe(self._pool_changed)
        await self._update_readiness()
        if self.discovery is not None:
            await self.discovery.start()  # lists and watches in the background; readiness waits for its first sync
        if self._server is not None:
            self._server.serve_socket(self._sockets[0])
        self._health_server.serve_socket(self._sockets[1])
        if context is not None and settings.cert_reload and settings.cert_path and self.workers is None:
            # (with --workers, each worker watches for its own context: epp.server.workers)
            self._reloading = asyncio.get_running_loop().create_task(
                CertificateReloader(context, settings.cert_path).run()
            )
        log.info(
            "serving ext_proc on %s:%d (%s), health on :%d, metrics on :%d; pool has %d endpoint(s)",
            settings.bind_address,
            self.grpc_port,
            "TLS" if settings.secure_serving else "plaintext",
            self.grpc_health_port,
            self.metrics_port,  # the port bound (--metrics-port 0 picks one)
            len(self.datastore.endpoints()),
        )

    def _worker_spec(self, index: int) -> WorkerSpec:
        settings = self.settings
        cert, key = self._pem
        return WorkerSpec(
            index=index,
            max_request_body_bytes=settings.max_request_body_bytes,
            max_message=_max_message(settings),
            flag=f"--grpc-port {self.grpc_port}",
            tls=settings.secure_serving,
            io_thread=settings.io_thread,
            io_thread_after_chunks=settings.io_thread_after_chunks,
            native_tls=settings.native_tls,
            cert_path=settings.cert_path,
            cert_reload=settings.cert_reload,
            tls_min_version=settings.tls_min_version,
            tls_cipher_suites=list(settings.tls_cipher_suites),
            subset_filter=settings.subset_filter,
            cert_pem=cert,
            key_pem=key,
            tracing=settings.tracing,
            verbosity=settings.verbosity,
            log_floor=settings.log_floor,
            log_format=settings.log_format,
            log_time_encoding=settings.log_time_encoding,
            log_stacks_from=settings.log_stacks_from,
            # A plugin's response_received hook may set response headers: the workers wait for them.
            wait_for_headers=any(isinstance(plugin, ResponseReceived) for _, plugin in self.config.plugins.values()),
            # A plugin reads the request as received (a tokenizer): it goes to the owner with the request.
            send_body=any(reads_body(plugin) for _, plugin in self.config.plugins.values()),
            stream_metrics=self.streams is not None,
        )

    def _workers_view(self) -> bytes:
        assert self.workers is not None
        workers = self.workers
        view = {"workers": workers.view(), "accepted": workers.accepted, "rebalances": workers.rebalances}
        return json.dumps(view, indent=1).encode()

    def _metrics_guard(self) -> Callable[[dict[str, Any]], Any] | None:
        """The metrics port's check (--metrics-endpoint-auth): with discovery only, a static pool has no API server."""
        if not self.settings.metrics_endpoint_auth:
            return None
        if self.discovery is None or self.discovery.client is None:
            log.info(
                "metrics endpoint auth is off: a static pool has no Kubernetes API server to review tokens "
                "(--metrics-endpoint-auth applies with --pool-name or --endpoint-selector)"
            )
            return None
        auth = MetricsAuth.for_client(self.discovery.client, asyncio.get_running_loop())
        log.info(
            "metrics endpoint auth is on: the metrics port needs a bearer token the API server accepts and "
            "whose user may get the path (TokenReview, SubjectAccessReview; --metrics-endpoint-auth=false to turn off)"
        )
        return auth.wsgi_guard

    async def shut_down(self) -> None:
        """What SIGTERM does: the --drain-timeout window (if any), then :meth:`stop` with the grace period."""
        drain = self.settings.drain_seconds
        if drain > 0:
            await self.not_serving()
            log.info("--drain-timeout: not ready, still serving new streams for %.0fs", drain)
            await asyncio.sleep(drain)
        log.info("draining in-flight streams for up to %.0fs", self.settings.shutdown_grace_seconds)
        await self.stop()

    async def not_serving(self) -> None:
        """Readiness NOT_SERVING from now on (so that the gateway and Kubernetes send elsewhere), while
        every port goes on serving: upstream's --drain-timeout window, before :meth:`stop`."""
        self._stopping = True
        await self._update_readiness()

    async def stop(self, grace: float | None = None) -> None:
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        await self.not_serving()  # 1. NOT_SERVING
        if self._reloading is not None:
            self._reloading.cancel()
        self.admission.close()  # 2. queued requests: 503 rejected-shutting-down
        self.health.stop()  # health Watches end now (UNAVAILABLE): they would hold the drain for its grace
        if self._server is not None:
            await self._server.stop(grace)  # 3. drain in-flight streams
        if self.workers is not None:
            await self.workers.stop(grace)  # 3. each worker drains its streams, then exits
            self._sockets[0].close()
        if self._health_server is not None:
            await self._health_server.stop(0)  # 4.
        if self.discovery is not None:
            await self.discovery.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        if self.models is not None:
            await self.models.stop()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans exported
        log.info("stopped")

    def _pool_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        task = asyncio.get_running_loop().create_task(self._update_readiness())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _first_answer(self, name: str) -> None:
        # On the scraper's path, for every update: a set lookup unless an endpoint answers for the first time.
        if name in self._answered:
            return
        endpoint = self.datastore.get(name)
        if endpoint is not None and endpoint.metrics.updated_at:
            self._answered.add(name)
            self._pool_changed((), ())

    async def _update_readiness(self) -> None:
        synced = self.discovery is None or self.discovery.synced
        endpoints = self.datastore.endpoints()
        if self.scraper is not None:  # only endpoints that have answered a scrape (updated_at: its time)
            endpoints = tuple(e for e in endpoints if e.metrics.updated_at)
            self._answered = {e.name for e in endpoints}
        has_pool = bool(endpoints) or self.config.admission.flow_control_enabled  # see the module docstring
        ready = has_pool and synced and not self._stopping
        self.metrics.ready_pods.labels(self.settings.pool_label).set(len(endpoints))
        for service in _READINESS_SERVICES:
            self.health.set(service, SERVING if ready else NOT_SERVING)


def _tracing(settings: Settings) -> Tracing | None:
    """The process's tracer with ``--tracing=true``; None (nothing of OpenTelemetry loaded) without."""
    if not settings.tracing:
        return None
    tracing = Tracing()
    log.info(
        "tracing on: %s exporter, service %s (OTEL_* environment variables)", tracing.exporter, tracing.service_name
    )
    return tracing


async def serve(
    settings: Settings, *, shutdown_trigger: Callable[[], Awaitable[None]] | None = None, freeze: bool = False
) -> None:
    """Run a picker until SIGTERM/SIGINT (or until ``shutdown_trigger()`` returns), then stop it gracefully.
    ``freeze``: :func:`freeze_startup_objects` once it has started."""
    picker = EndpointPicker(settings)
    await picker.start()
    if freeze:
        freeze_startup_objects()
    if shutdown_trigger is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received")
    else:
        await shutdown_trigger()
    await picker.shut_down()
