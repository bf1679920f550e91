"""What a plugin factory receives from the running service: the pool, metrics, in-flight counts.

A factory is ``factory(name, parameters, handle) -> plugin``. :class:`Handle` carries:

``pool``
    the endpoints right now (``pool.endpoints()``: an immutable snapshot) and membership changes
    (``pool.subscribe(listener)``: ``listener(added, removed)`` after every change; a re-labelled
    endpoint is removed and added under the same name).
``metrics``
    :class:`PluginMetrics`: where a plugin registers its own Prometheus series.
``in_flight``
    ``in_flight(endpoint) -> (requests, tokens)``: what this picker has sent to the endpoint and not
    seen end (saturation detectors read it).

Metrics and many instances
--------------------------
A config may configure one plugin type several times (two ``prefix-cache-scorer`` instances in two
profiles), and a process may build its config more than once (a test, ``validate-config``). Creating
a Prometheus ``Counter`` directly on the registry fails the second time ("Duplicated timeseries").
:class:`PluginMetrics` makes metric families shared: the first call for a name creates the family,
every later call with the same name, kind and labels returns that same family, so instances count
into one series (label by ``plugin.name`` where they must be told apart). A later call that disagrees
on kind or labels is an error naming both. For values computed on scrape, :meth:`PluginMetrics.gauge_sum`
adds a callback: the gauge reports the sum over every instance's callback.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.framework.endpoint import Endpoint
from epp.framework.histogram import Histogram

__all__ = ["Handle", "PluginMetrics", "Pool", "PoolListener", "endpoint_in_flight"]

PoolListener = Callable[[tuple[Endpoint, ...], tuple[Endpoint, ...]], None]


class Pool(Protocol):
    """The pool as plugins see it."""

    def endpoints(self) -> Sequence[Endpoint]:
        """The current endpoints with their metrics: an immutable snapshot, safe to hold."""
        ...

    def subscribe(self, listener: PoolListener) -> None:
        """Call ``listener(added, removed)`` after every membership change."""
        ...


def endpoint_in_flight(endpoint: Endpoint) -> tuple[int, int]:
    """(requests, estimated prompt tokens) this picker sent to ``endpoint`` whose responses have not ended."""
    record = endpoint.inflight
    return record.requests, record.tokens


class _SummedGauge(Collector):
    """One gauge whose value is the sum of its contributors' callbacks."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.functions: list[Callable[[], float]] = []

    def collect(self) -> list[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation)
        family.add_metric([], float(sum(function() for function in list(self.functions))))
        return [family]

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation)]


_Family = Counter | Gauge | Histogram | _SummedGauge
# Per registry: metric name -> (kind, label names, family). Weak, so a registry's families go with it.
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, tuple[str, tuple[str, ...], _Family]]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


class PluginMetrics:
    """Get-or-create metric families on one Prometheus registry (see the module docstring).

    Without a registry (tests), families go to a private registry of this object.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        family = self._family(
            "counter", name, tuple(labelnames), lambda: Counter(name, documentation, labelnames, registry=self.registry)
        )
        assert isinstance(family, Counter)
        return family

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        family = self._family(
            "gauge", name, tuple(labelnames), lambda: Gauge(name, documentation, labelnames, registry=self.registry)
        )
        assert isinstance(family, Gauge)
        return family

    def histogram(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        family = self._family(
            "histogram",
            name,
            tuple(labelnames),
            lambda: Histogram(name, documentation, labelnames, buckets=buckets, registry=self.registry),
        )
        assert isinstance(family, Histogram)
        return family

    def gauge_sum(self, name: str, documentation: str, function: Callable[[], float]) -> None:
        """Add ``function`` to the gauge ``name``, which reports the sum of every function added."""

        def create() -> _SummedGauge:
            collector = _SummedGauge(name, documentation)
            self.registry.register(collector)
            return collector

        family = self._family("gauge_sum", name, (), create)
        assert isinstance(family, _SummedGauge)
        family.functions.append(function)

    def _family(self, kind: str, name: str, labels: tuple[str, ...], create: Callable[[], _Family]) -> _Family:
        with _LOCK:
            families = _FAMILIES.setdefault(self.registry, {})
            found = families.get(name)
            if found is None:
                family = create()
                families[name] = (kind, labels, family)
                return family
            found_kind, found_labels, family = found
            if (found_kind, found_labels) != (kind, labels):
                raise ValueError(
                    f"metric {name!r} is already registered as a {found_kind} with labels {list(found_labels)}; "
                    f"asked for a {kind} with labels {list(labels)}"
                )
            return family


@dataclass(frozen=True, slots=True)
class Handle:
    """What a plugin factory may use from the running service (see the module docstring)."""

    pool: Pool
    metrics: PluginMetrics = field(default_factory=PluginMetrics)
    in_flight: Callable[[Endpoint], tuple[int, int]] = endpoint_in_flight
