"""The one table from error reason to HTTP answer (epp.errors)."""

from __future__ import annotations

import json

import pytest

from epp.errors import EppError, Reason, http_answer

_EXPECTED = [
    (Reason.BAD_REQUEST, 400, "invalid_request_error"),
    (Reason.BODY_TOO_LARGE, 413, "invalid_request_error"),
    (Reason.NO_ENDPOINT, 503, "service_unavailable"),
    (Reason.SHED, 429, "rate_limit_exceeded"),
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
        (Reason.NO_ENDPOINT, "no_endpoint"),
        (Reason.SHED, "shed"),
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
