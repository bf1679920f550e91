"""Plugin registry: kebab-case type name -> factory ``(name, parameters, handle) -> plugin``.

Built-in plugins register through :func:`epp.plugins.register`, the same call a third-party
package makes; a type name registered twice stops startup naming both sources.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from epp.datastore import Datastore

__all__ = ["Handle", "PluginFactory", "Registry", "check_parameters", "default_registry"]


@dataclass(frozen=True, slots=True)
class Handle:
    """What a plugin factory may use from the running service."""

    datastore: Datastore


PluginFactory = Callable[[str, Mapping[str, Any], Handle], object]


def check_parameters(name: str, parameters: Mapping[str, Any], valid: tuple[str, ...] = ()) -> None:
    """For plugin factories: ValueError naming any parameter not in ``valid``, and listing those that are."""
    unknown = sorted(set(parameters) - set(valid))
    if unknown and not valid:
        raise ValueError(f"{name}: takes no parameters, got {unknown}")
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) {unknown}; valid: {list(valid)}")


class Registry:
    def __init__(self) -> None:
        self._factories: dict[str, tuple[PluginFactory, str]] = {}

    def register(self, type_name: str, factory: PluginFactory, *, source: str) -> None:
        if type_name in self._factories:
            raise ValueError(
                f"plugin type {type_name!r} is registered twice: by {self._factories[type_name][1]} and by {source}"
            )
        self._factories[type_name] = (factory, source)

    def types(self) -> list[str]:
        return sorted(self._factories)

    def source(self, type_name: str) -> str:
        return self._factories[type_name][1]

    def create(self, type_name: str, name: str, parameters: Mapping[str, Any], handle: Handle) -> object:
        if type_name not in self._factories:
            raise KeyError(f"unknown plugin type {type_name!r}; known types: {', '.join(self.types())}")
        return self._factories[type_name][0](name, parameters, handle)


def default_registry() -> Registry:
    """A registry holding the built-in plugins."""
    from epp import plugins

    registry = Registry()
    plugins.register(registry)
    return registry
