"""The plugins' own series: how long each call takes, and how often one fails.

``inference_extension_plugin_duration_seconds{extension_point,plugin_type,plugin_name}`` (upstream's)
and ``epp_plugin_errors_total{extension_point,plugin_type,plugin_name,kind}`` (``kind``: ``exception``
or ``malformed``; see :mod:`epp.scheduling.runner`). :meth:`PluginCallMetrics.instrument` gives the
runner what it binds to each call site, once, at build time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from epp.framework.loopmetrics import LoopCounter, LoopHistogram
from epp.scheduling.runner import Instrument

__all__ = ["SCHEDULER_BUCKETS", "PluginCallMetrics"]

# Scheduling takes tens of microseconds to a few milliseconds: resolve that range finely.
SCHEDULER_BUCKETS = (
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip


class PluginCallMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.plugin_duration = LoopHistogram(
            "inference_extension_plugin_duration_seconds",
            "Time spent in each plugin call, by extension point, plugin type and plugin name.",
            ["extension_point", "plugin_type", "plugin_name"],
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        )
        self.plugin_errors = LoopCounter(
            "epp_plugin_errors_total",
            "Plugin calls that raised (kind=exception) or returned something unusable (kind=malformed); "
            "the request went on without that plugin.",
            ["extension_point", "plugin_type", "plugin_name", "kind"],
            registry=r,
        )

    def instrument(self, types: Mapping[str, str]) -> Instrument:
        """The runner's instrument; ``types``: plugin name -> type name (its ``plugin_type`` label)."""

        def bind(extension_point: str, plugin: object) -> tuple[Callable[[float], None], Callable[[str], None]]:
            name = getattr(plugin, "name", "")
            type_name = types.get(name, type(plugin).__name__)
            errors = self.plugin_errors

            def failed(kind: str) -> None:
                errors.labels(extension_point, type_name, name, kind).inc()

            return self.plugin_duration.labels(extension_point, type_name, name).observe, failed

        return bind
