"""The one error type of the request path, and the one table that maps it to an HTTP answer.

Any layer (body parsing, admission, scheduling) raises :class:`EppError` with a :class:`Reason`
and a message written for the client. Only :mod:`epp.extproc.processor` turns it into an Envoy
ImmediateResponse, through :func:`http_answer`; nothing else on the request path knows HTTP
status codes. A new failure mode is one new ``Reason`` member and one row in ``_ANSWERS``.

An error may carry response ``headers`` that the ImmediateResponse sets: admission's refusals carry
``x-llm-d-request-dropped-reason`` (its values are decided, per admission outcome, in
:mod:`epp.flowcontrol.outcomes`), so that clients and gateways can tell backpressure (429, retry
later) from unavailability (503).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import msgspec

__all__ = ["EppError", "Reason", "http_answer"]


class Reason(enum.Enum):
    """Why a request was not routed. The value is the label used in metrics and logs."""

    BAD_REQUEST = "bad_request"  # body is not JSON / not UTF-8 / lacks model / malformed field
    BODY_TOO_LARGE = "body_too_large"  # over --max-request-body-bytes
    PROMPT_TOO_LARGE = "prompt_too_large"  # the prompt exceeds every pod's whole KV-cache
    NO_ENDPOINT = "no_endpoint"  # empty pool, empty or non-matching subset hint
    SHED = "shed"  # dropped under load (sheddable request while saturated, flow control off)
    QUEUE_FULL = "queue_full"  # flow control: a queue limit (maxRequests/maxBytes) is reached
    QUEUE_TIMEOUT = "queue_timeout"  # flow control: waited its whole request TTL
    SHUTTING_DOWN = "shutting_down"  # flow control: queued or arriving while the picker stops
    UNSUPPORTED = "unsupported"  # a gateway configuration the picker cannot serve
    INTERNAL = "internal"  # a bug: logged with its traceback, answered without details


# Reason -> (HTTP status, OpenAI error "type"). The single place where statuses are decided.
_ANSWERS: dict[Reason, tuple[int, str]] = {
    Reason.BAD_REQUEST: (400, "invalid_request_error"),
    Reason.BODY_TOO_LARGE: (413, "invalid_request_error"),
    Reason.PROMPT_TOO_LARGE: (413, "invalid_request_error"),
    Reason.NO_ENDPOINT: (503, "service_unavailable"),
    Reason.SHED: (429, "rate_limit_exceeded"),
    Reason.QUEUE_FULL: (429, "rate_limit_exceeded"),
    Reason.QUEUE_TIMEOUT: (503, "service_unavailable"),
    Reason.SHUTTING_DOWN: (503, "service_unavailable"),
    Reason.UNSUPPORTED: (500, "server_error"),
    Reason.INTERNAL: (500, "server_error"),
}


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class EppError(Exception):
    """A request the picker refuses, with a message that tells the client what was wrong.

    ``headers``: response headers to set on the answer (lower-case names), e.g. the dropped reason.
    """

    def __init__(self, reason: Reason, message: str, *, headers: Mapping[str, str] = _NO_HEADERS) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.headers = headers

    @property
    def status(self) -> int:
        return _ANSWERS[self.reason][0]


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: int
    param: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_encode = msgspec.json.Encoder().encode


def http_answer(error: EppError) -> tuple[int, bytes]:
    """The HTTP status and OpenAI-style JSON body for ``error``."""
    status, kind = _ANSWERS[error.reason]
    return status, _encode(_ErrorBody(_ErrorDetail(message=error.message, type=kind, code=status)))
