"""``kv-cache-utilization-scorer``: prefer the endpoint with the most free KV-cache.

Upstream semantics: score = 1 - KV-cache usage (usage in 0..1).

The usage read is :attr:`epp.framework.Endpoint.kv_usage`: the scraped usage plus the prompt
tokens this picker sent to the endpoint after that scrape was taken (when the endpoint reports its
cache size), so a burst of long prompts between two scrapes spreads.

An endpoint whose metrics are stale counts as fully loaded: it scores 0.0.

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters


class KVCacheUtilizationScorer:
    def __init__(self, name: str = "kv-cache-utilization-scorer") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> KVCacheUtilizationScorer:
        check_parameters(name, parameters)
        return cls(name)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return [0.0 if e.metrics.stale else 1.0 - e.kv_usage for e in candidates]
