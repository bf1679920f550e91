"""Built-in scheduling plugins, written only against the public plugin API (:mod:`epp.scheduling`).

Installed as ``epp.plugins`` (the top-level ``plugins/`` folder is mapped there by pyproject).
"""

from __future__ import annotations

from epp.registry import Registry

from epp.datalayer import CoreMetricsExtractor, MetricsDataSource

from .random_picker import RandomPicker

__all__ = ["RandomPicker", "register"]


def register(registry: Registry) -> None:
    """Register every built-in plugin type."""
    source = "epp (built-in)"
    registry.register("random-picker", RandomPicker.from_config, source=source)
    registry.register("metrics-data-source", MetricsDataSource.from_config, source=source)
    registry.register("core-metrics-extractor", CoreMetricsExtractor.from_config, source=source)
