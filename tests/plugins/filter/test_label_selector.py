"""low-queue-filter, least-queue-filter, least-kv-cache-filter (GIE) and label-selector-filter (llm-d).
(lora-affinity-filter is tested with the LoRA scorer.)"""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle
from epp.plugins.filter.label_selector import LabelSelectorFilter
from tests.plugins._helpers import names, pod, request

REQUEST = request()


HANDLE = Handle(Datastore())


def pods_named(indexes: list[int]) -> list[str]:
    return [f"pod-{i}" for i in indexes]


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
