"""``lora-affinity-scorer``: prefer the endpoint that already has the request's LoRA adapter loaded.

Upstream semantics, per candidate, for the adapter the request names (first match wins):

==========================================================================  =====
the adapter is running on the endpoint (``running_adapters``)              1.0
the endpoint has a free adapter slot (running + waiting < ``max_adapters``)  0.8
the adapter is waiting to be loaded there (``waiting_adapters``)           0.6
otherwise (every slot taken by other adapters)                             0.0
==========================================================================  =====

A free slot ranks above "waiting" as upstream ranks it: loading into a free slot starts at once,
while a waiting adapter waits for a slot to free up.

A request for a base model (``request.adapter`` is None) scores 1.0 everywhere: every endpoint
serves it as well as one with an adapter already loaded, so the choice is left to the other
scorers. (Upstream has no notion of a base model here: it looks the model name up among the
adapters, never finds it, and so scores base-model requests 0.8 on endpoints with a free adapter
slot and 0.0 elsewhere, an artefact this scorer does not reproduce.)

An endpoint whose metrics are stale counts as fully loaded: it scores 0.0 (its adapter lists are
not to be trusted).

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, Metrics, check_parameters

# Upstream's scores (GIE lora-affinity-scorer).
ACTIVE = 1.0
FREE_SLOT = 0.8
WAITING = 0.6


def adapter_affinity(metrics: Metrics, adapter: str) -> float:
    """The upstream score of one endpoint's reported adapters for ``adapter``."""
    if adapter in metrics.running_adapters:
        return ACTIVE
    if len(metrics.running_adapters) + len(metrics.waiting_adapters) < metrics.max_adapters:
        return FREE_SLOT
    if adapter in metrics.waiting_adapters:
        return WAITING
    return 0.0


class LoraAffinityScorer:
    def __init__(self, name: str = "lora-affinity-scorer") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LoraAffinityScorer:
        check_parameters(name, parameters)
        return cls(name)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        adapter = request.adapter
        if adapter is None:
            return [0.0 if e.metrics.stale else 1.0 for e in candidates]
        return [0.0 if e.metrics.stale else adapter_affinity(e.metrics, adapter) for e in candidates]
