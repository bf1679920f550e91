"""Flow-control settings, and strict decoding of the upstream config sections that hold them.

Design
------
The upstream ``EndpointPickerConfig`` spreads admission over three top-level keys:

``featureGates``
    A list of gate names, each optionally ``name=true`` / ``name=false`` (a bare name is true).
    ``flowControl`` (default off) turns the central queue on; without it admission is upstream's
    legacy path (sheddable requests are refused with 429 while the pool is saturated).

``flowControl``
    ``maxBytes``, ``maxRequests`` (global limits over every band; Kubernetes quantities such as
    ``1Gi`` or ``1k``; omitted or 0: unlimited), ``defaultRequestTTL`` (queue-wait budget while the
    pool has endpoints; default 60s, ``0s`` disables), ``noEndpointRequestTTL`` (the budget while the
    pool has none; default 60s), ``priorityBands`` (a list of bands, each ``priority`` plus optional
    ``maxBytes`` (default 1G), ``maxRequests`` (default 5000; 0 means the default, as upstream),
    ``fairnessPolicyRef`` and ``orderingPolicyRef``), ``defaultPriorityBand`` and
    ``defaultNegativePriorityBand`` (templates for priorities no band lists; the negative one, for
    priorities < 0, falls back to the default one), and ``saturationDetector: {pluginRef: NAME}``.
    ``usageLimitPolicyPluginRef`` and ``enableEviction: true`` are upstream features this version
    does not implement: named in the error, never ignored.

``saturationDetector``
    The older spelling: either ``{pluginRef: NAME}`` (deprecated upstream in favour of
    ``flowControl.saturationDetector``, which wins when both are set) or GIE v1's inline thresholds
    ``queueDepthThreshold`` / ``kvCacheUtilThreshold`` / ``metricsStalenessThreshold``, which become a
    ``utilization-detector`` with those parameters. With neither, the detector is the plugin named
    ``utilization-detector`` if the config declares one, else a default ``utilization-detector``.

Fairness and ordering refs name a plugin from the config's ``plugins`` list (by name) or a built-in
policy type directly: ``global-strict-fairness-policy`` (default: FCFS across all flows of a band),
``round-robin-fairness-policy`` (flows take turns), ``fcfs-ordering-policy`` (the only ordering).

Every function takes already-parsed YAML and is strict: an unknown key is a ValueError that names it
and lists the valid keys; a bad value names where it is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any

from epp.flowcontrol.saturation import DETECTOR_TYPES, UTILIZATION_DETECTOR
from epp.framework import parse_duration

__all__ = [
    "DEFAULT_BAND_MAX_BYTES",
    "DEFAULT_BAND_MAX_REQUESTS",
    "DEFAULT_REQUEST_TTL",
    "FAIRNESS_POLICIES",
    "FCFS",
    "FLOW_CONTROL_GATE",
    "GLOBAL_STRICT",
    "KNOWN_FEATURE_GATES",
    "ORDERING_POLICIES",
    "ROUND_ROBIN",
    "AdmissionConfig",
    "BandConfig",
    "DetectorChoice",
    "FlowControlConfig",
    "decode_admission",
    "decode_feature_gates",
    "decode_flow_control",
    "decode_saturation_detector",
    "parse_quantity",
]

FLOW_CONTROL_GATE = "flowControl"
# Gate name -> default. Upstream registers more gates for features this version does not have.
KNOWN_FEATURE_GATES: Mapping[str, bool] = MappingProxyType({FLOW_CONTROL_GATE: False})

GLOBAL_STRICT = "global-strict-fairness-policy"
ROUND_ROBIN = "round-robin-fairness-policy"
FCFS = "fcfs-ordering-policy"
FAIRNESS_POLICIES = (GLOBAL_STRICT, ROUND_ROBIN)
ORDERING_POLICIES = (FCFS,)

# Upstream defaults (llm-d-router flowcontrol/registry/config.go and apix/config/v1alpha1).
DEFAULT_BAND_MAX_BYTES = 1_000_000_000  # 1 GB per band
DEFAULT_BAND_MAX_REQUESTS = 5000
DEFAULT_REQUEST_TTL = 60.0  # seconds, both defaultRequestTTL and noEndpointRequestTTL


@dataclass(frozen=True, slots=True)
class BandConfig:
    """One priority band: its limits and policies. ``priority`` is ignored on templates."""

    priority: int = 0
    max_requests: int = DEFAULT_BAND_MAX_REQUESTS
    max_bytes: int = DEFAULT_BAND_MAX_BYTES
    fairness: str = GLOBAL_STRICT
    ordering: str = FCFS

    def __post_init__(self) -> None:
        if self.max_requests <= 0 or self.max_bytes <= 0:
            raise ValueError(f"band {self.priority}: maxRequests and maxBytes must be > 0")
        if self.fairness not in FAIRNESS_POLICIES:
            raise ValueError(
                f"band {self.priority}: unknown fairness policy {self.fairness!r}; known: {list(FAIRNESS_POLICIES)}"
            )
        if self.ordering not in ORDERING_POLICIES:
            raise ValueError(
                f"band {self.priority}: unknown ordering policy {self.ordering!r}; known: {list(ORDERING_POLICIES)}"
            )


@dataclass(frozen=True, slots=True)
class FlowControlConfig:
    """The central queue's settings. Limits of 0 are unlimited; TTLs of 0 never expire."""

    max_requests: int = 0
    max_bytes: int = 0
    default_request_ttl: float = DEFAULT_REQUEST_TTL
    no_endpoint_request_ttl: float = DEFAULT_REQUEST_TTL
    bands: Mapping[int, BandConfig] = field(default_factory=lambda: MappingProxyType({}))
    default_band: BandConfig = BandConfig()
    default_negative_band: BandConfig | None = None

    def __post_init__(self) -> None:
        if self.max_requests < 0 or self.max_bytes < 0:
            raise ValueError("maxRequests and maxBytes must be >= 0")
        for ttl in (self.default_request_ttl, self.no_endpoint_request_ttl):
            if not ttl >= 0 or math.isinf(ttl):
                raise ValueError(f"request TTLs must be finite and >= 0, got {ttl}")
        for priority, band in self.bands.items():
            if band.priority != priority:
                raise ValueError(f"band keyed {priority} has priority {band.priority}")
        object.__setattr__(self, "bands", MappingProxyType(dict(self.bands)))

    def band(self, priority: int) -> BandConfig:
        """The band for ``priority``: a listed one, else built from the matching template."""
        found = self.bands.get(priority)
        if found is not None:
            return found
        template = self.default_negative_band if priority < 0 and self.default_negative_band else self.default_band
        return replace(template, priority=priority)


