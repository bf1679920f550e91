"""Prometheus metrics of the picker, under the upstream Endpoint Picker's names where they exist.

All metrics live on one registry per service (no process-global state), served on
``--metrics-port`` by :func:`start_metrics_server`, which answers ``/metrics`` and 404 on every
other path (a port that answers every path hides a scrape config's typo); a ``guard``
(``--metrics-endpoint-auth``, :mod:`epp.server.metrics_auth`) may refuse a request first. The
series are defined by the packages that write them (:mod:`epp.requestcontrol.metrics`,
:mod:`epp.scheduling.metrics`, flow control's, the plugins' own through
:class:`epp.framework.PluginMetrics`); :class:`Metrics` puts them together.

Counters carry no ``*_created`` series: upstream's Go client exports none, and they double the
series count for nothing a dashboard reads. prometheus_client's switch for that is process-wide
(``disable_created_metrics``); the service turns it on when it builds its registry.
"""

from __future__ import annotations

import os
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Gauge,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

import epp
from epp.requestcontrol.metrics import RequestMetrics
from epp.scheduling.metrics import PluginCallMetrics

__all__ = ["Guard", "Metrics", "start_metrics_server"]


class Metrics:
    """Every series of the service, on one registry: each part is owned by the package that writes it."""

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = RequestMetrics(r)
        self.plugins = PluginCallMetrics(r)
        self.ready_pods = Gauge(
            "inference_pool_ready_pods", "Endpoints in the pool that can take requests.", ["name"], registry=r
        )
        # Build information (upstream's labels) and the process' own CPU, memory and file descriptors.
        info = Gauge(
            "inference_extension_info",
            "The general information of the current build.",
            ["commit", "build_ref"],
            registry=r,
        )
        commit, ref = os.environ.get("EPP_BUILD_COMMIT", ""), os.environ.get("EPP_BUILD_REF") or f"v{epp.__version__}"
        info.labels(commit, ref).set(1)
        ProcessCollector(registry=r)
        r.register(PLATFORM_COLLECTOR)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes come every few seconds: no access log."""


# Given a request's WSGI environ: None to serve it, else (status line, extra headers, body) to answer.
Guard = Callable[[dict[str, Any]], tuple[str, list[tuple[str, str]], bytes] | None]


def _only_metrics(
    app: Callable[..., Iterable[bytes]], routes: Mapping[str, Callable[[], bytes]], guard: Guard | None = None
) -> Callable[..., Iterable[bytes]]:
    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        view = routes.get(path or "")
        if guard is not None and (view is not None or path == "/metrics"):
            refusal = guard(environ)
            if refusal is not None:
                status, headers, text = refusal
                start_response(
                    status,
                    [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(text))), *headers],
                )
                return [text]
        if view is not None:
            body = view()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: the picker serves only /metrics on this port\n"]
        return app(environ, start_response)

    return serve


_HANDSHAKE_TIMEOUT = 10.0  # seconds a metrics client gets for its TLS handshake and each read


def start_metrics_server(
    metrics: Metrics,
    port: int,
    address: str = "0.0.0.0",
    *,
    routes: Mapping[str, Callable[[], bytes]] | None = None,
    guard: Guard | None = None,
    tls: ssl.SSLContext | None = None,
) -> int:
    """Serve ``/metrics`` on a background thread (scrapes never touch the event loop); the port bound.

    ``guard`` (:mod:`epp.server.metrics_auth`) is asked first for ``/metrics`` and the ``routes``,
    on the server's thread. ``tls``: serve HTTPS with this context (``--metrics-cert-dir``, and a
    client CA that it requires with ``--metrics-client-ca-file``); each connection's handshake runs
    on its own request thread, bounded by :data:`_HANDSHAKE_TIMEOUT`, never on the accepting one.
    OSError when the port cannot be bound.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class _Server(ThreadingWSGIServer):
        address_family = family  # IPv6 bind addresses need AF_INET6

        def get_request(self) -> tuple[socket.socket, Any]:
            conn, peer = super().get_request()
            if tls is not None:  # (the handshake: in the request's thread, at its first read)
                conn.settimeout(_HANDSHAKE_TIMEOUT)
                conn = tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            return conn, peer

        def handle_error(self, request: Any, client_address: Any) -> None:
            if isinstance(sys.exc_info()[1], (ssl.SSLError, TimeoutError, ConnectionError)):
                return  # a client that does not speak TLS, or went away: its connection only
            super().handle_error(request, client_address)

    app = _only_metrics(make_wsgi_app(metrics.registry), routes or {}, guard)
    httpd = make_server(str(sockaddr[0]), port, app, _Server, _QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-server", daemon=True).start()
    return int(httpd.server_port)
