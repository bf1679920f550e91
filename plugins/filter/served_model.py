"""``served-model-filter`` (llm-d): keeps the endpoints that serve the requested model or adapter.

What an endpoint serves is its ``/v1/models`` list (``Endpoint.served``, polled by the data layer),
and, between polls, the LoRA adapters its metrics page reports running or waiting (the second
source: an adapter seen there is served). An endpoint whose list was never read is *unlisted*: it
may serve anything. For a request for model ``m``:

* endpoints serve ``m``, and ``m`` is an adapter (listed with a parent, or seen on a metrics page):
  only those; an unlisted endpoint is unlikely to hold an adapter another one has loaded;
* endpoints serve ``m``, a base model: those and the unlisted ones (every server of a base model
  lists it, so dropping unlisted endpoints would only pile load on the ones polled first);
* no endpoint serves ``m``: the unlisted ones, if any (with ``onMissing: Pass``); else every
  candidate when ``fallbackOnEmpty`` is true (the lists may be behind: a hot-loaded adapter), else
  none (upstream's default: the request finds no endpoint).

A request without a model keeps every candidate. Parameters, as upstream's: ``onMissing``
(``Pass``, the default, or ``Fail``: drop unlisted endpoints too) and ``fallbackOnEmpty`` (bool,
default false). The default profile sets ``fallbackOnEmpty: true``, so without a configuration the
picker narrows only on what some server says and is never stricter than the servers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, bool_parameter, check_parameters, str_parameter

__all__ = ["ServedModelFilter"]

_ON_MISSING = ("Pass", "Fail")


class ServedModelFilter:
    def __init__(
        self, name: str = "served-model-filter", *, on_missing: str = "Pass", fallback_on_empty: bool = False
    ) -> None:
        if on_missing not in _ON_MISSING:
            raise ValueError(f"{name}: onMissing must be 'Pass' or 'Fail', got {on_missing!r}")
        self.name = name
        self.pass_on_missing = on_missing == "Pass"
        self.fallback_on_empty = fallback_on_empty

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ServedModelFilter:
        check_parameters(name, parameters, ("onMissing", "fallbackOnEmpty"))
        return cls(
            name,
            on_missing=str_parameter(name, parameters, "onMissing", "Pass"),
            fallback_on_empty=bool_parameter(name, parameters, "fallbackOnEmpty", False),
        )

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        model = request.model
        if not model:
            return list(candidates)
        serving: list[Endpoint] = []
        unlisted: list[Endpoint] = []
        adapter = False
        for endpoint in candidates:
            served = endpoint.served
            if served.lists(model):
                serving.append(endpoint)
                adapter = adapter or served.is_adapter(model)
            elif model in endpoint.metrics.running_adapters or model in endpoint.metrics.waiting_adapters:
                serving.append(endpoint)
                adapter = True
            elif not served.listed:
                unlisted.append(endpoint)
        if serving:
            return serving if adapter or not self.pass_on_missing else serving + unlisted
        if self.pass_on_missing and unlisted:
            return unlisted
        return list(candidates) if self.fallback_on_empty else []
