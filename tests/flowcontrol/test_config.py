"""Strict decoding of the upstream featureGates / flowControl / saturationDetector sections."""

from __future__ import annotations

import pytest
import yaml

from epp.flowcontrol import (
    AdmissionConfig,
    BandConfig,
    DetectorChoice,
    FlowControlConfig,
    decode_admission,
    decode_feature_gates,
    decode_flow_control,
    decode_saturation_detector,
)
from epp.flowcontrol.config import FCFS, GLOBAL_STRICT, ROUND_ROBIN, parse_quantity

PLUGINS = {
    "fair": ROUND_ROBIN,
    "strict": GLOBAL_STRICT,
    "fcfs": FCFS,
    "sat": "concurrency-detector",
    "queue-scorer": "queue-scorer",
}


def admission(text: str, plugins: dict[str, str] | None = None) -> AdmissionConfig:
    return decode_admission(yaml.safe_load(text), plugin_types=PLUGINS if plugins is None else plugins)


def test_a_full_upstream_flow_control_section() -> None:
    config = admission(
        """
featureGates: [flowControl]
flowControl:
  maxBytes: 1Gi
  maxRequests: 1k
  defaultRequestTTL: 30s
  noEndpointRequestTTL: 2m
  defaultPriorityBand: {maxRequests: 100, fairnessPolicyRef: fair}
  defaultNegativePriorityBand: {maxRequests: 10, maxBytes: 10M}
  priorityBands:
  - {priority: 100, maxBytes: 500M, fairnessPolicyRef: round-robin-fairness-policy, orderingPolicyRef: fcfs}
  - {priority: 0, maxRequests: 2000}
  - {priority: -10, maxRequests: 0}
  saturationDetector: {pluginRef: sat}
"""
    )
    assert config.flow_control_enabled and not config.flow_control_section_given
    fc = config.flow_control
    assert (fc.max_bytes, fc.max_requests) == (1 << 30, 1000)
    assert (fc.default_request_ttl, fc.no_endpoint_request_ttl) == (30.0, 120.0)
    assert fc.bands == {
        100: BandConfig(100, max_requests=5000, max_bytes=500_000_000, fairness=ROUND_ROBIN, ordering=FCFS),
        0: BandConfig(0, max_requests=2000),
        -10: BandConfig(-10),  # 0 means the default, as upstream: per-band limits are always bounded
    }
    assert fc.default_band == BandConfig(0, max_requests=100, fairness=ROUND_ROBIN)
    assert fc.band(7) == BandConfig(7, max_requests=100, fairness=ROUND_ROBIN)  # unlisted: the template
    assert fc.band(-3) == BandConfig(-3, max_requests=10, max_bytes=10_000_000)  # negative template
    assert fc.band(-10) == BandConfig(-10)  # listed bands win over templates
    assert config.detector == DetectorChoice(plugin_ref="sat", type="concurrency-detector")


def test_defaults_when_nothing_is_configured() -> None:
    config = decode_admission({})
    assert config.feature_gates == {"flowControl": False} and not config.flow_control_enabled
    assert config.flow_control == FlowControlConfig()
    fc = config.flow_control
    assert (fc.max_bytes, fc.max_requests, fc.default_request_ttl, fc.no_endpoint_request_ttl) == (0, 0, 60.0, 60.0)
    assert fc.band(0) == BandConfig(0, max_requests=5000, max_bytes=1_000_000_000, fairness=GLOBAL_STRICT, ordering=FCFS)
    assert fc.band(-1) == BandConfig(-1)  # no negative template: the default one
    assert config.detector == DetectorChoice(plugin_ref=None, type="utilization-detector", parameters={})


def test_ttls_of_zero_disable_expiry() -> None:
    fc = decode_flow_control({"defaultRequestTTL": "0s", "noEndpointRequestTTL": "0"})
    assert (fc.default_request_ttl, fc.no_endpoint_request_ttl) == (0.0, 0.0)


