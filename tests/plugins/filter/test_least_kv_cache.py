"""low-queue-filter, least-queue-filter, least-kv-cache-filter (GIE) and label-selector-filter (llm-d).
(lora-affinity-filter is tested with the LoRA scorer.)"""

from __future__ import annotations

import pytest

from epp.plugins.filter.least_kv_cache import LeastKVCacheFilter
from tests.plugins._helpers import names, pod, request, send

REQUEST = request()


def pods_named(indexes: list[int]) -> list[str]:
    return [f"pod-{i}" for i in indexes]


@pytest.mark.parametrize(
    ("usages", "stale", "kept"),
    [
        ([0.0, 0.3, 0.6, 0.9], set(), [0]),  # band: 0 + 0.9/4 = 0.225
        ([0.1, 0.3, 0.9], set(), [0, 1]),  # band: 0.1 + 0.8/3 = 0.3667
        ([0.5, 0.75, 1.0], set(), [0]),  # band: 0.5 + 0.5/3 = 0.667
        ([0.2, 0.2], set(), [0, 1]),
        ([0.0, 0.8, 0.4], {0}, [2]),  # band: 0.4 + 0.4/2 = 0.6
        ([0.0, 0.8], {0, 1}, [0, 1]),
    ],
)
def test_least_kv_cache_filter(usages: list[float], stale: set[int], kept: list[int]) -> None:
    candidates = [pod(i, kv=u, stale=i in stale) for i, u in enumerate(usages)]
    assert names(LeastKVCacheFilter().filter(REQUEST, candidates)) == pods_named(kept)


def test_least_kv_cache_filter_counts_prompt_tokens_sent_since_the_scrape() -> None:
    candidates = [pod(0, kv=0.1, cache_tokens=1600), pod(1, kv=0.2, cache_tokens=1600)]
    send(candidates[0], 1, tokens=800)  # pod-0: 0.1 + 0.5 = 0.6; band 0.2 + 0.4/2 = 0.4
    assert names(LeastKVCacheFilter().filter(REQUEST, candidates)) == ["pod-1"]
