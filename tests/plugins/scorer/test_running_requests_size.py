"""running-requests-size-scorer (GIE), load-aware-scorer and active-request-scorer (llm-d)."""

from __future__ import annotations

import pytest

from epp.plugins.scorer.running_requests_size import RunningRequestsSizeScorer
from tests.plugins._helpers import SCRAPED_AT, pod, request, send

REQUEST = request()


@pytest.mark.parametrize(
    ("running", "sent", "stale", "expected"),
    [
        ([0, 5, 10], {}, set(), [1.0, 0.5, 0.0]),
        ([8, 2, 4], {}, set(), [0.0, 1.0, 2 / 3]),
        ([3, 3], {}, set(), [1.0, 1.0]),
        ([0, 0], {1: 4}, set(), [1.0, 0.0]),  # requests sent since the scrape count as running
        ([6, 0], {1: 3}, set(), [0.0, 1.0]),  # 6 vs 0 + 3
        ([6, 0, 3], {1: 3}, set(), [0.0, 1.0, 1.0]),
        ([0, 5, 10], {}, {0}, [0.0, 1.0, 0.0]),  # stale: fully loaded, out of the normalisation
        ([1, 2], {}, {0, 1}, [0.0, 0.0]),
    ],
)
def test_running_requests_size_scorer(
    running: list[int], sent: dict[int, int], stale: set[int], expected: list[float]
) -> None:
    candidates = [pod(i, running=r, stale=i in stale) for i, r in enumerate(running)]
    for i, count in sent.items():
        send(candidates[i], count)
    assert RunningRequestsSizeScorer().score(REQUEST, candidates) == pytest.approx(expected)


def test_running_requests_size_scorer_reads_running_not_waiting() -> None:
    candidates = [pod(0, running=0, queue=50), pod(1, running=4, queue=0)]
    assert RunningRequestsSizeScorer().score(REQUEST, candidates) == [1.0, 0.0]


def test_running_requests_size_scorer_ignores_requests_sent_before_the_scrape() -> None:
    candidates = [pod(0), pod(1)]
    send(candidates[1], 3, at=SCRAPED_AT - 0.5)
    assert RunningRequestsSizeScorer().score(REQUEST, candidates) == [1.0, 1.0]