def test_the_section_is_decoded_even_with_the_gate_off() -> None:
    config = admission("flowControl: {maxRequests: 10}")
    assert not config.flow_control_enabled and config.flow_control_section_given  # upstream warns: ignored
    with pytest.raises(ValueError, match="unknown key 'maxRequest'"):
        admission("flowControl: {maxRequest: 10}")
    # only a detector choice: used by the legacy path too, so nothing is ignored
    assert not admission("flowControl: {saturationDetector: {pluginRef: sat}}").flow_control_section_given


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("flowControl: {maxReqests: 5}", "flowControl: unknown key 'maxReqests'; valid keys: maxBytes, maxRequests, defaultRequestTTL"),
        ("flowControl: {priorityBands: [{priority: 1, maxByte: 5}]}", "flowControl.priorityBands[0]: unknown key 'maxByte'; valid keys: priority, maxBytes"),
        ("flowControl: {defaultPriorityBand: {fairness: x}}", "flowControl.defaultPriorityBand: unknown key 'fairness'"),
        ("flowControl: {saturationDetector: {queueDepthThreshold: 5}}", "flowControl.saturationDetector: unknown key 'queueDepthThreshold'; valid keys: pluginRef"),
        ("saturationDetector: {queueDepth: 5}", "saturationDetector: unknown key 'queueDepth'; valid keys: pluginRef, queueDepthThreshold"),
        ("flowControl: [1]", "flowControl must be a mapping"),
        ("flowControl: {priorityBands: {priority: 1}}", "flowControl.priorityBands must be a list"),
        ("flowControl: {priorityBands: [{maxRequests: 5}]}", "priorityBands[0].priority is required and must be an integer"),
        ("flowControl: {priorityBands: [{priority: high}]}", "priorityBands[0].priority is required and must be an integer"),
        ("flowControl: {priorityBands: [{priority: 1}, {priority: 1}]}", "priorityBands[1]: priority 1 is listed twice"),
        ("flowControl: {defaultPriorityBand: {priority: 3}}", "defaultPriorityBand: a template band takes no priority"),
        ("flowControl: {maxBytes: lots}", "flowControl.maxBytes: 'lots' is not a quantity"),
        ("flowControl: {maxRequests: -5}", "flowControl.maxRequests: -5: must not be negative"),
        ("flowControl: {defaultRequestTTL: 30}", 'flowControl.defaultRequestTTL must be a duration string such as "30s", got 30'),
        ("flowControl: {defaultRequestTTL: soon}", "flowControl.defaultRequestTTL must be a duration string"),
        ("flowControl: {noEndpointRequestTTL: -1s}", "flowControl.noEndpointRequestTTL must not be negative"),
        ("flowControl: {priorityBands: [{priority: 1, fairnessPolicyRef: fifo}]}", "fairnessPolicyRef: 'fifo' is not one of global-strict-fairness-policy, round-robin-fairness-policy"),
        ("flowControl: {priorityBands: [{priority: 1, fairnessPolicyRef: fcfs}]}", "'fcfs' (a fcfs-ordering-policy) is not one of global-strict"),
        ("flowControl: {priorityBands: [{priority: 1, orderingPolicyRef: edf-ordering-policy}]}", "orderingPolicyRef: 'edf-ordering-policy' is not one of fcfs-ordering-policy"),
        ("flowControl: {usageLimitPolicyPluginRef: holdback}", "usageLimitPolicyPluginRef: usage-limit policies are an upstream feature this version does not implement"),
        ("flowControl: {enableEviction: true}", "enableEviction: in-flight eviction is an upstream feature this version does not implement"),
        ("flowControl: {enableEviction: yes please}", "enableEviction must be true or false"),
        ("featureGates: flowControl", "featureGates must be a list of gate names"),
        ("featureGates: [flowcontrol]", "featureGates[0]: unknown feature gate 'flowcontrol'; known: flowControl"),
        ("featureGates: [flowControl=maybe]", "featureGates[0]: 'flowControl=maybe' must be NAME, NAME=true or NAME=false"),
        ("featureGates: [3]", "featureGates[0] must be a gate name, got 3"),
        ("saturationDetector: {pluginRef: nope}", "saturationDetector.pluginRef 'nope' names no plugin; defined: fair, strict"),
        ("saturationDetector: {pluginRef: queue-scorer}", "pluginRef 'queue-scorer' is a queue-scorer, not a saturation detector"),
        ("saturationDetector: {pluginRef: sat, queueDepthThreshold: 3}", "give either pluginRef or the inline thresholds (queueDepthThreshold), not both"),
        ("saturationDetector: {pluginRef: 7}", "saturationDetector.pluginRef must be a plugin name, got 7"),
    ],
)
def test_bad_sections_are_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        admission(text)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    ("gates", "expected"),
    [
        (None, False),
        ([], False),
        (["flowControl"], True),
        (["flowControl=true"], True),
        (["flowControl=False"], False),
        ([" flowControl = t "], True),
        (["flowControl", "flowControl=false"], False),  # the last one wins
    ],
)
def test_feature_gates(gates: list[str] | None, expected: bool) -> None:
    assert decode_feature_gates(gates) == {"flowControl": expected}


