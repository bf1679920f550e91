"""What the built-in plugins share: parameter checks, min-max normalisation, the pickers' shape."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, Self

from epp.scheduling.registry import Handle, check_parameters


def max_num_of_endpoints(name: str, parameters: Mapping[str, Any]) -> int:
    """The pickers' one parameter, checked: ``maxNumOfEndpoints`` (default 1)."""
    check_parameters(name, parameters, ("maxNumOfEndpoints",))
    return int_parameter(name, parameters, "maxNumOfEndpoints", 1, minimum=1)


def int_parameter(name: str, parameters: Mapping[str, Any], key: str, default: int, *, minimum: int | None = None) -> int:
    """``parameters[key]`` (``default`` when absent) as an integer; ValueError naming the plugin and key."""
    value = parameters.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: {key} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: {key} must be at least {minimum}, got {value}")
    return value


def float_parameter(
    name: str,
    parameters: Mapping[str, Any],
    key: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """``parameters[key]`` (``default`` when absent) as a finite number within the bounds given."""
    value = parameters.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}: {key} must be a number, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else f"at least {minimum:g}"
        high = "" if maximum is None else f"at most {maximum:g}"
        raise ValueError(f"{name}: {key} must be {' and '.join(p for p in (low, high) if p)}, got {value!r}")
    return float(value)


def str_parameter(name: str, parameters: Mapping[str, Any], key: str, default: str) -> str:
    """``parameters[key]`` (``default`` when absent) as a non-empty string."""
    value = parameters.get(key, default)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: {key} must be a non-empty string, got {value!r}")
    return value


def lower_is_better(loads: Sequence[float | None]) -> list[float]:
    """Min-max normalisation, ``(max - load) / (max - min)``: the lowest load scores 1.0, the
    highest 0.0; all equal -> all 1.0. ``None`` (stale metrics) scores 0.0 and takes no part."""
    fresh = [load for load in loads if load is not None]
    if not fresh:
        return [0.0] * len(loads)
    low, high = min(fresh), max(fresh)
    if low == high:
        return [0.0 if load is None else 1.0 for load in loads]
    span = high - low
    return [0.0 if load is None else (high - load) / span for load in loads]


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
