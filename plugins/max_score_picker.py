"""``max-score-picker``: the highest-scoring endpoints, ties broken at random.

Parameters (upstream names):
    maxNumOfEndpoints (int, default 1): how many endpoints to return, best first; the extra ones
        are fallbacks Envoy may try in order.

Candidates are shuffled before a stable sort by score, so equal scores come out in random order
(a deterministic tie-break would send every tie to the same endpoint).
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.datastore import Endpoint
from epp.request import InferenceRequest
from epp.scheduling import ScoredEndpoint

from ._common import CountedPicker


class MaxScorePicker(CountedPicker):
    def __init__(self, name: str = "max-score-picker", *, max_num_of_endpoints: int = 1, seed: int | None = None) -> None:
        super().__init__(name, max_num_of_endpoints=max_num_of_endpoints, seed=seed)

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        shuffled = list(scored)
        self._random.shuffle(shuffled)
        shuffled.sort(key=lambda item: item.score, reverse=True)
        return [item.endpoint for item in shuffled[: self.max_num_of_endpoints]]
