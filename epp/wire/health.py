"""The standard gRPC health service (``grpc.health.v1.Health``) on :class:`epp.wire.server.GrpcServer`.

:class:`Health` holds each service's status; :meth:`Health.methods` are its two methods for a
server's method table. ``Check`` answers a service's status (NOT_FOUND for a service never set, as
gRPC's own implementation does); ``Watch`` sends the status now and again on every change
(SERVICE_UNKNOWN for a service not set yet), until the client goes away or the server stops.
Kubelet's gRPC probes and Envoy's active health checks use ``Check``.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from epp.wire.http2 import Handler, Status, Stream

__all__ = ["NOT_SERVING", "SERVING", "Health"]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
_ANSWERS = {
    status: health_pb2.HealthCheckResponse(status=status).SerializeToString()
    for status in (SERVING, NOT_SERVING, _SERVICE_UNKNOWN)
}


class Health:
    """Services' statuses, and the calls that answer them."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._watchers: dict[str, set[_Watch]] = {}

    def set(self, service: str, status: int) -> None:
        if self._status.get(service) == status:
            return
        self._status[service] = status
        for watch in list(self._watchers.get(service, ())):
            watch.send(status)

    def get(self, service: str) -> int | None:
        return self._status.get(service)

    def methods(self) -> dict[str, Handler]:
        return {
            "/grpc.health.v1.Health/Check": lambda stream: _Check(self, stream),
            "/grpc.health.v1.Health/Watch": lambda stream: _Watch(self, stream),
        }

    def stop(self) -> None:
        """End every Watch (the server is stopping)."""
        for watches in self._watchers.values():
            for watch in list(watches):
                watch.stream.finish(Status.UNAVAILABLE, "the server is stopping")
        self._watchers.clear()


def _service(stream: Stream, data: bytes) -> str | None:
    try:
        return health_pb2.HealthCheckRequest.FromString(data).service
    except Exception:  # protobuf's DecodeError: not a HealthCheckRequest
        stream.finish(Status.INTERNAL, "the request is not a grpc.health.v1.HealthCheckRequest")
        return None


class _Check:
    __slots__ = ("_health", "_service", "stream")

    def __init__(self, health: Health, stream: Stream) -> None:
        self._health = health
        self.stream = stream
        self._service: str | None = None

    def message(self, data: bytes) -> None:
        self._service = _service(self.stream, data)

    def half_close(self) -> None:
        if self._service is None:
            self.stream.finish(Status.INVALID_ARGUMENT, "Check needs one HealthCheckRequest")
            return
        status = self._health.get(self._service)
        if status is None:
            self.stream.finish(Status.NOT_FOUND, f"unknown service {self._service!r}")
            return
        self.stream.send(_ANSWERS[status])
        self.stream.finish()

    def cancel(self) -> None:
        pass


class _Watch:
    __slots__ = ("_health", "_service", "stream")

    def __init__(self, health: Health, stream: Stream) -> None:
        self._health = health
        self.stream = stream
        self._service: str | None = None

    def message(self, data: bytes) -> None:
        service = _service(self.stream, data)
        if service is None or self._service is not None:
            return
        self._service = service
        self._health._watchers.setdefault(service, set()).add(self)
        self.send(self._health.get(service))

    def send(self, status: int | None) -> None:
        self.stream.send(_ANSWERS[_SERVICE_UNKNOWN if status is None else status])

    def half_close(self) -> None:
        if self._service is None:  # no request came: there is nothing to watch
            self.stream.finish(Status.INVALID_ARGUMENT, "Watch needs one HealthCheckRequest")
        # else a Watch goes on after the request

    def cancel(self) -> None:
        if self._service is not None:
            self._health._watchers.get(self._service, set()).discard(self)
