"""Small pieces the built-in scorers and pickers share, offered to every plugin."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Self

from epp.framework.handle import Handle
from epp.framework.parameters import check_parameters, int_parameter

__all__ = ["CountedPicker", "lower_is_better", "max_num_of_endpoints"]


def lower_is_better(loads: Sequence[float | None]) -> list[float]:
    """Min-max normalisation, ``(max - load) / (max - min)``: the lowest load scores 1.0, the highest
    0.0; all equal -> all 1.0. ``None`` (stale metrics) scores 0.0 and takes no part."""
    fresh = [load for load in loads if load is not None]
    if not fresh:
        return [0.0] * len(loads)
    low, high = min(fresh), max(fresh)
    if low == high:
        return [0.0 if load is None else 1.0 for load in loads]
    span = high - low
    return [0.0 if load is None else (high - load) / span for load in loads]


def max_num_of_endpoints(name: str, parameters: Mapping[str, Any]) -> int:
    """The pickers' one upstream parameter, checked: ``maxNumOfEndpoints`` (default 1)."""
    check_parameters(name, parameters, ("maxNumOfEndpoints",))
    return int_parameter(name, parameters, "maxNumOfEndpoints", 1, minimum=1)


class CountedPicker:
    """Base of a picker returning up to ``max_num_of_endpoints`` endpoints, with its own random source.

    ``from_config`` reads upstream's ``maxNumOfEndpoints``; a subclass implements ``pick``.
    """

    def __init__(self, name: str, *, max_num_of_endpoints: int = 1, seed: int | None = None) -> None:
        if max_num_of_endpoints < 1:
            raise ValueError(f"{name}: maxNumOfEndpoints must be at least 1, got {max_num_of_endpoints}")
        self.name = name
        self.max_num_of_endpoints = max_num_of_endpoints
        self._random = random.Random(seed)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        return cls(name, max_num_of_endpoints=max_num_of_endpoints(name, parameters))
