"""Checking a plugin's ``parameters``: the helpers every built-in plugin uses, offered to every plugin.

A config file is decoded strictly: a typo must stop startup, not be ignored, because a silently ignored
line is a routing policy nobody asked for. So a factory first refuses keys it does not know
(:func:`check_parameters`), then reads each value with the helper of its type, which raises a
``ValueError`` naming the plugin and the key (``"my-scorer: threshold must be an integer, got 'x'"``);
startup reports it with where in the file it was found.

Durations are Go duration strings (``"50ms"``, ``"2m"``, ``"1m30s"``), as in upstream's configs and flags.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "Duration",
    "bool_parameter",
    "check_parameters",
    "duration_parameter",
    "float_parameter",
    "format_duration",
    "int_parameter",
    "parse_duration",
    "str_parameter",
]


def check_parameters(name: str, parameters: Mapping[str, Any], valid: Iterable[str] = ()) -> None:
    """ValueError naming any parameter not in ``valid`` (and listing those that are)."""
    valid = tuple(valid)
    unknown = sorted(set(parameters) - set(valid))
    if unknown and not valid:
        raise ValueError(f"{name}: takes no parameters, got {unknown}")
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) {unknown}; valid: {list(valid)}")


def int_parameter(
    name: str, parameters: Mapping[str, Any], key: str, default: int, *, minimum: int | None = None
) -> int:
    """``parameters[key]`` (``default`` when absent) as an integer, at least ``minimum``."""
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


def str_parameter(
    name: str, parameters: Mapping[str, Any], key: str, default: str, *, allow_empty: bool = False
) -> str:
    """``parameters[key]`` (``default`` when absent) as a string, non-empty unless ``allow_empty``."""
    value = parameters.get(key, default)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ValueError(f"{name}: {key} must be a {'' if allow_empty else 'non-empty '}string, got {value!r}")
    return value


def bool_parameter(name: str, parameters: Mapping[str, Any], key: str, default: bool) -> bool:
    """``parameters[key]`` (``default`` when absent) as true or false (YAML's booleans, not strings)."""
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {key} must be true or false, got {value!r}")
    return value


def duration_parameter(
    name: str, parameters: Mapping[str, Any], key: str, default: float, *, positive: bool = False
) -> float:
    """``parameters[key]``, a Go duration string, in seconds (``default`` seconds when absent).

    Never negative; with ``positive``, never zero either.
    """
    value = parameters.get(key)
    if value is None:
        return default
    want = f'{name}: {key} must be a Go duration string such as "30s", "2m" or "1m30s"'
    if not isinstance(value, str):
        raise ValueError(f"{want}, got {value!r}")
    try:
        seconds = float(parse_duration(value))
    except ValueError:
        raise ValueError(f"{want}; {value!r} is not a Go duration") from None
    if seconds < 0 or (positive and seconds == 0):
        raise ValueError(f"{name}: {key} must be {'positive' if positive else 'at least 0s'}, got {value!r}")
    return seconds


class Duration(float):
    """Seconds, written as a Go duration ("50ms", "2s", "1m30s")."""

    def __repr__(self) -> str:
        return format_duration(self)


# Go's time.ParseDuration units, in seconds.
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(text: str) -> Duration:
    """Go's time.ParseDuration: a signed sequence of decimal numbers with units; "0" alone is allowed."""
    body = text[1:] if text[:1] in "+-" else text
    if body == "0":
        return Duration(0.0)
    position, total = 0, 0.0
    while position < len(body):
        match = _DURATION_PART.match(body, position)
        if match is None:
            raise ValueError(f"time: invalid duration {text!r}")
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        position = match.end()
    if not body:
        raise ValueError(f"time: invalid duration {text!r}")
    return Duration(-total if text.startswith("-") else total)


def format_duration(seconds: float) -> str:
    """A short Go-style spelling: 50ms, 2s, 1.5s, 300us; 0s for zero, as Go writes it."""
    if seconds == 0:
        return "0s"
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= size or unit == "us":
            value = seconds / size
            return f"{value:g}{unit}"
    return "0s"
