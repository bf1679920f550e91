"""What the built-in pickers share: their parameter and their shape."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Self

from epp.registry import Handle, check_parameters


def max_num_of_endpoints(name: str, parameters: Mapping[str, Any]) -> int:
    """The pickers' one parameter, checked: ``maxNumOfEndpoints`` (default 1)."""
    check_parameters(name, parameters, ("maxNumOfEndpoints",))
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
