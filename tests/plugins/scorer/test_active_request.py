"""running-requests-size-scorer (GIE), load-aware-scorer and active-request-scorer (llm-d)."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle
from epp.plugins.scorer.active_request import ActiveRequestScorer
from tests.plugins._helpers import pod, request, send

REQUEST = request()


HANDLE = Handle(Datastore())


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
    for endpoint, count in zip(candidates, active, strict=True):
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
