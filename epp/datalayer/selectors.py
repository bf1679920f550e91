"""Metric selectors: which series of a ``/metrics`` page a value is read from.

The syntax is upstream's (the ``core-metrics-extractor`` ``engineConfigs`` of GIE and llm-d-router):
a PromQL instant-vector selector restricted to equality matchers, ``name`` or
``name{label="value",other=value}``. Values may be quoted (with the exposition format's three
escapes, ``\\\\``, ``\\"`` and ``\\n``) or bare, as upstream accepts. Inequality and regex matchers
(``!=``, ``=~``, ``!~``) are refused with a message that says so, not misread.

A label matcher follows PromQL's rule: a label the series lacks reads as the empty string, so
``name{a=""}`` matches the series without ``a`` (the page reader, :mod:`epp.datalayer.page`, applies it).
``str()`` of a :class:`Selector` is its canonical text, which :func:`parse_selector` reads back
unchanged. An empty text is an error here; the engine configuration uses it to disable a field
(:func:`epp.datalayer.engines.engine_from_config`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Selector", "escape_label_value", "is_label_name", "parse_selector"]

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


@dataclass(frozen=True, slots=True, repr=False)
class Selector:
    """A metric name and the label values a series must have (equality matchers only)."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not _METRIC_NAME.match(self.name):
            raise ValueError(f"invalid metric name {self.name!r}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")
        for label, _ in self.labels:
            if not _LABEL_NAME.match(label):
                raise ValueError(f"invalid label name {label!r} in selector for {self.name!r}")

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        pairs = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in self.labels)
        return f"{self.name}{{{pairs}}}"

    def __repr__(self) -> str:
        return f"Selector({str(self)!r})"


def escape_label_value(value: str) -> str:
    """``value`` as the exposition format writes it between quotes (``\\``, ``"`` and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def is_label_name(text: str) -> bool:
    """Whether ``text`` is a valid Prometheus label name."""
    return _LABEL_NAME.match(text) is not None


def parse_selector(text: str) -> Selector:
    """Parse ``name`` or ``name{label="value",...}`` (values may also be unquoted, as upstream allows).

    Raises :class:`ValueError` saying what is wrong. An empty string is an error here; configuration
    uses it to disable a field (see :func:`epp.datalayer.engines.engine_from_config`).
    """
    s = text.strip()
    if not s:
        raise ValueError("empty metric selector")
    brace = s.find("{")
    name = (s if brace < 0 else s[:brace]).strip()
    if not _METRIC_NAME.match(name):
        raise ValueError(f"invalid metric name {name!r} in selector {text!r}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")
    if brace < 0:
        return Selector(name)
    labels: dict[str, str] = {}
    i, n = brace + 1, len(s)
    while True:
        while i < n and s[i] in " \t":
            i += 1
        if i < n and s[i] == "}":
            break
        j = i
        while j < n and (s[j].isalnum() or s[j] == "_"):
            j += 1
        label = s[i:j]
        while j < n and s[j] in " \t":
            j += 1
        if j >= n:
            raise ValueError(f"unclosed '{{' in selector {text!r}")
        if s.startswith(("!=", "=~", "!~"), j):
            raise ValueError(f"only equality matchers (label=\"value\") are supported, got {s[j:j + 2]!r} in {text!r}")
        if not label or s[j] != "=":
            raise ValueError(f"expected label=\"value\" at {s[i:i + 20]!r} in selector {text!r}")
        if not _LABEL_NAME.match(label):
            raise ValueError(f"invalid label name {label!r} in selector {text!r}")
        j += 1
        while j < n and s[j] in " \t":
            j += 1
        value, i = _selector_value(s, j, text)
        if label in labels:
            raise ValueError(f"label {label!r} given twice in selector {text!r}")
        labels[label] = value
        while i < n and s[i] in " \t":
            i += 1
        if i >= n:
            raise ValueError(f"unclosed '{{' in selector {text!r}")
        if s[i] == ",":
            i += 1
        elif s[i] != "}":
            raise ValueError(f"expected ',' or '}}' after label {label!r} in selector {text!r}")
    if s[i + 1 :].strip():
        raise ValueError(f"unexpected text {s[i + 1:]!r} after '}}' in selector {text!r}")
    return Selector(name, tuple(labels.items()))


def _selector_value(s: str, i: int, text: str) -> tuple[str, int]:
    """One label value starting at ``s[i]``: quoted (with \\\\, \\" and \\n escapes) or bare."""
    n = len(s)
    if i < n and s[i] == '"':
        out: list[str] = []
        i += 1
        while i < n:
            c = s[i]
            if c == '"':
                return "".join(out), i + 1
            if c == "\\":
                if i + 1 >= n or s[i + 1] not in '\\"n':
                    raise ValueError(f"invalid escape {s[i:i + 2]!r} in selector {text!r} (only \\\\, \\\" and \\n)")
                out.append("\n" if s[i + 1] == "n" else s[i + 1])
                i += 2
            else:
                out.append(c)
                i += 1
        raise ValueError(f"unterminated quoted label value in selector {text!r}")
    j = i
    while j < n and not s[j].isspace() and s[j] not in '",{}=!~':
        j += 1
    if j == i:
        raise ValueError(f"missing label value at {s[i:i + 20]!r} in selector {text!r}")
    return s[i:j], j
