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
   the pool is saturated and everything else passes at once. A refusal becomes the
   :class:`~epp.errors.EppError` of the outcome's refusal (429/503, with the
   ``x-llm-d-request-dropped-reason`` header; :data:`epp.errors.REFUSALS`);
   a client that goes away while queued cancels the awaiting task, which removes its entry.

Before admission, plugins that prepare data asynchronously (:class:`epp.framework.PrepareData`: a
tokenizer on a thread pool or behind the engine's ``/tokenize``) are awaited, each bounding its own
time. Only then is the pool snapshot taken, so the request is scheduled on what the pool looks like
when it leaves the queue. From the end of admission to the in-flight add there is no ``await``:
the flow controller lets one request go per event-loop turn and reads saturation again on the
next, by which time the released request already counts in flight. Capacity wakes the queue
without polling: every metrics update and pool change (the server subscribes ``admission.wake``)
and every response that ends (after its in-flight release).

A prompt that fits no pod's *free* KV-cache (but some pod's whole cache) is narrowed to the pods
with the most free cache before the scheduler runs.

The ``pre_request`` hooks after the answer. Given ``after``, ``route`` returns with the hooks still
to run, handed to it; the processor keeps them until it has sent the pick's answers, then hands
them to its stream's ``after_write`` (:meth:`epp.wire.http2.Connection.after_write`), so they run
once the answer is written: at the end of the read that brought the request, whose one write holds
the answer, or at once after the write of a route that went on in a task. They are bookkeeping
for later picks (the approximate prefix index's add of the prompt's blocks, the precise producer's
in-flight blocks; the in-flight count is added before, in ``RoutedRequest``), and Envoy waits for
the answer, not for them: at one request at a time, every microsecond before the write is latency
the request sees. A pick never runs before the hooks of the picks before it: ``route`` runs what
is still pending before it schedules (two requests in one read), so what each pick sees is what it
saw when the hooks ran first; and a request never ends before its hooks ran (``RoutedRequest.finish``
runs them first: Envoy may reset a stream in the read that routed it). What it moved off the path:
:mod:`epp.extproc.processor`, "What Envoy waits for".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from epp.datalayer.datastore import Datastore
from epp.errors import EppError, Reason, Refusal
from epp.flowcontrol.capacity import check_prompt_fits, place_by_free_kv
from epp.flowcontrol.controller import Admission
from epp.flowcontrol.objectives import Objectives
from epp.flowcontrol.outcomes import DEFAULT_FLOW_ID, AdmissionRequest, FlowControlError
from epp.framework import Endpoint, InferenceRequest, SchedulingResult
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.requestcontrol.metrics import RequestMetrics
from epp.requestcontrol.tracing import RequestTrace, Tracing
from epp.scheduling.decisions import DecisionRecord
from epp.scheduling.runner import Scheduler

__all__ = ["FAIRNESS_HEADERS", "Director", "admission_error"]

# llm-d's name first, then GIE's (both are read upstream).
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")


def admission_error(error: FlowControlError) -> EppError:
    """The client's answer to an admission refusal: the refusal of its outcome, with its message."""
    return EppError(Refusal[error.outcome.name], error.message)


def _flow_id(headers: Mapping[str, str]) -> str:
    for header in FAIRNESS_HEADERS:
        value = headers.get(header)
        if value:
            return value
    return DEFAULT_FLOW_ID


