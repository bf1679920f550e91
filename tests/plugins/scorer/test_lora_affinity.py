"""lora-affinity-scorer and lora-affinity-filter, against GIE's semantics."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle
from epp.plugins.scorer.lora_affinity import LoraAffinityScorer
from tests.plugins._helpers import pod, request

HANDLE = Handle(Datastore())


# The adapter "a" in each situation upstream distinguishes.
RUNNING = dict(running_adapters={"a", "b"}, max_adapters=2)  # running, no slot free


RUNNING_WITH_ROOM = dict(running_adapters={"a"}, max_adapters=4)


FREE_SLOT = dict(running_adapters={"b"}, max_adapters=2)  # not here, one slot free


WAITING = dict(running_adapters={"b"}, waiting_adapters={"a"}, max_adapters=2)  # queued, no slot free


WAITING_WITH_ROOM = dict(waiting_adapters={"a"}, max_adapters=4)


FULL = dict(running_adapters={"b", "c"}, max_adapters=2)  # every slot taken by others


FULL_WITH_QUEUE = dict(running_adapters={"b"}, waiting_adapters={"c"}, max_adapters=2)


NO_LORA = dict()  # a server without LoRA: no slots at all


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (RUNNING, 1.0),
        (RUNNING_WITH_ROOM, 1.0),
        (FREE_SLOT, 0.8),
        (WAITING_WITH_ROOM, 0.8),  # a free slot ranks above "waiting", as upstream orders its cases
        (WAITING, 0.6),
        (FULL, 0.0),
        (FULL_WITH_QUEUE, 0.0),
        (NO_LORA, 0.0),
    ],
)
def test_scorer_scores_each_adapter_state_as_upstream(state: dict[str, Any], expected: float) -> None:
    candidates = [pod(0, **state), pod(1, **state, stale=True)]
    assert LoraAffinityScorer().score(request(adapter="a"), candidates) == [expected, 0.0]  # stale: 0


def test_scorer_ranks_a_mixed_pool() -> None:
    candidates = [pod(0, **FULL), pod(1, **WAITING), pod(2, **FREE_SLOT), pod(3, **RUNNING)]
    assert LoraAffinityScorer().score(request(adapter="a"), candidates) == [0.0, 0.6, 0.8, 1.0]


def test_scorer_leaves_base_model_requests_to_the_other_scorers() -> None:
    candidates = [pod(0, **FULL), pod(1, **FREE_SLOT), pod(2, **NO_LORA), pod(3, stale=True)]
    assert LoraAffinityScorer().score(request(adapter=None), candidates) == [1.0, 1.0, 1.0, 0.0]


def test_scorer_takes_no_parameters() -> None:
    assert LoraAffinityScorer.from_config("l", {}, HANDLE).name == "l"
    with pytest.raises(ValueError, match="takes no parameters"):
        LoraAffinityScorer.from_config("l", {"threshold": 1}, HANDLE)
