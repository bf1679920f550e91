"""Table-driven tests of queue-scorer, kv-cache-utilization-scorer and the pickers, against
upstream's semantics, and of the in-flight accounting the load scorers read."""

from __future__ import annotations

from collections import Counter

from epp.framework import ScoredEndpoint
from epp.plugins.picker.random import RandomPicker
from tests.plugins._helpers import names, pod, request

REQUEST = request()


def test_random_picker_ignores_scores_and_returns_distinct_endpoints() -> None:
    scored = [ScoredEndpoint(pod(0), 1.0), ScoredEndpoint(pod(1), 0.0), ScoredEndpoint(pod(2), 0.0)]
    picker = RandomPicker(max_num_of_endpoints=2, seed=3)
    firsts = Counter()
    for _ in range(300):
        picked = names(picker.pick(REQUEST, scored))
        assert len(picked) == len(set(picked)) == 2
        firsts[picked[0]] += 1
    assert set(firsts) == {"pod-0", "pod-1", "pod-2"} and min(firsts.values()) > 60
