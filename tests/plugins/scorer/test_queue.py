"""Table-driven tests of queue-scorer, kv-cache-utilization-scorer and the pickers, against
upstream's semantics, and of the in-flight accounting the load scorers read."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle, Profile, ScoredEndpoint, WeightedScorer
from epp.plugins.picker.max_score import MaxScorePicker
from epp.plugins.scorer.queue import QueueScorer
from epp.scheduling.registry import default_registry
from epp.scheduling.runner import Scheduler
from tests.plugins._helpers import SCRAPED_AT, names, pod, request, send

REQUEST = request()


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
    ("queues", "sent", "expected"),
    [
        ([0, 0], {1: 3}, [1.0, 0.0]),  # two idle pods; 3 sent to pod-1 since its scrape
        ([0, 0, 0], {1: 2, 2: 4}, [1.0, 0.5, 0.0]),
        ([4, 0], {1: 4}, [1.0, 1.0]),  # the sent requests even the queues out
        ([6, 0], {1: 2}, [0.0, 1.0]),  # 6 vs 0 + 2
    ],
)
def test_queue_scorer_counts_requests_sent_since_the_scrape(
    queues: list[int], sent: dict[int, int], expected: list[float]
) -> None:
    candidates = [pod(i, queue=q) for i, q in enumerate(queues)]
    for i, count in sent.items():
        send(candidates[i], count)
    assert QueueScorer().score(REQUEST, candidates) == pytest.approx(expected)


def test_queue_scorer_ignores_answering_requests_sent_before_the_scrape() -> None:
    # Those are in the scraped numbers, and answering (past queue and prefill): not waiting.
    candidates = [pod(0), pod(1)]
    send(candidates[1], 5, at=SCRAPED_AT - 1.0)
    for _ in range(5):
        candidates[1].inflight.answering()
    assert QueueScorer().score(REQUEST, candidates) == [1.0, 1.0]
    send(candidates[1], 1)
    assert QueueScorer().score(REQUEST, candidates) == [1.0, 0.0]


def test_queue_scorer_counts_requests_not_answering_yet_even_from_before_the_scrape() -> None:
    # A pod prefilling two long prompts reports an empty waiting queue; a new request there would
    # still wait behind them. Until their responses start they count as queued.
    candidates = [pod(0), pod(1), pod(2, queue=1)]
    send(candidates[1], 2, at=SCRAPED_AT - 1.0)
    assert [c.queue_depth for c in candidates] == [0, 2, 1]
    assert QueueScorer().score(REQUEST, candidates) == [1.0, 0.0, 0.5]
    candidates[1].inflight.answering()
    candidates[1].inflight.answering()
    assert QueueScorer().score(REQUEST, candidates) == [1.0, 1.0, 0.0]


def test_a_burst_spreads_over_equal_pods_through_in_flight_accounting() -> None:
    # Between two scrapes every pod reports an empty queue; what this picker sent must spread the burst.
    scheduler = Scheduler(
        Profile("default", MaxScorePicker(), scorers=(WeightedScorer(QueueScorer(), 1.0),))
    )
    pods = [pod(i) for i in range(4)]
    for _ in range(40):
        send(scheduler.schedule(REQUEST, pods)[0])
    assert [p.inflight.requests for p in pods] == [10, 10, 10, 10]


def test_an_upstream_profile_of_these_plugins_prefers_the_least_loaded_pod() -> None:
    registry, handle = default_registry(), Handle(Datastore())
    create = lambda type_name: registry.create(type_name, type_name, {}, handle)  # noqa: E731
    scheduler = Scheduler(
        Profile(
            "default",
            create("max-score-picker"),  # type: ignore[arg-type]
            scorers=(
                WeightedScorer(create("queue-scorer"), 2.0),  # type: ignore[arg-type]
                WeightedScorer(create("kv-cache-utilization-scorer"), 2.0),  # type: ignore[arg-type]
            ),
        )
    )
    pods = [pod(0, queue=10, kv=0.9), pod(1, queue=0, kv=0.1), pod(2, queue=3, kv=0.5), pod(3, queue=0, kv=0.0, stale=True)]
    for _ in range(20):
        assert scheduler.schedule(REQUEST, pods)[0].name == "pod-1"


def test_queue_scorer_prefers_the_busy_pod_nearest_the_end_of_its_prefill() -> None:
    # Every pod prefilling one prompt (one unanswered request each): a whole count ties them all,
    # yet a new request waits least on the pod whose prefill is furthest along.
    now = time.monotonic()
    candidates = [replace(pod(i), metrics=replace(pod(i).metrics, updated_at=now)) for i in range(3)]
    for endpoint, started in zip(candidates, (now - 0.02, now - 0.08, now - 0.05), strict=True):
        warm = endpoint.inflight.add(1000, now=started - 10.0)
        endpoint.inflight.answering(warm, now=started - 9.9)  # learned: 0.1 s per 1000-token prompt
        endpoint.inflight.add(1000, now=started)
    scores = QueueScorer().score(REQUEST, candidates)
    assert scores[1] == 1.0 and scores[0] == 0.0
    assert 0.0 < scores[2] < 1.0
    picked = MaxScorePicker(seed=0).pick(REQUEST, [ScoredEndpoint(e, s) for e, s in zip(candidates, scores, strict=True)])
    assert names(picked) == ["pod-1"]
