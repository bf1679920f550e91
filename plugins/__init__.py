"""Built-in scheduling plugins, written only against the public plugin API (:mod:`epp.scheduling`).

Installed as ``epp.plugins`` (the top-level ``plugins/`` folder is mapped there by pyproject).
"""

from __future__ import annotations

from epp.datalayer import CoreMetricsExtractor, MetricsDataSource
from epp.registry import Registry

from .kv_cache_utilization_scorer import KVCacheUtilizationScorer
from .max_score_picker import MaxScorePicker
from .queue_scorer import QueueScorer
from .random_picker import RandomPicker

__all__ = ["KVCacheUtilizationScorer", "MaxScorePicker", "QueueScorer", "RandomPicker", "register"]


def register(registry: Registry) -> None:
    """Register every built-in plugin type."""
    source = "epp (built-in)"
    registry.register("random-picker", RandomPicker.from_config, source=source)
    registry.register("max-score-picker", MaxScorePicker.from_config, source=source)
    registry.register("queue-scorer", QueueScorer.from_config, source=source)
    registry.register("kv-cache-utilization-scorer", KVCacheUtilizationScorer.from_config, source=source)
    registry.register("metrics-data-source", MetricsDataSource.from_config, source=source)
    registry.register("core-metrics-extractor", CoreMetricsExtractor.from_config, source=source)
