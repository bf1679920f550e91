"""EndpointPickerConfig decoding (epp.scheduling.config), the plugin registry (epp.scheduling.registry), the
random-picker plugin and the scheduler it plugs into (epp.scheduling.runner)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.datalayer.static import parse_endpoint
from epp.flowcontrol.config import ROUND_ROBIN
from epp.flowcontrol.saturation import ConcurrencyDetector, UtilizationDetector
from epp.framework import (
    Endpoint,
    Filter,
    Handle,
    InferenceRequest,
    Metrics,
    Picker,
    Profile,
    ScoredEndpoint,
    Scorer,
    StateKey,
    WeightedScorer,
    roles,
)
from epp.plugins.picker.max_score import MaxScorePicker
from epp.plugins.picker.random import RandomPicker
from epp.scheduling.config import API_VERSIONS, DEFAULT_CONFIG, ConfigError, load_config, load_scheduler
from epp.scheduling.metrics import PluginCallMetrics
from epp.scheduling.registry import Registry, default_registry, load_registry
from epp.scheduling.runner import Scheduler
from tests.doubles import Hooks, OnlyPicker

ENDPOINTS = tuple(parse_endpoint(f"10.0.0.{i}:8000") for i in range(1, 5))
REQUEST = InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers={})
HANDLE = Handle(pool=Datastore(ENDPOINTS))


def _config(plugins: str, profiles: str, api_version: str = API_VERSIONS[0]) -> str:
    return f"apiVersion: {api_version}\nkind: EndpointPickerConfig\nplugins:\n{plugins}\nschedulingProfiles:\n{profiles}\n"


_ONE_PROFILE = "- name: default\n  plugins:\n  - pluginRef: random-picker\n"


# -- fakes written against the public plugin API ------------------------------------------------


class _FixedScorer:
    """Scores candidates from a table keyed by hostport (0.0 when absent)."""

    def __init__(self, name: str, scores: Mapping[str, float]) -> None:
        self.name = name
        self.scores = dict(scores)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[float]:
        return [self.scores.get(e.hostport, 0.0) for e in candidates]


class _RawScorer:
    """Returns exactly the list it was given, whatever the candidates."""

    def __init__(self, name: str, values: list[float]) -> None:
        self.name = name
        self.values = values

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[float]:
        return self.values


class _KeepFilter:
    def __init__(self, name: str, keep: set[str]) -> None:
        self.name = name
        self.keep = keep
        self.calls = 0

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        self.calls += 1
        return [e for e in candidates if e.hostport in self.keep]


class _RecordingPicker:
    """Returns every candidate, best score first, and remembers what it was given."""

    def __init__(self, name: str = "recording-picker") -> None:
        self.name = name
        self.seen: list[ScoredEndpoint] | None = None

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        self.seen = list(scored)
        return [item.endpoint for item in sorted(scored, key=lambda item: -item.score)]


def _registry_with_fakes() -> Registry:
    registry = default_registry()
    registry.register(
        "fixed-scorer", lambda name, params, handle: _FixedScorer(name, params.get("scores", {})), source="tests"
    )
    registry.register("keep-filter", lambda name, params, handle: _KeepFilter(name, set(params["keep"])), source="tests")
    registry.register("not-a-plugin", lambda name, params, handle: object(), source="tests")
    return registry


def test_fakes_satisfy_the_protocols() -> None:
    assert isinstance(_FixedScorer("s", {}), Scorer)
    assert isinstance(_KeepFilter("f", set()), Filter)
    assert isinstance(_RecordingPicker(), Picker)
    assert isinstance(RandomPicker(), Picker)
    assert not isinstance(RandomPicker(), Scorer)


# -- configs that load --------------------------------------------------------------------------


def test_default_config_is_upstreams() -> None:
    for text in (None, DEFAULT_CONFIG):
        scheduler = load_scheduler(text, default_registry(), HANDLE)
        profile = scheduler.profile
        assert profile.name == "default"
        assert isinstance(profile.picker, MaxScorePicker)
        assert profile.picker.max_num_of_endpoints == 1
        # Upstream's scorers and picker, behind llm-d's served-model-filter (which never empties the list).
        assert [f.name for f in profile.filters] == ["served-model-filter"]
        assert profile.filters[0].fallback_on_empty and profile.filters[0].pass_on_missing
        assert [(w.scorer.name, w.weight) for w in profile.scorers] == [
            ("queue-scorer", 2.0),
            ("kv-cache-utilization-scorer", 2.0),
            ("prefix-cache-scorer", 3.0),
        ]
        picked = scheduler.schedule(REQUEST, ENDPOINTS)
        assert len(picked) == 1
        assert picked[0] in ENDPOINTS


def test_default_config_leaves_out_disabled_types() -> None:
    registry = load_registry(disabled={"prefix-cache-scorer", "approx-prefix-cache-producer"})
    profile = load_scheduler(None, registry, HANDLE).profile
    assert [w.scorer.name for w in profile.scorers] == ["queue-scorer", "kv-cache-utilization-scorer"]


@pytest.mark.parametrize("api_version", API_VERSIONS)
def test_both_api_versions_are_accepted(api_version: str) -> None:
    text = _config("- type: random-picker", _ONE_PROFILE, api_version)
    assert isinstance(load_scheduler(text, default_registry(), HANDLE).profile.picker, RandomPicker)


def test_max_num_of_endpoints_picks_distinct_endpoints() -> None:
    text = _config(
        "- name: three\n  type: random-picker\n  parameters:\n    maxNumOfEndpoints: 3",
        "- name: default\n  plugins:\n  - pluginRef: three",
    )
    scheduler = load_scheduler(text, default_registry(), HANDLE)
    assert scheduler.profile.picker.name == "three"
    for _ in range(20):
        picked = scheduler.schedule(REQUEST, ENDPOINTS)
        assert len(picked) == 3
        assert len(set(picked)) == 3
        assert set(picked) <= set(ENDPOINTS)
    # never more than there are candidates
    assert sorted(scheduler.schedule(REQUEST, ENDPOINTS[:2]), key=lambda e: e.name) == list(ENDPOINTS[:2])


def test_config_wires_filters_scorers_and_weights() -> None:
    text = _config(
        "- type: random-picker\n"
        "- name: keep\n  type: keep-filter\n  parameters: {keep: ['10.0.0.1:8000', '10.0.0.2:8000']}\n"
        "- name: s1\n  type: fixed-scorer\n"
        "- name: s2\n  type: fixed-scorer",
        "- name: p\n  plugins:\n"
        "  - pluginRef: keep\n"
        "  - pluginRef: s1\n    weight: 2\n"
        "  - pluginRef: s2\n    weight: 0.5\n"
        "  - pluginRef: random-picker",
    )
    profile = load_scheduler(text, _registry_with_fakes(), HANDLE).profile
    assert profile.name == "p"
    assert [f.name for f in profile.filters] == ["keep"]
    assert [(w.scorer.name, w.weight) for w in profile.scorers] == [("s1", 2.0), ("s2", 0.5)]
    assert all(isinstance(w.weight, float) for w in profile.scorers)
    assert isinstance(profile.picker, RandomPicker)


def test_plugin_name_defaults_to_its_type() -> None:
    text = _config("- type: random-picker", "- name: p\n  plugins:\n  - pluginRef: random-picker")
    assert load_scheduler(text, default_registry(), HANDLE).profile.picker.name == "random-picker"


# -- configs that do not load -------------------------------------------------------------------

_PICKER = "- type: random-picker"

_BAD_CONFIGS = [
    pytest.param("a: [1\nb: 2", "the config is not valid YAML: ", id="invalid-yaml"),
    pytest.param("", "the config must be a YAML mapping with apiVersion, kind, plugins and schedulingProfiles", id="empty"),
    pytest.param("- 1\n- 2", "the config must be a YAML mapping", id="list"),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE, "inference.networking.k8s.io/v1"),
        "apiVersion must be one of ['inference.networking.x-k8s.io/v1alpha1', 'llm-d.ai/v1alpha1'], "
        "got 'inference.networking.k8s.io/v1'",
        id="wrong-apiVersion",
    ),
    pytest.param(
        "kind: EndpointPickerConfig\nplugins: []\n",
        "apiVersion must be one of ['inference.networking.x-k8s.io/v1alpha1', 'llm-d.ai/v1alpha1'], got None",
        id="no-apiVersion",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE).replace("kind: EndpointPickerConfig", "kind: InferencePool"),
        "kind must be EndpointPickerConfig, got 'InferencePool'",
        id="wrong-kind",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "scheduling: {}\n",
        "the config: unknown key 'scheduling'; valid keys: apiVersion, data, dataLayer, featureGates, flowControl, "
        "inferenceObjectives, kind, plugins, saturationDetector, schedulingProfiles",
        id="unknown-top-key",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "requestControl: {}\n",
        "the config: 'requestControl' is an upstream setting this version does not implement yet",
        id="requestControl",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "featureGates: [prepareDataPlugins]\n",
        "featureGates[0]: unknown feature gate 'prepareDataPlugins'; known: dataLayer, flowControl",
        id="unknown-feature-gate",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "saturationDetector:\n  queueDepth: 5\n",
        "saturationDetector: unknown key 'queueDepth'; valid keys: pluginRef, queueDepthThreshold",
        id="saturationDetector-unknown-key",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "flowControl: {maxRequests: lots}\n",
        "flowControl.maxRequests: 'lots' is not a quantity",
        id="flowControl-bad-quantity",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "saturationDetector: {pluginRef: random-picker}\n",
        "saturationDetector.pluginRef 'random-picker' is a random-picker, not a saturation detector",
        id="saturationDetector-names-a-picker",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "inferenceObjectives: [{name: chat, priority: high}]\n",
        "inferenceObjectives[0]: priority must be an integer in the int32 range, got 'high'",
        id="objective-bad-priority",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "inferenceObjectives: [{name: chat}, {name: chat, priority: 1}]\n",
        "inferenceObjectives[1]: objective 'chat' is defined twice",
        id="objective-twice",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "inferenceObjectives: [{name: chat, criticality: Critical}]\n",
        "inferenceObjectives[0]: unknown key 'criticality'; valid keys: name, priority",
        id="objective-unknown-key",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE) + "inferenceObjectives: {chat: 1}\n",
        "inferenceObjectives must be a list of {name, priority} mappings",
        id="objectives-not-a-list",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE).replace("plugins:\n- type", "plugins:\n  type", 1),
        "plugins must be a list",
        id="plugins-not-a-list",
    ),
    pytest.param(
        _config("- random-picker", _ONE_PROFILE),
        "plugins[0] must be a mapping with type, and optionally name and parameters",
        id="plugin-not-a-mapping",
    ),
    pytest.param(
        _config("- name: x", _ONE_PROFILE), "plugins[0]: type is required", id="plugin-without-type"
    ),
    pytest.param(
        _config("- type: random-picker\n  weight: 2", _ONE_PROFILE),
        "plugins[0]: unknown key 'weight'; valid keys: name, parameters, type",
        id="plugin-unknown-key",
    ),
    pytest.param(
        _config("- type: random-picker\n  parameters: [1]", _ONE_PROFILE),
        "plugins[0]: parameters must be a mapping",
        id="parameters-not-a-mapping",
    ),
    pytest.param(
        _config("- type: no-such-picker", _ONE_PROFILE),
        "plugins[0] (no-such-picker): unknown plugin type 'no-such-picker'; known types: active-request-scorer, ",
        id="unknown-plugin-type",
    ),
    pytest.param(
        _config("- type: random-picker\n  parameters:\n    maxNumOfEndpoint: 2", _ONE_PROFILE),
        "plugins[0] (random-picker): random-picker: unknown parameter(s) ['maxNumOfEndpoint']; "
        "valid: ['maxNumOfEndpoints']",
        id="unknown-parameter",
    ),
    pytest.param(
        _config("- type: random-picker\n  parameters:\n    maxNumOfEndpoints: 0", _ONE_PROFILE),
        "plugins[0] (random-picker): random-picker: maxNumOfEndpoints must be at least 1, got 0",
        id="maxNumOfEndpoints-0",
    ),
    pytest.param(
        _config("- type: random-picker\n  parameters:\n    maxNumOfEndpoints: x", _ONE_PROFILE),
        "plugins[0] (random-picker): random-picker: maxNumOfEndpoints must be an integer, got 'x'",
        id="maxNumOfEndpoints-x",
    ),
    pytest.param(
        _config("- type: random-picker\n  parameters:\n    maxNumOfEndpoints: true", _ONE_PROFILE),
        "plugins[0] (random-picker): random-picker: maxNumOfEndpoints must be an integer, got True",
        id="maxNumOfEndpoints-bool",
    ),
    pytest.param(
        _config("- type: random-picker\n  parameters:\n    maxNumOfEndpoints: 2.0", _ONE_PROFILE),
        "plugins[0] (random-picker): random-picker: maxNumOfEndpoints must be an integer, got 2.0",
        id="maxNumOfEndpoints-float",
    ),
    pytest.param(
        _config("- type: random-picker\n- type: random-picker", _ONE_PROFILE),
        "plugins[1]: a plugin named 'random-picker' is already defined",
        id="duplicate-plugin-name",
    ),
    pytest.param(
        _config("- name: a\n  type: random-picker\n- name: a\n  type: random-picker", _ONE_PROFILE),
        "plugins[1]: a plugin named 'a' is already defined",
        id="duplicate-explicit-name",
    ),
    pytest.param(
        _config(_PICKER, "- name: default\n  plugins:\n  - pluginRef: random"),
        "schedulingProfiles[0].plugins[0]: pluginRef 'random' names no plugin; defined: random-picker",
        id="unknown-pluginRef",
    ),
    pytest.param(
        _config(_PICKER, "- name: default\n  plugins:\n  - random-picker"),
        "schedulingProfiles[0].plugins[0] must be a mapping with pluginRef and optionally weight",
        id="ref-not-a-mapping",
    ),
    pytest.param(
        _config(_PICKER, "- name: default\n  plugins:\n  - pluginRef: random-picker\n    wieght: 2"),
        "schedulingProfiles[0].plugins[0]: unknown key 'wieght'; valid keys: pluginRef, weight",
        id="ref-unknown-key",
    ),
    pytest.param(
        _config(_PICKER, "- name: default\n  plugins:\n  - pluginRef: random-picker\n    weight: -1"),
        "schedulingProfiles[0].plugins[0]: weight must be a non-negative number, got -1",
        id="negative-weight",
    ),
    pytest.param(
        _config(_PICKER, "- name: default\n  plugins:\n  - pluginRef: random-picker\n    weight: heavy"),
        "schedulingProfiles[0].plugins[0]: weight must be a non-negative number, got 'heavy'",
        id="string-weight",
    ),
    pytest.param(
        _config(_PICKER, "- name: default\n  plugins:\n  - pluginRef: random-picker\n    weight: true"),
        "schedulingProfiles[0].plugins[0]: weight must be a non-negative number, got True",
        id="bool-weight",
    ),
    pytest.param(
        _config(
            "- name: a\n  type: random-picker\n- name: b\n  type: random-picker",
            "- name: default\n  plugins:\n  - pluginRef: a\n  - pluginRef: b",
        ),
        "schedulingProfiles[0]: a profile takes one picker, got 2: ['a', 'b']",
        id="profile-with-two-pickers",
    ),
    pytest.param(
        _config(_PICKER, "- name: default\n  plugins: []\n  weight: 1"),
        "schedulingProfiles[0]: unknown key 'weight'; valid keys: name, plugins",
        id="profile-unknown-key",
    ),
    pytest.param(
        _config(_PICKER, "- default"),
        "schedulingProfiles[0] must be a mapping with name and plugins",
        id="profile-not-a-mapping",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE + _ONE_PROFILE.replace("default", "second")),
        "schedulingProfiles: 2 profiles need a profile handler plugin to choose between them",
        id="two-profiles-no-handler",
    ),
    pytest.param(
        _config(_PICKER, _ONE_PROFILE + _ONE_PROFILE),
        "schedulingProfiles: profile names must be unique, got ['default', 'default']",
        id="same-profile-name",
    ),
    pytest.param(
        _config(_PICKER, "- plugins:\n  - pluginRef: random-picker"),
        "schedulingProfiles[0]: name is required",
        id="profile-without-name",
    ),
    pytest.param(
        _config(_PICKER + "\n- name: other\n  type: random-picker", _ONE_PROFILE + "  - pluginRef: other\n"),
        "schedulingProfiles[0]: a profile takes one picker, got 2: ['random-picker', 'other']",
        id="two-pickers",
    ),
    pytest.param(
        _config("- type: single-profile-handler\n- name: h2\n  type: single-profile-handler\n" + _PICKER, _ONE_PROFILE),
        "plugins: at most one profile handler, got ['single-profile-handler', 'h2']",
        id="two-handlers",
    ),
]


@pytest.mark.parametrize(("text", "message"), _BAD_CONFIGS)
def test_bad_config(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_scheduler(text, default_registry(), HANDLE)
    assert str(info.value).startswith(message)


def test_plugin_that_is_no_filter_scorer_or_picker() -> None:
    text = _config(_PICKER + "\n- name: odd\n  type: not-a-plugin", _ONE_PROFILE.rstrip() + "\n  - pluginRef: odd")
    with pytest.raises(ConfigError) as info:
        load_scheduler(text, _registry_with_fakes(), HANDLE)
    assert str(info.value) == "schedulingProfiles[0].plugins[1]: plugin 'odd' (not-a-plugin) is not a filter, scorer or picker"


def test_unknown_type_lists_every_registered_type() -> None:
    registry = _registry_with_fakes()
    with pytest.raises(ConfigError) as info:
        load_scheduler(_config("- type: nope", _ONE_PROFILE), registry, HANDLE)
    assert str(info.value) == f"plugins[0] (nope): unknown plugin type 'nope'; known types: {', '.join(registry.types())}"
    assert "fixed-scorer, " in str(info.value) and "queue-scorer, " in str(info.value)


@pytest.mark.parametrize("ref", ["[random-picker]", "{name: random-picker}"])
def test_unhashable_plugin_ref_is_a_config_error(ref: str) -> None:
    # A list or mapping is unhashable: it must be reported, not crash the lookup.
    text = _config(_PICKER, f"- name: default\n  plugins:\n  - pluginRef: {ref}")
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\]\.plugins\[0\]: pluginRef"):
        load_scheduler(text, default_registry(), HANDLE)


@pytest.mark.parametrize("weight", [".nan", ".inf"])
def test_non_finite_weight_is_a_config_error(weight: str) -> None:
    # `weight < 0` is False for NaN and +inf; a NaN weight makes every total NaN, and inf * 0 is NaN.
    text = _config(
        _PICKER + "\n- name: s\n  type: fixed-scorer",
        f"- name: default\n  plugins:\n  - pluginRef: random-picker\n  - pluginRef: s\n    weight: {weight}",
    )
    with pytest.raises(ConfigError, match="weight must be a non-negative number"):
        load_scheduler(text, _registry_with_fakes(), HANDLE)


# -- registry -----------------------------------------------------------------------------------


BUILT_IN_TYPES = [
    "active-request-scorer",
    "approx-prefix-cache-producer",
    "core-metrics-extractor",
    "kv-cache-utilization-scorer",
    "label-selector-filter",
    "least-kv-cache-filter",
    "least-queue-filter",
    "load-aware-scorer",
    "lora-affinity-filter",
    "lora-affinity-scorer",
    "low-queue-filter",
    "max-score-picker",
    "metrics-data-source",
    "prefix-cache-scorer",
    "queue-scorer",
    "random-picker",
    "running-requests-size-scorer",
    "session-affinity-scorer",
    "single-profile-handler",
    "weighted-random-picker",
]


def test_default_registry_holds_the_built_ins_from_entry_points() -> None:
    registry = default_registry()
    assert set(BUILT_IN_TYPES) <= set(registry.types())
    assert registry.source("random-picker").startswith("epp ")
    picker = registry.create("random-picker", "rp", {"maxNumOfEndpoints": 2}, HANDLE)
    assert isinstance(picker, RandomPicker)
    assert (picker.name, picker.max_num_of_endpoints) == ("rp", 2)


def test_registering_a_type_twice_names_both_sources() -> None:
    registry = default_registry()
    with pytest.raises(ValueError) as info:
        registry.register("random-picker", RandomPicker.from_config, source="acme-plugins 1.0")
    assert str(info.value) == (
        f"plugin type 'random-picker' is registered twice: by {registry.source('random-picker')} and by acme-plugins 1.0"
    )
    assert registry.source("random-picker").startswith("epp ")  # the first registration stays


def test_create_unknown_type() -> None:
    with pytest.raises(KeyError) as info:
        Registry().create("x", "x", {}, HANDLE)
    assert info.value.args[0] == "unknown plugin type 'x'; known types: "


def test_factory_receives_name_parameters_and_handle() -> None:
    received: list[tuple[str, Mapping[str, Any], Handle]] = []
    registry = Registry()
    registry.register("probe", lambda name, params, handle: received.append((name, params, handle)) or object(), source="t")
    registry.create("probe", "p1", {"k": 1}, HANDLE)
    assert received == [("p1", {"k": 1}, HANDLE)]


# -- random-picker ------------------------------------------------------------------------------


def _scored(endpoints: Sequence[Endpoint]) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(e, 0.0) for e in endpoints]


@pytest.mark.parametrize(("max_num", "candidates", "expected_len"), [(1, 4, 1), (3, 4, 3), (4, 4, 4), (9, 4, 4), (2, 0, 0)])
def test_random_picker_count(max_num: int, candidates: int, expected_len: int) -> None:
    picker = RandomPicker(max_num_of_endpoints=max_num, seed=7)
    picked = picker.pick(REQUEST, _scored(ENDPOINTS[:candidates]))
    assert len(picked) == expected_len
    assert len(set(picked)) == expected_len
    assert set(picked) <= set(ENDPOINTS)


def test_random_picker_ignores_scores_and_reaches_every_endpoint() -> None:
    picker = RandomPicker(seed=1)
    scored = [ScoredEndpoint(e, 1.0 if i == 0 else 0.0) for i, e in enumerate(ENDPOINTS)]
    seen = {picker.pick(REQUEST, scored)[0] for _ in range(200)}
    assert seen == set(ENDPOINTS)


def test_random_picker_seed_is_reproducible() -> None:
    a, b = RandomPicker(max_num_of_endpoints=2, seed=42), RandomPicker(max_num_of_endpoints=2, seed=42)
    scored = _scored(ENDPOINTS)
    assert [a.pick(REQUEST, scored) for _ in range(10)] == [b.pick(REQUEST, scored) for _ in range(10)]


def test_random_picker_rejects_zero() -> None:
    with pytest.raises(ValueError, match=r"^rp: maxNumOfEndpoints must be at least 1, got 0$"):
        RandomPicker("rp", max_num_of_endpoints=0)


# -- Scheduler ----------------------------------------------------------------------------------

E1, E2, E3 = ENDPOINTS[:3]


def _totals(picker: _RecordingPicker) -> dict[str, float]:
    assert picker.seen is not None
    return {item.endpoint.hostport: item.score for item in picker.seen}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ([0.0, 0.5, 1.0], [0.0, 0.5, 1.0]),
        ([-0.5, 1.5, 0.25], [0.0, 1.0, 0.25]),
        ([math.nan, 0.5, math.nan], [0.0, 0.5, 0.0]),
        ([-math.inf, math.inf, 0.0], [0.0, 1.0, 0.0]),
    ],
)
def test_scores_are_clamped_and_nan_is_worst(raw: list[float], expected: list[float]) -> None:
    picker = _RecordingPicker()
    scheduler = Scheduler(Profile("p", picker, scorers=(WeightedScorer(_RawScorer("raw", raw), 1.0),)))
    scheduler.schedule(REQUEST, (E1, E2, E3))
    assert picker.seen is not None
    assert [item.score for item in picker.seen] == expected


def test_weights_are_applied_and_summed() -> None:
    picker = _RecordingPicker()
    a = _FixedScorer("a", {E1.hostport: 1.0, E2.hostport: 0.5})
    b = _FixedScorer("b", {E2.hostport: 1.0, E3.hostport: 2.0})  # 2.0 clamps to 1.0
    scheduler = Scheduler(Profile("p", picker, scorers=(WeightedScorer(a, 2.0), WeightedScorer(b, 0.5))))
    picked = scheduler.schedule(REQUEST, (E1, E2, E3))
    assert _totals(picker) == {E1.hostport: 2.0, E2.hostport: 1.5, E3.hostport: 0.5}
    assert picked == [E1, E2, E3]


def test_zero_weight_silences_a_scorer() -> None:
    picker = _RecordingPicker()
    scorer = _FixedScorer("a", {E1.hostport: 1.0})
    Scheduler(Profile("p", picker, scorers=(WeightedScorer(scorer, 0.0),))).schedule(REQUEST, (E1, E2))
    assert _totals(picker) == {E1.hostport: 0.0, E2.hostport: 0.0}


def test_no_scorers_means_all_zero_in_candidate_order() -> None:
    picker = _RecordingPicker()
    Scheduler(Profile("p", picker)).schedule(REQUEST, (E3, E1))
    assert picker.seen == [ScoredEndpoint(E3, 0.0), ScoredEndpoint(E1, 0.0)]


@pytest.mark.parametrize("raw", [[1.0], [1.0, 1.0, 1.0, 1.0], []])
def test_wrong_number_of_scores_scores_zero_and_is_counted(raw: list[float], caplog: pytest.LogCaptureFixture) -> None:
    metrics = PluginCallMetrics()
    picker = _RecordingPicker()
    scorers = (WeightedScorer(_RawScorer("bad", raw), 1.0), WeightedScorer(_FixedScorer("good", {E2.hostport: 1.0}), 1.0))
    scheduler = Scheduler(Profile("p", picker, scorers=scorers), instrument=metrics.instrument({"bad": "raw"}))
    with caplog.at_level(logging.ERROR):
        scheduler.schedule(REQUEST, (E1, E2, E3))
    assert _totals(picker) == {E1.hostport: 0.0, E2.hostport: 1.0, E3.hostport: 0.0}  # the good scorer still counts
    labels = {"extension_point": "Scorer", "plugin_type": "raw", "plugin_name": "bad", "kind": "malformed"}
    assert metrics.registry.get_sample_value("epp_plugin_errors_total", labels) == 1
    assert f"returned {len(raw)} scores for 3 candidates" in caplog.text


def test_a_failing_scorer_is_logged_once_a_minute_with_the_count_of_those_left_out(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("epp.framework.helpers.time.monotonic", lambda: now[0])
    metrics = PluginCallMetrics()
    scheduler = Scheduler(Profile("p", _RecordingPicker(), scorers=(WeightedScorer(_RawScorer("bad", [1.0]), 1.0),)),
                          instrument=metrics.instrument({"bad": "raw"}))  # fmt: skip
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            scheduler.schedule(REQUEST, (E1, E2, E3))
        now[0] += 60
        scheduler.schedule(REQUEST, (E1, E2, E3))
    lines = [r.getMessage() for r in caplog.records if "scores for 3 candidates" in r.getMessage()]
    assert len(lines) == 2 and "not logged" not in lines[0]
    assert "2 more failure(s) here in the last 60s not logged" in lines[1]
    labels = {"extension_point": "Scorer", "plugin_type": "raw", "plugin_name": "bad", "kind": "malformed"}
    assert metrics.registry.get_sample_value("epp_plugin_errors_total", labels) == 4  # every one counted


def test_filters_narrow_in_order() -> None:
    picker = _RecordingPicker()
    first = _KeepFilter("first", {E1.hostport, E2.hostport})
    second = _KeepFilter("second", {E2.hostport, E3.hostport})
    picked = Scheduler(Profile("p", picker, filters=(first, second))).schedule(REQUEST, (E1, E2, E3))
    assert picked == [E2]
    assert (first.calls, second.calls) == (1, 1)


def test_filters_that_empty_the_list_return_nothing() -> None:
    picker = _RecordingPicker()
    scorer = _RawScorer("never", [])
    first = _KeepFilter("none", set())
    second = _KeepFilter("after", {E1.hostport})
    profile = Profile("p", picker, filters=(first, second), scorers=(WeightedScorer(scorer, 1.0),))
    assert Scheduler(profile).schedule(REQUEST, (E1, E2)) == []
    assert second.calls == 0  # later filters, scorers and the picker never run
    assert picker.seen is None


def test_no_candidates_returns_nothing() -> None:
    picker = _RecordingPicker()
    assert Scheduler(Profile("p", picker)).schedule(REQUEST, ()) == []
    assert picker.seen is None


# -- admission: featureGates, flowControl, saturationDetector, inferenceObjectives ---------------


def test_admission_defaults_are_upstreams() -> None:
    built = load_config(None, default_registry(), HANDLE)
    assert not built.admission.flow_control_enabled
    assert isinstance(built.detector, UtilizationDetector)
    assert (built.detector.config.queue_depth_threshold, built.detector.config.kv_cache_util_threshold) == (5, 0.8)
    assert built.objectives == {}


def test_flow_control_objectives_and_a_declared_detector_are_wired() -> None:
    text = _config(
        "- type: concurrency-detector\n  name: sat\n  parameters: {maxConcurrency: 3}\n"
        "- type: round-robin-fairness-policy\n  name: fair\n- type: random-picker",
        "",
    ).replace("schedulingProfiles:\n\n", "") + (
        "featureGates: [flowControl, dataLayer]\n"
        "flowControl:\n  defaultRequestTTL: 5s\n  priorityBands:\n  - priority: 10\n    fairnessPolicyRef: fair\n"
        "  saturationDetector: {pluginRef: sat}\n"
        "inferenceObjectives:\n- {name: chat, priority: 10}\n- {name: bulk, priority: -1}\n"
    )
    built = load_config(text, default_registry(), HANDLE)
    assert built.admission.flow_control_enabled and built.admission.feature_gates["dataLayer"]
    assert built.admission.flow_control.default_request_ttl == 5.0
    assert built.admission.flow_control.band(10).fairness == ROUND_ROBIN
    assert isinstance(built.detector, ConcurrencyDetector) and built.detector is built.plugins["sat"][1]
    assert built.detector.saturation(ENDPOINTS) == 0.0  # the handle's in-flight accounting: nothing sent yet
    assert built.objectives == {"chat": 10, "bulk": -1}
    # Without schedulingProfiles every filter joins the default profile, but not the detector.
    assert built.scheduler.profile.filters == ()


def test_a_flow_control_section_without_its_gate_is_decoded_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    text = _config(_PICKER, _ONE_PROFILE) + "flowControl: {maxRequests: 10}\n"
    built = load_config(text, default_registry(), HANDLE)
    assert not built.admission.flow_control_enabled
    assert "flowControl: the section is ignored while the flowControl feature gate is off" in caplog.text


@pytest.mark.parametrize(
    ("listed", "flag", "enabled"),
    [
        ("", ["flowControl"], True),  # a bare name enables (kubelet style)
        ("featureGates: [flowControl]\n", ["flowControl=false"], False),  # the flag wins over the config
        ("featureGates: [flowControl]\n", ["dataLayer"], True),  # and leaves the config's others
        ("featureGates: [flowControl=false]\n", ["flowControl=true"], True),
    ],
)
def test_the_feature_gates_flag_applies_after_the_config(listed: str, flag: list[str], enabled: bool) -> None:
    built = load_config(_config(_PICKER, _ONE_PROFILE) + listed, default_registry(), HANDLE, feature_gates=flag)
    assert built.admission.flow_control_enabled is enabled


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["bogus"], "--feature-gates: featureGates[0]: unknown feature gate 'bogus'; known: dataLayer, flowControl"),
        (["flowControl=maybe"], "--feature-gates: featureGates[0]: 'flowControl=maybe' must be NAME, NAME=true or NAME=false"),
    ],
)  # fmt: skip
def test_a_bad_feature_gates_flag_is_named(flag: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_config(_PICKER, _ONE_PROFILE), default_registry(), HANDLE, feature_gates=flag)
    assert str(info.value) == message


# -- plugin roles, producers, profiles and defaults as the config wires them ---------------------


FRESH = tuple(
    Endpoint(e.name, e.address, e.port, metrics=Metrics(stale=False))
    for e in (parse_endpoint(f"10.0.0.{i}:8000") for i in range(1, 4))
)


P1, P2, P3 = FRESH


def request(prompt: str = "", **headers: str) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers=headers, model="m", prompt=prompt)


def config(plugins: str, profiles: str | None = None) -> str:
    text = f"apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n{plugins}\n"
    return text + (f"schedulingProfiles:\n{profiles}\n" if profiles is not None else "")


calls: list[str] = []


class Producer:
    def __init__(self, name: str, produces: tuple[str, ...], consumes: tuple[str, ...] = ()) -> None:
        self.name, self.produces, self.consumes = name, produces, consumes

    def produce(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        calls.append(f"produce:{self.name}")
        for data in self.consumes:
            assert StateKey(data) in req.state, f"{self.name} ran before the producer of {data}"
        for data in self.produces:
            req.state[StateKey(data)] = {e.name: float(i == 0) for i, e in enumerate(candidates)}


class Consumer:
    """A scorer scoring from the data it consumes."""

    def __init__(self, name: str, data: str) -> None:
        self.name, self.consumes, self.data = name, (data,), data

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        calls.append(f"score:{self.name}")
        return [req.state[StateKey[dict[str, float]](self.data)][e.name] for e in candidates]


class FilterAndScorer:
    """Two roles in one plugin: drops P3, and prefers P2."""

    name = "both"

    def filter(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if e != P3]

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return [1.0 if e == P2 else 0.0 for e in candidates]


class TwoStepHandler:
    """Runs profile ``a``, then ``b``; the request goes by ``b``."""

    name = "two-step"

    def pick_profiles(self, req: InferenceRequest, profiles: Mapping[str, Profile], results: Mapping[str, list[Endpoint]]) -> list[Profile]:
        calls.append(f"handler:{sorted(results)}")
        if not results:
            return [profiles["a"]]
        if "b" not in results:
            return [profiles["b"]]
        return []

    def process_results(self, req: InferenceRequest, results: Mapping[str, list[Endpoint]]) -> str:
        return "b"


def registry_with(**factories: Any) -> Registry:
    registry = default_registry()
    for type_name, factory in factories.items():
        registry.register(type_name.replace("_", "-"), factory, source="tests")
    return registry


def test_roles_are_found_by_method() -> None:
    assert roles(FilterAndScorer()) == ["Filter", "Scorer"]
    assert roles(Hooks()) == ["PreRequest", "ResponseReceived", "ResponseComplete"]
    assert roles(TwoStepHandler()) == ["ProfileHandler"]
    assert roles(object()) == []


def test_producers_run_first_in_dependency_order() -> None:
    registry = registry_with(
        # "second" consumes what "first" produces, and is listed before it.
        second=lambda n, p, h: Producer(n, ("b",), consumes=("a",)),
        first=lambda n, p, h: Producer(n, ("a",)),
        consumer=lambda n, p, h: Consumer(n, "b"),
    )
    text = config(
        "- type: second\n- type: first\n- type: consumer\n- type: max-score-picker",
        "- name: p\n  plugins:\n  - pluginRef: consumer\n  - pluginRef: max-score-picker",
    )
    calls.clear()
    picked = load_scheduler(text, registry, Handle(Datastore())).schedule(request(), FRESH)
    assert calls == ["produce:first", "produce:second", "score:consumer"]
    assert picked == [P1]  # the consumer scored from the data: P1 has 1.0


def test_each_producer_is_told_what_the_other_plugins_consume() -> None:
    told: dict[str, frozenset[str]] = {}

    class Told(Producer):
        def data_consumed(self, names: frozenset[str]) -> None:
            told[self.name] = names

    registry = registry_with(
        first=lambda n, p, h: Told(n, ("a",)),
        second=lambda n, p, h: Told(n, ("b",), consumes=("a",)),
        consumer=lambda n, p, h: Consumer(n, "b"),
    )
    load_scheduler(config("- type: first\n- type: second\n- type: consumer\n- type: max-score-picker"), registry,
                   Handle(Datastore()))  # fmt: skip
    assert told == {"first": frozenset({"a", "b"}), "second": frozenset({"b"})}  # not their own


def test_a_producer_cycle_is_refused() -> None:
    registry = registry_with(
        x=lambda n, p, h: Producer(n, ("a",), consumes=("b",)), y=lambda n, p, h: Producer(n, ("b",), consumes=("a",))
    )
    with pytest.raises(ConfigError, match=r"data producers depend on each other in a cycle: x -> y -> x"):
        load_scheduler(config("- type: x\n- type: y\n- type: random-picker"), registry, Handle(Datastore()))


def test_consuming_data_nobody_produces_is_refused() -> None:
    registry = registry_with(consumer=lambda n, p, h: Consumer(n, "mystery"))
    with pytest.raises(ConfigError) as info:
        load_scheduler(config("- type: consumer"), registry, Handle(Datastore()))
    assert str(info.value) == "plugins: 'consumer' consumes 'mystery', which no configured plugin produces"


def test_prefix_cache_scorer_alone_brings_its_producer_with_its_parameters() -> None:
    text = config(
        "- type: prefix-cache-scorer\n  parameters:\n    blockSizeTokens: 4\n    lruCapacityPerServer: 7",
        "- name: p\n  plugins:\n  - pluginRef: prefix-cache-scorer",
    )
    built = load_config(text, default_registry(), Handle(Datastore()))
    assert built.plugins["approx-prefix-cache-producer"][0] == "approx-prefix-cache-producer"
    producer = built.plugins["approx-prefix-cache-producer"][1]
    assert (producer.parameters.block_size_tokens, producer.parameters.lru_capacity_per_server) == (4, 7)


def test_a_profile_handler_runs_several_profiles() -> None:
    registry = registry_with(
        two_step=lambda n, p, h: TwoStepHandler(),
        only=lambda n, p, h: OnlyPicker(n, p["hostport"]),
    )
    text = config(
        "- type: two-step\n"
        "- name: pick-1\n  type: only\n  parameters: {hostport: '10.0.0.1:8000'}\n"
        "- name: pick-2\n  type: only\n  parameters: {hostport: '10.0.0.2:8000'}",
        "- name: a\n  plugins:\n  - pluginRef: pick-1\n- name: b\n  plugins:\n  - pluginRef: pick-2",
    )
    scheduler = load_scheduler(text, registry, Handle(Datastore()))
    calls.clear()
    result = scheduler.run(request(), FRESH)
    assert calls == ["handler:[]", "handler:['a']", "handler:['a', 'b']"]
    assert dict(result.profile_results) == {"a": [P1], "b": [P2]}
    assert (result.primary_profile, result.endpoints) == ("b", [P2])


def test_a_profile_without_picker_gets_max_score_picker_and_a_scorer_weight_1() -> None:
    text = config("- type: queue-scorer", "- name: p\n  plugins:\n  - pluginRef: queue-scorer")
    profile = load_scheduler(text, default_registry(), Handle(Datastore())).profile
    assert type(profile.picker).__name__ == "MaxScorePicker"
    assert [(w.scorer.name, w.weight) for w in profile.scorers] == [("queue-scorer", 1.0)]


def test_no_profiles_means_one_default_profile_with_every_plugin() -> None:
    registry = registry_with(both=lambda n, p, h: FilterAndScorer())
    scheduler = load_scheduler(config("- type: both\n- type: max-score-picker"), registry, Handle(Datastore()))
    profile = scheduler.profile
    assert profile.name == "default"
    assert [f.name for f in profile.filters] == ["both"]  # one plugin, two roles
    assert [w.scorer.name for w in profile.scorers] == ["both"]
    for _ in range(10):
        assert scheduler.schedule(request(), FRESH) == [P2]


def test_weight_on_a_non_scorer_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    text = config("- type: random-picker", "- name: p\n  plugins:\n  - pluginRef: random-picker\n    weight: 3")
    with caplog.at_level(logging.WARNING):
        load_scheduler(text, default_registry(), Handle(Datastore()))
    assert "weight given to 'random-picker', which is not a scorer: ignored" in caplog.text


def test_upstream_old_type_name_kv_cache_scorer_loads() -> None:
    text = config("- type: kv-cache-scorer", "- name: p\n  plugins:\n  - pluginRef: kv-cache-scorer")
    built = load_config(text, default_registry(), Handle(Datastore()))
    assert built.plugins["kv-cache-scorer"][0] == "kv-cache-utilization-scorer"


def test_every_plugin_call_is_timed_with_its_type_and_name() -> None:
    seen: list[tuple[str, str, str]] = []

    class Recorder:  # what load_config binds each call site to, as PluginCallMetrics does
        def instrument(self, types: dict[str, str]) -> Any:
            def bind(point: str, plugin: Any) -> Any:
                name = plugin.name
                return (lambda seconds: seen.append((point, types[name], name)) if seconds >= 0 else None), print

            return bind

    text = config(
        "- type: low-queue-filter\n- name: q\n  type: queue-scorer\n- type: prefix-cache-scorer\n- type: max-score-picker",
        "- name: p\n  plugins:\n  - pluginRef: low-queue-filter\n  - pluginRef: q\n  - pluginRef: prefix-cache-scorer\n"
        "  - pluginRef: max-score-picker",
    )
    scheduler = load_config(text, default_registry(), Handle(Datastore()), metrics=Recorder()).scheduler  # type: ignore[arg-type]
    result = scheduler.run(request("x" * 200), FRESH)
    scheduler.pre_request(request(), result)
    assert seen == [
        ("DataProducer", "approx-prefix-cache-producer", "approx-prefix-cache-producer"),
        ("Filter", "low-queue-filter", "low-queue-filter"),
        ("Scorer", "queue-scorer", "q"),
        ("Scorer", "prefix-cache-scorer", "prefix-cache-scorer"),
        ("Picker", "max-score-picker", "max-score-picker"),
        ("PreRequest", "approx-prefix-cache-producer", "approx-prefix-cache-producer"),
    ]


def test_the_readme_and_deploy_configs_load() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    texts = [b for b in blocks if "kind: EndpointPickerConfig" in b]
    texts += [p.read_text() for p in sorted((root / "deploy" / "config").glob("*.yaml"))]
    assert len(texts) >= 5
    for text in texts:
        load_config(text, default_registry(), Handle(Datastore()))
