"""Plugin registry: kebab-case type name -> factory ``(name, parameters, handle) -> plugin``.

Design
------
Plugin types arrive through the Python entry-point group ``epp.plugins`` (:data:`ENTRY_POINT_GROUP`):
the entry point's name is the type name, its value the factory. The built-in plugins are declared
the same way in this project's own ``pyproject.toml``, so built-in and third-party types load
through one path and a third-party type cannot shadow a built-in silently: a type name offered
twice stops startup naming both distributions. :func:`load_registry` logs which distribution
supplied each type.

Turning plugins off: ``--disable-plugin NAME`` (repeatable, or comma-separated) and the
environment variable ``EPP_DISABLE_PLUGINS`` (comma-separated) name types that are then not even
imported (the way to start with a third-party plugin that is broken). A config that uses a
disabled type is refused with a message saying it is disabled.

Factories check their parameters with :func:`epp.framework.check_parameters`, so every plugin
refuses unknown parameters the same way.

Defaults. A plugin type may declare what it is the default of (``default_for`` on its factory, see
:mod:`epp.framework.roles`): the picker a profile without one gets, the saturation detector admission
uses when the config names none, the producer added for a consumed key nobody produces. The registry
records these declarations as types are loaded (:meth:`Registry.default`); two enabled types claiming
one default stop startup, naming both. The core thus knows no plugin type by name.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

from epp.framework import Handle

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "PluginFactory",
    "PluginLoadError",
    "Registry",
    "declared_defaults",
    "default_registry",
    "disabled_from_env",
    "load_registry",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "epp.plugins"
DISABLE_ENV = "EPP_DISABLE_PLUGINS"

PluginFactory = Callable[[str, Mapping[str, Any], Handle], object]


def declared_defaults(factory: PluginFactory) -> tuple[str, ...]:
    """What a factory's plugin type declares itself the default of (``default_for``).

    Read from the class of a ``Class.from_config`` factory, else from the factory itself.
    """
    owner = getattr(factory, "__self__", factory)
    value = getattr(owner, "default_for", ())
    return (value,) if isinstance(value, str) else tuple(value)


class PluginLoadError(ValueError):
    """The installed plugin types cannot be loaded (a clash of names, or a broken plugin)."""


class Registry:
    def __init__(self, *, disabled: Iterable[str] = ()) -> None:
        self._factories: dict[str, tuple[PluginFactory, str]] = {}
        self._defaults: dict[str, str] = {}  # role -> type name (see the module docstring)
        self.disabled: frozenset[str] = frozenset(disabled)

    def register(self, type_name: str, factory: PluginFactory, *, source: str) -> None:
        if type_name in self._factories:
            raise ValueError(
                f"plugin type {type_name!r} is registered twice: by {self._factories[type_name][1]} and by {source}"
            )
        for role in declared_defaults(factory):
            other = self._defaults.get(role)
            if other is not None:
                raise PluginLoadError(
                    f"plugin types {other!r} ({self._factories[other][1]}) and {type_name!r} ({source}) "
                    f"both declare themselves the default {role}; disable one with --disable-plugin"
                )
        self._factories[type_name] = (factory, source)
        for role in declared_defaults(factory):
            self._defaults[role] = type_name

    def default(self, role: str) -> str | None:
        """The type name declared the default of ``role`` (None: no enabled type declares it)."""
        return self._defaults.get(role)

    def types(self) -> list[str]:
        return sorted(self._factories)

    def source(self, type_name: str) -> str:
        return self._factories[type_name][1]

    def factory(self, type_name: str) -> PluginFactory:
        return self._factories[type_name][0]

    def create(self, type_name: str, name: str, parameters: Mapping[str, Any], handle: Handle) -> object:
        if type_name not in self._factories:
            if type_name in self.disabled:
                raise KeyError(f"plugin type {type_name!r} is disabled (--disable-plugin / ${DISABLE_ENV})")
            raise KeyError(f"unknown plugin type {type_name!r}; known types: {', '.join(self.types())}")
        return self._factories[type_name][0](name, parameters, handle)


def disabled_from_env(environ: Mapping[str, str] | None = None) -> set[str]:
    """The type names ``$EPP_DISABLE_PLUGINS`` turns off."""
    value = (os.environ if environ is None else environ).get(DISABLE_ENV, "")
    return {item.strip() for item in value.split(",") if item.strip()}


def _distribution(entry_point: metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return f"{dist.name} {dist.version}" if dist is not None else f"module {entry_point.module}"


def load_registry(
    disabled: Iterable[str] = (),
    *,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    log_sources: bool = False,
) -> Registry:
    """Every plugin type offered in the ``epp.plugins`` entry-point group, except ``disabled``.

    PluginLoadError when two distributions offer one type name, or an entry point cannot be loaded.
    """
    registry = Registry(disabled=disabled)
    if entry_points is None:
        entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen: dict[str, str] = {}
    loaded = []
    for entry_point in entry_points:
        source = _distribution(entry_point)
        # The same distribution can be visible twice (an editable install next to its source tree);
        # it is one offer, not a clash.
        if seen.get(entry_point.name) == source:
            continue
        if entry_point.name in seen:
            raise PluginLoadError(
                f"plugin type {entry_point.name!r} is offered twice: by {seen[entry_point.name]} and by {source}"
            )
        seen[entry_point.name] = source
        if entry_point.name in registry.disabled:
            continue
        try:
            factory = entry_point.load()
        except Exception as exc:  # a broken third-party plugin: say which, then stop
            raise PluginLoadError(
                f"plugin type {entry_point.name!r} from {source} failed to load ({entry_point.value}): {exc!r}; "
                f"disable it with --disable-plugin {entry_point.name}"
            ) from exc
        registry.register(entry_point.name, factory, source=source)
        loaded.append((entry_point.name, source))
    if not any(source.split(" ")[0] == "epp" for source in seen.values()):
        raise PluginLoadError(
            f"the built-in plugins are not registered (no {ENTRY_POINT_GROUP!r} entry points from epp): "
            "install the package (pip install -e .) so its metadata is present"
        )
    if log_sources:
        # One line at info (27 lines of types drowned the start-up log); each type at debug (-v 3).
        counts = Counter(source for _, source in loaded)
        log.info("plugin types: %s", ", ".join(f"{n} from {source}" for source, n in sorted(counts.items())))
        for name, source in sorted(loaded):
            log.debug("plugin type %s from %s", name, source)
        for name in sorted(registry.disabled):
            log.info("plugin type %s is disabled", name)
    return registry


def default_registry() -> Registry:
    """The registry of every installed plugin type (built-in and third-party), none disabled."""
    return load_registry()
