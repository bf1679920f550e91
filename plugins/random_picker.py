"""``random-picker``: picks uniformly at random among the candidates, ignoring scores.

Parameters (upstream names):
    maxNumOfEndpoints (int, default 1): how many endpoints to return, primary first; the extra ones
        are fallbacks Envoy may try in order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from epp.datastore import Endpoint
from epp.registry import Handle
from epp.request import InferenceRequest
from epp.scheduling import ScoredEndpoint


def max_num_of_endpoints(name: str, parameters: Mapping[str, Any]) -> int:
    """The pickers' one parameter, checked: ``maxNumOfEndpoints`` (default 1)."""
    unknown = set(parameters) - {"maxNumOfEndpoints"}
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) {sorted(unknown)}; valid: ['maxNumOfEndpoints']")
    count = parameters.get("maxNumOfEndpoints", 1)
    if not isinstance(count, int) or isinstance(count, bool):
        raise ValueError(f"{name}: maxNumOfEndpoints must be an integer, got {count!r}")
    return count


class RandomPicker:
    def __init__(self, name: str = "random-picker", *, max_num_of_endpoints: int = 1, seed: int | None = None) -> None:
        if max_num_of_endpoints < 1:
            raise ValueError(f"{name}: maxNumOfEndpoints must be at least 1, got {max_num_of_endpoints}")
        self.name = name
        self.max_num_of_endpoints = max_num_of_endpoints
        self._random = random.Random(seed)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> RandomPicker:
        return cls(name, max_num_of_endpoints=max_num_of_endpoints(name, parameters))

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        count = min(self.max_num_of_endpoints, len(scored))
        return [item.endpoint for item in self._random.sample(scored, count)]
