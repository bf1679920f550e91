"""``EndpointPickerConfig``: the upstream Endpoint Picker's YAML, decoded strictly.

The file names plugin instances (``type``, optional ``name`` and ``parameters``) and scheduling
profiles that reference them by name (``pluginRef``, optional ``weight``). Decoding is strict: an
unknown key, plugin type or parameter stops startup with a message naming it and listing what is
valid, because a silently ignored line is a routing policy nobody asked for. Upstream keys this
version does not implement yet are refused by name, never ignored.

Upstream's defaults, applied after decoding:

* no config at all: :data:`DEFAULT_CONFIG` (queue-scorer 2, kv-cache-utilization-scorer 2,
  prefix-cache-scorer 3, max-score-picker; one profile). Plugin types turned off with
  ``--disable-plugin`` are left out of it.
* no ``schedulingProfiles``: one profile ``default`` using every filter, scorer and picker defined.
* a profile without a picker gets a ``max-score-picker``; a scorer without a weight gets 1.
* one profile and no profile handler: ``single-profile-handler``. Several profiles need a handler.
* a plugin that consumes data (``consumes``) no configured plugin produces gets the type the registry
  records as that data's default producer, built from the consumer's ``producer_parameters``
  (upstream's ``prefix-cache-scorer`` alone brings its own index this way).

The defaults are the types that declare themselves so (``default_for``, see
:mod:`epp.framework.roles`), looked up in the registry: this module names no plugin type.

Plugin roles are found by method (:func:`epp.framework.roles`): in a profile a plugin acts as every
one of filter, scorer and picker it implements; producers and lifecycle hooks run for every
configured plugin, whether or not a profile references it. The data layer's plugins and saturation
detectors are found by their protocols too (:class:`epp.datalayer.plugins.MetricsSource`,
:class:`epp.datalayer.plugins.MetricsExtractor`, :class:`epp.flowcontrol.saturation.SaturationDetector`).

Admission (:mod:`epp.flowcontrol`): ``featureGates`` (``flowControl`` turns the central queue on;
``dataLayer`` is accepted and changes nothing, the data layer being always on here),
``flowControl`` and ``saturationDetector`` are upstream's sections, decoded strictly by
:func:`epp.flowcontrol.decode_admission` after the plugins exist (policy and detector references
name plugins). The saturation detector is the plugin they name, else the registry's default detector with default
parameters (upstream's ``utilization-detector``; a declared plugin of that name is used). A
saturation detector acts as a scheduling filter only in a profile that references it. The
section ``inferenceObjectives`` (name and priority of each objective the request header may name)
is this project's extension (:mod:`epp.flowcontrol.objectives`); upstream reads objectives only
from Kubernetes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, cast

import yaml

from epp.datalayer.plugins import MetricsExtractor, MetricsSource
from epp.flowcontrol.config import (
    FLOW_CONTROL_GATE,
    KNOWN_FEATURE_GATES,
    AdmissionConfig,
    decode_admission,
    decode_feature_gates,
)
from epp.flowcontrol.objectives import decode_objectives
from epp.flowcontrol.saturation import SaturationDetector
from epp.framework import (
    DEFAULT_PICKER,
    DEFAULT_SATURATION_DETECTOR,
    DataProducer,
    Filter,
    Handle,
    Picker,
    Profile,
    ProfileHandler,
    Scorer,
    WeightedScorer,
    declared_keys,
    default_producer_of,
    roles,
)
from epp.scheduling.metrics import PluginCallMetrics
from epp.scheduling.registry import Registry
from epp.scheduling.runner import Scheduler, no_instrument

__all__ = [
    "API_VERSIONS",
    "DEFAULT_CONFIG",
    "ConfigError",
    "PickerConfig",
    "default_config",
    "load_config",
    "load_scheduler",
]

log = logging.getLogger(__name__)

API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")

# Upstream's default profile, used when no config is given: a data file, so that the code names no
# plugin type (deploy/config/default-plugins.yaml writes the same profile out with its parameters).
DEFAULT_CONFIG = resources.files("epp.scheduling").joinpath("default-config.yaml").read_text()

# Type names upstream has renamed: the old name still loads (and says so).
_RENAMED = {"kv-cache-scorer": "kv-cache-utilization-scorer"}

_TOP_KEYS = {
    "apiVersion",
    "kind",
    "plugins",
    "schedulingProfiles",
    "data",
    "dataLayer",
    "featureGates",
    "flowControl",
    "saturationDetector",
    "inferenceObjectives",  # this project's extension (see epp.flowcontrol.objectives)
}
# Upstream keys this version understands but does not implement yet: named, never ignored.
_NOT_YET = {"requestControl", "requestHandler", "parser"}
# Upstream's gates: flowControl works; dataLayer (upstream's switch to the data layer, always on
# here) is accepted so that upstream configs load, and changes nothing.
_FEATURE_GATES = {**KNOWN_FEATURE_GATES, "dataLayer": False}


class ConfigError(ValueError):
    """The configuration cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class _PluginSpec:
    name: str
    type: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PickerConfig:
    """What an EndpointPickerConfig configures: scheduling, and where/how metrics are read.

    ``plugins``: every plugin instance by name, with its type name. ``admission``: the feature
    gates and flow-control settings; ``detector``: the saturation detector admission reads;
    ``objectives``: the configured InferenceObjectives (name -> priority).
    """

    scheduler: Scheduler
    metrics_source: MetricsSource | None = None
    metrics_extractor: MetricsExtractor | None = None
    plugins: Mapping[str, tuple[str, object]] = field(default_factory=dict)
    admission: AdmissionConfig = field(default_factory=lambda: decode_admission({}))
    detector: SaturationDetector | None = None
    objectives: Mapping[str, int] = field(default_factory=dict)


