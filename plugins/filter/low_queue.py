"""``low-queue-filter`` (GIE): keeps the endpoints whose waiting queue is at most ``threshold``.
When none qualifies it keeps none, as upstream's does, and the request finds no endpoint.
Parameters: ``threshold`` (int >= 0, default 128, upstream's queueing threshold).

The queue read is ``Endpoint.queue_depth``: the scraped waiting queue plus what this picker sent since
that scrape. An endpoint whose metrics are stale counts as fully loaded: it is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters, int_parameter

__all__ = ["DEFAULT_QUEUE_THRESHOLD", "LowQueueFilter"]


DEFAULT_QUEUE_THRESHOLD = 128  # GIE's DefaultQueueingThresholdLoRA


class LowQueueFilter:
    def __init__(self, name: str = "low-queue-filter", *, threshold: int = DEFAULT_QUEUE_THRESHOLD) -> None:
        if threshold < 0:
            raise ValueError(f"{name}: threshold must be at least 0, got {threshold}")
        self.name = name
        self.threshold = threshold

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LowQueueFilter:
        check_parameters(name, parameters, ("threshold",))
        return cls(name, threshold=int_parameter(name, parameters, "threshold", DEFAULT_QUEUE_THRESHOLD, minimum=0))

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        threshold = self.threshold
        return [e for e in candidates if not e.metrics.stale and e.queue_depth <= threshold]
