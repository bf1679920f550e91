"""``random-picker``: picks uniformly at random among the candidates, ignoring scores.

Parameters (upstream names):
    maxNumOfEndpoints (int, default 1): how many endpoints to return, primary first; the extra ones
        are fallbacks Envoy may try in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.framework import CountedPicker, Endpoint, InferenceRequest, ScoredEndpoint


class RandomPicker(CountedPicker):
    def __init__(self, name: str = "random-picker", *, max_num_of_endpoints: int = 1, seed: int | None = None) -> None:
        super().__init__(name, max_num_of_endpoints=max_num_of_endpoints, seed=seed)

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        count = min(self.max_num_of_endpoints, len(scored))
        return [item.endpoint for item in self._random.sample(scored, count)]