@dataclass(frozen=True, slots=True)
class DetectorChoice:
    """Which saturation detector the config asks for.

    ``plugin_ref`` names a configured plugin to use as is; otherwise build ``type`` with
    ``parameters`` (:func:`epp.flowcontrol.saturation.from_config`).
    """

    plugin_ref: str | None = None
    type: str = UTILIZATION_DETECTOR
    parameters: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    feature_gates: Mapping[str, bool]
    flow_control_enabled: bool
    flow_control: FlowControlConfig
    detector: DetectorChoice
    flow_control_section_given: bool = False  # set while the gate is off: upstream warns it is ignored


# --- decoding ---------------------------------------------------------------------------------

_FLOW_CONTROL_KEYS = (
    "maxBytes",
    "maxRequests",
    "defaultRequestTTL",
    "noEndpointRequestTTL",
    "priorityBands",
    "defaultPriorityBand",
    "defaultNegativePriorityBand",
    "saturationDetector",
    "usageLimitPolicyPluginRef",
    "enableEviction",
)
_BAND_KEYS = ("priority", "maxBytes", "maxRequests", "fairnessPolicyRef", "orderingPolicyRef")
_DETECTOR_KEYS = ("pluginRef", "queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold")


def decode_feature_gates(value: Any, known: Mapping[str, bool] = KNOWN_FEATURE_GATES) -> dict[str, bool]:
    """``featureGates`` -> every known gate with its value (defaults for those not listed)."""
    gates = dict(known)
    if value is None:
        return gates
    if not isinstance(value, list):
        raise ValueError("featureGates must be a list of gate names")
    for index, entry in enumerate(value):
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"featureGates[{index}] must be a gate name, got {entry!r}")
        name, sep, text = entry.partition("=")
        name = name.strip()
        if name not in known:
            raise ValueError(f"featureGates[{index}]: unknown feature gate {name!r}; known: {', '.join(sorted(known))}")
        enabled = True
        if sep:
            text = text.strip().lower()
            if text not in _BOOLS:
                raise ValueError(f"featureGates[{index}]: {entry!r} must be NAME, NAME=true or NAME=false")
            enabled = _BOOLS[text]
        gates[name] = enabled  # last one wins, as upstream
    return gates


# Go's strconv.ParseBool, lower-cased (upstream lower-cases before parsing).
_BOOLS = {"1": True, "t": True, "true": True, "0": False, "f": False, "false": False}


