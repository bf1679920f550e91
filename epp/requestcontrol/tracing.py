"""OpenTelemetry traces of requests, behind upstream's ``--tracing`` flag.

Design
------
:class:`Tracing` is made once per process, and only with ``--tracing=true``: it is the only place
that imports the OpenTelemetry SDK, so with tracing off no tracer exists, nothing of OpenTelemetry
is imported and the request path tests one ``None`` per request (the stream's ``trace``).

It reads the standard environment, as upstream does: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; an ``http://`` endpoint is plaintext), ``OTEL_SERVICE_NAME``
(default upstream's ``llm-d-inference-scheduler/epp``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_EXPORTER`` (``otlp``, the default; ``console``; ``none``) and
``OTEL_TRACES_SAMPLER``/``_ARG`` (default upstream's ``parentbased_traceidratio`` at 0.1; every
sampler of the OpenTelemetry spec is accepted). Spans are exported in batches by the SDK's thread.

One :class:`RequestTrace` per HTTP request, made when its headers arrive, continuing the client's
``traceparent``. Its spans (names and attributes: README "Tracing")::

    gateway.request                   SERVER, from the request headers to the end of the response
      epp.parse                       the body parsed (model, size)
      gateway.request_orchestration   the director: priority, then
        epp.admission                 admission and flow-control queueing (priority, flow, wait)
        epp.scheduling                the pick: profile, pod, the top pods' scores per scorer
      epp.response                    from the pick to the end of the stream: status, bytes, usage

The time-bound children are made when their work is over, with its measured start and end, so
nothing is held open across an ``await``. The request's ``traceparent`` (the ``gateway.request``
span's) is what the model server gets. A request the sampler drops still carries a ``traceparent``
(flags 00) and records nothing else. The response path costs nothing per chunk: the response span
is made at the end from what :class:`~epp.requestcontrol.lifecycle.RoutedRequest` kept.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from epp.errors import EppError, http_answer
from epp.framework import InferenceRequest, SchedulingResult
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.scheduling.decisions import DecisionRecord

__all__ = ["DEFAULT_SERVICE_NAME", "SPAN_NAMES", "RequestTrace", "Tracing"]

log = logging.getLogger(__name__)

# Upstream's default service name (llm-d-router's runner); its chart sets OTEL_SERVICE_NAME itself.
DEFAULT_SERVICE_NAME = "llm-d-inference-scheduler/epp"
# Upstream's default sampler and ratio when OTEL_TRACES_SAMPLER is not set.
_DEFAULT_RATIO = 0.1
_TOP = 5  # pods whose scores the scheduling span lists, best first (as decision records do)
SPAN_NAMES = (
    "gateway.request",
    "epp.parse",
    "gateway.request_orchestration",
    "epp.admission",
    "epp.scheduling",
    "epp.response",
)


# xds-protos (the ext_proc messages) ships an old copy of opentelemetry/proto in the same place as
# opentelemetry-proto's; whichever pip installed last wins, and the old one breaks the exporter.
_PROTO_CLASH = (
    "--tracing: the OTLP exporter cannot be loaded ({}). xds-protos installs an old copy of "
    "opentelemetry/proto over opentelemetry-proto's; put the right one back with "
    "`pip install --no-deps --force-reinstall opentelemetry-proto` (the version installed)"
)


class Tracing:
    """The process's tracer (made only with ``--tracing=true``) and its exporter."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        # Imported here: with tracing off nothing of OpenTelemetry is loaded.
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        env = os.environ if environ is None else environ
        service = env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        resource = Resource.create({"service.name": service}).merge(OTELResourceDetector().detect())
        resource = resource.merge(Resource({"service.name": service}))
        self.provider = TracerProvider(resource=resource, sampler=_sampler(env))
        exporter_name = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
        if exporter_name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            except ImportError as exc:
                raise ValueError(_PROTO_CLASH.format(exc)) from None

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif exporter_name == "console":
            self.provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif exporter_name != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: this picker exports otlp, console or none")
        self.exporter = exporter_name
        self.service_name = service
        self.tracer = self.provider.get_tracer("epp")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._in_context = set_span_in_context

    def start(self, headers: Mapping[str, str]) -> RequestTrace:
        """The trace of a request whose headers just arrived (continuing the client's ``traceparent``)."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span("gateway.request", context=parent, kind=self._server)
        return RequestTrace(self, span)

    def inject(self, span: Any) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        return carrier

    def shutdown(self) -> None:
        """Export what is left and stop the exporter (blocking: call it off the event loop)."""
        self.provider.shutdown()


def _sampler(env: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.trace import sampling

    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_traceidratio").strip().lower()
    arg = env.get("OTEL_TRACES_SAMPLER_ARG")
    ratio = _DEFAULT_RATIO
    if arg:
        try:
            ratio = float(arg)
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number in [0, 1]") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number in [0, 1]")
    samplers = {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
    }
    if name not in samplers:
        raise ValueError(f"OTEL_TRACES_SAMPLER={name!r}: one of {', '.join(samplers)}")
    return samplers[name]()


class RequestTrace:
    """One request's spans; every method is a no-op beyond a flag test when the sampler dropped it."""

    __slots__ = (
        "_admitted", "_ended", "_orchestration", "_parse_started", "_picked_at", "_root", "_tracing",
        "headers", "recording",
    )  # fmt: skip

    def __init__(self, tracing: Tracing, root: Any) -> None:
        self._tracing = tracing
        self._root = root
        self.recording: bool = root.is_recording()
        # What the model server gets: this request's traceparent (and the client's tracestate).
        self.headers: dict[str, str] = tracing.inject(root)
        self._parse_started = 0
        self._orchestration: Any = None
        self._admitted = False
        self._picked_at = 0
        self._ended = False

    def _child(self, name: str, parent: Any, start: int, end: int, attributes: Mapping[str, Any]) -> None:
        tracing = self._tracing
        span = tracing.tracer.start_span(
            name, context=tracing._in_context(parent), start_time=start, attributes=attributes
        )
        span.end(end_time=end)

    def parse_started(self) -> None:
        if self.recording:
            self._parse_started = time.time_ns()

    def parsed(self, request: InferenceRequest) -> None:
        """The body is parsed: the parse span, and the orchestration span starts."""
        if not self.recording:
            return
        now = time.time_ns()
        attributes: dict[str, Any] = {
            "gen_ai.request.model": request.model,
            "epp.request.body_bytes": request.body_size,
        }
        if request.request_id:
            attributes["epp.request.id"] = request.request_id
        self._child("epp.parse", self._root, self._parse_started or now, now, attributes)
        self._root.set_attributes(attributes)
        self._orchestration = self._tracing.tracer.start_span(
            "gateway.request_orchestration", context=self._tracing._in_context(self._root), start_time=now
        )

    def admission(self, started: int, priority: int, flow: str, error: EppError | None = None) -> None:
        """Admission ended (``started``: its ``time.time_ns()``): admitted, or refused with ``error``."""
        if self._orchestration is None:
            return
        attributes: dict[str, Any] = {"epp.admission.priority": priority, "epp.admission.flow": flow}
        attributes["epp.admission.outcome"] = "admitted" if error is None else error.reason.value
        self._child("epp.admission", self._orchestration, started, time.time_ns(), attributes)

    def scheduled(
        self, started: int, request: InferenceRequest, result: SchedulingResult, records: Sequence[DecisionRecord]
    ) -> None:
        """The scheduler ran (``records``: what each profile did, filled by the runner)."""
        if self._orchestration is None:
            return
        endpoints = result.endpoints
        attributes: dict[str, Any] = {"epp.scheduling.profile": result.primary_profile}
        if endpoints:
            attributes["epp.scheduling.endpoint"] = endpoints[0].name
            attributes["epp.scheduling.destination"] = ",".join(e.hostport for e in endpoints)
        record = next((r for r in records if r.profile == result.primary_profile), None)
        if record is not None:
            attributes.update(_scores(record))
        self._child("epp.scheduling", self._orchestration, started, time.time_ns(), attributes)
        self._orchestration.set_attributes({"target_model": request.model, "request_prio": request.priority})

    def routed(self) -> None:
        """The pick is made: the orchestration span ends, the response span's time starts."""
        if self._orchestration is not None:
            self._picked_at = time.time_ns()
            self._orchestration.end(end_time=self._picked_at)

    def failed(self, error: EppError | None) -> None:
        """The request got an HTTP answer from the picker (``error``; None: an internal error)."""
        if not self.recording:
            return
        from opentelemetry.trace import Status, StatusCode

        status = http_answer(error)[0] if error is not None else 500
        self._root.set_attribute("http.response.status_code", status)
        if error is not None:
            self._root.set_attribute("epp.refusal", error.reason.value)
        self._root.set_status(Status(StatusCode.ERROR, str(error) if error is not None else "internal error"))

    def end(self, outcome: str, routed: RoutedRequest | None) -> None:
        """The stream is over: the response span (if the request was routed), then the request span."""
        if self._ended:
            return
        self._ended = True
        root = self._root
        if not self.recording:
            root.end()
            return
        orchestration = self._orchestration
        now = time.time_ns()
        if self._parse_started and orchestration is None:  # the body could not be parsed
            self._child("epp.parse", root, self._parse_started, now, {"epp.outcome": "error"})
        if orchestration is not None and not self._picked_at:
            orchestration.end(end_time=now)  # refused during orchestration
        root.set_attribute("epp.outcome", outcome)
        if routed is not None and self._picked_at:
            attributes: dict[str, Any] = {"epp.outcome": outcome, "epp.response.bytes": routed.response_bytes}
            if routed.status:
                attributes["http.response.status_code"] = routed.status
                root.set_attribute("http.response.status_code", routed.status)
            usage = routed.usage
            if usage is not None:
                attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"] = usage
            first_byte = routed.first_byte_after
            if first_byte is not None:
                attributes["epp.response.first_byte_ms"] = round(first_byte * 1000, 3)
            attributes["epp.endpoint"] = routed.primary.name
            self._child("epp.response", root, self._picked_at, now, attributes)
        root.end(end_time=now)


def _scores(record: DecisionRecord) -> dict[str, Any]:
    """The scheduling span's view of a profile's record: the top pods, their totals and each scorer's scores."""
    candidates = record.scored_candidates
    totals = record.totals
    order = sorted(range(len(candidates)), key=lambda i: -totals[i] if i < len(totals) else 0.0)[:_TOP]
    attributes: dict[str, Any] = {
        "epp.scheduling.candidates": record.candidates,
        "epp.scheduling.top_endpoints": [candidates[i].name for i in order],
        "epp.scheduling.top_totals": [round(float(totals[i]), 4) if i < len(totals) else 0.0 for i in order],
    }
    for name, _weight, scores in record.scores:
        attributes[f"epp.scheduling.score.{name}"] = [
            round(float(scores[i]), 4) if i < len(scores) else 0.0 for i in order
        ]
    return attributes
