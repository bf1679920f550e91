"""What admission decides about a request, and the typed error for every outcome but dispatch.

Design
------
:class:`Outcome` values are upstream's ``QueueOutcome`` names (they are metric label values). A
refusal's HTTP status and ``x-llm-d-request-dropped-reason`` value are those of the refusal of the
same name in the service's one table of refusals (:data:`epp.errors.REFUSALS`), so flow control
decides no status of its own: :class:`FlowControlError` reads them from there.

A client that goes away while queued is not an error here: the awaiting task is cancelled, its
entry leaves the queue at once, and ``CancelledError`` propagates (outcome
``EvictedContextCancelled`` is recorded in metrics only; nobody is left to answer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from epp.errors import DROPPED_REASON_HEADER, REFUSALS, Refusal

__all__ = [
    "DEFAULT_FLOW_ID",
    "DROPPED_REASON_HEADER",
    "FAIRNESS_ID_HEADER",
    "AdmissionRequest",
    "FlowControlError",
    "Outcome",
]

# Upstream header names and the flow id used when a request names none.
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
DEFAULT_FLOW_ID = "default-flow"


class Outcome(enum.Enum):
    DISPATCHED = "Dispatched"
    REJECTED_CAPACITY = "RejectedCapacity"
    REJECTED_SATURATED = "RejectedSaturated"  # the no-flow-control path; upstream answers it without a queue outcome
    REJECTED_NO_ENDPOINTS = "RejectedNoEndpoints"
    REJECTED_OTHER = "RejectedOther"
    EVICTED_TTL = "EvictedTTL"
    EVICTED_NO_ENDPOINTS = "EvictedNoEndpoints"
    EVICTED_CANCELLED = "EvictedContextCancelled"
    EVICTED_OTHER = "EvictedOther"


class FlowControlError(Exception):
    """A request admission refused or gave up on: ``outcome``, a ``message`` for the client, and from
    the refusal of the outcome's name (:data:`epp.errors.REFUSALS`) its HTTP ``status`` and ``reason``
    (the dropped-reason header value)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.refusal = Refusal[outcome.name]  # KeyError for an outcome nobody is answered with
        answer = REFUSALS[self.refusal]
        self.status = answer.status
        self.reason = answer.dropped_reason or ""

    @property
    def headers(self) -> dict[str, str]:
        """The response headers upstream adds to this answer."""
        return {DROPPED_REASON_HEADER: self.reason}


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What admission needs to know about a request.

    ``priority``: the InferenceObjective's (default 0; < 0 is sheddable). ``flow_id``: the fairness
    id (``x-gateway-inference-fairness-id``). ``byte_size``: counted against ``maxBytes``.
    ``ttl``: seconds this request may wait, overriding the configured budgets (None: use them).
    """

    priority: int = 0
    flow_id: str = DEFAULT_FLOW_ID
    byte_size: int = 0
    ttl: float | None = None
    request_id: str = ""

    @property
    def sheddable(self) -> bool:
        return self.priority < 0
