"""low-queue-filter, least-queue-filter, least-kv-cache-filter (GIE) and label-selector-filter (llm-d).
(lora-affinity-filter is tested with the LoRA scorer.)"""

from __future__ import annotations

import pytest

from epp.plugins.filter.least_queue import LeastQueueFilter
from tests.plugins._helpers import names, pod, request, send

REQUEST = request()


def pods_named(indexes: list[int]) -> list[str]:
    return [f"pod-{i}" for i in indexes]


@pytest.mark.parametrize(
    ("queues", "stale", "kept"),
    [
        ([0, 10, 20, 30], set(), [0]),  # band: 0 + 30/4 = 7.5 -> 7
        ([0, 7, 8, 28], set(), [0, 1]),  # band: 0 + 28/4 = 7, inclusive
        ([5, 6, 100], set(), [0, 1]),  # band: 5 + 95/3 = 36
        ([4, 4, 4], set(), [0, 1, 2]),
        ([9], set(), [0]),
        ([0, 1], set(), [0]),  # band: 0 + 1/2 -> 0
        ([2, 4], set(), [0]),  # band: 2 + 2/2 = 3
        ([0, 2, 6], set(), [0, 1]),  # band: 0 + 6/3 = 2, inclusive
        ([0, 50, 3], {0}, [2]),  # stale: out of the band computation
        ([0, 50], {0, 1}, [0, 1]),  # all stale: nothing to tell them apart
    ],
)
def test_least_queue_filter(queues: list[int], stale: set[int], kept: list[int]) -> None:
    candidates = [pod(i, queue=q, stale=i in stale) for i, q in enumerate(queues)]
    assert names(LeastQueueFilter().filter(REQUEST, candidates)) == pods_named(kept)


def test_least_queue_filter_counts_requests_sent_since_the_scrape() -> None:
    candidates = [pod(0), pod(1), pod(2, queue=6)]
    send(candidates[0], 4)  # queues 4, 0, 6: band 0 + 6/3 = 2
    assert names(LeastQueueFilter().filter(REQUEST, candidates)) == ["pod-1"]
