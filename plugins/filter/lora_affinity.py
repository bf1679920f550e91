"""``lora-affinity-filter`` (GIE): for a request naming a LoRA adapter, splits the candidates into
those with the adapter running or waiting to load ("affinity") and, among the others, those
with a free adapter slot (running + waiting < max adapters: "available"); endpoints in neither
group are dropped. When both groups are non-empty it keeps the affinity group with probability
``threshold`` and the available group otherwise (so a popular adapter now and then spreads to a
new endpoint); when one is empty it keeps the other (possibly none). A request for a base
model (``request.adapter`` is None) passes unfiltered: every endpoint serves it. (Upstream looks
the base model up among the adapters and so drops every endpoint without a free adapter slot;
not reproduced.) Parameters: ``threshold`` (number in [0, 1], default 0.999, upstream's
LORA_AFFINITY_THRESHOLD).

An endpoint whose metrics are stale counts as fully loaded: it is dropped (its adapter lists are not to be
trusted).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, Metrics, check_parameters, float_parameter

__all__ = ["DEFAULT_LORA_AFFINITY_THRESHOLD", "LoraAffinityFilter"]


DEFAULT_LORA_AFFINITY_THRESHOLD = 0.999  # GIE's DefaultLoraAffinityThreshold


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
