"""The scheduling framework around the plugins: producers and data declarations, profile handlers,
lifecycle hooks through the director, plugin timing, entry-point loading and turning plugins off."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import (
    Endpoint,
    Handle,
    InferenceRequest,
    ScoredEndpoint,
)
from epp.scheduling.registry import ENTRY_POINT_GROUP, PluginLoadError, default_registry, load_registry


class OnlyPicker:
    """Picks one fixed endpoint (by hostport) when it is a candidate."""

    def __init__(self, name: str, hostport: str) -> None:
        self.name, self.hostport = name, hostport

    def pick(self, req: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        return [s.endpoint for s in scored if s.endpoint.hostport == self.hostport]


class FakeDist:
    def __init__(self, name: str) -> None:
        self.name, self.version = name, "1.0"


class FakeEntryPoint:
    def __init__(self, name: str, target: Any, dist: str) -> None:
        self.name, self._target, self.dist = name, target, FakeDist(dist)
        self.value, self.module, self.group = f"{dist}.plugins:factory", f"{dist}.plugins", ENTRY_POINT_GROUP

    def load(self) -> Any:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def _epp_entry_point() -> FakeEntryPoint:
    return FakeEntryPoint("max-score-picker", lambda n, p, h: OnlyPicker(n, ""), "epp")


def test_entry_points_register_with_their_distribution() -> None:
    registry = load_registry(entry_points=[_epp_entry_point(), FakeEntryPoint("acme-scorer", lambda n, p, h: None, "acme")])
    assert registry.types() == ["acme-scorer", "max-score-picker"]
    assert registry.source("acme-scorer") == "acme 1.0"


def test_a_type_offered_by_two_distributions_stops_startup_naming_both() -> None:
    points = [_epp_entry_point(), FakeEntryPoint("max-score-picker", lambda n, p, h: None, "acme")]
    with pytest.raises(PluginLoadError) as info:
        load_registry(entry_points=points)
    assert str(info.value) == "plugin type 'max-score-picker' is offered twice: by epp 1.0 and by acme 1.0"


def test_a_broken_plugin_names_itself_and_can_be_disabled() -> None:
    points = [_epp_entry_point(), FakeEntryPoint("bad-scorer", ImportError("no module named torch"), "acme")]
    with pytest.raises(PluginLoadError, match=r"plugin type 'bad-scorer' from acme 1\.0 failed to load .*--disable-plugin bad-scorer"):
        load_registry(entry_points=points)
    registry = load_registry(["bad-scorer"], entry_points=points)
    assert registry.types() == ["max-score-picker"]
    with pytest.raises(KeyError, match="plugin type 'bad-scorer' is disabled"):
        registry.create("bad-scorer", "b", {}, Handle(Datastore()))


def test_the_installed_entry_points_are_the_built_ins() -> None:
    registry = default_registry()
    assert all(registry.source(name).startswith("epp ") for name in registry.types() if not name.startswith("example-"))


def test_disable_plugin_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from epp.server.cli import settings_from_args

    monkeypatch.setenv("EPP_DISABLE_PLUGINS", "session-affinity-scorer, load-aware-scorer")
    settings, _ = settings_from_args(["--disable-plugin", "prefix-cache-scorer", "--disable-plugin=a,b"])
    assert settings.disabled_plugins == ("a", "b", "load-aware-scorer", "prefix-cache-scorer", "session-affinity-scorer")


# -- defaults are declared by plugin types, not known to the core by name -------------------------


class _Claims:
    default_for = ("picker",)

    @classmethod
    def from_config(cls, name: str, parameters: Any, handle: Any) -> object:
        return cls()


def test_the_built_in_defaults_come_from_the_types_declarations() -> None:
    registry = default_registry()
    assert registry.default("picker") == "max-score-picker"
    assert registry.default("saturation-detector") == "utilization-detector"
    assert registry.default("producer:prefix-cache-match") == "approx-prefix-cache-producer"
    assert registry.default("nothing") is None


def test_two_types_claiming_one_default_stop_startup_naming_both() -> None:
    registry = default_registry()
    with pytest.raises(PluginLoadError, match=r"'max-score-picker' \(epp .*\) and 'my-picker' \(tests\) both declare"):
        registry.register("my-picker", _Claims.from_config, source="tests")


def test_a_disabled_default_leaves_the_role_to_another_type() -> None:
    registry = load_registry(disabled=["max-score-picker"])
    assert registry.default("picker") is None
    registry.register("my-picker", _Claims.from_config, source="tests")
    assert registry.default("picker") == "my-picker"


def test_loaded_types_are_one_info_line_and_each_type_a_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    entry_points = [
        _epp_entry_point(),
        FakeEntryPoint("queue-scorer", lambda n, p, h: None, "epp"),
        FakeEntryPoint("acme-scorer", lambda n, p, h: None, "acme"),
    ]
    with caplog.at_level("DEBUG", logger="epp.scheduling.registry"):
        load_registry(entry_points=entry_points, log_sources=True)
    info = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"]
    assert info == ["plugin types: 1 from acme 1.0, 2 from epp 1.0"]
    assert debug == [
        "plugin type acme-scorer from acme 1.0",
        "plugin type max-score-picker from epp 1.0",
        "plugin type queue-scorer from epp 1.0",
    ]
