"""Test-only switches of a simulated pod, for fault-injection benchmarks (``bench/chaos.py``): both off by default.

* **A broken metrics page** (``fault_control``): ``PUT /sim/faults/metrics`` with a body naming a mode
  turns the pod's ``/metrics`` and ``/metrics/`` into what a sick server answers, ``GET`` the same path
  reads the current mode. Modes (:data:`METRICS_MODES`): ``ok`` (the real page), ``html`` (200, an HTML
  error page, as a proxy or an ingress in front of a pod may answer), ``garbage`` (200, bytes that are
  no exposition format), ``hang`` (never answers; the request stays open until the client gives up)
  and ``500``. Requests to the pod's other endpoints are served as usual: the pod is alive, only its
  telemetry is broken.
* **A record of what the pod received** (``record``): one JSON line per request, appended with a single
  ``write`` as soon as the request's body is read (before it is served), so that a pod killed with
  SIGKILL has still recorded every request it had received: ``{"t": <time.time()>, "pod", "id": <the
  x-request-id header>, "method", "path", "model": <the body's model, or null>}``. The picker's own
  requests (metrics scrapes, ``/health``, the model poller's ``/v1/models``) and the control endpoint
  are not recorded.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Final

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

__all__ = ["METRICS_MODES", "FaultSwitches", "RequestRecorder", "add_fault_routes", "broken_metrics", "recording"]

METRICS_MODES: Final = ("ok", "html", "garbage", "hang", "500")
_CONTROL_PATH = "/sim/faults/metrics"
_NOT_RECORDED = frozenset({"/metrics", "/metrics/", "/health", _CONTROL_PATH})
_POLLER_AGENT = "epp-model-poller"  # epp.datalayer.served.USER_AGENT (the sim does not import the picker)
_HANG_SECONDS = 3600.0  # "forever" for any client: a scraper times out long before

_HTML = (
    b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n"
    b"<body><h1>Bad Gateway</h1><p>The upstream server is unavailable.</p></body></html>\n"
)
# Neither UTF-8 nor the text format: NUL bytes, a stray brace, half a sample line.
_GARBAGE = b"\x00\xff\xfe{{vllm:num_requests_waiting\x00 NaN NaN\n\x89PNG\r\n\x1a\n\xde\xad\xbe\xef" * 8


class FaultSwitches:
    """The pod's current metrics mode; ``ok`` until the control endpoint changes it."""

    def __init__(self) -> None:
        self.metrics = "ok"


class _Model(msgspec.Struct):
    model: str | None = None


_decode_model = msgspec.json.Decoder(_Model).decode


class RequestRecorder:
    """Appends one JSON line per received request to ``path`` (see the module docstring)."""

    def __init__(self, path: str, pod: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pod = pod

    def record(self, request_id: str | None, method: str, path: str, body: bytes) -> None:
        try:
            model = _decode_model(body).model if body else None
        except (msgspec.DecodeError, RecursionError):
            model = None
        line = msgspec.json.encode(
            {"t": time.time(), "pod": self._pod, "id": request_id, "method": method, "path": path, "model": model}
        )
        os.write(self._fd, line + b"\n")  # one write of a short line to an O_APPEND file: never interleaved

    def close(self) -> None:
        os.close(self._fd)


def recording(recorder: RequestRecorder) -> Middleware:
    """A middleware that records every client request with ``recorder`` before handling it."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _NOT_RECORDED and request.headers.get("User-Agent") != _POLLER_AGENT:
            body = await request.read() if request.can_read_body else b""  # cached: the handler reads it again
            recorder.record(request.headers.get("x-request-id"), request.method, request.path, body)
        return await handler(request)

    return record


async def broken_metrics(switches: FaultSwitches) -> web.Response | None:
    """What ``/metrics`` answers under the current fault, or None for the real page."""
    mode = switches.metrics
    if mode == "ok":
        return None
    if mode == "html":
        return web.Response(body=_HTML, content_type="text/html")
    if mode == "garbage":
        return web.Response(body=_GARBAGE, content_type="text/plain")
    if mode == "500":
        return web.Response(status=500, text="Internal Server Error")
    await asyncio.sleep(_HANG_SECONDS)  # "hang": cancelled when the client goes away
    return web.Response(status=504)


def add_fault_routes(app: web.Application, switches: FaultSwitches) -> None:
    """The control endpoint: ``PUT /sim/faults/metrics`` (body: a mode) and ``GET`` it."""

    async def put(request: web.Request) -> web.Response:
        mode = (await request.text()).strip()
        if mode not in METRICS_MODES:
            return web.Response(status=400, text=f"unknown metrics mode {mode!r}; one of {', '.join(METRICS_MODES)}\n")
        switches.metrics = mode
        return web.Response(text=mode + "\n")

    async def get(request: web.Request) -> web.Response:
        return web.Response(text=switches.metrics + "\n")

    app.router.add_put(_CONTROL_PATH, put)
    app.router.add_get(_CONTROL_PATH, get)
