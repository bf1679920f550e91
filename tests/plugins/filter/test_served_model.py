"""served-model-filter: llm-d's rules over /v1/models lists, with the metrics page's adapters as a second source."""

from __future__ import annotations

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Endpoint, Handle, InferenceRequest, Metrics, ServedModels
from epp.plugins.filter.served_model import ServedModelFilter
from epp.scheduling.config import load_scheduler
from epp.scheduling.registry import default_registry

HANDLE = Handle(pool=Datastore())


def _pod(name: str, *models: str) -> Endpoint:
    """A pod listing ``models``: the first is its base, the rest adapters of it (vLLM's order)."""
    entries = [{"id": m, "parent": models[0] if i else None} for i, m in enumerate(models)]
    return Endpoint(name, "10.0.0.1", int(name[1:]) + 8000, served=ServedModels.from_entries(entries))


BASE = _pod("p1", "llama")
ADAPTER = _pod("p2", "llama", "sql")
OTHER = _pod("p3", "llama", "support")
UNLISTED = Endpoint("p4", "10.0.0.1", 8004)
EMPTY = _pod("p5")
RUNNING = Endpoint("p6", "10.0.0.1", 8006, metrics=Metrics(running_adapters=frozenset({"hot"}), stale=False))
ALL = [BASE, ADAPTER, OTHER, UNLISTED, EMPTY]


@pytest.mark.parametrize(
    ("parameters", "model", "candidates", "kept"),
    [
        ({}, "sql", ALL, [ADAPTER]),  # an adapter: only the pods listing it
        ({}, "llama", ALL, [BASE, ADAPTER, OTHER, UNLISTED]),  # a base model: those and the unlisted
        ({}, "nobody", ALL, [UNLISTED]),  # no pod lists it: the unlisted may
        ({}, "llama", [UNLISTED], [UNLISTED]),
        ({}, "nobody", [BASE, EMPTY], []),  # upstream's default: no endpoint
        ({"fallbackOnEmpty": True}, "nobody", [BASE, EMPTY], [BASE, EMPTY]),  # the default profile's
        ({"fallbackOnEmpty": True}, "nobody", ALL, [UNLISTED]),
        ({"onMissing": "Fail"}, "llama", ALL, [BASE, ADAPTER, OTHER]),
        ({"onMissing": "Fail"}, "nobody", ALL, []),
        ({"onMissing": "Fail", "fallbackOnEmpty": True}, "nobody", ALL, ALL),
        ({}, "", ALL, ALL),  # no model: nothing to narrow on
        ({}, "hot", [*ALL, RUNNING], [RUNNING]),  # running there per its metrics page: an adapter it serves
    ],
)
def test_the_rules(parameters: dict[str, object], model: str, candidates: list[Endpoint], kept: list[Endpoint]) -> None:
    plugin = ServedModelFilter.from_config("f", parameters, HANDLE)
    request = InferenceRequest(request_id="r", method="POST", path="/v1/completions", model=model)
    assert plugin.filter(request, candidates) == kept


def test_a_bad_on_missing_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="onMissing"):
        ServedModelFilter.from_config("f", {"onMissing": "Maybe"}, HANDLE)
    with pytest.raises(ValueError, match="bogus"):
        ServedModelFilter.from_config("f", {"bogus": 1}, HANDLE)


def test_it_loads_by_its_llm_d_type_name() -> None:
    text = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: served-model-filter
  parameters: {onMissing: Fail}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: served-model-filter}, {pluginRef: max-score-picker}]
"""
    (plugin,) = load_scheduler(text, default_registry(), HANDLE).profile.filters
    assert isinstance(plugin, ServedModelFilter) and not plugin.pass_on_missing
