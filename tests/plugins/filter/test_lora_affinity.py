"""lora-affinity-scorer and lora-affinity-filter, against GIE's semantics."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle
from epp.plugins.filter.lora_affinity import LoraAffinityFilter
from tests.plugins._helpers import names, pod, request

HANDLE = Handle(Datastore())


# The adapter "a" in each situation upstream distinguishes.
RUNNING = dict(running_adapters={"a", "b"}, max_adapters=2)  # running, no slot free


RUNNING_WITH_ROOM = dict(running_adapters={"a"}, max_adapters=4)


FREE_SLOT = dict(running_adapters={"b"}, max_adapters=2)  # not here, one slot free


WAITING = dict(running_adapters={"b"}, waiting_adapters={"a"}, max_adapters=2)  # queued, no slot free


WAITING_WITH_ROOM = dict(waiting_adapters={"a"}, max_adapters=4)


FULL = dict(running_adapters={"b", "c"}, max_adapters=2)  # every slot taken by others


FULL_WITH_QUEUE = dict(running_adapters={"b"}, waiting_adapters={"c"}, max_adapters=2)


NO_LORA = dict()  # a server without LoRA: no slots at all


@pytest.mark.parametrize(
    ("states", "threshold", "expected"),
    [
        # affinity (running or waiting) and available (free slot) both present: threshold decides
        ([RUNNING, FREE_SLOT, FULL], 1.0, ["pod-0"]),
        ([RUNNING, FREE_SLOT, FULL], 0.0, ["pod-1"]),
        ([WAITING, RUNNING_WITH_ROOM, FREE_SLOT, WAITING_WITH_ROOM], 1.0, ["pod-0", "pod-1", "pod-3"]),
        ([WAITING, RUNNING_WITH_ROOM, FREE_SLOT, WAITING_WITH_ROOM], 0.0, ["pod-2"]),
        # one group empty: the other, whatever the threshold
        ([FULL, FREE_SLOT, NO_LORA], 1.0, ["pod-1"]),
        ([RUNNING, FULL], 0.0, ["pod-0"]),
        # neither: nothing (upstream), so the request finds no endpoint
        ([FULL, FULL_WITH_QUEUE, NO_LORA], 0.999, []),
    ],
)
def test_filter_groups_as_upstream(states: list[dict[str, Any]], threshold: float, expected: list[str]) -> None:
    candidates = [pod(i, **state) for i, state in enumerate(states)]
    kept = LoraAffinityFilter(threshold=threshold, seed=1).filter(request(adapter="a"), candidates)
    assert names(kept) == expected


def test_filter_keeps_the_affinity_group_with_probability_threshold() -> None:
    candidates = [pod(0, **RUNNING), pod(1, **FREE_SLOT)]
    lora_filter = LoraAffinityFilter(threshold=0.7, seed=3)
    tally = Counter(tuple(names(lora_filter.filter(request(adapter="a"), candidates))) for _ in range(4000))
    assert set(tally) == {("pod-0",), ("pod-1",)}
    assert tally[("pod-0",)] / 4000 == pytest.approx(0.7, abs=0.03)


def test_filter_drops_stale_endpoints_and_passes_base_model_requests() -> None:
    candidates = [pod(0, **RUNNING, stale=True), pod(1, **FREE_SLOT)]
    assert names(LoraAffinityFilter(threshold=1.0).filter(request(adapter="a"), candidates)) == ["pod-1"]
    assert names(LoraAffinityFilter().filter(request(adapter=None), [*candidates, pod(2, **FULL)])) == [
        "pod-0",
        "pod-1",
        "pod-2",
    ]


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [({}, 0.999), ({"threshold": 0.5}, 0.5), ({"threshold": 1}, 1.0), ({"threshold": 0}, 0.0)],
)
def test_filter_from_config(parameters: dict[str, Any], expected: float) -> None:
    assert LoraAffinityFilter.from_config("f", parameters, HANDLE).threshold == expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"threshold": 1.5}, "at most 1"),
        ({"threshold": -0.1}, "at least 0"),
        ({"threshold": "0.9"}, "must be a number"),
        ({"threshold": float("nan")}, "must be a number"),
        ({"threshold": None}, "must be a number"),
        ({"loraAffinityThreshold": 0.9}, "unknown parameter"),
    ],
)
def test_filter_refuses_bad_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoraAffinityFilter.from_config("f", parameters, HANDLE)