def decode_flow_control(value: Any, *, plugin_types: Mapping[str, str] | None = None) -> FlowControlConfig:
    """``flowControl`` -> :class:`FlowControlConfig` (its ``saturationDetector`` is read by
    :func:`decode_saturation_detector`). ``plugin_types`` maps the config's plugin names to types,
    to resolve policy refs."""
    if value is None:
        return FlowControlConfig()
    where = "flowControl"
    _check_mapping(value, _FLOW_CONTROL_KEYS, where)
    if "usageLimitPolicyPluginRef" in value:
        raise ValueError(
            f"{where}.usageLimitPolicyPluginRef: usage-limit policies are an upstream feature "
            "this version does not implement"
        )
    eviction = value.get("enableEviction", False)
    if not isinstance(eviction, bool):
        raise ValueError(f"{where}.enableEviction must be true or false, got {eviction!r}")
    if eviction:
        raise ValueError(
            f"{where}.enableEviction: in-flight eviction is an upstream feature this version does not implement"
        )
    types = plugin_types or {}
    default_band = BandConfig()
    if value.get("defaultPriorityBand") is not None:
        default_band = _band(
            value["defaultPriorityBand"], f"{where}.defaultPriorityBand", types, BandConfig(), template=True
        )
    negative = None
    if value.get("defaultNegativePriorityBand") is not None:
        negative = _band(
            value["defaultNegativePriorityBand"],
            f"{where}.defaultNegativePriorityBand",
            types,
            BandConfig(),
            template=True,
        )
    bands: dict[int, BandConfig] = {}
    raw_bands = value.get("priorityBands") or []
    if not isinstance(raw_bands, list):
        raise ValueError(f"{where}.priorityBands must be a list")
    for index, raw in enumerate(raw_bands):
        band = _band(raw, f"{where}.priorityBands[{index}]", types, None, template=False)
        if band.priority in bands:
            raise ValueError(f"{where}.priorityBands[{index}]: priority {band.priority} is listed twice")
        bands[band.priority] = band
    return FlowControlConfig(
        max_requests=_quantity(value, "maxRequests", where, 0),
        max_bytes=_quantity(value, "maxBytes", where, 0),
        default_request_ttl=_duration(value, "defaultRequestTTL", where, DEFAULT_REQUEST_TTL),
        no_endpoint_request_ttl=_duration(value, "noEndpointRequestTTL", where, DEFAULT_REQUEST_TTL),
        bands=bands,
        default_band=default_band,
        default_negative_band=negative,
    )


def decode_saturation_detector(
    flow_control: Any = None, top_level: Any = None, *, plugin_types: Mapping[str, str] | None = None
) -> DetectorChoice:
    """The detector chosen by ``flowControl.saturationDetector`` (wins) or ``saturationDetector``."""
    types = plugin_types or {}
    raw, where = top_level, "saturationDetector"
    if isinstance(flow_control, Mapping) and flow_control.get("saturationDetector") is not None:
        raw, where = flow_control["saturationDetector"], "flowControl.saturationDetector"
        _check_mapping(raw, ("pluginRef",), where)
    if raw is None:
        raw = {}
    _check_mapping(raw, _DETECTOR_KEYS, where)
    thresholds = {key: raw[key] for key in _DETECTOR_KEYS[1:] if key in raw}
    ref = raw.get("pluginRef")
    if ref is not None and thresholds:
        raise ValueError(f"{where}: give either pluginRef or the inline thresholds ({', '.join(thresholds)}), not both")
    if thresholds:
        return DetectorChoice(type=UTILIZATION_DETECTOR, parameters=MappingProxyType(thresholds))
    if ref is None:
        # Upstream's default is the plugin named "utilization-detector", created if not declared.
        if types.get(UTILIZATION_DETECTOR) == UTILIZATION_DETECTOR:
            return DetectorChoice(plugin_ref=UTILIZATION_DETECTOR, type=UTILIZATION_DETECTOR)
        return DetectorChoice()
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"{where}.pluginRef must be a plugin name, got {ref!r}")
    plugin_type = types.get(ref)
    if plugin_type is None:
        if ref in DETECTOR_TYPES:  # a built-in type named directly: build it with defaults
            return DetectorChoice(type=ref)
        raise ValueError(f"{where}.pluginRef {ref!r} names no plugin; defined: {', '.join(types) or 'none'}")
    if plugin_type not in DETECTOR_TYPES:
        raise ValueError(
            f"{where}.pluginRef {ref!r} is a {plugin_type}, not a saturation detector ({', '.join(DETECTOR_TYPES)})"
        )
    return DetectorChoice(plugin_ref=ref, type=plugin_type)


