"""``max-score-picker``: the highest-scoring endpoints, ties broken at random.

Parameters (upstream names):
    maxNumOfEndpoints (int, default 1): how many endpoints to return, best first; the extra ones
        are fallbacks Envoy may try in order.

Candidates are shuffled before a stable sort by score, so equal scores come out in random order
(a deterministic tie-break would send every tie to the same endpoint).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from epp.datastore import Endpoint
from epp.registry import Handle
from epp.request import InferenceRequest
from epp.scheduling import ScoredEndpoint

from .random_picker import max_num_of_endpoints


class MaxScorePicker:
    def __init__(self, name: str = "max-score-picker", *, max_num_of_endpoints: int = 1, seed: int | None = None) -> None:
        if max_num_of_endpoints < 1:
            raise ValueError(f"{name}: maxNumOfEndpoints must be at least 1, got {max_num_of_endpoints}")
        self.name = name
        self.max_num_of_endpoints = max_num_of_endpoints
        self._random = random.Random(seed)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> MaxScorePicker:
        return cls(name, max_num_of_endpoints=max_num_of_endpoints(name, parameters))

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        shuffled = list(scored)
        self._random.shuffle(shuffled)
        shuffled.sort(key=lambda item: item.score, reverse=True)
        return [item.endpoint for item in shuffled[: self.max_num_of_endpoints]]
