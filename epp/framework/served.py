"""What a model-server endpoint says it serves: its base model(s) and its loaded LoRA adapters.

Design
------
A vLLM server lists, at ``GET /v1/models``, its base model (``parent: null``) and every LoRA module
it has loaded (``parent``: the base model the adapter applies to). The data layer polls that list
on a slow cadence and attaches it to the endpoint as a :class:`ServedModels`, immutable like the
rest of :class:`~epp.framework.Endpoint`: a new list replaces the record. Plugins read it from
``endpoint.served``; :meth:`ServedModels.lists` and the two frozensets are set lookups, cheap
enough for every candidate of every request.

``listed`` tells "this endpoint said it serves nothing of that" (a list was read) from "nobody
knows" (never polled, or the server has no ``/v1/models``): a filter must treat the second as
possibly serving anything, or the picker would be stricter than the servers behind it.
``entries`` keeps each model's card as the server sent it (``id``, ``object``, ``created``,
``owned_by``, ``root``, ``parent``, ...) for the gateway's own ``GET /v1/models`` answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["NOT_LISTED", "ServedModels"]

_NO_ADAPTERS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The models one endpoint serves, as of ``updated_at``.

    Attributes:
        base_models: the ids listed without a parent (the models the server was started with).
        adapters: the ids listed with a parent (LoRA adapters), mapped to that parent.
        entries: the model cards as listed, in the server's order (read-only mappings).
        listed: a list was read from the server at least once; False: nothing is known.
        updated_at: ``time.monotonic()`` of the poll the list comes from (0: never).
    """

    base_models: frozenset[str] = frozenset()
    adapters: Mapping[str, str] = field(default_factory=lambda: _NO_ADAPTERS)
    entries: tuple[Mapping[str, Any], ...] = ()
    listed: bool = True
    updated_at: float = 0.0

    def lists(self, model: str) -> bool:
        """Whether ``model`` is on the list, as a base model or an adapter."""
        return model in self.base_models or model in self.adapters

    def is_adapter(self, model: str) -> bool:
        """Whether ``model`` is listed as an adapter (with a parent)."""
        return model in self.adapters

    @classmethod
    def from_entries(cls, entries: Sequence[Mapping[str, Any]], updated_at: float = 0.0) -> ServedModels:
        """The record of a ``/v1/models`` ``data`` list: entries without a string ``id`` are skipped;
        an entry with a non-empty string ``parent`` is an adapter, any other a base model."""
        kept: list[Mapping[str, Any]] = []
        bases: set[str] = set()
        adapters: dict[str, str] = {}
        for entry in entries:
            model = entry.get("id")
            if not isinstance(model, str) or not model:
                continue
            kept.append(MappingProxyType(dict(entry)))
            parent = entry.get("parent")
            if isinstance(parent, str) and parent and parent != model:
                adapters[model] = parent
            else:
                bases.add(model)
        return cls(frozenset(bases), MappingProxyType(adapters), tuple(kept), True, updated_at)


NOT_LISTED = ServedModels(listed=False)
"""What an endpoint serves before its list was read (or when it has none): unknown."""
