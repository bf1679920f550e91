"""Doubles shared by tests: plugins (request control, scheduling config) and an ext_proc stream's wire side."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.framework import Endpoint, InferenceRequest, SchedulingResult, ScoredEndpoint
from epp.wire._fast import StreamBase

__all__ = ["Hooks", "OnlyPicker", "WireStream"]


class OnlyPicker:
    """Picks one fixed endpoint (by hostport) when it is a candidate."""

    def __init__(self, name: str, hostport: str) -> None:
        self.name, self.hostport = name, hostport

    def pick(self, req: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        return [s.endpoint for s in scored if s.endpoint.hostport == self.hostport]


class Hooks:
    name = "hooks"

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def pre_request(self, req: InferenceRequest, result: SchedulingResult) -> None:
        # In-flight accounting is already counting this request when plugins hear of the pick.
        self.events.append(("pre", result.endpoints[0].name, result.endpoints[0].inflight.requests))

    def response_received(self, req: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]) -> dict[str, str]:
        self.events.append(("headers", endpoint.name, headers.get(":status")))
        return {"x-served-by": endpoint.name}

    def response_complete(self, req: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        self.events.append(("complete", endpoint.name, outcome, endpoint.inflight.requests))


class WireStream(StreamBase):
    """One ext_proc stream's wire side, in memory: what the call sends, and how it ended.

    No C read path here (``echo_response_bodies`` does nothing): every chunk reaches the call.
    """

    def __init__(self, headers: dict[bytes, bytes] | None = None) -> None:
        super().__init__()
        self.headers = headers or {}  # the gRPC request metadata
        self.sent: list[pb.ProcessingResponse] = []
        self.status: tuple[int, str] | None = None
        self.idled = False

    def send(self, data: bytes) -> None:
        assert self.status is None, "an answer after the stream ended"
        self.sent.append(pb.ProcessingResponse.FromString(data))

    def finish(self, status: int = 0, message: str = "") -> None:
        if self.status is None:
            self.status = (status, message)

    def send_all(self, messages: Iterable[bytes], *, end: bool = False) -> None:
        for message in messages:
            self.send(message)
        if end:
            self.finish()

    def echo_response_bodies(self, *, observed: bool = False) -> None:
        pass

    def idle(self) -> None:
        self.idled = True

    def after_write(self, work: Callable[[], object]) -> None:
        work()  # (nothing waits to be written here)
