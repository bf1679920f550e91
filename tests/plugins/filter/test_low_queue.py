"""low-queue-filter, least-queue-filter, least-kv-cache-filter (GIE) and label-selector-filter (llm-d).
(lora-affinity-filter is tested with the LoRA scorer.)"""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle
from epp.plugins.filter.least_kv_cache import LeastKVCacheFilter
from epp.plugins.filter.least_queue import LeastQueueFilter
from epp.plugins.filter.low_queue import LowQueueFilter
from tests.plugins._helpers import names, pod, request, send

REQUEST = request()


HANDLE = Handle(Datastore())


def pods_named(indexes: list[int]) -> list[str]:
    return [f"pod-{i}" for i in indexes]


@pytest.mark.parametrize(
    ("threshold", "queues", "stale", "kept"),
    [
        (128, [0, 128, 129, 500], set(), [0, 1]),  # at the threshold is kept, above is not
        (5, [3, 6, 5], set(), [0, 2]),
        (0, [0, 1, 0], set(), [0, 2]),
        (5, [6, 7], set(), []),  # none qualifies: none kept, as upstream
        (5, [0, 1], {0}, [1]),  # stale: fully loaded
        (5, [0, 1], {0, 1}, []),
    ],
)
def test_low_queue_filter(threshold: int, queues: list[int], stale: set[int], kept: list[int]) -> None:
    candidates = [pod(i, queue=q, stale=i in stale) for i, q in enumerate(queues)]
    assert names(LowQueueFilter(threshold=threshold).filter(REQUEST, candidates)) == pods_named(kept)


def test_low_queue_filter_counts_requests_sent_since_the_scrape() -> None:
    candidates = [pod(0, queue=3), pod(1, queue=3)]
    send(candidates[1], 3)
    assert names(LowQueueFilter(threshold=5).filter(REQUEST, candidates)) == ["pod-0"]


@pytest.mark.parametrize(("parameters", "expected"), [({}, 128), ({"threshold": 0}, 0), ({"threshold": 16}, 16)])
def test_low_queue_filter_from_config(parameters: dict[str, Any], expected: int) -> None:
    assert LowQueueFilter.from_config("f", parameters, HANDLE).threshold == expected


@pytest.mark.parametrize(
    ("factory", "parameters", "message"),
    [
        (LowQueueFilter.from_config, {"threshold": -1}, "at least 0"),
        (LowQueueFilter.from_config, {"threshold": 1.5}, "must be an integer"),
        (LowQueueFilter.from_config, {"threshold": "8"}, "must be an integer"),
        (LowQueueFilter.from_config, {"queueThreshold": 8}, "unknown parameter"),
        (LeastQueueFilter.from_config, {"threshold": 8}, "takes no parameters"),
        (LeastKVCacheFilter.from_config, {"threshold": 0.5}, "takes no parameters"),
    ],
)
def test_queue_filters_refuse_bad_parameters(factory: Any, parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory("f", parameters, HANDLE)
