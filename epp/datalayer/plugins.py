"""``metrics-data-source`` and ``core-metrics-extractor``: where and how model-server metrics are read.

Upstream's data layer, as configured in an ``EndpointPickerConfig``::

    plugins:
    - type: metrics-data-source          # parameters: scheme (http), path (/metrics), insecureSkipVerify (true)
    - type: core-metrics-extractor       # parameters: defaultEngine (vllm), engineLabelKey, engineConfigs
      parameters:
        engineConfigs:
        - name: vllm
          queuedRequestsSpec: "vllm:num_requests_waiting"
          kvUsageSpec: "vllm:kv_cache_usage_perc"
    data:                                # or dataLayer:
      sources:
      - pluginRef: metrics-data-source
        extractors:
        - pluginRef: core-metrics-extractor

An ``engineConfigs`` entry named like a built-in engine (vllm, sglang, trtllm-serve,
triton-tensorrt-llm) replaces it; a new name adds an engine that pods select with the engine-type
label. Both plugins only carry settings, which :mod:`epp.server.server` hands to :mod:`epp.datalayer.scraper`; they
live in the core because the scraper is core, and register like every built-in plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from epp.datalayer.engines import ENGINE_TYPE_LABEL, EngineMapping, builtin_engines, engine_from_config
from epp.framework import Handle, check_parameters

__all__ = ["CoreMetricsExtractor", "MetricsDataSource", "MetricsExtractor", "MetricsSource"]


@runtime_checkable
class MetricsSource(Protocol):
    """A data-layer plugin saying where pods serve their metrics."""

    name: str
    scheme: str
    path: str
    insecure_skip_verify: bool


@runtime_checkable
class MetricsExtractor(Protocol):
    """A data-layer plugin saying how to read a pod's metrics page, per engine."""

    name: str
    engines: Mapping[str, EngineMapping]
    default_engine: str
    engine_label_key: str


@dataclass(frozen=True)
class MetricsDataSource:
    name: str
    scheme: str = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> MetricsDataSource:
        check_parameters(name, parameters, ("scheme", "path", "insecureSkipVerify"))
        scheme = parameters.get("scheme", "http")
        path = parameters.get("path", "/metrics")
        insecure = parameters.get("insecureSkipVerify", True)
        if scheme not in ("http", "https"):
            raise ValueError(f"{name}: scheme must be http or https, got {scheme!r}")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"{name}: path must start with /, got {path!r}")
        if not isinstance(insecure, bool):
            raise ValueError(f"{name}: insecureSkipVerify must be true or false, got {insecure!r}")
        return cls(name, scheme, path, insecure)


@dataclass(frozen=True)
class CoreMetricsExtractor:
    name: str
    engines: Mapping[str, EngineMapping]
    default_engine: str = "vllm"
    engine_label_key: str = ENGINE_TYPE_LABEL

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> CoreMetricsExtractor:
        check_parameters(name, parameters, ("defaultEngine", "engineLabelKey", "engineConfigs"))
        engines = builtin_engines()
        configs = parameters.get("engineConfigs") or []
        if not isinstance(configs, list):
            raise ValueError(f"{name}: engineConfigs must be a list")
        for index, entry in enumerate(configs):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
                raise ValueError(f"{name}: engineConfigs[{index}] must be a mapping with a name")
            engines[entry["name"]] = engine_from_config(entry["name"], entry)
        default = parameters.get("defaultEngine", "vllm")
        if default not in engines:
            raise ValueError(f"{name}: defaultEngine {default!r} is not one of {sorted(engines)}")
        label = parameters.get("engineLabelKey", ENGINE_TYPE_LABEL)
        if not isinstance(label, str) or not label:
            raise ValueError(f"{name}: engineLabelKey must be a label name")
        return cls(name, engines, default, label)
