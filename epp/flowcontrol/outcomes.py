"""What admission decides about a request, and the typed error for every outcome but dispatch.

Design
------
:class:`Outcome` values are upstream's ``QueueOutcome`` names (they are metric label values).
Every non-dispatch outcome maps, in the one table ``_ANSWERS``, to the HTTP status upstream answers
with and the value of the ``x-llm-d-request-dropped-reason`` response header:

==========================  ======  ===============================  ====================================
outcome                     status  dropped reason                   when
==========================  ======  ===============================  ====================================
RejectedCapacity            429     rejected-saturated               a queue limit is full
RejectedSaturated           429     rejected-saturated               no flow control: sheddable while saturated
RejectedNoEndpoints         503     rejected-no-endpoints            a limit is full and the pool is empty
EvictedTTL                  503     rejected-ttl-expired             waited ``defaultRequestTTL``
EvictedNoEndpoints          503     rejected-no-endpoints            waited ``noEndpointRequestTTL``, no pod
RejectedOther/EvictedOther  503     rejected-shutting-down           the controller is closed
==========================  ======  ===============================  ====================================

A client that goes away while queued is not an error here: the awaiting task is cancelled, its
entry leaves the queue at once, and ``CancelledError`` propagates (outcome
``EvictedContextCancelled`` is recorded in metrics only; nobody is left to answer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "DEFAULT_FLOW_ID",
    "DROPPED_REASON_HEADER",
    "FAIRNESS_ID_HEADER",
    "AdmissionRequest",
    "FlowControlError",
    "Outcome",
]

# Upstream header names and the flow id used when a request names none.
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
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


# Outcome -> (HTTP status, x-llm-d-request-dropped-reason). The one place these are decided.
_ANSWERS: dict[Outcome, tuple[int, str]] = {
    Outcome.REJECTED_CAPACITY: (429, "rejected-saturated"),
    Outcome.REJECTED_SATURATED: (429, "rejected-saturated"),
    Outcome.REJECTED_NO_ENDPOINTS: (503, "rejected-no-endpoints"),
    Outcome.REJECTED_OTHER: (503, "rejected-shutting-down"),
    Outcome.EVICTED_TTL: (503, "rejected-ttl-expired"),
    Outcome.EVICTED_NO_ENDPOINTS: (503, "rejected-no-endpoints"),
    Outcome.EVICTED_CANCELLED: (503, "rejected-context-cancelled"),
    Outcome.EVICTED_OTHER: (503, "rejected-shutting-down"),
}


class FlowControlError(Exception):
    """A request admission refused or gave up on: ``status``, ``reason`` (the dropped-reason
    header value) and a ``message`` for the client."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.status, self.reason = _ANSWERS[outcome]

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
