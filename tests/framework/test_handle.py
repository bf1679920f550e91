"""Plugin metrics that any number of plugin instances (and config loads) can share."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from epp.framework import Endpoint, Handle, PluginMetrics, endpoint_in_flight


def test_two_instances_share_one_family_instead_of_failing() -> None:
    registry = CollectorRegistry()
    first, second = PluginMetrics(registry), PluginMetrics(registry)
    a = first.counter("my_plugin_calls", "Calls.", ["plugin"])
    b = second.counter("my_plugin_calls", "Calls.", ["plugin"])
    assert a is b
    a.labels("one").inc()
    b.labels("two").inc(2)
    assert registry.get_sample_value("my_plugin_calls_total", {"plugin": "one"}) == 1
    assert registry.get_sample_value("my_plugin_calls_total", {"plugin": "two"}) == 2
    assert first.histogram("my_seconds", "S.", buckets=(1.0,)) is second.histogram("my_seconds", "S.", buckets=(1.0,))
    assert first.gauge("my_gauge", "G.") is second.gauge("my_gauge", "G.")


def test_a_family_asked_for_differently_is_an_error_naming_both() -> None:
    metrics = PluginMetrics(CollectorRegistry())
    metrics.counter("my_thing", "T.", ["a"])
    with pytest.raises(ValueError, match=r"already registered as a counter with labels \['a'\]; asked for a gauge"):
        metrics.gauge("my_thing", "T.", ["a"])
    with pytest.raises(ValueError, match=r"asked for a counter with labels \['b'\]"):
        metrics.counter("my_thing", "T.", ["b"])


def test_gauge_sum_adds_every_instance() -> None:
    registry = CollectorRegistry()
    PluginMetrics(registry).gauge_sum("my_blocks", "Blocks.", lambda: 3)
    PluginMetrics(registry).gauge_sum("my_blocks", "Blocks.", lambda: 4)
    assert registry.get_sample_value("my_blocks") == 7


def test_families_are_per_registry() -> None:
    one, two = PluginMetrics(), PluginMetrics()
    assert one.counter("x", "X.") is not two.counter("x", "X.")


def test_the_default_handle_counts_nothing_in_flight() -> None:
    class Pool:
        def endpoints(self) -> tuple[Endpoint, ...]:
            return ()

        def subscribe(self, listener: object) -> None:
            pass

    handle = Handle(Pool())
    assert handle.in_flight(Endpoint("a", "10.0.0.1", 1)) == endpoint_in_flight(Endpoint("a", "10.0.0.1", 1)) == (0, 0)
    assert isinstance(handle.metrics, PluginMetrics)
