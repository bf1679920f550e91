"""InferenceObjectives: the config section, the Kubernetes resources and their watch.

The watch runs the real client library against the fake API server (epp.testing.fake_apiserver)
with the InferenceObjective resource registered, over real sockets."""

from __future__ import annotations

from typing import Any

import pytest

from epp.flowcontrol.objectives import decode_objectives


def test_config_objectives_decode_with_a_default_priority() -> None:
    assert decode_objectives(None) == {}
    assert decode_objectives([{"name": "chat", "priority": 10}, {"name": "plain"}, {"name": "bulk", "priority": -3}]) == {
        "chat": 10,
        "plain": 0,
        "bulk": -3,
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([{"priority": 1}], r"inferenceObjectives\[0\]: name is required"),
        ([{"name": ""}], r"inferenceObjectives\[0\]: name is required"),
        ([{"name": "x", "priority": 2**31}], r"int32 range, got 2147483648"),
        ([{"name": "x", "priority": True}], r"int32 range, got True"),
        ([{"name": "x", "priority": 1.5}], r"int32 range, got 1.5"),
        (["x"], r"inferenceObjectives\[0\] must be a mapping"),
    ],
)
def test_bad_config_objectives(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_objectives(value)
