"""``running-requests-size-scorer``: prefer the endpoint running the fewest requests.

Upstream semantics: min-max normalisation over the candidates' running-request counts,
``(max - running) / (max - min)``: the fewest running scores 1.0, the most 0.0, and when every
candidate runs as many all score 1.0.

The count read is the scraped ``running_requests`` plus the requests this picker sent to the
endpoint after that scrape was taken (``Endpoint.inflight.since(metrics.updated_at)``): the picker
cannot know whether the model server has started them yet, and counting them is what stops a burst
between two scrapes herding onto the endpoint that looked idle. (``queue-scorer`` counts the same
requests as waiting; each scorer sees them once.)

An endpoint whose metrics are stale counts as fully loaded: it scores 0.0 and takes no part in the
normalisation.

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters, lower_is_better


def running_requests(endpoint: Endpoint) -> int:
    """Requests running on ``endpoint`` as last scraped, plus those sent to it since."""
    metrics = endpoint.metrics
    return metrics.running_requests + endpoint.inflight.since(metrics.updated_at)[0]


class RunningRequestsSizeScorer:
    def __init__(self, name: str = "running-requests-size-scorer") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> RunningRequestsSizeScorer:
        check_parameters(name, parameters)
        return cls(name)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return lower_is_better([None if e.metrics.stale else running_requests(e) for e in candidates])
