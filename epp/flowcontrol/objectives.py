"""InferenceObjectives: the priority a request gets, chosen by name in a request header.

Design
------
Upstream ties a request to an InferenceObjective by name: the header ``x-llm-d-inference-objective``
(llm-d's current spelling, read first) or ``x-gateway-inference-objective`` (GIE's). The objective's
``spec.priority`` (an int32; unset means 0) becomes the request's priority: higher is served first
by flow control, and a priority below 0 is *sheddable* (refused with 429 while the pool is
saturated when flow control is off). A request that names no objective, or one nobody defined,
gets priority 0, as upstream.

Objectives come from two places:

* **The config file**, in the section ``inferenceObjectives``. Upstream has no such section (its
  objectives exist only as Kubernetes resources); this one is this project's extension, so that a
  picker without Kubernetes can have priorities. It mirrors the resource's fields and is strict::

      inferenceObjectives:
      - name: interactive      # what the header names; required, unique
        priority: 10           # an int32; optional, default 0
      - name: batch
        priority: -1           # sheddable

* **Kubernetes**: the ``InferenceObjective`` resources (``inference.networking.x-k8s.io/v1alpha2``)
  of the pool's namespace that reference the pool, watched by :mod:`epp.kube.objectives`, which
  calls :meth:`Objectives.set_discovered` with the whole current set after every change. A resource
  overrides a config entry of the same name (the cluster is the live source; the file is a default).

Resolving is a header read and a dict lookup per request; the table is replaced whole, never
mutated, so a request never sees half an update.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "DEFAULT_PRIORITY",
    "OBJECTIVE_HEADERS",
    "Objectives",
    "check_priority",
    "decode_objectives",
]

# llm-d's name first, then GIE's (both are read upstream).
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
DEFAULT_PRIORITY = 0  # upstream: no objective, or an objective without a priority
_INT32 = (-(2**31), 2**31 - 1)  # spec.priority is an int32
_KEYS = ("name", "priority")


def check_priority(value: Any, where: str) -> int:
    """``value`` as a priority (an int32; None is the default 0); ValueError saying where it is wrong."""
    if value is None:
        return DEFAULT_PRIORITY
    if not isinstance(value, int) or isinstance(value, bool) or not _INT32[0] <= value <= _INT32[1]:
        raise ValueError(f"{where}: priority must be an integer in the int32 range, got {value!r}")
    return value


def decode_objectives(value: Any, where: str = "inferenceObjectives") -> dict[str, int]:
    """The config section ``inferenceObjectives`` -> objective name -> priority, strictly."""
    if value is None:
        return {}
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of {{name, priority}} mappings")
    objectives: dict[str, int] = {}
    for index, entry in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{at} must be a mapping with name and priority")
        for key in entry:
            if key not in _KEYS:
                raise ValueError(f"{at}: unknown key {key!r}; valid keys: {', '.join(_KEYS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{at}: name is required and must be a non-empty string, got {name!r}")
        if name in objectives:
            raise ValueError(f"{at}: objective {name!r} is defined twice")
        objectives[name] = check_priority(entry.get("priority"), at)
    return objectives


class Objectives:
    """Objective name -> priority: the configured ones, overridden by those discovered in Kubernetes."""

    def __init__(self, configured: Mapping[str, int] | None = None) -> None:
        self._configured: Mapping[str, int] = MappingProxyType(dict(configured or {}))
        self._discovered: Mapping[str, int] = MappingProxyType({})
        self._table: Mapping[str, int] = self._configured

    def resolve(self, headers: Mapping[str, str]) -> tuple[str, int]:
        """(objective name, priority) for a request's headers: ("", 0) when it names none.

        A name nobody defined keeps its name (for logs) and gets the default priority, as upstream.
        """
        for header in OBJECTIVE_HEADERS:
            name = headers.get(header)
            if name:
                return name, self._table.get(name, DEFAULT_PRIORITY)
        return "", DEFAULT_PRIORITY

    def priority(self, name: str) -> int:
        return self._table.get(name, DEFAULT_PRIORITY)

    def set_discovered(self, discovered: Mapping[str, int]) -> None:
        """Replace the objectives read from Kubernetes (the whole current set)."""
        self._discovered = MappingProxyType(dict(discovered))
        self._table = MappingProxyType({**self._configured, **self._discovered})

    @property
    def discovered(self) -> Mapping[str, int]:
        """The objectives last read from Kubernetes."""
        return self._discovered

    @property
    def table(self) -> Mapping[str, int]:
        """Every known objective and its priority, as requests see them now."""
        return self._table
