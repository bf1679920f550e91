"""The director: from a parsed request to the endpoints to try, and the request's lifecycle after.

Design
------
:mod:`epp.extproc.processor` speaks the protocol; the director decides. For each request it takes one
snapshot of the pool, narrows it to the gateway's subset hint, runs the scheduler and returns a
:class:`Routing` whose lifecycle calls (``response_headers``, ``finish``) the protocol module makes
as the response streams back. ``finish`` runs exactly once however the stream ends (complete,
error, cancelled), which is where in-flight accounting is released.

In-flight accounting: a routed request is added to its primary endpoint's
:class:`epp.datalayer.datastore.InFlight` record (with its estimated prompt tokens) before the plugins'
``pre_request`` hooks run, and released in ``finish``; scorers see it through
``Endpoint.queue_depth``/``kv_usage`` until a scrape taken after it was sent reports the pod's own
numbers. Plugin hook failures are logged and never fail the request.

Admission, in ``route``, before anything else:

1. **Priority and flow.** The request's InferenceObjective (header ``x-llm-d-inference-objective``
   or ``x-gateway-inference-objective``) gives its priority (:mod:`epp.flowcontrol.objectives`);
   its flow is the fairness id (``x-llm-d-inference-fairness-id`` or
   ``x-gateway-inference-fairness-id``, else one default flow).
2. **Capacity limit.** A prompt larger than every pod's whole KV-cache is refused with 413 before
   it queues (:mod:`epp.flowcontrol.capacity`).
3. **Admission** (:class:`epp.flowcontrol.Admission`): ``await admission.admit(...)`` returns when
   the request may be scheduled. With flow control on it waits in the central queue until the pool
   has room; with it off (upstream's default) a sheddable request (priority < 0) is refused while
   the pool is saturated and everything else passes at once. A refusal becomes an
   :class:`~epp.errors.EppError` (429/503) carrying the ``x-llm-d-request-dropped-reason`` header;
   a client that goes away while queued cancels the awaiting task, which removes its entry.

Only then is the pool snapshot taken, so the request is scheduled on what the pool looks like
when it leaves the queue. From the end of admission to the in-flight add there is no ``await``:
the flow controller lets one request go per event-loop turn and reads saturation again on the
next, by which time the released request already counts in flight. Capacity wakes the queue
without polling: every metrics update and pool change (the server subscribes ``admission.wake``)
and every response that ends (``finish``, after its in-flight release).

A prompt that fits no pod's *free* KV-cache (but some pod's whole cache) is narrowed to the pods
with the most free cache before the scheduler runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from epp.datalayer.datastore import Datastore, Endpoint
from epp.errors import EppError, Reason
from epp.flowcontrol.capacity import check_prompt_fits, place_by_free_kv
from epp.flowcontrol.controller import Admission
from epp.flowcontrol.objectives import Objectives
from epp.flowcontrol.outcomes import DEFAULT_FLOW_ID, AdmissionRequest, FlowControlError, Outcome
from epp.server.metrics import Metrics
from epp.extproc.parsing import InferenceRequest
from epp.scheduling.runner import Scheduler, SchedulingResult

__all__ = ["FAIRNESS_HEADERS", "Director", "Routing", "admission_error"]

log = logging.getLogger(__name__)

# llm-d's name first, then GIE's (both are read upstream).
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")

# Admission outcome -> the error reason the client is answered with. The status each reason gets
# (errors._ANSWERS) agrees with the one upstream gives the outcome (flowcontrol.outcomes; a test
# checks it); the dropped-reason header comes from the FlowControlError. EvictedContextCancelled
# is never raised: nobody is left to answer.
_ADMISSION_REASONS: dict[Outcome, Reason] = {
    Outcome.REJECTED_CAPACITY: Reason.QUEUE_FULL,
    Outcome.REJECTED_SATURATED: Reason.SHED,
    Outcome.REJECTED_NO_ENDPOINTS: Reason.NO_ENDPOINT,
    Outcome.EVICTED_TTL: Reason.QUEUE_TIMEOUT,
    Outcome.EVICTED_NO_ENDPOINTS: Reason.NO_ENDPOINT,
    Outcome.REJECTED_OTHER: Reason.SHUTTING_DOWN,
    Outcome.EVICTED_OTHER: Reason.SHUTTING_DOWN,
}


def admission_error(error: FlowControlError) -> EppError:
    """The client's answer to an admission refusal: its reason, message and dropped-reason header."""
    reason = _ADMISSION_REASONS.get(error.outcome, Reason.INTERNAL)
    return EppError(reason, error.message, headers=error.headers)


def _flow_id(headers: Mapping[str, str]) -> str:
    for header in FAIRNESS_HEADERS:
        value = headers.get(header)
        if value:
            return value
    return DEFAULT_FLOW_ID


