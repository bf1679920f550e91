"""weighted-random-picker: probability proportional to score, A-Res sampling without replacement."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle, ScoredEndpoint
from epp.plugins.picker.weighted_random import WeightedRandomPicker
from tests.plugins._helpers import names, pod, request

REQUEST = request()
TRIALS = 6000


def shares(scores: list[float], *, place: int = 0, count: int = 1, seed: int = 11) -> dict[str, float]:
    """How often each pod came out at ``place`` over TRIALS picks."""
    scored = [ScoredEndpoint(pod(i), s) for i, s in enumerate(scores)]
    picker = WeightedRandomPicker(max_num_of_endpoints=count, seed=seed)
    tally = Counter(names(picker.pick(REQUEST, scored))[place] for _ in range(TRIALS))
    return {name: n / TRIALS for name, n in tally.items()}


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([1.0, 3.0], {"pod-0": 0.25, "pod-1": 0.75}),
        ([1.0, 2.0, 3.0], {"pod-0": 1 / 6, "pod-1": 2 / 6, "pod-2": 3 / 6}),
        ([0.2, 0.2, 0.2, 0.2], {f"pod-{i}": 0.25 for i in range(4)}),
        ([0.0, 0.5, 0.0], {"pod-1": 1.0}),  # a zero score never wins over a positive one
        ([0.0, 0.0, 0.0], {f"pod-{i}": 1 / 3 for i in range(3)}),  # all zero: uniform
        ([1e-300, 1.0], {"pod-1": 1.0}),  # a tiny weight neither underflows nor crashes
    ],
)
def test_first_pick_is_proportional_to_score(scores: list[float], expected: dict[str, float]) -> None:
    observed = shares(scores)
    assert set(observed) == set(expected)
    for name, share in expected.items():
        assert observed[name] == pytest.approx(share, abs=0.025), name


def test_fallbacks_are_drawn_without_replacement_in_proportion_to_what_is_left() -> None:
    # P(pod-0 second) = P(pod-1 first) * 1/4 + P(pod-2 first) * 1/3 = 1/12 + 1/6 = 1/4.
    observed = shares([1.0, 2.0, 3.0], place=1, count=2)
    assert observed["pod-0"] == pytest.approx(0.25, abs=0.025)
    assert observed["pod-1"] == pytest.approx(1 / 6 * 2 / 5 + 1 / 2 * 2 / 3, abs=0.025)


@pytest.mark.parametrize(
    ("scores", "count", "length", "head", "tail"),
    [
        ([0.0, 0.5, 0.0, 0.9], 4, 4, {"pod-1", "pod-3"}, {"pod-0", "pod-2"}),  # zero scores only fill the tail
        ([0.5, 0.9], 5, 2, {"pod-0", "pod-1"}, set()),  # never more than the candidates
        ([0.0, 0.0], 2, 2, set(), {"pod-0", "pod-1"}),
    ],
)
def test_returns_distinct_endpoints_positive_scores_first(
    scores: list[float], count: int, length: int, head: set[str], tail: set[str]
) -> None:
    scored = [ScoredEndpoint(pod(i), s) for i, s in enumerate(scores)]
    picker = WeightedRandomPicker(max_num_of_endpoints=count, seed=5)
    for _ in range(50):
        picked = names(picker.pick(REQUEST, scored))
        assert len(picked) == len(set(picked)) == length
        assert set(picked[: len(head)]) == head and set(picked[len(head) :]) == tail


def test_no_candidates_pick_nothing() -> None:
    assert WeightedRandomPicker().pick(REQUEST, []) == []


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [({}, 1), ({"maxNumOfEndpoints": 3}, 3)],
)
def test_from_config(parameters: dict[str, Any], expected: int) -> None:
    picker = WeightedRandomPicker.from_config("wrp", parameters, Handle(Datastore()))
    assert picker.name == "wrp" and picker.max_num_of_endpoints == expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"maxNumOfEndpoints": 0}, "at least 1"),
        ({"maxNumOfEndpoints": -2}, "at least 1"),
        ({"maxNumOfEndpoints": "2"}, "must be an integer"),
        ({"maxNumOfEndpoints": True}, "must be an integer"),
        ({"maxNumOfEndpoints": 1.5}, "must be an integer"),
        ({"maxEndpoints": 2}, "unknown parameter"),
    ],
)
def test_from_config_refuses_bad_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightedRandomPicker.from_config("wrp", parameters, Handle(Datastore()))
