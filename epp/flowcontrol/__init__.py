"""Admission and flow control: hold requests in one central, prioritised, fair queue in the picker.

With the ``flowControl`` feature gate on, the director awaits :meth:`FlowController.admit` before
scheduling each request; it returns once the pool has room (strict priority between bands, a
fairness policy between flows, FCFS inside a flow), or raises :class:`FlowControlError` carrying the
HTTP status and the ``x-llm-d-request-dropped-reason`` value. With the gate off,
:class:`LegacyAdmission` refuses only sheddable requests (priority < 0) while the pool is saturated.
Saturation comes from :mod:`epp.flowcontrol.saturation`.

Modules: :mod:`.controller` (the queue and dispatch), :mod:`.outcomes` (outcomes, statuses,
headers), :mod:`.config` (settings and strict decoding of the upstream config sections),
:mod:`.metrics` (Prometheus series), :mod:`.wiring` (registry plugin types and assembly),
:mod:`.objectives` (InferenceObjective name -> priority), :mod:`.capacity` (the KV-cache capacity
limit). :mod:`epp.requestcontrol.director` calls them in that order: objective, capacity check, admission.
"""

from epp.flowcontrol.config import (
    FLOW_CONTROL_GATE,
    AdmissionConfig,
    BandConfig,
    DetectorChoice,
    FlowControlConfig,
    decode_admission,
    decode_feature_gates,
    decode_flow_control,
    decode_saturation_detector,
)
from epp.flowcontrol.controller import Admission, FlowController, LegacyAdmission
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.outcomes import (
    DEFAULT_FLOW_ID,
    DROPPED_REASON_HEADER,
    FAIRNESS_ID_HEADER,
    AdmissionRequest,
    FlowControlError,
    Outcome,
)
from epp.flowcontrol.wiring import build_admission, register

__all__ = [
    "DEFAULT_FLOW_ID",
    "DROPPED_REASON_HEADER",
    "FAIRNESS_ID_HEADER",
    "FLOW_CONTROL_GATE",
    "Admission",
    "AdmissionConfig",
    "AdmissionRequest",
    "BandConfig",
    "DetectorChoice",
    "FlowControlConfig",
    "FlowControlError",
    "FlowControlMetrics",
    "FlowController",
    "LegacyAdmission",
    "Outcome",
    "build_admission",
    "decode_admission",
    "decode_feature_gates",
    "decode_flow_control",
    "decode_saturation_detector",
    "register",
]
