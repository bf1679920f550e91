"""running-requests-size-scorer (GIE), load-aware-scorer and active-request-scorer (llm-d)."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle
from epp.plugins.scorer.load_aware import LoadAwareScorer
from tests.plugins._helpers import pod, request, send

REQUEST = request()


HANDLE = Handle(Datastore())


@pytest.mark.parametrize(
    ("threshold", "queue", "expected"),
    [
        (128, 0, 0.5),  # an empty queue scores 0.5, not 1.0
        (128, 1, 0.5 * (1 - 1 / 128)),
        (128, 32, 0.375),
        (128, 64, 0.25),
        (128, 128, 0.0),
        (128, 500, 0.0),  # capped at the threshold
        (10, 5, 0.25),
        (10, 10, 0.0),
        (1, 1, 0.0),
    ],
)
def test_load_aware_scorer(threshold: int, queue: int, expected: float) -> None:
    assert LoadAwareScorer(threshold=threshold).score(REQUEST, [pod(0, queue=queue)]) == pytest.approx([expected])


def test_load_aware_scorer_is_absolute_counts_in_flight_and_zeroes_stale() -> None:
    candidates = [pod(0, queue=64), pod(1, queue=64), pod(2, stale=True), pod(3)]
    send(candidates[1], 32)
    assert LoadAwareScorer().score(REQUEST, candidates) == pytest.approx([0.25, 0.125, 0.0, 0.5])


@pytest.mark.parametrize(("parameters", "expected"), [({}, 128), ({"threshold": 10}, 10), ({"threshold": 1}, 1)])
def test_load_aware_scorer_from_config(parameters: dict[str, Any], expected: int) -> None:
    assert LoadAwareScorer.from_config("la", parameters, HANDLE).threshold == expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"threshold": 0}, "at least 1"),
        ({"threshold": -5}, "at least 1"),
        ({"threshold": 12.5}, "must be an integer"),
        ({"threshold": "128"}, "must be an integer"),
        ({"queueThreshold": 10}, "unknown parameter"),
    ],
)
def test_load_aware_scorer_refuses_bad_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadAwareScorer.from_config("la", parameters, HANDLE)