class Director:
    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        metrics: RequestMetrics | None = None,
        *,
        base_models: frozenset[str] = frozenset(),
        admission: Admission | None = None,
        objectives: Objectives | None = None,
        tracing: Tracing | None = None,
        emit_scores: bool = False,
    ) -> None:
        self.datastore = datastore
        self.scheduler = scheduler
        self.metrics = metrics if metrics is not None else RequestMetrics()
        self._base_models = base_models  # configured; the pool's lists add theirs (see base_models)
        self.admission = admission  # None: every request passes at once
        self.objectives = objectives if objectives is not None else Objectives()
        self._wake = admission.wake if admission is not None else _nothing
        self.tracing = tracing  # None (--tracing=false): no request is traced
        self.emit_scores = emit_scores  # --emit-endpoint-scores: each pick carries its profile's scores
        self._unhooked: list[tuple[InferenceRequest, SchedulingResult]] = []  # picks whose pre_request waits

    @property
    def base_models(self) -> frozenset[str]:
        """The models that are not adapters: those given, and every base model a pod lists at
        ``/v1/models`` (so a base-model request is never scored by adapter slots)."""
        configured, listed = self._base_models, self.datastore.base_models()
        return listed if not configured else configured | listed

    async def route(
        self,
        request: InferenceRequest,
        subset: Collection[str] | None = None,
        trace: RequestTrace | None = None,
        after: Callable[[Callable[[], object]], None] | None = None,
    ) -> RoutedRequest:
        """Admit ``request``, then pick its endpoints; raises EppError when refused or when no
        endpoint can take it (NO_ENDPOINT).

        ``subset``: the gateway's hint (``ip:port`` strings); when given, only those pool members
        are candidates. ``trace``: the request's trace, given admission's and the pick's spans.
        ``after``: where to hand the ``pre_request`` hooks, to run once the pick's answer is
        written (see the module docstring); None runs them before returning.
        """
        objective, priority = self.objectives.resolve(request.headers)
        if objective or priority:
            request = replace(request, objective=objective, priority=priority)
        tokens = request.prompt_tokens
        check_prompt_fits(tokens, self.datastore.endpoints())
        if request.body and getattr(self.scheduler, "prepares", False):
            await self.scheduler.prepare(request)  # data that waits on I/O: before admission, never after
        admission = self.admission
        if admission is not None:
            admitting = time.time_ns() if trace is not None else 0
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
                if trace is not None:
                    trace.admission(admitting, request.priority, _flow_id(request.headers), admission_error(exc))
                raise admission_error(exc) from None
            if trace is not None:
                trace.admission(admitting, request.priority, _flow_id(request.headers))
        # No await from here to the in-flight add (see the module docstring).
        metrics = self.metrics
        started = time.perf_counter()
        candidates: Sequence[Endpoint] = self.datastore.endpoints()
        if subset is not None:
            by_hostport = self.datastore.by_hostport()
            candidates = [by_hostport[hostport] for hostport in subset if hostport in by_hostport]
            if not candidates:
                metrics.unscheduled.inc()
                raise EppError(
                    Reason.NO_ENDPOINT,
                    "no pool endpoint matches the gateway's subset hint"
                    + (f" ({', '.join(list(subset)[:5])})" if subset else " (the hint is empty)"),
                )
        if not candidates:
            metrics.unscheduled.inc()
            raise EppError(Reason.NO_ENDPOINT, "the inference pool has no ready endpoint")
        candidates = place_by_free_kv(tokens, candidates)
        if self._unhooked:  # earlier picks' hooks first: this pick sees what they record
            self._run_hooks()
        scheduler = self.scheduler
        records: list[DecisionRecord] | None = (
            [] if self.emit_scores or (trace is not None and trace.recording) else None
        )
        scheduling = time.time_ns() if records is not None else 0
        try:
            # Records only for a recorded trace or --emit-endpoint-scores: a scheduler stand-in (tests) may take two.
            if records is None:
                result = scheduler.run(request, candidates)
            else:
                result = scheduler.run(request, candidates, records)
        except Exception:  # plugins are isolated by the runner: this is a bug in the runner itself
            metrics.unscheduled.inc()
            raise
        if trace is not None and records is not None and trace.recording:
            trace.scheduled(scheduling, request, result, records)
        endpoints = result.endpoints
        in_flight = self.datastore.in_flight(endpoints[0].name) if endpoints else None
        if in_flight is None:
            metrics.unscheduled.inc()
            raise EppError(
                Reason.NO_ENDPOINT, f"no endpoint can take this request ({len(candidates)} candidates filtered out)"
            )
        metrics.scheduled.inc()
        metrics.scheduler_e2e.observe(time.perf_counter() - started)
        model = request.model
        per_model = metrics.for_model(model, served=lambda: model in self.base_models or _adapter_of(model, candidates))
        per_model.requests.inc()
        metrics.routed.inc()
        if request.body_size:
            per_model.sizes.observe(request.body_size)
        metrics.picked(endpoints[0].name)
        routed = RoutedRequest(
            request, result, scheduler, in_flight, per_model,
            wake=self._wake, not_found=self.datastore.not_found, unreachable=self.datastore.mark_unreachable,
            hooks=None if after is None else self._run_hooks,
        )  # fmt: skip
        if self.emit_scores and records:
            routed.scores = _scores(records, result.primary_profile)
        if after is None:
            scheduler.pre_request(request, result)
        else:
            self._unhooked.append((request, result))
            after(self._run_hooks)
        return routed

    def _run_hooks(self) -> None:
        """The ``pre_request`` hooks of the picks that handed them to ``after``, in pick order."""
        unhooked = self._unhooked
        while unhooked:
            request, result = unhooked.pop(0)
            self.scheduler.pre_request(request, result)


def _nothing() -> None:
    pass


def _scores(records: Sequence[DecisionRecord], profile: str) -> dict[str, float]:
    """Every endpoint the primary profile's scorers saw (``ip:port``), with its weighted total
    (upstream's ``x-gateway-destination-endpoint-scores``)."""
    for record in records:
        if record.profile == profile:
            return {e.hostport: float(total) for e, total in zip(record.scored_candidates, record.totals, strict=False)}
    return {}


def _adapter_of(model: str, endpoints: Sequence[Endpoint]) -> bool:
    """Whether a pod serves ``model``: lists it at ``/v1/models`` or reports it running or queued."""
    return any(e.serves(model) for e in endpoints)
