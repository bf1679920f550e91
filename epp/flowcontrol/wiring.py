"""Assembling admission from the config: plugin types for the registry, the detector, the admitter.

The config file names detectors and fairness/ordering policies as plugins, as upstream does
(``plugins: [{type: concurrency-detector, parameters: {maxConcurrency: 8}}]``). The factories
here are what the ``epp.plugins`` entry points name (:data:`PLUGIN_FACTORIES`; :func:`register`
adds them to a registry directly); the detector factories take the
in-flight tracker from the handle's optional ``in_flight`` attribute (``concurrency-detector``
needs it; ``utilization-detector`` uses it for scrape-lag compensation when present).
:func:`build_admission` makes the admitter the director awaits; the detector it reads is built by
the scheduling config through the registry (:func:`epp.scheduling.config`), like every plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from epp.flowcontrol.config import FCFS, GLOBAL_STRICT, ROUND_ROBIN, AdmissionConfig
from epp.flowcontrol.controller import FlowController, LegacyAdmission
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.saturation import (
    CONCURRENCY_DETECTOR,
    UTILIZATION_DETECTOR,
    SaturationDetector,
    UtilizationDetector,
    from_config,
)
from epp.framework import Endpoint, check_parameters

__all__ = [
    "PLUGIN_FACTORIES",
    "PolicyPlugin",
    "build_admission",
    "concurrency_detector",
    "fcfs_ordering_policy",
    "global_strict_fairness_policy",
    "register",
    "round_robin_fairness_policy",
    "utilization_detector",
]


class PolicyPlugin:
    """A fairness or ordering policy declared in ``plugins`` (they take no parameters)."""

    def __init__(self, name: str, type_name: str) -> None:
        self.name = name
        self.type_name = type_name


def utilization_detector(name: str, parameters: Mapping[str, Any], handle: Any) -> object:
    """Plugin factory for ``utilization-detector`` (:meth:`UtilizationDetector.from_config`)."""
    return UtilizationDetector.from_config(name, parameters, handle)


def concurrency_detector(name: str, parameters: Mapping[str, Any], handle: Any) -> object:
    """Plugin factory for ``concurrency-detector``; needs ``handle.in_flight``."""
    return from_config(CONCURRENCY_DETECTOR, parameters, name=name, in_flight=getattr(handle, "in_flight", None))


def global_strict_fairness_policy(name: str, parameters: Mapping[str, Any], handle: Any) -> object:
    check_parameters(name, parameters)
    return PolicyPlugin(name, GLOBAL_STRICT)


def round_robin_fairness_policy(name: str, parameters: Mapping[str, Any], handle: Any) -> object:
    check_parameters(name, parameters)
    return PolicyPlugin(name, ROUND_ROBIN)


def fcfs_ordering_policy(name: str, parameters: Mapping[str, Any], handle: Any) -> object:
    check_parameters(name, parameters)
    return PolicyPlugin(name, FCFS)


# Plugin type -> factory: what the ``epp.plugins`` entry points (or :func:`register`) offer.
PLUGIN_FACTORIES: Mapping[str, Callable[[str, Mapping[str, Any], Any], object]] = {
    UTILIZATION_DETECTOR: utilization_detector,
    CONCURRENCY_DETECTOR: concurrency_detector,
    GLOBAL_STRICT: global_strict_fairness_policy,
    ROUND_ROBIN: round_robin_fairness_policy,
    FCFS: fcfs_ordering_policy,
}


class _Registering(Protocol):
    def register(
        self, type_name: str, factory: Callable[[str, Mapping[str, Any], Any], object], *, source: str
    ) -> None: ...


def register(registry: _Registering, *, source: str = "epp.flowcontrol") -> None:
    """Register every type of :data:`PLUGIN_FACTORIES` (for registries not built from entry points)."""
    for type_name, factory in PLUGIN_FACTORIES.items():
        registry.register(type_name, factory, source=source)


def build_admission(
    config: AdmissionConfig,
    detector: SaturationDetector,
    endpoints: Callable[[], Sequence[Endpoint]],
    *,
    metrics: FlowControlMetrics | None = None,
    safety_interval: float = 0.25,
) -> FlowController | LegacyAdmission:
    """The admitter for ``config``: the central queue with the ``flowControl`` gate on, else the
    legacy path. ``endpoints`` returns the current pool snapshot (``datastore.endpoints``)."""

    def saturation() -> float:
        return detector.saturation(endpoints())

    if config.flow_control_enabled:
        return FlowController(
            config.flow_control,
            saturation,
            has_endpoints=lambda: bool(endpoints()),
            metrics=metrics,
            safety_interval=safety_interval,
        )
    return LegacyAdmission(saturation, metrics=metrics)
