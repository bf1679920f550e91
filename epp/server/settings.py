"""The frozen settings of one picker process, built from the command line (see :mod:`epp.server.cli`).

Configuration flows one way: flags -> :class:`Settings` -> the config file decoded strictly ->
plugins -> a frozen scheduler. Nothing reads flags or the environment after this point.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import Endpoint

__all__ = ["DEFAULT_MAX_REQUEST_BODY_BYTES", "Settings"]

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Settings:
    endpoints: tuple[Endpoint, ...] = ()
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    enable_debug_endpoints: bool = False  # /debug/pool and /debug/config on the metrics port
    # TokenReview + SubjectAccessReview for the metrics port (epp.server.metrics_auth); only with discovery.
    metrics_endpoint_auth: bool = True
    metrics_cert_dir: str = ""  # HTTPS on the metrics port from tls.crt/tls.key here (--metrics-cert-dir)
    metrics_client_ca_file: str = ""  # and client certificates this CA signed required (--metrics-client-ca-file)
    bind_address: str = "0.0.0.0"
    secure_serving: bool = True
    cert_path: str = ""  # a directory holding tls.crt and tls.key; empty: self-signed at start
    cert_reload: bool = False  # serve cert_path's pair anew when it changes (epp.server.tls.CertificateReloader)
    tls_min_version: str = ""  # upstream's --tls-min-version (Go's name; epp.server.tls.tls_policy)
    tls_cipher_suites: tuple[str, ...] = ()  # upstream's --tls-cipher-suites (Go's names)
    subset_filter: bool = True  # honour the gateway's endpoint subset hint (--disable-endpoint-subset-filter)
    emit_endpoint_scores: bool = False  # the pick's scores in envoy.lb dynamic metadata (upstream's flag)
    grpc_stream_metrics: bool = False  # upstream's ext_proc stream series (--enable-grpc-stream-metrics)
    io_thread: bool = True  # streamed chunks answered by a native thread (epp.wire._fast)
    io_thread_after_chunks: int = 32  # lent once each open stream has had this many response chunks
    native_tls: bool = True  # TLS records in C (epp.wire._fast.TlsTransport), not the event loop's
    config_text: str | None = None
    feature_gates: tuple[str, ...] = ()  # --feature-gates: after the config's featureGates (name, name=bool)
    disabled_plugins: tuple[str, ...] = ()  # plugin types turned off (--disable-plugin, $EPP_DISABLE_PLUGINS)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    grpc_max_recv_message: int = 0  # --grpc-max-recv-msg-size (0: room for a max_request_body_bytes body)
    pool_name: str = ""
    pool_namespace: str = "default"
    # Kubernetes discovery (epp.kube): the InferencePool named pool_name, or the no-CRD mode's
    # equality selector and target ports; kubeconfig empty: $KUBECONFIG, in-cluster, ~/.kube/config.
    endpoint_selector: tuple[tuple[str, str], ...] = ()
    endpoint_target_ports: tuple[int, ...] = ()
    kubeconfig: str = ""
    verbosity: int = 1
    log_floor: int = 0  # nothing below this level is logged (--zap-log-level=warn/error/...; 0: -v decides)
    # OpenTelemetry traces (epp.requestcontrol.tracing), configured by the standard OTEL_* variables.
    tracing: bool = False
    log_format: str = "console"  # or json (--zap-encoder)
    log_time_encoding: str = ""  # --zap-time-encoding (epp.server.logs.TIME_ENCODINGS; "": epp's own)
    log_stacks_from: int = 0  # records from this logging level carry a stack (--zap-stacktrace-level; 0: none)
    shutdown_grace_seconds: float = 20.0
    # --drain-timeout: after SIGTERM, NOT_SERVING while new streams are still served this long (0: none)
    drain_seconds: float = 0.0
    # ext_proc worker processes (epp.server.workers; ours, not upstream's): 0 is one process.
    workers: int = 0
    # Model-server telemetry (epp.datalayer.scraper).
    scrape_metrics: bool = True
    metrics_scraper_process: bool = True  # scrape in a child process, off the request loop
    refresh_metrics_interval: float = 0.05
    refresh_metrics_idle_interval: float = 1.0  # ours: backoff for pods whose numbers do not change (0: off)
    metrics_staleness_threshold: float = 2.0
    model_server_metrics_path: str = "/metrics"
    model_server_metrics_scheme: str = "http"
    model_server_metrics_port: int = 0  # 0: each endpoint's own port
    model_server_metrics_insecure_skip_verify: bool = True
    model_server_metrics_name_filter: bool = True  # ?name[]=... for only the metrics in use
    # vLLM metric-name overrides from the upstream flags (empty: the engine's default).
    metric_overrides: tuple[tuple[str, str], ...] = ()

    @property
    def pool_label(self) -> str:
        """The pool's value of the metrics' pool labels (``name``, ``inference_pool``): the pool's name,
        else ``static`` for a static pool and ``selector`` for upstream's no-CRD mode, never empty."""
        if self.pool_name:
            return self.pool_name
        return "selector" if self.endpoint_selector and not self.endpoints else "static"

    @property
    def kube_discovery(self) -> bool:
        """Whether the pool comes from Kubernetes: a pool name or selector, and no static pool."""
        return bool(self.pool_name or self.endpoint_selector) and not self.endpoints
