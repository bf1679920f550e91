"""``queue-scorer``: prefer the endpoint with the shortest waiting queue.

Upstream semantics: min-max normalisation over the candidates' waiting-queue lengths,
``(max - queue) / (max - min)``: the shortest queue scores 1.0, the longest 0.0, and when every
candidate has the same queue all score 1.0 (nothing to tell them apart).

The queue read is :attr:`epp.datastore.Endpoint.queue_depth`: the scraped waiting-queue length plus
the requests this picker sent to the endpoint after that scrape was taken, so a burst between two
scrapes spreads instead of herding onto the endpoint that looked idle.

An endpoint whose metrics are stale counts as fully loaded: it scores 0.0 and takes no part in the
normalisation.

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.datastore import Endpoint
from epp.registry import Handle, check_parameters
from epp.request import InferenceRequest

from ._common import lower_is_better


class QueueScorer:
    def __init__(self, name: str = "queue-scorer") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> QueueScorer:
        check_parameters(name, parameters)
        return cls(name)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return lower_is_better([None if e.metrics.stale else e.queue_depth for e in candidates])
