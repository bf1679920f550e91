"""``EndpointPickerConfig``: the upstream Endpoint Picker's YAML, decoded strictly.

The file names plugin instances (``type``, optional ``name`` and ``parameters``) and scheduling
profiles that reference them by name (``pluginRef``, optional ``weight``). Decoding is strict: an
unknown key, plugin type or parameter stops startup with a message naming it and listing what is
valid, because a silently ignored line is a routing policy nobody asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from epp.datalayer import CoreMetricsExtractor, MetricsDataSource
from epp.registry import Handle, Registry
from epp.scheduling import Filter, Picker, Profile, Scheduler, Scorer, WeightedScorer

__all__ = ["API_VERSIONS", "ConfigError", "DEFAULT_CONFIG", "PickerConfig", "load_config", "load_scheduler"]

API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")

# Until the scoring plugins land, the default profile picks at random among ready endpoints.
DEFAULT_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""

_TOP_KEYS = {"apiVersion", "kind", "plugins", "schedulingProfiles", "data", "dataLayer"}
# Upstream keys this version understands but does not implement yet: named, never ignored.
_NOT_YET = {"featureGates", "saturationDetector", "flowControl", "requestControl", "parser"}


class ConfigError(ValueError):
    """The configuration cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class _PluginSpec:
    name: str
    type: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PickerConfig:
    """What an EndpointPickerConfig configures: scheduling, and where/how metrics are read."""

    scheduler: Scheduler
    metrics_source: MetricsDataSource | None = None
    metrics_extractor: CoreMetricsExtractor | None = None


def load_scheduler(text: str | None, registry: Registry, handle: Handle) -> Scheduler:
    """Decode ``text`` (None: the default config) and build the scheduler it describes."""
    return load_config(text, registry, handle).scheduler


def load_config(text: str | None, registry: Registry, handle: Handle) -> PickerConfig:
    """Decode ``text`` (None: the default config) strictly and build what it describes."""
    doc = _load_yaml(DEFAULT_CONFIG if text is None else text)
    _check_keys(doc, _TOP_KEYS, "the config")
    if doc.get("apiVersion") not in API_VERSIONS:
        raise ConfigError(f"apiVersion must be one of {list(API_VERSIONS)}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != "EndpointPickerConfig":
        raise ConfigError(f"kind must be EndpointPickerConfig, got {doc.get('kind')!r}")

    plugins: dict[str, object] = {}
    for index, raw in enumerate(_as_list(doc.get("plugins"), "plugins")):
        spec = _plugin_spec(raw, index)
        if spec.name in plugins:
            raise ConfigError(f"plugins[{index}]: a plugin named {spec.name!r} is already defined")
        try:
            plugins[spec.name] = registry.create(spec.type, spec.name, spec.parameters, handle)
        except KeyError as exc:
            raise ConfigError(f"plugins[{index}] ({spec.name}): {exc.args[0]}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"plugins[{index}] ({spec.name}): {exc}") from None

    profiles = [
        _profile(raw, index, plugins) for index, raw in enumerate(_as_list(doc.get("schedulingProfiles"), "schedulingProfiles"))
    ]
    if len(profiles) != 1:
        raise ConfigError(
            f"schedulingProfiles: exactly one profile is supported until profile handlers land, got {len(profiles)}"
        )
    sources = [p for p in plugins.values() if isinstance(p, MetricsDataSource)]
    extractors = [p for p in plugins.values() if isinstance(p, CoreMetricsExtractor)]
    for kind, found in (("metrics-data-source", sources), ("core-metrics-extractor", extractors)):
        if len(found) > 1:
            raise ConfigError(f"plugins: at most one {kind} is supported, got {len(found)}")
    data_key = "dataLayer" if "dataLayer" in doc else "data"
    if data_key in doc:
        _check_data_layer(doc[data_key], data_key, plugins)
    return PickerConfig(
        scheduler=Scheduler(profiles[0]),
        metrics_source=sources[0] if sources else None,
        metrics_extractor=extractors[0] if extractors else None,
    )


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
        if not isinstance(plugins.get(source.get("pluginRef")), MetricsDataSource):
            raise ConfigError(f"{at}: pluginRef {source.get('pluginRef')!r} names no metrics-data-source plugin")
        for ext_index, extractor in enumerate(_as_list(source.get("extractors"), f"{at}.extractors")):
            ext_at = f"{at}.extractors[{ext_index}]"
            if not isinstance(extractor, dict):
                raise ConfigError(f"{ext_at} must be a mapping with pluginRef")
            _check_keys(extractor, {"pluginRef"}, ext_at)
            if not isinstance(plugins.get(extractor.get("pluginRef")), CoreMetricsExtractor):
                raise ConfigError(f"{ext_at}: pluginRef {extractor.get('pluginRef')!r} names no core-metrics-extractor plugin")


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


def _profile(raw: Any, index: int, plugins: Mapping[str, object]) -> Profile:
    where = f"schedulingProfiles[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with name and plugins")
    _check_keys(raw, {"name", "plugins"}, where)
    filters: list[Filter] = []
    scorers: list[WeightedScorer] = []
    pickers: list[Picker] = []
    for ref_index, ref in enumerate(_as_list(raw.get("plugins"), f"{where}.plugins")):
        ref_where = f"{where}.plugins[{ref_index}]"
        if not isinstance(ref, dict):
            raise ConfigError(f"{ref_where} must be a mapping with pluginRef and optionally weight")
        _check_keys(ref, {"pluginRef", "weight"}, ref_where)
        name = ref.get("pluginRef")
        if not isinstance(name, str) or name not in plugins:
            raise ConfigError(f"{ref_where}: pluginRef {name!r} names no plugin; defined: {', '.join(plugins)}")
        plugin = plugins[name]
        weight = ref.get("weight", 1)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{ref_where}: weight must be a non-negative number, got {weight!r}")
        if isinstance(plugin, Picker):
            pickers.append(plugin)
        elif isinstance(plugin, Scorer):
            scorers.append(WeightedScorer(plugin, float(weight)))
        elif isinstance(plugin, Filter):
            filters.append(plugin)
        else:
            raise ConfigError(f"{ref_where}: plugin {name!r} is not a filter, scorer or picker")
    if len(pickers) != 1:
        raise ConfigError(f"{where}: a profile needs exactly one picker, got {len(pickers)}")
    return Profile(name=str(raw.get("name", f"profile-{index}")), picker=pickers[0], filters=tuple(filters), scorers=tuple(scorers))