class Routing:
    """A routed request: its pick, and the hooks called while its response streams back."""

    __slots__ = ("request", "result", "endpoints", "_director", "_ticket", "_finished", "_answering", "status")

    def __init__(self, director: Director, request: InferenceRequest, result: SchedulingResult, ticket: Any) -> None:
        self.request = request
        self.result = result
        self.endpoints = result.endpoints
        self.status = 0
        self._director = director
        self._ticket = ticket
        self._finished = False
        self._answering = False

    @property
    def destination(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: primary first, then fallbacks."""
        return ",".join(endpoint.hostport for endpoint in self.endpoints)

    def response_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        """The response headers arrived; returns the headers plugins ask to set on the response."""
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        return self._director._response_received(self, headers)

    def response_body_started(self) -> None:
        """The first response body bytes arrived: the pod has finished queueing and prefill."""
        if not self._answering and not self._finished:
            self._answering = True
            self.endpoints[0].inflight.answering(self._ticket)

    def finish(self, outcome: str = "complete") -> None:
        """The response ended (``complete``), failed (``error``) or the stream went away (``cancelled``)."""
        if self._finished:
            return
        self._finished = True
        if outcome == "complete" and self.status >= 500:
            outcome = "error"
        self._director._finished(self, outcome)


class Director:
    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        base_models: frozenset[str] = frozenset(),
        admission: Admission | None = None,
        objectives: Objectives | None = None,
    ) -> None:
        self.datastore = datastore
        self.scheduler = scheduler
        self.metrics = metrics
        self.base_models = base_models
        self.admission = admission  # None: every request passes at once
        self.objectives = objectives if objectives is not None else Objectives()
        self._succeeded = metrics.scheduler_attempts.labels("success")
        self._failed = metrics.scheduler_attempts.labels("failure")

    async def route(self, request: InferenceRequest, subset: Collection[str] | None = None) -> Routing:
        """Admit ``request``, then pick its endpoints; raises EppError when refused or when no
        endpoint can take it (NO_ENDPOINT).

        ``subset``: the gateway's hint (``ip:port`` strings); when given, only those pool members
        are candidates.
        """
        request.objective, request.priority = self.objectives.resolve(request.headers)
        tokens = request.prompt_tokens
        check_prompt_fits(tokens, self.datastore.endpoints())
        admission = self.admission
        if admission is not None:
            try:
                await admission.admit(
                    AdmissionRequest(
                        priority=request.priority,
                        flow_id=_flow_id(request.headers),
                        byte_size=request.body_size,
                        request_id=request.request_id,
                    )
                )
            except FlowControlError as exc:
                raise admission_error(exc) from None
        # No await from here to the in-flight add (see the module docstring).
        started = time.perf_counter()
        candidates: Sequence[Endpoint] = self.datastore.endpoints()
        if subset is not None:
            by_hostport = self.datastore.by_hostport()
            candidates = [by_hostport[hostport] for hostport in subset if hostport in by_hostport]
            if not candidates:
                self._failed.inc()
                raise EppError(
                    Reason.NO_ENDPOINT,
                    "no pool endpoint matches the gateway's subset hint"
                    + (f" ({', '.join(list(subset)[:5])})" if subset else " (the hint is empty)"),
                )
        if not candidates:
            self._failed.inc()
            raise EppError(Reason.NO_ENDPOINT, "the inference pool has no ready endpoint")
        candidates = place_by_free_kv(tokens, candidates)
        scheduler = self.scheduler
        try:
            result = scheduler.run(request, candidates)
        except Exception:
            self._failed.inc()
            raise
        endpoints = result.endpoints
        if not endpoints:
            self._failed.inc()
            raise EppError(Reason.NO_ENDPOINT, f"no endpoint can take this request ({len(candidates)} candidates filtered out)")
        self._succeeded.inc()
        self.metrics.scheduler_e2e.observe(time.perf_counter() - started)
        # The request counts toward its primary's load from now until its response ends.
        ticket = endpoints[0].inflight.add(request.prompt_tokens)
        self.metrics.for_model(request.model).running.inc()
        routing = Routing(self, request, result, ticket)
        try:
            scheduler.pre_request(request, result)
        except Exception:
            log.exception("a pre-request plugin failed for request %s", request.request_id or "?")
        return routing

    def _response_received(self, routing: Routing, headers: Mapping[str, str]) -> dict[str, str] | None:
        try:
            return self.scheduler.response_received(routing.request, routing.endpoints[0], headers)
        except Exception:
            log.exception("a response-received plugin failed for request %s", routing.request.request_id or "?")
            return None

    def _finished(self, routing: Routing, outcome: str) -> None:
        primary = routing.endpoints[0]
        primary.inflight.release(routing._ticket, answered=routing._answering)
        self.metrics.for_model(routing.request.model).running.dec()
        if self.admission is not None:
            self.admission.wake()  # a slot freed: a queued request may go
        try:
            self.scheduler.response_complete(routing.request, primary, outcome)
        except Exception:
            log.exception("a response-complete plugin failed for request %s", routing.request.request_id or "?")
