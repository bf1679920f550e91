"""The one table from error reason to HTTP answer (epp.errors)."""

from __future__ import annotations

import json

import pytest

from epp.errors import EppError, Reason, http_answer
from epp.flowcontrol import DROPPED_REASON_HEADER, FlowControlError, Outcome
from epp.requestcontrol.director import admission_error

_EXPECTED = [
    (Reason.BAD_REQUEST, 400, "invalid_request_error"),
    (Reason.BODY_TOO_LARGE, 413, "invalid_request_error"),
    (Reason.PROMPT_TOO_LARGE, 413, "invalid_request_error"),
    (Reason.NO_ENDPOINT, 503, "service_unavailable"),
    (Reason.SHED, 429, "rate_limit_exceeded"),
    (Reason.QUEUE_FULL, 429, "rate_limit_exceeded"),
    (Reason.QUEUE_TIMEOUT, 503, "service_unavailable"),
    (Reason.SHUTTING_DOWN, 503, "service_unavailable"),
    (Reason.UNSUPPORTED, 500, "server_error"),
    (Reason.INTERNAL, 500, "server_error"),
]


def test_the_table_covers_every_reason() -> None:
    assert {reason for reason, _, _ in _EXPECTED} == set(Reason)


@pytest.mark.parametrize(("reason", "status", "kind"), _EXPECTED)
def test_http_answer(reason: Reason, status: int, kind: str) -> None:
    error = EppError(reason, "what went wrong")
    assert error.status == status
    answer_status, body = http_answer(error)
    assert answer_status == status
    assert json.loads(body) == {"error": {"message": "what went wrong", "type": kind, "code": status, "param": None}}


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        (Reason.BAD_REQUEST, "bad_request"),
        (Reason.BODY_TOO_LARGE, "body_too_large"),
        (Reason.PROMPT_TOO_LARGE, "prompt_too_large"),
        (Reason.NO_ENDPOINT, "no_endpoint"),
        (Reason.SHED, "shed"),
        (Reason.QUEUE_FULL, "queue_full"),
        (Reason.QUEUE_TIMEOUT, "queue_timeout"),
        (Reason.SHUTTING_DOWN, "shutting_down"),
        (Reason.UNSUPPORTED, "unsupported"),
        (Reason.INTERNAL, "internal"),
    ],
)
def test_reason_values_are_metric_labels(reason: Reason, label: str) -> None:
    assert reason.value == label


def test_message_is_json_escaped() -> None:
    message = 'bad "model" \\ ünïcode\n<|user|>'
    _, body = http_answer(EppError(Reason.BAD_REQUEST, message))
    assert json.loads(body)["error"]["message"] == message


def test_error_carries_reason_and_message() -> None:
    error = EppError(Reason.SHED, "try later")
    assert error.reason is Reason.SHED
    assert error.message == "try later"
    assert str(error) == "try later"
    assert isinstance(error, Exception)


def test_an_error_has_no_headers_unless_given() -> None:
    assert dict(EppError(Reason.NO_ENDPOINT, "x").headers) == {}
    error = EppError(Reason.QUEUE_FULL, "full", headers={DROPPED_REASON_HEADER: "rejected-saturated"})
    assert dict(error.headers) == {"x-llm-d-request-dropped-reason": "rejected-saturated"}
    assert http_answer(error)[0] == 429  # headers do not change the status or the body


# Every admission outcome a client can be answered with -> the reason, status and dropped reason
# (upstream's statuses and header values).
_ADMISSION = [
    (Outcome.REJECTED_CAPACITY, Reason.QUEUE_FULL, 429, "rejected-saturated"),
    (Outcome.REJECTED_SATURATED, Reason.SHED, 429, "rejected-saturated"),
    (Outcome.REJECTED_NO_ENDPOINTS, Reason.NO_ENDPOINT, 503, "rejected-no-endpoints"),
    (Outcome.EVICTED_TTL, Reason.QUEUE_TIMEOUT, 503, "rejected-ttl-expired"),
    (Outcome.EVICTED_NO_ENDPOINTS, Reason.NO_ENDPOINT, 503, "rejected-no-endpoints"),
    (Outcome.REJECTED_OTHER, Reason.SHUTTING_DOWN, 503, "rejected-shutting-down"),
    (Outcome.EVICTED_OTHER, Reason.SHUTTING_DOWN, 503, "rejected-shutting-down"),
]


def test_every_answerable_admission_outcome_is_listed() -> None:
    # EvictedContextCancelled is never raised: the client is gone.
    assert {row[0] for row in _ADMISSION} == set(Outcome) - {Outcome.DISPATCHED, Outcome.EVICTED_CANCELLED}


@pytest.mark.parametrize(("outcome", "reason", "status", "dropped"), _ADMISSION)
def test_admission_refusals_become_errors_with_the_dropped_reason(outcome: Outcome, reason: Reason, status: int, dropped: str) -> None:
    refusal = FlowControlError(outcome, "why it was refused")
    error = admission_error(refusal)
    assert (error.reason, error.status, error.message) == (reason, status, "why it was refused")
    assert error.status == refusal.status  # errors' table and the outcomes' table agree
    assert dict(error.headers) == {"x-llm-d-request-dropped-reason": dropped}
