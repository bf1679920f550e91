"""low-queue-filter, least-queue-filter, least-kv-cache-filter (GIE) and label-selector-filter (llm-d).
(lora-affinity-filter is tested with the LoRA scorer.)"""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.plugins.filters import LabelSelectorFilter, LeastKVCacheFilter, LeastQueueFilter, LowQueueFilter
from epp.scheduling.registry import Handle

from ._helpers import names, pod, request, send

REQUEST = request()
HANDLE = Handle(Datastore())


def pods_named(indexes: list[int]) -> list[str]:
    return [f"pod-{i}" for i in indexes]


# --- low-queue-filter -----------------------------------------------------------------------------


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


# --- least-queue-filter ---------------------------------------------------------------------------


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


# --- least-kv-cache-filter ------------------------------------------------------------------------


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


# --- parameters of the queue filters --------------------------------------------------------------


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


# --- label-selector-filter ------------------------------------------------------------------------

LABELS = [
    {"role": "decode", "hw": "H100"},
    {"role": "prefill", "hw": "H100"},
    {"role": "decode", "hw": "A100", "llm-d.ai/canary": "true"},
    {},
]


@pytest.mark.parametrize(
    ("selector", "kept"),
    [
        ({}, [0, 1, 2, 3]),  # empty selector: everything
        ({"matchLabels": {"role": "decode"}}, [0, 2]),
        ({"matchLabels": {"role": "decode", "hw": "H100"}}, [0]),  # every pair must match
        ({"matchLabels": {"role": ""}}, []),  # an empty value matches only an empty value, not absence
        ({"matchExpressions": [{"key": "hw", "operator": "In", "values": ["A100", "B200"]}]}, [2]),
        ({"matchExpressions": [{"key": "role", "operator": "NotIn", "values": ["prefill"]}]}, [0, 2, 3]),  # absent passes
        ({"matchExpressions": [{"key": "llm-d.ai/canary", "operator": "Exists"}]}, [2]),
        ({"matchExpressions": [{"key": "llm-d.ai/canary", "operator": "DoesNotExist"}]}, [0, 1, 3]),
        ({"matchExpressions": [{"key": "role", "operator": "Exists", "values": None}]}, [0, 1, 2]),
        (
            {
                "matchLabels": {"role": "decode"},
                "matchExpressions": [{"key": "llm-d.ai/canary", "operator": "DoesNotExist"}],
            },
            [0],
        ),
        (
            {
                "matchExpressions": [
                    {"key": "hw", "operator": "In", "values": ["H100"]},
                    {"key": "role", "operator": "NotIn", "values": ["decode"]},
                ]
            },
            [1],
        ),
    ],
)
def test_label_selector_filter(selector: dict[str, Any], kept: list[int]) -> None:
    candidates = [pod(i, labels=labels) for i, labels in enumerate(LABELS)]
    label_filter = LabelSelectorFilter.from_config("f", selector, HANDLE)
    assert names(label_filter.filter(REQUEST, candidates)) == pods_named(kept)


def test_label_selector_filter_ignores_staleness() -> None:
    candidates = [pod(0, labels={"role": "decode"}, stale=True), pod(1, labels={"role": "prefill"})]
    label_filter = LabelSelectorFilter.from_config("f", {"matchLabels": {"role": "decode"}}, HANDLE)
    assert names(label_filter.filter(REQUEST, candidates)) == ["pod-0"]


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ({"selector": {}}, "unknown parameter"),
        ({"matchLabels": ["role=decode"]}, "matchLabels must be a map"),
        ({"matchLabels": {"gpus": 8}}, "must be a string.*quote it"),
        ({"matchLabels": {"role": "has space"}}, "label value 'has space'"),
        ({"matchLabels": {"-role": "x"}}, "label key '-role'"),
        ({"matchLabels": {"Bad_Prefix.io/role": "x"}}, "prefix must be a DNS subdomain"),
        ({"matchLabels": {"a" * 64: "x"}}, "1-63 characters"),
        ({"matchLabels": {"role": "v" * 64}}, "at most 63 characters"),
        ({"matchExpressions": {"key": "role"}}, "matchExpressions must be a list"),
        ({"matchExpressions": ["role"]}, r"matchExpressions\[0\] must be a map"),
        ({"matchExpressions": [{"key": "role", "operator": "in", "values": ["x"]}]}, "operator 'in' is not one of"),
        ({"matchExpressions": [{"key": "role", "operator": "In"}]}, "needs a non-empty values list"),
        ({"matchExpressions": [{"key": "role", "operator": "NotIn", "values": []}]}, "needs a non-empty values list"),
        ({"matchExpressions": [{"key": "role", "operator": "Exists", "values": ["x"]}]}, "takes no values"),
        ({"matchExpressions": [{"operator": "Exists"}]}, "needs both key and operator"),
        ({"matchExpressions": [{"key": "role", "operator": "In", "values": "x"}]}, "values must be a list"),
        ({"matchExpressions": [{"key": "role", "operator": "Exists", "value": 1}]}, r"unknown field\(s\) \['value'\]"),
    ],
)
def test_label_selector_filter_refuses_bad_selectors(selector: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LabelSelectorFilter.from_config("f", selector, HANDLE)