def decode_admission(
    doc: Mapping[str, Any],
    *,
    plugin_types: Mapping[str, str] | None = None,
    known_gates: Mapping[str, bool] = KNOWN_FEATURE_GATES,
) -> AdmissionConfig:
    """Read ``featureGates``, ``flowControl`` and ``saturationDetector`` from a whole config mapping.

    Other keys are the caller's business and are not looked at. The ``flowControl`` section is
    decoded strictly even while the gate is off (a typo is an error either way). ``known_gates``:
    the gate names accepted (with their defaults); it must include ``flowControl``.
    """
    gates = decode_feature_gates(doc.get("featureGates"), known_gates)
    flow_control = decode_flow_control(doc.get("flowControl"), plugin_types=plugin_types)
    detector = decode_saturation_detector(
        doc.get("flowControl"), doc.get("saturationDetector"), plugin_types=plugin_types
    )
    section = doc.get("flowControl")
    given = isinstance(section, Mapping) and any(key != "saturationDetector" for key in section)
    return AdmissionConfig(
        feature_gates=MappingProxyType(gates),
        flow_control_enabled=gates[FLOW_CONTROL_GATE],
        flow_control=flow_control,
        detector=detector,
        flow_control_section_given=given and not gates[FLOW_CONTROL_GATE],
    )


def _check_mapping(value: Any, valid: tuple[str, ...], where: str) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping with keys from: {', '.join(valid)}")
    for key in value:
        if key not in valid:
            raise ValueError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid)}")


def _band(raw: Any, where: str, types: Mapping[str, str], base: BandConfig | None, *, template: bool) -> BandConfig:
    _check_mapping(raw, _BAND_KEYS, where)
    if template:
        if "priority" in raw:
            raise ValueError(f"{where}: a template band takes no priority (it applies to every unlisted one)")
        priority = 0
    else:
        priority = raw.get("priority")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"{where}.priority is required and must be an integer, got {priority!r}")
    base = base or BandConfig()
    # Upstream: an omitted or zero limit takes the default (per-band limits are always bounded).
    max_requests = _quantity(raw, "maxRequests", where, 0) or base.max_requests
    max_bytes = _quantity(raw, "maxBytes", where, 0) or base.max_bytes
    fairness = _policy(raw, "fairnessPolicyRef", where, types, FAIRNESS_POLICIES, base.fairness)
    ordering = _policy(raw, "orderingPolicyRef", where, types, ORDERING_POLICIES, base.ordering)
    return BandConfig(
        priority=priority, max_requests=max_requests, max_bytes=max_bytes, fairness=fairness, ordering=ordering
    )


def _policy(
    raw: Mapping[str, Any], key: str, where: str, types: Mapping[str, str], known: tuple[str, ...], default: str
) -> str:
    ref = raw.get(key)
    if ref is None or ref == "":
        return default
    if not isinstance(ref, str):
        raise ValueError(f"{where}.{key} must be a plugin name or policy type, got {ref!r}")
    policy = types.get(ref, ref)  # a configured plugin's name, or a built-in type named directly
    if policy not in known:
        named = f"{ref!r} (a {policy})" if ref in types else repr(ref)
        raise ValueError(f"{where}.{key}: {named} is not one of {', '.join(known)}")
    return policy


_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_SUFFIX = {
    None: Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def parse_quantity(value: Any) -> int:
    """A Kubernetes resource quantity (``500M``, ``1Gi``, ``1k``, ``100``, or a YAML number) as an
    integer, rounded up like ``Quantity.Value()``. ValueError for anything else or a negative one."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a quantity (e.g. 100, 1k, 500M, 1Gi)")
    if isinstance(value, int):
        number = Decimal(value)
    else:
        text = str(value).strip() if isinstance(value, str) else repr(float(value))
        match = _QUANTITY.match(text)
        if match is None:
            raise ValueError(f"{value!r} is not a quantity (e.g. 100, 1k, 500M, 1Gi)")
        try:
            number = Decimal(match.group(1)) * _SUFFIX[match.group(2)]
        except InvalidOperation:
            raise ValueError(f"{value!r} is not a quantity (e.g. 100, 1k, 500M, 1Gi)") from None
    if number < 0:
        raise ValueError(f"{value!r}: must not be negative")
    return int(number.to_integral_value(rounding=ROUND_CEILING))


def _quantity(raw: Mapping[str, Any], key: str, where: str, default: int) -> int:
    if raw.get(key) is None:
        return default
    try:
        return parse_quantity(raw[key])
    except ValueError as exc:
        raise ValueError(f"{where}.{key}: {exc}") from None


def _duration(raw: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f'{where}.{key} must be a duration string such as "30s", got {value!r}')
    try:
        seconds = float(parse_duration(value))
    except ValueError:
        raise ValueError(f'{where}.{key} must be a duration string such as "30s", got {value!r}') from None
    if seconds < 0:
        raise ValueError(f"{where}.{key} must not be negative, got {value!r}")
    return seconds
