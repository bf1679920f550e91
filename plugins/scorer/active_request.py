"""``active-request-scorer`` (llm-d): prefer the endpoint with the fewest requests this picker has
sent to it that have not finished.

Upstream semantics (llm-d-inference-scheduler): each endpoint's count of active requests (sent
by this picker, response not yet complete) is scored against the busiest one:

* a count at or below ``idleThreshold`` (0 by default: no active request) scores 1.0;
* otherwise ``(max - count) / max * maxBusyScore``, ``max`` being the busiest count, so the busiest
  endpoint scores 0.0 and ``maxBusyScore`` below 1 opens a gap between idle and busy endpoints.

A request stops counting when its response ends, fails or is cancelled, or once it has been in
flight for ``requestTimeout`` (upstream's guard against a completion that never arrives; a
response streaming for longer stops counting too, as upstream's does).

The counts are the picker's shared in-flight record (:attr:`epp.framework.Endpoint.inflight`),
which the director adds each routed request to and releases when its response ends; this scorer
keeps no state of its own and needs no lifecycle hooks. Differences from upstream, both small:
``max`` is the busiest *candidate* (upstream takes it over every endpoint it tracks, including any
a filter removed), and a request counts once on the endpoint it was sent to (upstream counts a
multi-prompt completion once per prompt, and counts a disaggregated request on its prefill endpoint
as well).

An endpoint whose metrics are stale counts as fully loaded: it scores 0.0 (it may be gone).

Parameters (upstream names):
    requestTimeout (Go duration string, default "2m"): how long a request may count before it is
        assumed lost; must be positive.
    idleThreshold (int, default 0): active requests at or below which an endpoint is idle (1.0).
    maxBusyScore (number in [0, 1], default 1.0): the best score a busy endpoint can get.
(Upstream replaces an invalid value with the default, logging it; here it is an error.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epp.framework import (
    Endpoint,
    Handle,
    InferenceRequest,
    check_parameters,
    duration_parameter,
    float_parameter,
    int_parameter,
)

DEFAULT_REQUEST_TIMEOUT = 120.0  # seconds; llm-d's defaultRequestTimeout (2m)


class ActiveRequestScorer:
    def __init__(
        self,
        name: str = "active-request-scorer",
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        idle_threshold: int = 0,
        max_busy_score: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not request_timeout > 0:
            raise ValueError(f"{name}: requestTimeout must be positive, got {request_timeout!r}s")
        if idle_threshold < 0:
            raise ValueError(f"{name}: idleThreshold must be at least 0, got {idle_threshold}")
        if not 0.0 <= max_busy_score <= 1.0:
            raise ValueError(f"{name}: maxBusyScore must be within [0, 1], got {max_busy_score}")
        self.name = name
        self.request_timeout = request_timeout
        self.idle_threshold = idle_threshold
        self.max_busy_score = max_busy_score
        self._clock = clock  # the clock of InFlight's send times

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ActiveRequestScorer:
        check_parameters(name, parameters, ("requestTimeout", "idleThreshold", "maxBusyScore"))
        timeout = duration_parameter(name, parameters, "requestTimeout", DEFAULT_REQUEST_TIMEOUT, positive=True)
        return cls(
            name,
            request_timeout=timeout,
            idle_threshold=int_parameter(name, parameters, "idleThreshold", 0, minimum=0),
            max_busy_score=float_parameter(name, parameters, "maxBusyScore", 1.0, minimum=0.0, maximum=1.0),
        )

    def active(self, endpoint: Endpoint) -> int:
        """Requests sent to ``endpoint`` within ``requestTimeout`` whose responses have not ended."""
        return endpoint.inflight.since(self._clock() - self.request_timeout)[0]

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        counts = [None if e.metrics.stale else self.active(e) for e in candidates]
        busiest = max((c for c in counts if c is not None), default=0)
        idle, scale = self.idle_threshold, self.max_busy_score
        # count > idle >= 0 implies busiest >= count > 0: no division by zero.
        return [
            0.0 if count is None else 1.0 if count <= idle else (busiest - count) / busiest * scale for count in counts
        ]
