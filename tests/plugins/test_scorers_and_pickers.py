"""Table-driven tests of the built-in scorers and pickers, against upstream's semantics."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.datastore import Endpoint, Metrics
from epp.plugins import KVCacheUtilizationScorer, MaxScorePicker, QueueScorer
from epp.request import InferenceRequest
from epp.scheduling import ScoredEndpoint

REQUEST = InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers={})


def pod(i: int, *, queue: int = 0, kv: float = 0.0, stale: bool = False) -> Endpoint:
    return Endpoint(f"pod-{i}", f"10.0.0.{i}", 8000, metrics=Metrics(waiting_queue_size=queue, kv_cache_usage=kv, stale=stale))


@pytest.mark.parametrize(
    ("queues", "stale", "expected"),
    [
        ([0, 4, 8], set(), [1.0, 0.5, 0.0]),  # upstream's own example
        ([10, 2, 6], set(), [0.0, 1.0, 0.5]),
        ([3, 3, 3], set(), [1.0, 1.0, 1.0]),  # nothing to tell them apart
        ([5], set(), [1.0]),
        ([0, 4, 8], {0}, [0.0, 1.0, 0.0]),  # a stale pod is fully loaded, out of the normalisation
        ([0, 4], {0, 1}, [0.0, 0.0]),
        ([0, 9, 9], {0}, [0.0, 1.0, 1.0]),
    ],
)
def test_queue_scorer(queues: list[int], stale: set[int], expected: list[float]) -> None:
    candidates = [pod(i, queue=q, stale=i in stale) for i, q in enumerate(queues)]
    assert QueueScorer().score(REQUEST, candidates) == pytest.approx(expected)


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
    assert [e.name for e in picked] == [f"pod-{i}" for i in expected]


def test_max_score_picker_breaks_ties_at_random() -> None:
    scored = [ScoredEndpoint(pod(i), 1.0) for i in range(4)] + [ScoredEndpoint(pod(9), 0.2)]
    picker = MaxScorePicker(seed=7)
    wins = Counter(picker.pick(REQUEST, scored)[0].name for _ in range(400))
    assert set(wins) == {"pod-0", "pod-1", "pod-2", "pod-3"}  # every tied pod wins sometimes, the low one never
    assert min(wins.values()) > 50


def test_an_upstream_profile_of_these_plugins_prefers_the_least_loaded_pod() -> None:
    from epp.config import load_scheduler
    from epp.datastore import Datastore
    from epp.registry import Handle, default_registry

    text = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: max-score-picker
"""
    scheduler = load_scheduler(text, default_registry(), Handle(Datastore()))
    pods = [pod(0, queue=10, kv=0.9), pod(1, queue=0, kv=0.1), pod(2, queue=3, kv=0.5), pod(3, queue=0, kv=0.0, stale=True)]
    for _ in range(20):
        assert scheduler.schedule(REQUEST, pods)[0].name == "pod-1"
