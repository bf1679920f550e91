"""Every built-in plugin type in this folder is reachable through the registry, by its upstream name."""

from __future__ import annotations

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle, roles
from epp.scheduling.registry import Registry, default_registry

TYPES = {
    "random-picker": ["Picker"],
    "max-score-picker": ["Picker"],
    "weighted-random-picker": ["Picker"],
    "queue-scorer": ["Scorer"],
    "kv-cache-utilization-scorer": ["Scorer"],
    "lora-affinity-scorer": ["Scorer"],
    "running-requests-size-scorer": ["Scorer"],
    "load-aware-scorer": ["Scorer"],
    "active-request-scorer": ["Scorer"],
    "session-affinity-scorer": ["Scorer", "ResponseReceived"],
    "low-queue-filter": ["Filter"],
    "least-queue-filter": ["Filter"],
    "least-kv-cache-filter": ["Filter"],
    "lora-affinity-filter": ["Filter"],
    "label-selector-filter": ["Filter"],
}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return default_registry()


@pytest.mark.parametrize(("type_name", "expected_roles"), TYPES.items())
def test_type_is_registered_with_defaults_and_its_roles(
    registry: Registry, type_name: str, expected_roles: list[str]
) -> None:
    assert registry.source(type_name).startswith("epp ")
    plugin = registry.create(type_name, "my-" + type_name, {}, Handle(Datastore()))
    assert plugin.name == "my-" + type_name  # type: ignore[attr-defined]
    assert roles(plugin) == expected_roles


@pytest.mark.parametrize("type_name", TYPES)
def test_type_refuses_an_unknown_parameter(registry: Registry, type_name: str) -> None:
    with pytest.raises(ValueError, match=r"my-plugin: .*'surprise'"):
        registry.create(type_name, "my-plugin", {"surprise": 1}, Handle(Datastore()))
