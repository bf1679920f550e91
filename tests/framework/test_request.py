"""Typed per-request state, and the immutable request."""

from __future__ import annotations

import dataclasses

import pytest

from epp.framework import PREFIX_MATCH, InferenceRequest, PrefixMatch, RequestState, StateKey, declared_keys

COUNT: StateKey[int] = StateKey("count")


def test_state_is_keyed_by_typed_keys_equal_by_name() -> None:
    state = RequestState()
    assert state.get(COUNT) is None and state.get(COUNT, 7) == 7 and COUNT not in state
    state[COUNT] = 3
    assert state[COUNT] == 3 and state[StateKey[int]("count")] == 3 and COUNT in state
    assert list(state.names()) == ["count"]
    del state[COUNT]
    with pytest.raises(KeyError):
        state[COUNT]


def test_a_bare_string_is_not_a_key() -> None:
    state = RequestState()
    assert "count" not in state
    with pytest.raises(AttributeError):
        state["count"] = 1  # type: ignore[index]


def test_a_key_needs_a_name() -> None:
    with pytest.raises(ValueError, match="needs a name"):
        StateKey("")


def test_declared_keys_accept_keys_names_and_single_values() -> None:
    class Plugin:
        produces = (PREFIX_MATCH, "other")
        consumes = COUNT

    assert declared_keys(Plugin(), "produces") == ("prefix-cache-match", "other")
    assert declared_keys(Plugin(), "consumes") == ("count",)
    assert declared_keys(object(), "produces") == ()


def test_the_request_is_immutable_and_its_state_is_its_own() -> None:
    a = InferenceRequest(request_id="a", method="POST", path="/v1/completions", prompt="x" * 9)
    b = InferenceRequest(request_id="b", method="POST", path="/v1/completions")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.priority = 3  # type: ignore[misc]
    a.state[COUNT] = 1
    assert COUNT not in b.state
    assert a.prompt_tokens == 3 and dict(a.headers) == {}


def test_prefix_match_share() -> None:
    match = PrefixMatch(blocks=4, matched={"a": 3})
    assert (match.share("a"), match.share("b"), PrefixMatch(0, {}).share("a")) == (0.75, 0.0, 0.0)
