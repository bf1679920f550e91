"""``queue-scorer``: prefer the endpoint with the shortest waiting queue.

Upstream semantics: min-max normalisation over the candidates' waiting-queue lengths,
``(max - queue) / (max - min)``: the shortest queue scores 1.0, the longest 0.0, and when every
candidate has the same queue all score 1.0 (nothing to tell them apart). An endpoint whose metrics
are stale counts as fully loaded: it scores 0.0 and does not take part in the normalisation.

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.datastore import Endpoint
from epp.registry import Handle, check_parameters
from epp.request import InferenceRequest


class QueueScorer:
    def __init__(self, name: str = "queue-scorer") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> QueueScorer:
        check_parameters(name, parameters)
        return cls(name)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        queues = [None if e.metrics.stale else e.metrics.waiting_queue_size for e in candidates]
        fresh = [q for q in queues if q is not None]
        if not fresh:
            return [0.0] * len(candidates)
        low, high = min(fresh), max(fresh)
        if low == high:
            return [0.0 if q is None else 1.0 for q in queues]
        span = high - low
        return [0.0 if q is None else (high - q) / span for q in queues]
