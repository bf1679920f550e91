"""``label-selector-filter`` (llm-d): keeps the endpoints whose labels match a Kubernetes label
selector, given as the parameters themselves: ``matchLabels`` (a map; every pair must match)
and ``matchExpressions`` (a list of ``{key, operator, values}``, operator ``In`` or ``NotIn``
with a non-empty ``values`` list, or ``Exists`` or ``DoesNotExist`` without one). All
requirements must hold; ``NotIn`` also holds when the label is absent; an empty selector keeps
every endpoint. Keys and values are checked as Kubernetes checks them, at startup.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters

__all__ = ["LabelSelectorFilter", "Requirement", "parse_selector"]


# Kubernetes label syntax (k8s.io/apimachinery validation): a name segment of at most 63
# characters, alphanumeric at both ends with [-_.] inside; a key may carry a DNS-subdomain prefix
# of at most 253 characters and a "/"; a value is a name segment or empty.
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _check_key(name: str, key: object) -> str:
    if not isinstance(key, str):
        raise ValueError(f"{name}: label key {key!r} must be a string")
    prefix, slash, segment = key.rpartition("/")
    if slash and not (prefix and len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise ValueError(
            f"{name}: label key {key!r}: the prefix must be a DNS subdomain (lower-case, at most 253 characters)"
        )
    if not (len(segment) <= 63 and _NAME.fullmatch(segment)):
        raise ValueError(
            f"{name}: label key {key!r}: the name must be 1-63 characters, alphanumeric at both ends, "
            "with '-', '_' or '.' inside"
        )
    return key


def _check_value(name: str, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: the value of label {key!r} must be a string, got {value!r} (quote it in YAML)")
    if value and not (len(value) <= 63 and _NAME.fullmatch(value)):
        raise ValueError(
            f"{name}: label value {value!r} (key {key!r}) must be at most 63 characters, alphanumeric at both "
            "ends, with '-', '_' or '.' inside"
        )
    return value


@dataclass(frozen=True, slots=True)
class Requirement:
    """One label requirement: ``operator`` is In, NotIn, Exists or DoesNotExist."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        operator = self.operator
        if operator == "In":
            return labels.get(self.key) in self.values
        if operator == "NotIn":
            return labels.get(self.key) not in self.values  # an absent label is not in any set
        if operator == "Exists":
            return self.key in labels
        return self.key not in labels


def _requirement(name: str, index: int, item: object) -> Requirement:
    where = f"{name}: matchExpressions[{index}]"
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be a map with key, operator and values, got {item!r}")
    unknown = sorted(set(item) - {"key", "operator", "values"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; valid: ['key', 'operator', 'values']")
    if "key" not in item or "operator" not in item:
        raise ValueError(f"{where} needs both key and operator")
    key = _check_key(name, item["key"])
    operator = item["operator"]
    if operator not in _OPERATORS:
        raise ValueError(f"{where}: operator {operator!r} is not one of {list(_OPERATORS)}")
    values = item.get("values")
    if values is None:
        values = []
    if not isinstance(values, list):
        raise ValueError(f"{where}: values must be a list, got {values!r}")
    if operator in ("In", "NotIn") and not values:
        raise ValueError(f"{where}: operator {operator} needs a non-empty values list")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ValueError(f"{where}: operator {operator} takes no values, got {values!r}")
    return Requirement(key, operator, frozenset(_check_value(name, key, v) for v in values))


def parse_selector(name: str, parameters: Mapping[str, Any]) -> tuple[Requirement, ...]:
    """A Kubernetes ``LabelSelector`` (``matchLabels``, ``matchExpressions``) as requirements, all of
    which must hold. ValueError naming what is wrong."""
    check_parameters(name, parameters, ("matchLabels", "matchExpressions"))
    match_labels = parameters.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise ValueError(f"{name}: matchLabels must be a map of label keys to values, got {match_labels!r}")
    expressions = parameters.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise ValueError(f"{name}: matchExpressions must be a list, got {expressions!r}")
    requirements = [
        Requirement(_check_key(name, key), "In", frozenset([_check_value(name, key, value)]))
        for key, value in match_labels.items()
    ]
    requirements += [_requirement(name, i, item) for i, item in enumerate(expressions)]
    return tuple(requirements)


class LabelSelectorFilter:
    def __init__(self, name: str = "label-selector-filter", requirements: Sequence[Requirement] = ()) -> None:
        self.name = name
        self.requirements = tuple(requirements)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LabelSelectorFilter:
        return cls(name, parse_selector(name, parameters))

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        requirements = self.requirements
        return [e for e in candidates if all(r.matches(e.labels) for r in requirements)]
