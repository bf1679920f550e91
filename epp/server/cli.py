"""The ``epp`` command: ``serve`` runs the picker; ``validate-config``, ``envoy-config``, ``demo``, ``version``.

Flags keep the upstream Endpoint Picker's names and defaults, parsed the Go way (:mod:`epp.server.flags`),
so the container arguments of the upstream Helm chart are accepted unchanged. Upstream flags this
version accepts but does not implement yet are listed at startup, never silently ignored.

Every usage error (an unknown command or flag, a bad value) is printed the same way, on stderr: the
error, a hint when one helps (a did-you-mean, the boolean ``=``), a pointer at ``-h``; exit status 2.
Help asked for goes to stdout, exit 0. ``validate-config`` takes serve's flags and builds the picker
as start-up does, without binding a port: the same messages and exit status (2) for a bad config.
A start-up failure outside the config (a port in use) is one log line naming the flag, exit 1.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
import re
import sys
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from epp.framework import Duration
from epp.scheduling.registry import disabled_from_env
from epp.server.flags import FlagError, FlagSet, HelpRequested, make_flag, print_usage_error
from epp.server.logs import TIME_ENCODINGS, configure_logging, stack_level, zap_level
from epp.server.pool_flags import ENDPOINTS_FILE_HELP, static_endpoints
from epp.server.process import limit_malloc_arenas
from epp.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, Settings
from epp.server.tls import tls_policy

__all__ = ["SERVE_FLAGS", "main", "settings_from_args", "version"]

log = logging.getLogger("epp")

# Upstream's metric-name flags -> (default selector, what it measures).
_METRIC_FLAGS = {
    "total-queued-requests-metric": ("vllm:num_requests_waiting", "requests waiting"),
    "total-running-requests-metric": ("vllm:num_requests_running", "requests running"),
    "kv-cache-usage-percentage-metric": ("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1"),
    "lora-info-metric": ("vllm:lora_requests_info", "LoRA adapters (running/waiting/max labels)"),
    "cache-info-metric": ("vllm:cache_config_info", "KV-cache block size and count (labels)"),
}

# --workers above this is a typo, not a pod (each worker is a Python process of some 60 MB).
_MAX_WORKERS = 256

# The only InferencePool API discovery speaks: inference.networking.k8s.io/v1.
_POOL_GROUP = "inference.networking.k8s.io"

SERVE_FLAGS = FlagSet(
    "epp serve",
    [
        make_flag("grpc-port", 9002, "gRPC port of the ext_proc service"),
        make_flag("grpc-health-port", 9003, "gRPC port of the health service"),
        make_flag("metrics-port", 9090, "port of the Prometheus /metrics endpoint"),
        make_flag(
            "enable-debug-endpoints",
            False,
            "serve /debug/pool (endpoints, scraped numbers, in-flight) and /debug/config on the metrics port",
        ),
        make_flag(
            "metrics-endpoint-auth",
            True,
            "metrics port (/metrics, /debug/*) needs a bearer token the API server accepts (TokenReview) and "
            "whose user may get the path (SubjectAccessReview); off in static mode (--endpoints)",
        ),
        make_flag(
            "metrics-cert-dir",
            "",
            "serve the metrics port over HTTPS with this directory's tls.crt and tls.key (needs "
            "--metrics-endpoint-auth or --metrics-client-ca-file)",
        ),
        make_flag(
            "metrics-client-ca-file",
            "",
            "with --metrics-cert-dir: require a client certificate signed by this PEM CA on the metrics port",
        ),
        make_flag("secure-serving", True, "serve ext_proc over TLS"),
        make_flag("cert-path", "", "directory with tls.crt and tls.key; empty: a self-signed certificate"),
        make_flag(
            "tls-min-version",
            "",
            "lowest TLS version served: VersionTLS12 (also for 10, 11: HTTP/2 needs 1.2) or VersionTLS13; empty: 1.2",
        ),
        make_flag(
            "tls-cipher-suites",
            [],
            "TLS 1.2 cipher suites, Go's names (TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,...; TLS 1.3's are accepted, "
            "not configurable); empty: OpenSSL's defaults",
        ),
        make_flag(
            "enable-cert-reload",
            False,
            "serve --cert-path's tls.crt and tls.key anew (to new connections) when they change",
        ),
        make_flag(
            "io-thread",
            True,
            "this project's, not upstream's: a native thread answers the middle chunks of streamed responses "
            "while a connection has at most 4 streams open (32 observed ones), each past its "
            "--io-thread-after-chunks chunks (less CPU per chunk); false: the event loop answers every message",
        ),
        make_flag(
            "io-thread-after-chunks",
            32,
            "this project's: a connection is lent to the I/O thread once each of its open streams has had this "
            "many response chunks (a lend and its hand-back cost the event loop a wake-up or two)",
        ),
        make_flag(
            "native-tls",
            True,
            "this project's, not upstream's: with --secure-serving, TLS records are encrypted and decrypted in C "
            "(OpenSSL, the same library and settings as Python's ssl module), so that streamed chunks cost what "
            "they cost on plaintext and the I/O thread serves TLS connections too; false: the event loop's TLS",
        ),
        make_flag("config-file", "", "EndpointPickerConfig YAML file"),
        make_flag("config-text", "", "EndpointPickerConfig YAML, inline (instead of --config-file)"),
        make_flag(
            "feature-gates",
            [],
            "feature gates, kubelet style (flowControl=true; a bare name enables), after the config's "
            "featureGates: these win",
        ),
        make_flag(
            "disable-plugin", [], "plugin type to turn off (repeatable, or comma-separated; also $EPP_DISABLE_PLUGINS)"
        ),
        make_flag("v", 1, "log verbosity: 0-2 info, 3 debug, 4 a decision record per request, 5 libraries' debug too"),
        make_flag("zap-encoder", "console", "log format: console or json"),
        make_flag("pool-name", "", "InferencePool to serve (Kubernetes discovery)"),
        make_flag("pool-namespace", "", "namespace of the InferencePool (default $NAMESPACE, else default)"),
        make_flag(
            "pool-group",
            _POOL_GROUP,
            f"API group of the InferencePool (only {_POOL_GROUP}, InferencePool v1, is supported)",
            implemented=False,
        ),
        make_flag("endpoint-selector", "", "no-CRD discovery: the pods matching these labels (k=v,...) are the pool"),
        make_flag("endpoint-target-ports", "", "no-CRD discovery: the pods' serving ports, comma-separated"),
        make_flag(
            "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, else in-cluster config, else ~/.kube/config)"
        ),
        make_flag(
            "disable-endpoint-subset-filter",
            False,
            "ignore the gateway's destination endpoint subset hint (envoy.lb.subset_hint): every pool endpoint "
            "is a candidate",
        ),
        make_flag(
            "emit-endpoint-scores",
            False,
            "put the primary profile's score of every endpoint it scored (ip:port -> weighted total) in the routing "
            "answer's envoy.lb dynamic metadata, key x-gateway-destination-endpoint-scores",
        ),
        make_flag("endpoints", "", "static pool: comma-separated ip:port list (no Kubernetes needed)"),
        make_flag("endpoints-file", "", "static pool from a file: ip:port per line, # comments"),
        make_flag("max-request-body-bytes", DEFAULT_MAX_REQUEST_BODY_BYTES, "larger request bodies get 413"),
        make_flag("bind-address", "0.0.0.0", "address the gRPC, health and metrics servers listen on"),
        make_flag("shutdown-grace-period", Duration(20.0), "how long in-flight streams get to finish after SIGTERM"),
        make_flag(
            "drain-timeout",
            Duration(0.0),
            "after SIGTERM, report NOT_SERVING but go on serving new streams this long, then drain for "
            "--shutdown-grace-period (upstream's default is 30s; 0: drain at once)",
        ),
        make_flag(
            "workers",
            0,
            "this project's, not upstream's: ext_proc worker processes that share the --grpc-port socket while "
            "this process routes for them (a core each); 0: one process does everything",
        ),
        make_flag(
            "tracing",
            False,
            "export OpenTelemetry traces over OTLP (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER[_ARG], ...)",
        ),
        # Accepted for drop-in compatibility with the upstream chart; no effect yet.
        make_flag("log-level", "info", "older charts' log level (use -v)", implemented=False),
        make_flag("ha-enable-leader-election", False, "leader election between replicas", implemented=False),
        make_flag("health-checking", False, "upstream flag: enable health checking", implemented=False),
        make_flag("enable-pprof", True, "upstream profiling endpoint", implemented=False),
        make_flag(
            "refresh-prometheus-metrics-interval",
            Duration(5.0),
            "upstream: flush interval of its own metrics (ours are live)",
            implemented=False,
        ),
        # Newer upstream (llm-d's) flags: those marked implemented=False are accepted so that a chart or
        # operator passing them starts this picker, and each one given is named at startup as having no effect yet.
        make_flag(
            "grpc-max-recv-msg-size",
            "",
            "the largest gRPC message the ext_proc port takes (10MiB, 25MB, 4Mi, 1048576...; a larger one fails "
            "its stream with RESOURCE_EXHAUSTED, as grpc's limit does); empty or 0: room for a "
            "--max-request-body-bytes body in one message",
        ),
        make_flag(
            "grpc-max-send-msg-size",
            "",
            "upstream: the largest gRPC message sent (the picker's messages stay under 64 KB: body chunks are cut "
            "at 62,000 bytes)",
            implemented=False,
        ),
        make_flag(
            "plugin-state-staleness-threshold",
            Duration(0.0),
            "upstream: when a request's plugin state is reaped (0: its default)",
            implemented=False,
        ),
        make_flag(
            "enable-grpc-stream-metrics",
            False,
            "export llm_d_epp_extproc_streams_inflight, llm_d_epp_extproc_stream_duration_seconds and "
            "llm_d_epp_extproc_streams_total{code}: the ext_proc streams open, how long each was, how each ended",
        ),
        make_flag("fairness-id-metric-label-limit", 1000, "upstream: fairness_id label values kept", implemented=False),
        make_flag("allow-experimental-plugins", False, "upstream: allow alpha plugins", implemented=False),
        # controller-runtime's zap flags, which upstream binds beside -v and --zap-encoder.
        make_flag(
            "zap-devel",
            False,
            "given: zap's development defaults (console, stack traces from warn), =false its production ones "
            "(json, from error), for what --zap-encoder and --zap-stacktrace-level do not set",
        ),
        make_flag(
            "zap-log-level",
            "",
            "upstream's zap level, which wins over -v: a number N is -v N, info -v 0, debug -v 1; warn, error, "
            "dpanic, panic, fatal log only from that level up",
        ),
        make_flag("zap-stacktrace-level", "", "records from this level up carry the logging call's stack"),
        make_flag("zap-time-encoding", "", "log times: " + ", ".join(TIME_ENCODINGS) + " (zap's; default: local time)"),
        # Model-server telemetry.
        make_flag("refresh-metrics-interval", Duration(0.05), "interval between scrapes of each endpoint's metrics"),
        make_flag(
            "refresh-metrics-idle-interval",
            Duration(1.0),
            "this project's extension: the longest gap between scrapes of an endpoint whose numbers do not change "
            "(backoff; fast again at a pick, a change or a failure; at most half --metrics-staleness-threshold); "
            "0: every endpoint every --refresh-metrics-interval, as upstream",
        ),
        make_flag(
            "metrics-staleness-threshold",
            Duration(2.0),
            "metrics older than this mark an endpoint stale (treated as fully loaded)",
        ),
        make_flag("model-server-metrics-path", "/metrics", "path of the model servers' Prometheus metrics"),
        make_flag("model-server-metrics-scheme", "http", "http or https"),
        make_flag("model-server-metrics-port", 0, "port of the model servers' metrics; 0: the endpoint's own port"),
        make_flag("model-server-metrics-https-insecure-skip-verify", True, "do not verify model servers' certificates"),
        make_flag(
            "model-server-metrics-name-filter",
            True,
            "ask model servers for only the metrics in use (?name[]=..., honoured by prometheus_client: vLLM, SGLang)",
        ),
        make_flag(
            "scrape-metrics", True, "scrape model-server metrics (false: route without telemetry, e.g. benchmarks)"
        ),
        make_flag("metrics-scraper-process", True, "scrape in a child process, off the request path's event loop"),
        # vLLM metric-name overrides (upstream flags); the config file's core-metrics-extractor is the general form.
        *(make_flag(name, default, f"vLLM metric selector: {what}") for name, (default, what) in _METRIC_FLAGS.items()),
    ],
)


def _unquote(value: str) -> str:
    """``value`` without one pair of surrounding double or single quotes."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def settings_from_args(argv: Sequence[str]) -> tuple[Settings, list[str]]:
    """Settings from ``epp serve`` arguments, and the names of given flags that have no effect yet."""
    values, positional, given = SERVE_FLAGS.parse(argv)
    if positional:
        raise SERVE_FLAGS.positional_error(argv, positional)
    if values["config-file"] and values["config-text"]:
        raise FlagError("give --config-file or --config-text, not both")
    config_text: str | None = values["config-text"] or None
    if values["config-file"]:
        try:
            config_text = Path(values["config-file"]).read_text()
        except OSError as exc:
            raise FlagError(f"--config-file: {exc}") from None
    endpoints = static_endpoints(values["endpoints"], values["endpoints-file"])
    selector, target_ports = _discovery_flags(values, static=bool(endpoints))
    if values["zap-encoder"] not in ("console", "json"):
        raise FlagError(f"--zap-encoder must be console or json, got {values['zap-encoder']!r}")
    if values["max-request-body-bytes"] < 1:
        raise FlagError("--max-request-body-bytes must be positive")
    if values["io-thread-after-chunks"] < 1:
        raise FlagError("--io-thread-after-chunks must be at least 1")
    if not 0 <= values["workers"] <= _MAX_WORKERS:
        raise FlagError(f"--workers must be between 0 and {_MAX_WORKERS}, got {values['workers']}")
    if values["refresh-metrics-interval"] <= 0:
        raise FlagError("--refresh-metrics-interval must be positive (use --scrape-metrics=false to turn scraping off)")
    if values["refresh-metrics-idle-interval"] < 0:
        raise FlagError("--refresh-metrics-idle-interval cannot be negative (0 turns the backoff off)")
    _metrics_tls_flags(values)
    if values["drain-timeout"] < 0:
        raise FlagError("--drain-timeout cannot be negative")
    if values["metrics-staleness-threshold"] <= 0:
        raise FlagError("--metrics-staleness-threshold must be positive")
    if values["model-server-metrics-scheme"] not in ("http", "https"):
        raise FlagError(
            f"--model-server-metrics-scheme must be http or https, got {values['model-server-metrics-scheme']!r}"
        )
    if not values["model-server-metrics-path"].startswith("/"):
        raise FlagError("--model-server-metrics-path must start with /")
    try:
        tls_policy(values["tls-min-version"], values["tls-cipher-suites"])
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    try:
        grpc_max_recv = parse_size(values["grpc-max-recv-msg-size"])
    except ValueError as exc:
        raise FlagError(f"invalid grpc-max-recv-msg-size: {exc}") from None
    verbosity, log_floor = values["v"], 0
    if "zap-log-level" in given:
        try:
            verbosity, log_floor = zap_level(values["zap-log-level"])
        except ValueError as exc:
            raise FlagError(str(exc)) from None
    log_format, stacks_from = values["zap-encoder"], 0
    if "zap-devel" in given:  # zap's development or production defaults, under what is given (epp.server.logs)
        development = values["zap-devel"]
        stacks_from = logging.WARNING if development else logging.ERROR
        if "zap-encoder" not in given:
            log_format = "console" if development else "json"
    if "zap-stacktrace-level" in given:
        try:
            stacks_from = stack_level(values["zap-stacktrace-level"])
        except ValueError as exc:
            raise FlagError(str(exc)) from None
    time_encoding = values["zap-time-encoding"].strip().lower()
    if time_encoding and time_encoding not in TIME_ENCODINGS:
        raise FlagError(
            f"--zap-time-encoding must be one of {', '.join(TIME_ENCODINGS)}, got {values['zap-time-encoding']!r}"
        )
    settings = Settings(
        endpoints=tuple(endpoints),
        grpc_port=values["grpc-port"],
        grpc_health_port=values["grpc-health-port"],
        metrics_port=values["metrics-port"],
        enable_debug_endpoints=values["enable-debug-endpoints"],
        metrics_endpoint_auth=values["metrics-endpoint-auth"],
        metrics_cert_dir=values["metrics-cert-dir"],
        metrics_client_ca_file=values["metrics-client-ca-file"],
        bind_address=values["bind-address"],
        secure_serving=values["secure-serving"],
        cert_path=values["cert-path"],
        cert_reload=values["enable-cert-reload"],
        tls_min_version=values["tls-min-version"],
        tls_cipher_suites=tuple(values["tls-cipher-suites"]),
        subset_filter=not values["disable-endpoint-subset-filter"],
        emit_endpoint_scores=values["emit-endpoint-scores"],
        grpc_stream_metrics=values["enable-grpc-stream-metrics"],
        feature_gates=tuple(values["feature-gates"]),
        io_thread=values["io-thread"],
        io_thread_after_chunks=values["io-thread-after-chunks"],
        native_tls=values["native-tls"],
        config_text=config_text,
        disabled_plugins=tuple(sorted({*values["disable-plugin"], *disabled_from_env()})),
        max_request_body_bytes=values["max-request-body-bytes"],
        grpc_max_recv_message=grpc_max_recv,
        pool_name=values["pool-name"],
        pool_namespace=values["pool-namespace"] or os.environ.get("NAMESPACE") or "default",
        endpoint_selector=selector,
        endpoint_target_ports=target_ports,
        kubeconfig=values["kubeconfig"],
        verbosity=verbosity,
        log_floor=log_floor,
        tracing=values["tracing"],
        log_format=log_format,
        log_time_encoding=time_encoding,
        log_stacks_from=stacks_from,
        shutdown_grace_seconds=float(values["shutdown-grace-period"]),
        drain_seconds=float(values["drain-timeout"]),
        workers=values["workers"],
        scrape_metrics=values["scrape-metrics"],
        metrics_scraper_process=values["metrics-scraper-process"],
        refresh_metrics_interval=float(values["refresh-metrics-interval"]),
        refresh_metrics_idle_interval=float(values["refresh-metrics-idle-interval"]),
        metrics_staleness_threshold=float(values["metrics-staleness-threshold"]),
        model_server_metrics_path=values["model-server-metrics-path"],
        model_server_metrics_scheme=values["model-server-metrics-scheme"],
        model_server_metrics_port=values["model-server-metrics-port"],
        model_server_metrics_insecure_skip_verify=values["model-server-metrics-https-insecure-skip-verify"],
        model_server_metrics_name_filter=values["model-server-metrics-name-filter"],
        # The upstream chart writes some of these as --flag="name": the quotes reach us; drop them.
        metric_overrides=tuple((name, _unquote(values[name])) for name in _METRIC_FLAGS if name in given),
    )
    not_yet = sorted(name for name in given if not SERVE_FLAGS.flags[name].implemented)
    return settings, not_yet


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?)(?:[eE]([+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E))?")
_SIZE_UNITS = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


def parse_size(text: str) -> int:
    """A byte count as upstream reads one (a Kubernetes quantity, a trailing B or b dropped: 10MiB, 25MB,
    4Mi, 1e6, 1048576); 0 for an empty text. ValueError for a fraction of a byte or what is not a quantity."""
    text = text.strip()
    if len(text) > 1 and text[-1] in "Bb":
        text = text[:-1]
    if not text:
        return 0
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (a number, with Ki, Mi, Gi, k, M, G... or an exponent: 10MiB, 1e6)")
    number, exponent, unit = match.groups()
    value = Fraction(number) * (Fraction(10) ** int(exponent) if exponent else _SIZE_UNITS.get(unit or "", 1))
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _metrics_tls_flags(values: dict[str, Any]) -> None:
    """Upstream's checks of the metrics port's TLS flags (its messages), and that the files are there."""
    cert_dir, client_ca = values["metrics-cert-dir"], values["metrics-client-ca-file"]
    if client_ca and not cert_dir:
        raise FlagError('"metrics-client-ca-file" requires "metrics-cert-dir"')
    if cert_dir and not client_ca and not values["metrics-endpoint-auth"]:
        raise FlagError(
            '"metrics-cert-dir" enables metrics TLS without authentication; set "metrics-client-ca-file" or '
            '"metrics-endpoint-auth"'
        )
    files = [os.path.join(cert_dir, "tls.crt"), os.path.join(cert_dir, "tls.key")] if cert_dir else []
    if client_ca:
        files.append(client_ca)
    for path in files:
        if not os.path.isfile(path):
            raise FlagError(f"metrics TLS cert file unreadable: {path}: no such file")


def _discovery_flags(values: dict[str, Any], *, static: bool) -> tuple[tuple[tuple[str, str], ...], tuple[int, ...]]:
    """Check the discovery flags together; the no-CRD mode's selector and ports (empty without it)."""
    from epp.kube.pods import PoolSpecError, parse_selector, parse_target_ports

    if values["pool-group"] != _POOL_GROUP:
        raise FlagError(f"--pool-group {values['pool-group']!r}: only {_POOL_GROUP} (InferencePool v1) is supported")
    if not values["endpoint-selector"]:
        if values["endpoint-target-ports"]:
            raise FlagError("--endpoint-target-ports needs --endpoint-selector")
        return (), ()
    if values["pool-name"]:
        raise FlagError("give --pool-name or --endpoint-selector, not both")
    if static:
        raise FlagError("give --endpoints/--endpoints-file or --endpoint-selector, not both")
    if not values["endpoint-target-ports"]:
        raise FlagError("--endpoint-selector needs --endpoint-target-ports")
    try:
        return parse_selector(values["endpoint-selector"]), parse_target_ports(values["endpoint-target-ports"])
    except PoolSpecError as exc:
        raise FlagError(str(exc)) from None


def _run(coroutine: Any) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop has no Windows build
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


def _parse_serve_flags(program: str, argv: Sequence[str]) -> tuple[Settings, list[str]] | int:
    """Settings from ``argv``, or the exit status once the usage (0) or a usage error (2) is printed."""
    try:
        return settings_from_args(argv)
    except HelpRequested:
        print(SERVE_FLAGS.usage().replace(f"Usage of {SERVE_FLAGS.program}:", f"Usage of {program}:", 1))
        if program == "epp serve":
            print(ENDPOINTS_FILE_HELP)
        return 0
    except FlagError as exc:
        return print_usage_error(program, exc)


def _serve(argv: Sequence[str]) -> int:
    parsed = _parse_serve_flags("epp serve", argv)
    if isinstance(parsed, int):
        return parsed
    settings, not_yet = parsed
    configure_logging(
        settings.verbosity, settings.log_format, settings.log_floor,
        time_encoding=settings.log_time_encoding, stacks_from=settings.log_stacks_from,
    )  # fmt: skip
    arenas = limit_malloc_arenas()  # before any thread allocates (epp.server.process)
    if arenas is not None:
        log.debug("glibc malloc: at most %d arenas (MALLOC_ARENA_MAX overrides)", arenas)
    for name in not_yet:
        log.warning("flag --%s is accepted for compatibility with the upstream picker but has no effect yet", name)
    # A TLS/plaintext mismatch with Envoy shows only as grpc's own handshake errors (or nothing, the
    # other way round): say once which Envoy configuration pairs with this one.
    if settings.secure_serving:
        log.info(
            "ext_proc is served over TLS (--secure-serving=true): Envoy must use TLS to the picker "
            "(deploy/envoy/envoy-tls.yaml, epp envoy-config --picker-tls=true); "
            "for deploy/envoy/envoy.yaml start with --secure-serving=false"
        )
    else:
        log.info(
            "ext_proc is served in plaintext (--secure-serving=false): pairs with deploy/envoy/envoy.yaml "
            "(epp envoy-config --picker-tls=false)"
        )
    if settings.pool_name and settings.endpoints:
        log.info(
            "static pool given (--endpoints): no Kubernetes discovery; --pool-name %s only names the pool",
            settings.pool_name,
        )
    elif not settings.kube_discovery and not settings.endpoints:
        log.warning(
            "no pool: give --pool-name, --endpoint-selector or --endpoints "
            "(until then, requests wait in flow control if it is on, else fail)"
        )

    from epp.kube.client import KubeConfigError
    from epp.scheduling.config import ConfigError
    from epp.scheduling.registry import PluginLoadError
    from epp.server.server import StartupError, serve

    try:
        _run(serve(settings, freeze=True))
    except (ConfigError, KubeConfigError) as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    except PluginLoadError as exc:
        log.error("plugins: %s", exc)
        return 2
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


def _validate_config(argv: Sequence[str]) -> int:
    """``epp validate-config``: build the configuration as ``epp serve`` would, then exit; no port is bound."""
    parsed = _parse_serve_flags("epp validate-config", argv)
    if isinstance(parsed, int):
        return parsed
    settings, _ = parsed
    configure_logging(
        settings.verbosity, settings.log_format, settings.log_floor,
        time_encoding=settings.log_time_encoding, stacks_from=settings.log_stacks_from,
    )  # fmt: skip

    from epp.kube.client import KubeConfigError
    from epp.scheduling.config import ConfigError
    from epp.scheduling.registry import PluginLoadError
    from epp.server.server import EndpointPicker

    try:
        # The picker's constructor is startup up to the first port: registry, config, plugins,
        # admission, scraper and discovery objects. start() (ports, child processes) is not called.
        picker = EndpointPicker(settings)
    except (ConfigError, KubeConfigError) as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    except PluginLoadError as exc:
        log.error("plugins: %s", exc)
        return 2
    source = "the built-in default configuration" if settings.config_text is None else "the configuration"
    print(
        f"{source} is valid: {len(picker.config.plugins)} plugin(s), "
        f"scheduling profile(s) {', '.join(picker.scheduler.profiles)}"
    )
    return 0


def _version(argv: Sequence[str]) -> int:
    if argv:
        return print_usage_error("epp version", FlagError(f"unexpected argument(s): {' '.join(argv)}"))
    print(f"epp {version()}")
    return 0


def version() -> str:
    """The installed distribution's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("epp")
    except PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


def _demo(argv: Sequence[str]) -> int:
    from epp.server.demo import main as demo_main

    return demo_main(argv)


def _envoy_config(argv: Sequence[str]) -> int:
    from epp.server.envoy_config import main as envoy_config_main

    return envoy_config_main(argv)


_COMMANDS = {
    "serve": _serve,
    "validate-config": _validate_config,
    "envoy-config": _envoy_config,
    "demo": _demo,
    "version": _version,
}

_USAGE = """\
usage: epp <command> [flags]

commands:
  serve            run the endpoint picker (the default when the first argument is a flag)
  validate-config  check --config-file/--config-text (and every other serve flag) as serve would, then exit
  envoy-config     print an Envoy bootstrap that puts Envoy in front of the picker
  demo             start the local demo: Envoy + simulated vLLM pods + the picker
  version          print the version (also: epp --version)

Run 'epp <command> -h' for a command's flags."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(_USAGE, file=sys.stderr)
        return 2
    command = args[0]
    if command in _COMMANDS:
        return _COMMANDS[command](args[1:])
    if command in ("-h", "--help", "-help", "help"):
        print(_USAGE)
        return 0
    if command in ("--version", "-version"):
        return _version(args[1:])
    if command.startswith("-"):
        return _serve(args)  # `epp --grpc-port ...`: the upstream binary takes flags directly
    close = difflib.get_close_matches(command, _COMMANDS, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    print(f"epp: unknown command '{command}'{hint}\nRun 'epp -h' for the list of commands.", file=sys.stderr)
    return 2
