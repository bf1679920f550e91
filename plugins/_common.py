"""What the built-in plugins share: parameter checks and the pickers' common shape."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Self

from epp.registry import Handle


def no_parameters(name: str, parameters: Mapping[str, Any]) -> None:
    if parameters:
        raise ValueError(f"{name}: takes no parameters, got {sorted(parameters)}")


def max_num_of_endpoints(name: str, parameters: Mapping[str, Any]) -> int:
    """The pickers' one parameter, checked: ``maxNumOfEndpoints`` (default 1)."""
    unknown = set(parameters) - {"maxNumOfEndpoints"}
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) {sorted(unknown)}; valid: ['maxNumOfEndpoints']")
    count = parameters.get("maxNumOfEndpoints", 1)
    if not isinstance(count, int) or isinstance(count, bool):
        raise ValueError(f"{name}: maxNumOfEndpoints must be an integer, got {count!r}")
    return count


class CountedPicker:
    """A picker returning up to ``max_num_of_endpoints`` endpoints, with its own random source."""

    def __init__(self, name: str, *, max_num_of_endpoints: int = 1, seed: int | None = None) -> None:
        if max_num_of_endpoints < 1:
            raise ValueError(f"{name}: maxNumOfEndpoints must be at least 1, got {max_num_of_endpoints}")
        self.name = name
        self.max_num_of_endpoints = max_num_of_endpoints
        self._random = random.Random(seed)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        return cls(name, max_num_of_endpoints=max_num_of_endpoints(name, parameters))
