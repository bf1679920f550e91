"""``load-aware-scorer`` (llm-d): score by waiting-queue length against a fixed threshold.

Upstream semantics (llm-d-inference-scheduler): an endpoint with an empty waiting queue scores 0.5;
one with ``queue`` waiting requests scores ``0.5 * (1 - min(queue, threshold) / threshold)``, falling
linearly to 0.0 at ``threshold`` and staying there beyond it. Unlike ``queue-scorer`` the scale is
absolute, not relative to the other candidates: two endpoints with 100 and 110 waiting score
nearly alike. (Upstream keeps scores above 0.5 for "spare capacity" it does not measure yet.)

The queue read is :attr:`epp.framework.Endpoint.queue_depth`: the scraped waiting-queue length plus
the requests this picker sent to the endpoint after that scrape was taken.

An endpoint whose metrics are stale counts as fully loaded: it scores 0.0.

Parameters (upstream names):
    threshold (int, default 128): the queue length at and beyond which an endpoint scores 0.0; at
        least 1. (Upstream silently replaces a value of 0 or less with the default; here it is an
        error.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters, int_parameter

DEFAULT_THRESHOLD = 128  # llm-d's QueueThresholdDefault
IDLE_SCORE = 0.5  # llm-d: an empty queue scores 0.5


class LoadAwareScorer:
    def __init__(self, name: str = "load-aware-scorer", *, threshold: int = DEFAULT_THRESHOLD) -> None:
        if threshold < 1:
            raise ValueError(f"{name}: threshold must be at least 1, got {threshold}")
        self.name = name
        self.threshold = threshold

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LoadAwareScorer:
        check_parameters(name, parameters, ("threshold",))
        return cls(name, threshold=int_parameter(name, parameters, "threshold", DEFAULT_THRESHOLD, minimum=1))

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        threshold = self.threshold
        return [
            0.0 if e.metrics.stale else IDLE_SCORE * (1.0 - min(e.queue_depth, threshold) / threshold)
            for e in candidates
        ]
