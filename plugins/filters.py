"""The built-in filters: each narrows the candidates before the scorers run.

``low-queue-filter`` (GIE): keeps the endpoints whose waiting queue is at most ``threshold``.
    When none qualifies it keeps none, as upstream's does, and the request finds no endpoint.
    Parameters: ``threshold`` (int >= 0, default 128, upstream's queueing threshold).

``least-queue-filter`` (GIE): keeps the endpoints in the lowest of ``n`` equal bands between the
    shortest and the longest queue among the ``n`` candidates: queue <= min + (max - min) / n
    (whole requests, as upstream's integer division gives). Keeping the whole band rather than only
    the minimum leaves the next plugins a choice, which upstream found better in aggregate. The
    shortest queue always survives, so a non-empty candidate list stays non-empty. No parameters.

``least-kv-cache-filter`` (GIE): the same band over KV-cache usage (0..1):
    usage <= min + (max - min) / n. No parameters.

``lora-affinity-filter`` (GIE): for a request naming a LoRA adapter, splits the candidates into
    those with the adapter running or waiting to load ("affinity") and, among the others, those
    with a free adapter slot (running + waiting < max adapters: "available"); endpoints in neither
    group are dropped. When both groups are non-empty it keeps the affinity group with probability
    ``threshold`` and the available group otherwise (so a popular adapter now and then spreads to a
    new endpoint); when one is empty it keeps the other (possibly none). A request for a base
    model (``request.adapter`` is None) passes unfiltered: every endpoint serves it. (Upstream looks
    the base model up among the adapters and so drops every endpoint without a free adapter slot;
    not reproduced.) Parameters: ``threshold`` (number in [0, 1], default 0.999, upstream's
    LORA_AFFINITY_THRESHOLD).

``label-selector-filter`` (llm-d): keeps the endpoints whose labels match a Kubernetes label
    selector, given as the parameters themselves: ``matchLabels`` (a map; every pair must match)
    and ``matchExpressions`` (a list of ``{key, operator, values}``, operator ``In`` or ``NotIn``
    with a non-empty ``values`` list, or ``Exists`` or ``DoesNotExist`` without one). All
    requirements must hold; ``NotIn`` also holds when the label is absent; an empty selector keeps
    every endpoint. Keys and values are checked as Kubernetes checks them, at startup.

Queue and KV-cache usage are read in flight (``Endpoint.queue_depth``, ``Endpoint.kv_usage``): the
scraped numbers plus what this picker sent since that scrape. An endpoint whose metrics are stale
counts as fully loaded: ``low-queue-filter`` and ``lora-affinity-filter`` drop it;
``least-queue-filter`` and ``least-kv-cache-filter`` compute their band over the fresh endpoints
only and keep stale ones only when every candidate is stale (all equally unknown: nothing to tell
them apart). ``label-selector-filter`` reads no metrics; staleness does not affect it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.datalayer.datastore import Endpoint, Metrics
from epp.scheduling.registry import Handle, check_parameters
from epp.extproc.parsing import InferenceRequest

from ._common import float_parameter, int_parameter

__all__ = [
    "LabelSelectorFilter",
    "LeastKVCacheFilter",
    "LeastQueueFilter",
    "LoraAffinityFilter",
    "LowQueueFilter",
    "Requirement",
]

DEFAULT_QUEUE_THRESHOLD = 128  # GIE's DefaultQueueingThresholdLoRA
DEFAULT_LORA_AFFINITY_THRESHOLD = 0.999  # GIE's DefaultLoraAffinityThreshold


class LowQueueFilter:
    def __init__(self, name: str = "low-queue-filter", *, threshold: int = DEFAULT_QUEUE_THRESHOLD) -> None:
        if threshold < 0:
            raise ValueError(f"{name}: threshold must be at least 0, got {threshold}")
        self.name = name
        self.threshold = threshold

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LowQueueFilter:
        check_parameters(name, parameters, ("threshold",))
        return cls(name, threshold=int_parameter(name, parameters, "threshold", DEFAULT_QUEUE_THRESHOLD, minimum=0))

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        threshold = self.threshold
        return [e for e in candidates if not e.metrics.stale and e.queue_depth <= threshold]


class LeastQueueFilter:
    def __init__(self, name: str = "least-queue-filter") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LeastQueueFilter:
        check_parameters(name, parameters)
        return cls(name)

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        fresh = [(e, e.queue_depth) for e in candidates if not e.metrics.stale]
        if not fresh:
            return list(candidates)
        queues = [q for _, q in fresh]
        low, span, count = min(queues), max(queues) - min(queues), len(fresh)
        # q <= low + span / count, in integers: exact, and what upstream's integer division keeps.
        return [e for e, q in fresh if (q - low) * count <= span]


class LeastKVCacheFilter:
    def __init__(self, name: str = "least-kv-cache-filter") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LeastKVCacheFilter:
        check_parameters(name, parameters)
        return cls(name)

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        fresh = [(e, e.kv_usage) for e in candidates if not e.metrics.stale]
        if not fresh:
            return list(candidates)
        usages = [u for _, u in fresh]
        low = min(usages)
        limit = low + (max(usages) - low) / len(fresh)
        return [e for e, u in fresh if u <= limit]


def _has_free_slot(metrics: Metrics) -> bool:
    return len(metrics.running_adapters) + len(metrics.waiting_adapters) < metrics.max_adapters


class LoraAffinityFilter:
    def __init__(
        self,
        name: str = "lora-affinity-filter",
        *,
        threshold: float = DEFAULT_LORA_AFFINITY_THRESHOLD,
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"{name}: threshold must be within [0, 1], got {threshold}")
        self.name = name
        self.threshold = threshold
        self._random = random.Random(seed)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LoraAffinityFilter:
        check_parameters(name, parameters, ("threshold",))
        threshold = float_parameter(
            name, parameters, "threshold", DEFAULT_LORA_AFFINITY_THRESHOLD, minimum=0.0, maximum=1.0
        )
        return cls(name, threshold=threshold)

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        adapter = request.adapter
        if adapter is None:
            return list(candidates)
        affinity: list[Endpoint] = []
        available: list[Endpoint] = []
        for endpoint in candidates:
            metrics = endpoint.metrics
            if metrics.stale:
                continue
            if adapter in metrics.running_adapters or adapter in metrics.waiting_adapters:
                affinity.append(endpoint)
            elif _has_free_slot(metrics):
                available.append(endpoint)
        if affinity and available:
            return affinity if self._random.random() < self.threshold else available
        return affinity or available


# --- label-selector-filter ---------------------------------------------------------------------

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
