"""Small pieces the built-in scorers and pickers share, offered to every plugin."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Self

from epp.framework.handle import Handle
from epp.framework.parameters import check_parameters, int_parameter

__all__ = ["CountedPicker", "LogLimiter", "lower_is_better", "max_num_of_endpoints"]


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


class LogLimiter:
    """At most one log line per key every ``every`` seconds; the lines held back are counted, and the count
    goes with the next line let through. For what can happen once per request or per connection (a failing
    plugin, a misconfigured client), where a line each time would flood the log::

        _limit = LogLimiter(60.0)
        ...
        held = _limit.allow(kind)  # None: not now (counted); else how many were held back since the last
        if held is not None:
            log.warning("...%s", f" ({held} more in the last minute)" if held else "")

    Keys are kept until :meth:`reset`; past ``max_keys`` of them (keys that name peers, say) all are
    forgotten at once, so memory stays bounded and at worst a key is logged again early. Not thread-safe:
    one limiter per thread (the event loop's, typically).
    """

    __slots__ = ("_clock", "_every", "_held", "_last", "_max_keys")

    def __init__(
        self, every: float = 60.0, *, max_keys: int = 1024, clock: Callable[[], float] | None = None
    ) -> None:
        self._every = every
        self._max_keys = max_keys
        self._clock = time.monotonic if clock is None else clock
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable = None) -> int | None:
        """``None`` if a line for ``key`` was let through less than ``every`` seconds ago (this one is
        counted as held back); else the count of those held back since it (0 for the first), reset."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._every:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if last is None and len(self._last) >= self._max_keys:
            self.reset()
        self._last[key] = now
        return self._held.pop(key, 0)

    def reset(self) -> None:
        """Forget every key: the next line of each is let through."""
        self._last.clear()
        self._held.clear()
