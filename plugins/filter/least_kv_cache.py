"""``least-kv-cache-filter`` (GIE): the same band over KV-cache usage (0..1):
usage <= min + (max - min) / n. No parameters.

The usage read is ``Endpoint.kv_usage``: the scraped KV-cache usage plus the prompt tokens this picker
sent since that scrape. The band is computed over the endpoints whose metrics are fresh; stale ones are
kept only when every candidate is stale (all equally unknown: nothing to tell them apart).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters

__all__ = ["LeastKVCacheFilter"]


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