def default_config(registry: Registry) -> str:
    """:data:`DEFAULT_CONFIG` without the plugin types the registry has disabled."""
    if not registry.disabled:
        return DEFAULT_CONFIG
    doc = yaml.safe_load(DEFAULT_CONFIG)
    doc["plugins"] = [p for p in doc["plugins"] if p["type"] not in registry.disabled]
    for profile in doc["schedulingProfiles"]:
        profile["plugins"] = [ref for ref in profile["plugins"] if ref["pluginRef"] not in registry.disabled]
    return yaml.safe_dump(doc)


def load_scheduler(text: str | None, registry: Registry, handle: Handle) -> Scheduler:
    """Decode ``text`` (None: the default config) and build the scheduler it describes."""
    return load_config(text, registry, handle).scheduler


def load_config(
    text: str | None,
    registry: Registry,
    handle: Handle,
    *,
    metrics: PluginCallMetrics | None = None,
    feature_gates: Sequence[str] = (),
) -> PickerConfig:
    """Decode ``text`` (None: the default config) strictly and build what it describes.

    ``metrics``: where every plugin call's duration and failures are recorded (none: not recorded).
    ``feature_gates``: upstream's ``--feature-gates`` entries (``name``, ``name=true|false``), applied
    after the config's ``featureGates`` list, so that they override it.
    """
    doc = _load_yaml(default_config(registry) if text is None else text)
    _check_keys(doc, _TOP_KEYS, "the config")
    if feature_gates:
        try:
            decode_feature_gates(list(feature_gates), _FEATURE_GATES)
        except ValueError as exc:
            raise ConfigError(f"--feature-gates: {exc}") from None
        listed = doc.get("featureGates")
        if listed is None or isinstance(listed, list):  # (anything else: the config's own error below)
            doc = {**doc, "featureGates": [*(listed or ()), *feature_gates]}
    if doc.get("apiVersion") not in API_VERSIONS:
        raise ConfigError(f"apiVersion must be one of {list(API_VERSIONS)}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != "EndpointPickerConfig":
        raise ConfigError(f"kind must be EndpointPickerConfig, got {doc.get('kind')!r}")

    plugins: dict[str, object] = {}
    types: dict[str, str] = {}
    for index, raw in enumerate(_as_list(doc.get("plugins"), "plugins")):
        spec = _plugin_spec(raw, index)
        if spec.name in plugins:
            raise ConfigError(f"plugins[{index}]: a plugin named {spec.name!r} is already defined")
        plugins[spec.name] = _create(registry, spec, f"plugins[{index}] ({spec.name})", handle)
        types[spec.name] = spec.type if spec.type in registry.types() else _RENAMED.get(spec.type, spec.type)
    _add_missing_producers(plugins, types, registry, handle)
    _tell_consumed(plugins)
    producers = _ordered_producers(plugins)
    admission, detector = _admission(doc, plugins, types, registry, handle)
    try:
        objectives = decode_objectives(doc.get("inferenceObjectives"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    raw_profiles = _as_list(doc.get("schedulingProfiles"), "schedulingProfiles")
    if not raw_profiles:
        # Every filter, scorer and picker; a saturation detector filters only where referenced.
        refs = [
            {"pluginRef": name}
            for name, plugin in plugins.items()
            if {"Filter", "Scorer", "Picker"} & set(roles(plugin)) and not isinstance(plugin, SaturationDetector)
        ]
        raw_profiles = [{"name": "default", "plugins": refs}]
    profiles = [_profile(raw, index, plugins, types, registry, handle) for index, raw in enumerate(raw_profiles)]
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise ConfigError(f"schedulingProfiles: profile names must be unique, got {names}")

    handlers = [name for name, plugin in plugins.items() if isinstance(plugin, ProfileHandler)]
    if len(handlers) > 1:
        raise ConfigError(f"plugins: at most one profile handler, got {handlers}")
    if not handlers and len(profiles) > 1:
        raise ConfigError(
            f"schedulingProfiles: {len(profiles)} profiles need a profile handler plugin to choose between them"
        )
    handler = cast(ProfileHandler, plugins[handlers[0]]) if handlers else None

    sources = [p for p in plugins.values() if isinstance(p, MetricsSource)]
    extractors = [p for p in plugins.values() if isinstance(p, MetricsExtractor)]
    for kind, found in (("metrics-data-source", sources), ("core-metrics-extractor", extractors)):
        if len(found) > 1:
            raise ConfigError(f"plugins: at most one {kind} is supported, got {len(found)}")
    data_key = "dataLayer" if "dataLayer" in doc else "data"
    if data_key in doc:
        _check_data_layer(doc[data_key], data_key, plugins)

    scheduler = Scheduler(
        profiles,
        handler=handler,
        producers=producers,
        hooks=list(plugins.values()),
        instrument=metrics.instrument(types) if metrics is not None else no_instrument,
    )
    return PickerConfig(
        scheduler=scheduler,
        metrics_source=sources[0] if sources else None,
        metrics_extractor=extractors[0] if extractors else None,
        plugins={name: (types[name], plugin) for name, plugin in plugins.items()},
        admission=admission,
        detector=detector,
        objectives=objectives,
    )


def _admission(
    doc: Mapping[str, Any],
    plugins: Mapping[str, object],
    types: Mapping[str, str],
    registry: Registry,
    handle: Handle,
) -> tuple[AdmissionConfig, SaturationDetector]:
    """The admission sections, decoded, and the saturation detector they choose."""
    try:
        admission = decode_admission(doc, plugin_types=types, known_gates=_FEATURE_GATES)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    choice = admission.detector
    if choice.plugin_ref is not None:
        plugin = plugins.get(choice.plugin_ref)
        if not isinstance(plugin, SaturationDetector):
            raise ConfigError(f"saturationDetector: plugin {choice.plugin_ref!r} is not a saturation detector")
        detector = plugin
    else:
        # Inline thresholds name their type; otherwise the registry's default detector.
        type_name = choice.type if choice.parameters else registry.default(DEFAULT_SATURATION_DETECTOR) or choice.type
        spec = _PluginSpec(type_name, type_name, choice.parameters)
        built = _create(registry, spec, "saturationDetector", handle)
        if not isinstance(built, SaturationDetector):
            raise ConfigError(f"saturationDetector: plugin type {type_name!r} is not a saturation detector")
        detector = built
    if admission.flow_control_section_given:
        log.warning("flowControl: the section is ignored while the %s feature gate is off", FLOW_CONTROL_GATE)
    if admission.feature_gates.get("dataLayer"):
        log.info("featureGates: dataLayer changes nothing here (the data layer is always on)")
    return admission, detector


def _create(registry: Registry, spec: _PluginSpec, where: str, handle: Handle) -> object:
    type_name = spec.type
    if type_name in _RENAMED and type_name not in registry.types():
        log.info("%s: plugin type %r is upstream's old name of %r", where, type_name, _RENAMED[type_name])
        type_name = _RENAMED[type_name]
    try:
        return registry.create(type_name, spec.name, spec.parameters, handle)
    except KeyError as exc:
        raise ConfigError(f"{where}: {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _add_missing_producers(
    plugins: dict[str, object], types: dict[str, str], registry: Registry, handle: Handle
) -> None:
    """Add the default producer of every consumed data name nobody produces; refuse the rest."""
    for name, plugin in list(plugins.items()):
        for data in declared_keys(plugin, "consumes"):
            if any(data in declared_keys(other, "produces") for other in plugins.values()):
                continue
            producer_type = registry.default(default_producer_of(data))
            if producer_type is None:
                raise ConfigError(
                    f"plugins: {name!r} consumes {data!r}, which no configured plugin produces"
                    + (f" (add a {producer_type} plugin)" if producer_type else "")
                )
            parameters = dict(getattr(plugin, "producer_parameters", None) or {})
            producer_name = producer_type if producer_type not in plugins else f"{producer_type}-for-{name}"
            spec = _PluginSpec(producer_name, producer_type, parameters)
            plugins[producer_name] = _create(registry, spec, f"plugins ({producer_name}, added for {name})", handle)
            types[producer_name] = producer_type
            log.info("added a %s plugin: %r consumes %r", producer_type, name, data)


def _tell_consumed(plugins: Mapping[str, object]) -> None:
    """Call each plugin's ``data_consumed`` with what the others declare they consume (see
    :mod:`epp.framework.roles`)."""
    for plugin in plugins.values():
        tell = getattr(plugin, "data_consumed", None)
        if callable(tell):
            others = (other for other in plugins.values() if other is not plugin)
            tell(frozenset(name for other in others for name in declared_keys(other, "consumes")))


def _ordered_producers(plugins: Mapping[str, object]) -> list[DataProducer]:
    """The producers, each after the producers of the data it consumes; a cycle is an error."""
    producers = {name: plugin for name, plugin in plugins.items() if isinstance(plugin, DataProducer)}
    ordered: list[DataProducer] = []
    state: dict[str, str] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ConfigError(f"plugins: data producers depend on each other in a cycle: {' -> '.join((*chain, name))}")
        state[name] = "visiting"
        for data in declared_keys(producers[name], "consumes"):
            for other, plugin in producers.items():
                if other != name and data in declared_keys(plugin, "produces"):
                    visit(other, (*chain, name))
        state[name] = "done"
        ordered.append(producers[name])

    for name in producers:
        visit(name, ())
    return ordered


def _check_data_layer(raw: Any, where: str, plugins: Mapping[str, object]) -> None:
    """``data``/``dataLayer``: sources and their extractors, by reference; the wiring is implied
    (one metrics source, one extractor), so this only checks that the section is well formed."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with sources")
    _check_keys(raw, {"sources"}, where)
    for index, source in enumerate(_as_list(raw.get("sources"), f"{where}.sources")):
        at = f"{where}.sources[{index}]"
        if not isinstance(source, dict):
            raise ConfigError(f"{at} must be a mapping with pluginRef and extractors")
        _check_keys(source, {"pluginRef", "extractors"}, at)
        if not isinstance(plugins.get(str(source.get("pluginRef"))), MetricsSource):
            raise ConfigError(f"{at}: pluginRef {source.get('pluginRef')!r} names no metrics-data-source plugin")
        for ext_index, extractor in enumerate(_as_list(source.get("extractors"), f"{at}.extractors")):
            ext_at = f"{at}.extractors[{ext_index}]"
            if not isinstance(extractor, dict):
                raise ConfigError(f"{ext_at} must be a mapping with pluginRef")
            _check_keys(extractor, {"pluginRef"}, ext_at)
            if not isinstance(plugins.get(str(extractor.get("pluginRef"))), MetricsExtractor):
                raise ConfigError(
                    f"{ext_at}: pluginRef {extractor.get('pluginRef')!r} names no core-metrics-extractor plugin"
                )


def _load_yaml(text: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"the config is not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError("the config must be a YAML mapping with apiVersion, kind, plugins and schedulingProfiles")
    return doc


def _check_keys(mapping: Mapping[str, Any], valid: set[str], where: str) -> None:
    for key in mapping:
        if key in _NOT_YET and where == "the config":
            raise ConfigError(f"{where}: {key!r} is an upstream setting this version does not implement yet")
        if key not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {', '.join(sorted(valid))}")


def _as_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list")
    return value


def _plugin_spec(raw: Any, index: int) -> _PluginSpec:
    where = f"plugins[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with type, and optionally name and parameters")
    _check_keys(raw, {"name", "type", "parameters"}, where)
    if not isinstance(raw.get("type"), str) or not raw["type"]:
        raise ConfigError(f"{where}: type is required")
    parameters = raw.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ConfigError(f"{where}: parameters must be a mapping")
    return _PluginSpec(name=str(raw.get("name") or raw["type"]), type=raw["type"], parameters=parameters)


def _profile(
    raw: Any, index: int, plugins: dict[str, object], types: dict[str, str], registry: Registry, handle: Handle
) -> Profile:
    where = f"schedulingProfiles[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with name and plugins")
    _check_keys(raw, {"name", "plugins"}, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name is required")
    filters: list[Filter] = []
    scorers: list[WeightedScorer] = []
    pickers: list[Picker] = []
    for ref_index, ref in enumerate(_as_list(raw.get("plugins"), f"{where}.plugins")):
        ref_where = f"{where}.plugins[{ref_index}]"
        if not isinstance(ref, dict):
            raise ConfigError(f"{ref_where} must be a mapping with pluginRef and optionally weight")
        _check_keys(ref, {"pluginRef", "weight"}, ref_where)
        plugin_name = ref.get("pluginRef")
        if not isinstance(plugin_name, str) or plugin_name not in plugins:
            raise ConfigError(f"{ref_where}: pluginRef {plugin_name!r} names no plugin; defined: {', '.join(plugins)}")
        plugin = plugins[plugin_name]
        weight = ref.get("weight", 1)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{ref_where}: weight must be a non-negative number, got {weight!r}")
        found = roles(plugin)
        if not {"Filter", "Scorer", "Picker"} & set(found):
            raise ConfigError(
                f"{ref_where}: plugin {plugin_name!r} ({types[plugin_name]}) is not a filter, scorer or picker"
                + (f"; it is a {', '.join(found)} plugin, which runs without a profile reference" if found else "")
            )
        if "weight" in ref and "Scorer" not in found:
            log.warning("%s: weight given to %r, which is not a scorer: ignored", ref_where, plugin_name)
        if "Filter" in found:
            filters.append(cast(Filter, plugin))
        if "Scorer" in found:
            scorers.append(WeightedScorer(cast(Scorer, plugin), float(weight)))
        if "Picker" in found:
            pickers.append(cast(Picker, plugin))
    if len(pickers) > 1:
        raise ConfigError(f"{where}: a profile takes one picker, got {len(pickers)}: {[p.name for p in pickers]}")
    if not pickers:
        picker_type = registry.default(DEFAULT_PICKER)
        if picker_type is None:
            raise ConfigError(f"{where}: the profile has no picker, and no installed plugin type is the default picker")
        picker_name = picker_type
        if picker_name in plugins and not isinstance(plugins[picker_name], Picker):
            picker_name = f"{picker_type}-for-{name}"
        if picker_name not in plugins:
            spec = _PluginSpec(picker_name, picker_type, {})
            plugins[picker_name] = _create(registry, spec, f"{where} (default picker)", handle)
            types[picker_name] = picker_type
        pickers.append(cast(Picker, plugins[picker_name]))
    return Profile(name=name, picker=pickers[0], filters=tuple(filters), scorers=tuple(scorers))
