"""running-requests-size-scorer (GIE), load-aware-scorer and active-request-scorer (llm-d)."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.plugins.active_request_scorer import ActiveRequestScorer
from epp.plugins.load_aware_scorer import LoadAwareScorer
from epp.plugins.running_requests_size_scorer import RunningRequestsSizeScorer
from epp.scheduling.registry import Handle

from ._helpers import SCRAPED_AT, pod, request, send

REQUEST = request()
HANDLE = Handle(Datastore())

# --- running-requests-size-scorer --------------------------------------------------------------


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


# --- load-aware-scorer ---------------------------------------------------------------------------


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


# --- active-request-scorer ------------------------------------------------------------------------

NOW = 1000.0


def active_scorer(**kwargs: Any) -> ActiveRequestScorer:
    return ActiveRequestScorer(clock=lambda: NOW, **kwargs)


@pytest.mark.parametrize(
    ("active", "kwargs", "expected"),
    [
        ([0, 2, 4], {}, [1.0, 0.5, 0.0]),  # (max - count) / max
        ([1, 3], {}, [2 / 3, 0.0]),  # not min-max: the least busy scores 2/3, not 1
        ([0, 0], {}, [1.0, 1.0]),
        ([5, 5], {}, [0.0, 0.0]),  # all equally busy: all score as the busiest
        ([0, 2, 4], {"idle_threshold": 2}, [1.0, 1.0, 0.0]),
        ([1, 3, 4], {"idle_threshold": 1, "max_busy_score": 0.5}, [1.0, 0.125, 0.0]),
        ([0, 2, 4], {"max_busy_score": 0.5}, [1.0, 0.25, 0.0]),
        ([0, 2, 4], {"max_busy_score": 0.0}, [1.0, 0.0, 0.0]),
    ],
)
def test_active_request_scorer(active: list[int], kwargs: dict[str, Any], expected: list[float]) -> None:
    candidates = [pod(i) for i in range(len(active))]
    for endpoint, count in zip(candidates, active):
        send(endpoint, count, at=NOW - 1.0)
    assert active_scorer(**kwargs).score(REQUEST, candidates) == pytest.approx(expected)


def test_active_request_scorer_counts_requests_until_released_or_timed_out() -> None:
    candidates = [pod(0), pod(1), pod(2)]
    send(candidates[0], 2, at=NOW - 10.0)
    send(candidates[1], 4, at=NOW - 121.0)  # in flight longer than requestTimeout (2m): assumed lost
    ticket = candidates[2].inflight.add(0, now=NOW - 1.0)
    # Counted whether or not a scrape happened since (unlike queue_depth): it is this picker's own record.
    assert active_scorer().score(REQUEST, candidates) == pytest.approx([0.0, 1.0, 0.5])
    candidates[2].inflight.release(ticket)
    assert active_scorer().score(REQUEST, candidates) == pytest.approx([0.0, 1.0, 1.0])
    assert active_scorer(request_timeout=300.0).score(REQUEST, candidates) == pytest.approx([0.5, 0.0, 1.0])


def test_active_request_scorer_zeroes_stale_endpoints_and_leaves_them_out_of_the_max() -> None:
    candidates = [pod(0), pod(1), pod(2, stale=True)]
    send(candidates[0], 2, at=NOW - 1.0)
    send(candidates[1], 1, at=NOW - 1.0)
    send(candidates[2], 8, at=NOW - 1.0)
    assert active_scorer().score(REQUEST, candidates) == pytest.approx([0.0, 0.5, 0.0])


@pytest.mark.parametrize(
    ("parameters", "timeout", "idle", "busy"),
    [
        ({}, 120.0, 0, 1.0),
        ({"requestTimeout": "30s", "idleThreshold": 2, "maxBusyScore": 0.5}, 30.0, 2, 0.5),
        ({"requestTimeout": "1m30s", "maxBusyScore": 0}, 90.0, 0, 0.0),
        ({"requestTimeout": "1500ms"}, 1.5, 0, 1.0),
    ],
)
def test_active_request_scorer_from_config(parameters: dict[str, Any], timeout: float, idle: int, busy: float) -> None:
    scorer = ActiveRequestScorer.from_config("ar", parameters, HANDLE)
    assert (scorer.request_timeout, scorer.idle_threshold, scorer.max_busy_score) == pytest.approx((timeout, idle, busy))


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"requestTimeout": "2 minutes"}, "not a Go duration"),
        ({"requestTimeout": "0s"}, "must be positive"),
        ({"requestTimeout": "-5s"}, "must be positive"),
        ({"requestTimeout": 120}, "Go duration string"),
        ({"idleThreshold": -1}, "at least 0"),
        ({"idleThreshold": 1.5}, "must be an integer"),
        ({"maxBusyScore": 1.5}, "at most 1"),
        ({"maxBusyScore": -0.5}, "at least 0"),
        ({"maxBusyScore": "high"}, "must be a number"),
        ({"inFlightLoadProducerName": "x"}, "unknown parameter"),
    ],
)
def test_active_request_scorer_refuses_bad_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ActiveRequestScorer.from_config("ar", parameters, HANDLE)
