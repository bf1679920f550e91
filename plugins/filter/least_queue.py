"""``least-queue-filter`` (GIE): keeps the endpoints in the lowest of ``n`` equal bands between the
shortest and the longest queue among the ``n`` candidates: queue <= min + (max - min) / n
(whole requests, as upstream's integer division gives). Keeping the whole band rather than only
the minimum leaves the next plugins a choice, which upstream found better in aggregate. The
shortest queue always survives, so a non-empty candidate list stays non-empty. No parameters.

The queue read is ``Endpoint.queue_depth``: the scraped waiting queue plus what this picker sent since
that scrape. The band is computed over the endpoints whose metrics are fresh; stale ones are kept only
when every candidate is stale (all equally unknown: nothing to tell them apart).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters

__all__ = ["LeastQueueFilter"]


class LeastQueueFilter:
    def __init__(self, name: str = "least-queue-filter") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LeastQueueFilter:
        check_parameters(name, parameters)
        return cls(name)

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        fresh = [(e, e.queue_depth) for e in candidates if not e.metrics.stale]
        if not fresh:
            return list(candidates)
        queues = [q for _, q in fresh]
        low, span, count = min(queues), max(queues) - min(queues), len(fresh)
        # q <= low + span / count, in integers: exact, and what upstream's integer division keeps.
        return [e for e, q in fresh if (q - low) * count <= span]
