"""The one error type of the request path, and the one table of every refusal the service makes.

Any layer (body parsing, admission, scheduling) raises :class:`EppError` for a request it refuses,
with a message written for the client. What the client is answered with is decided here and only
here, in :data:`REFUSALS`: one row per :class:`Refusal`, giving the HTTP status, the OpenAI-style
error type, the ``x-llm-d-request-dropped-reason`` header (admission's refusals carry it, so that
clients and gateways can tell backpressure, 429, from unavailability, 503) and the :class:`Reason`
that labels the refusal in metrics and logs. Only :mod:`epp.extproc` turns an error into an Envoy
ImmediateResponse (:func:`http_answer`).

A refusal by admission is named after upstream's queue outcome (``Refusal.EVICTED_TTL`` for outcome
``EvictedTTL``), so flow control raises the refusal of its outcome without a table of its own. A new
failure mode is one new ``Refusal`` row (and, if it needs its own metric label, one ``Reason``).

==========================  ======  ============================  ======================  ==============
refusal                     status  OpenAI error type             dropped reason          reason label
==========================  ======  ============================  ======================  ==============
BAD_REQUEST                 400     invalid_request_error                                 bad_request
BODY_TOO_LARGE              413     invalid_request_error                                 body_too_large
PROMPT_TOO_LARGE            413     invalid_request_error                                 prompt_too_large
NO_ENDPOINT                 503     service_unavailable                                   no_endpoint
UNSUPPORTED                 500     server_error                                          unsupported
INTERNAL                    500     server_error                                          internal
REJECTED_CAPACITY           429     rate_limit_exceeded           rejected-saturated      queue_full
REJECTED_SATURATED          429     rate_limit_exceeded           rejected-saturated      shed
REJECTED_NO_ENDPOINTS       503     service_unavailable           rejected-no-endpoints   no_endpoint
EVICTED_TTL                 503     service_unavailable           rejected-ttl-expired    queue_timeout
EVICTED_NO_ENDPOINTS        503     service_unavailable           rejected-no-endpoints   no_endpoint
REJECTED_OTHER              503     service_unavailable           rejected-shutting-down  shutting_down
EVICTED_OTHER               503     service_unavailable           rejected-shutting-down  shutting_down
==========================  ======  ============================  ======================  ==============
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import msgspec

__all__ = ["DROPPED_REASON_HEADER", "REFUSALS", "Answer", "EppError", "Reason", "Refusal", "http_answer"]

# Upstream's header naming why admission dropped a request.
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


class Reason(enum.Enum):
    """Why a request was not routed, in a word. The value is the label used in metrics and logs."""

    BAD_REQUEST = "bad_request"  # body is not JSON / not UTF-8 / a malformed field
    BODY_TOO_LARGE = "body_too_large"  # over --max-request-body-bytes
    PROMPT_TOO_LARGE = "prompt_too_large"  # the prompt exceeds every pod's whole KV-cache
    NO_ENDPOINT = "no_endpoint"  # empty pool, empty or non-matching subset hint
    SHED = "shed"  # dropped under load (sheddable request while saturated, flow control off)
    QUEUE_FULL = "queue_full"  # flow control: a queue limit (maxRequests/maxBytes) is reached
    QUEUE_TIMEOUT = "queue_timeout"  # flow control: waited its whole request TTL
    SHUTTING_DOWN = "shutting_down"  # flow control: queued or arriving while the picker stops
    UNSUPPORTED = "unsupported"  # a gateway configuration the picker cannot serve
    INTERNAL = "internal"  # a bug: logged with its traceback, answered without details


class Refusal(enum.Enum):
    """Every refusal the service makes; admission's are named after upstream's queue outcomes."""

    BAD_REQUEST = "BadRequest"
    BODY_TOO_LARGE = "BodyTooLarge"
    PROMPT_TOO_LARGE = "PromptTooLarge"
    NO_ENDPOINT = "NoEndpoint"
    UNSUPPORTED = "Unsupported"
    INTERNAL = "Internal"
    REJECTED_CAPACITY = "RejectedCapacity"
    REJECTED_SATURATED = "RejectedSaturated"
    REJECTED_NO_ENDPOINTS = "RejectedNoEndpoints"
    EVICTED_TTL = "EvictedTTL"
    EVICTED_NO_ENDPOINTS = "EvictedNoEndpoints"
    REJECTED_OTHER = "RejectedOther"
    EVICTED_OTHER = "EvictedOther"


@dataclass(frozen=True, slots=True)
class Answer:
    """How one refusal is answered."""

    reason: Reason
    status: int
    error_type: str  # OpenAI's error "type"
    dropped_reason: str | None = None  # the x-llm-d-request-dropped-reason header, if any


_INVALID, _UNAVAILABLE, _RATE, _SERVER = (
    "invalid_request_error",
    "service_unavailable",
    "rate_limit_exceeded",
    "server_error",
)

# The one table (see the module docstring).
REFUSALS: Mapping[Refusal, Answer] = MappingProxyType({
    Refusal.BAD_REQUEST: Answer(Reason.BAD_REQUEST, 400, _INVALID),
    Refusal.BODY_TOO_LARGE: Answer(Reason.BODY_TOO_LARGE, 413, _INVALID),
    Refusal.PROMPT_TOO_LARGE: Answer(Reason.PROMPT_TOO_LARGE, 413, _INVALID),
    Refusal.NO_ENDPOINT: Answer(Reason.NO_ENDPOINT, 503, _UNAVAILABLE),
    Refusal.UNSUPPORTED: Answer(Reason.UNSUPPORTED, 500, _SERVER),
    Refusal.INTERNAL: Answer(Reason.INTERNAL, 500, _SERVER),
    Refusal.REJECTED_CAPACITY: Answer(Reason.QUEUE_FULL, 429, _RATE, "rejected-saturated"),
    Refusal.REJECTED_SATURATED: Answer(Reason.SHED, 429, _RATE, "rejected-saturated"),
    Refusal.REJECTED_NO_ENDPOINTS: Answer(Reason.NO_ENDPOINT, 503, _UNAVAILABLE, "rejected-no-endpoints"),
    Refusal.EVICTED_TTL: Answer(Reason.QUEUE_TIMEOUT, 503, _UNAVAILABLE, "rejected-ttl-expired"),
    Refusal.EVICTED_NO_ENDPOINTS: Answer(Reason.NO_ENDPOINT, 503, _UNAVAILABLE, "rejected-no-endpoints"),
    Refusal.REJECTED_OTHER: Answer(Reason.SHUTTING_DOWN, 503, _UNAVAILABLE, "rejected-shutting-down"),
    Refusal.EVICTED_OTHER: Answer(Reason.SHUTTING_DOWN, 503, _UNAVAILABLE, "rejected-shutting-down"),
})  # fmt: skip

# A reason given alone stands for its first refusal in the table.
_BY_REASON: Mapping[Reason, Refusal] = MappingProxyType(
    {answer.reason: refusal for refusal, answer in reversed(list(REFUSALS.items()))}
)

_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class EppError(Exception):
    """A request the picker refuses, with a message that tells the client what was wrong.

    ``refusal``: a :class:`Refusal`, or a :class:`Reason` standing for its first refusal in the table.
    ``headers``: further response headers to set on the answer (lower-case names).
    """

    def __init__(self, refusal: Refusal | Reason, message: str, *, headers: Mapping[str, str] = _NO_HEADERS) -> None:
        super().__init__(message)
        self.refusal = _BY_REASON[refusal] if isinstance(refusal, Reason) else refusal
        self.message = message
        answer = REFUSALS[self.refusal]
        self.reason = answer.reason
        if answer.dropped_reason is not None:
            headers = {DROPPED_REASON_HEADER: answer.dropped_reason, **headers}
        self.headers = headers

    @property
    def status(self) -> int:
        return REFUSALS[self.refusal].status


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
    answer = REFUSALS[error.refusal]
    return answer.status, _encode(
        _ErrorBody(_ErrorDetail(message=error.message, type=answer.error_type, code=answer.status))
    )
