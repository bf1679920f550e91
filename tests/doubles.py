"""Plugin doubles shared by the request-control and scheduling-config tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, InferenceRequest, ScoredEndpoint, SchedulingResult

__all__ = ["Hooks", "OnlyPicker"]


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
