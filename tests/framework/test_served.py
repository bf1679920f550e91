"""ServedModels: a /v1/models list read into base models and adapters, and what an endpoint serves."""

from __future__ import annotations

from epp.framework import NOT_LISTED, Endpoint, Metrics, ServedModels

# vLLM 0.32's shape: the base model with parent null, each LoRA module with its base as parent.
ENTRIES = [
    {"id": "base", "object": "model", "root": "/models/base", "parent": None, "max_model_len": 2048},
    {"id": "sql-lora", "object": "model", "root": "/models/sql", "parent": "base"},
    {"object": "model"},  # no id: skipped
    {"id": 7},  # not a string: skipped
]


def test_a_list_splits_into_base_models_and_adapters() -> None:
    served = ServedModels.from_entries(ENTRIES, updated_at=5.0)
    assert served.listed and served.updated_at == 5.0
    assert served.base_models == {"base"}
    assert dict(served.adapters) == {"sql-lora": "base"}
    assert [entry["id"] for entry in served.entries] == ["base", "sql-lora"]
    assert served.lists("base") and served.lists("sql-lora") and not served.lists("other")
    assert served.is_adapter("sql-lora") and not served.is_adapter("base")


def test_an_endpoint_never_polled_lists_nothing_and_is_unknown() -> None:
    endpoint = Endpoint("a", "10.0.0.1", 8000)
    assert endpoint.served is NOT_LISTED and not NOT_LISTED.listed
    assert not endpoint.serves("base")


def test_the_metrics_pages_adapters_are_a_second_source() -> None:
    metrics = Metrics(running_adapters=frozenset({"run"}), waiting_adapters=frozenset({"wait"}), stale=False)
    endpoint = Endpoint("a", "10.0.0.1", 8000, metrics=metrics)
    assert endpoint.serves("run") and endpoint.serves("wait") and not endpoint.serves("base")


def test_served_is_not_part_of_the_identity() -> None:
    listed = Endpoint("a", "10.0.0.1", 8000, served=ServedModels.from_entries(ENTRIES))
    assert listed == Endpoint("a", "10.0.0.1", 8000) and hash(listed) == hash(Endpoint("a", "10.0.0.1", 8000))