def test_feature_gates_known_to_the_caller() -> None:
    assert decode_feature_gates(["dataLayer"], known={"flowControl": False, "dataLayer": False}) == {
        "flowControl": False,
        "dataLayer": True,
    }


@pytest.mark.parametrize(
    ("flow_control", "top_level", "plugins", "expected"),
    [
        (None, None, {}, DetectorChoice()),  # default: a default utilization-detector
        (None, None, {"utilization-detector": "utilization-detector"}, DetectorChoice("utilization-detector", "utilization-detector")),
        (None, {"pluginRef": "sat"}, PLUGINS, DetectorChoice("sat", "concurrency-detector")),
        ({"saturationDetector": {"pluginRef": "sat"}}, {"pluginRef": "other"}, PLUGINS, DetectorChoice("sat", "concurrency-detector")),
        (None, {"pluginRef": "concurrency-detector"}, {}, DetectorChoice(None, "concurrency-detector")),  # a type named directly
        (
            None,
            {"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.9, "metricsStalenessThreshold": "1s"},
            {},
            DetectorChoice(None, "utilization-detector", {"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.9, "metricsStalenessThreshold": "1s"}),
        ),  # GIE v1's inline thresholds
    ],
)
def test_detector_choice(flow_control: dict | None, top_level: dict | None, plugins: dict, expected: DetectorChoice) -> None:
    choice = decode_saturation_detector(flow_control, top_level, plugin_types=plugins)
    assert (choice.plugin_ref, choice.type, dict(choice.parameters)) == (expected.plugin_ref, expected.type, dict(expected.parameters))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (100, 100),
        ("100", 100),
        ("1k", 1000),
        ("500M", 500_000_000),
        ("1G", 1_000_000_000),
        ("1Gi", 1 << 30),
        ("64Ki", 65536),
        ("1.5Mi", 1572864),
        ("1e3", 1000),
        ("1500m", 2),  # Quantity.Value() rounds up
        (2.5, 3),
        ("  2Ki ", 2048),
    ],
)
def test_quantities(value: object, expected: int) -> None:
    assert parse_quantity(value) == expected


@pytest.mark.parametrize("value", ["", "1KB", "k", "1 Gi", "-1", True, None, [1], "1.2.3"])
def test_bad_quantities(value: object) -> None:
    with pytest.raises(ValueError):
        parse_quantity(value)


def test_config_objects_validate_themselves() -> None:
    with pytest.raises(ValueError, match="unknown fairness policy"):
        BandConfig(fairness="lottery")
    with pytest.raises(ValueError, match="must be > 0"):
        BandConfig(max_requests=0)
    with pytest.raises(ValueError, match="TTLs must be finite"):
        FlowControlConfig(default_request_ttl=-1)
    with pytest.raises(ValueError, match="band keyed 1 has priority 2"):
        FlowControlConfig(bands={1: BandConfig(priority=2)})
