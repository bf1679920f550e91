"""Table-driven tests of queue-scorer, kv-cache-utilization-scorer and the pickers, against
upstream's semantics, and of the in-flight accounting the load scorers read."""

from __future__ import annotations

import pytest

from epp.plugins.scorer.kv_cache_utilization import KVCacheUtilizationScorer
from tests.plugins._helpers import pod, request, send

REQUEST = request()


@pytest.mark.parametrize(
    ("usages", "stale", "expected"),
    [
        ([0.0, 0.25, 1.0], set(), [1.0, 0.75, 0.0]),
        ([0.5, 0.5], {1}, [0.5, 0.0]),
    ],
)
def test_kv_cache_utilization_scorer(usages: list[float], stale: set[int], expected: list[float]) -> None:
    candidates = [pod(i, kv=u, stale=i in stale) for i, u in enumerate(usages)]
    assert KVCacheUtilizationScorer().score(REQUEST, candidates) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("usage", "cache_tokens", "sent_tokens", "expected"),
    [
        (0.0, 1600, 400, 0.75),  # 400 of 1600 tokens sent since the scrape
        (0.5, 1600, 400, 0.25),
        (0.5, 1600, 4000, 0.0),  # never below 0
        (0.5, None, 400, 0.5),  # cache size unknown: the scraped usage alone
    ],
)
def test_kv_cache_utilization_scorer_counts_prompt_tokens_sent_since_the_scrape(
    usage: float, cache_tokens: int | None, sent_tokens: int, expected: float
) -> None:
    idle, busy = pod(0, kv=usage, cache_tokens=cache_tokens), pod(1, kv=usage, cache_tokens=cache_tokens)
    send(busy, 1, tokens=sent_tokens)
    assert KVCacheUtilizationScorer().score(REQUEST, [idle, busy]) == pytest.approx([1.0 - usage, expected])
