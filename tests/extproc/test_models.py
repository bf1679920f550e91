"""GET /v1/models through the gateway: which requests are answered, and the union's shape."""

from __future__ import annotations

import json

import pytest

from epp.extproc.models import is_models_request, models_answer, models_union
from epp.framework import Endpoint, ServedModels


def _pod(name: str, *cards: dict[str, object]) -> Endpoint:
    return Endpoint(name, "10.0.0.1", 8000 + len(name), served=ServedModels.from_entries(list(cards)))


@pytest.mark.parametrize(
    ("method", "path", "answered"),
    [("GET", "/v1/models", True), ("GET", "/v1/models/", True), ("GET", "/v1/models?x=1", True),
     ("POST", "/v1/models", False), ("GET", "/v1/models/base", False), ("GET", "/v1/completions", False)],
)  # fmt: skip
def test_only_get_v1_models_is_answered(method: str, path: str, answered: bool) -> None:
    assert is_models_request({":method": method, ":path": path}) is answered


def test_the_union_is_deduplicated_sorted_and_keeps_parent() -> None:
    b = _pod("b", {"id": "base", "parent": None, "owned_by": "b"}, {"id": "sql", "parent": "base", "root": "/sql"})
    a = _pod("a", {"id": "base", "parent": None, "owned_by": "a"})
    unknown = Endpoint("c", "10.0.0.3", 8000)
    answer = models_answer([b, unknown, a])
    assert answer is not None and answer.immediate_response.status.code == 200
    body = json.loads(answer.immediate_response.body)
    assert body == {"object": "list", "data": [
        {"id": "base", "parent": None, "owned_by": "a"},  # the first pod by name wins a duplicate id
        {"id": "sql", "parent": "base", "root": "/sql"},
    ]}  # fmt: skip
    headers = {h.header.key: h.header.raw_value for h in answer.immediate_response.headers.set_headers}
    assert headers == {"content-type": b"application/json"}


def test_nothing_listed_yet_routes_it_to_a_pod() -> None:
    assert models_union([Endpoint("a", "10.0.0.1", 8000)]) is None
    assert models_answer([]) is None
    assert models_union([_pod("a")]) == []  # a pod listed nothing: an empty list, answered
