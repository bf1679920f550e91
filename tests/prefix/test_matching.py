"""epp.prefix.matching: each endpoint's run, from samples and hints, in as few lookups as the
docstring promises."""

from __future__ import annotations

import numpy as np
import pytest

import epp.prefix.matching as prefix_matching
from epp.prefix import PrefixIndex, prompt_hashes
from tests.prefix._helpers import blocks


def test_match_reports_each_endpoints_longest_consecutive_prefix() -> None:
    index = PrefixIndex()
    system = "S" * 400  # 100 blocks: the sampled path
    index.add("a", blocks(system + "q1" * 50))
    index.add("b", blocks(system[:200]))
    index.add("c", blocks("other" * 40))
    index.add("d", blocks(system[:188]))  # 47 blocks: a run ending between two samples
    query = blocks(system + "q2" * 50)
    assert index.matches(query) == {"a": 100, "b": 50, "d": 47}
    assert index.match(query, ["c", "b", "a", "unknown"]) == [0, 50, 100, 0]
    assert index.matches(prompt_hashes(system + "q1" * 50, "other-model", None, 4)) == {}
    assert index.matches(np.empty(0, dtype=np.uint64)) == {}


def lookups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every table lookup matches make from now on (in this test)."""
    sizes: list[int] = []
    held = prefix_matching.Matcher.held

    def counted(self: prefix_matching.Matcher, keys: np.ndarray) -> tuple:
        sizes.append(keys.size)
        return held(self, keys)

    monkeypatch.setattr(prefix_matching.Matcher, "held", counted)
    return sizes


def test_where_runs_ended_before_is_looked_up_with_the_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PrefixIndex()
    system = "S" * 400  # 100 blocks; prompts of 125 blocks are sampled every 11th (13 samples)
    index.add("a", blocks(system + "q1" * 50))
    sizes = lookups(monkeypatch)
    assert index.matches(blocks("T" * 500)) == {}
    assert sizes == [4]  # a first block not seen lately: most likely new, so few samples (0, 44, 88, 124)
    sizes.clear()
    assert index.matches(blocks(system + "q2" * 50)) == {"a": 100}
    assert sizes == [13, 10]  # the first time: the samples, then the gap (100..109) where the run ends
    index.add("b", blocks(system + "q2" * 50))
    sizes.clear()
    assert index.matches(blocks(system + "q3" * 50)) == {"a": 100, "b": 100}
    assert sizes == [15]  # now blocks 99 and 100 come with the samples: one lookup
    # A stale hint costs nothing but its two blocks: a run that ends elsewhere is still exact.
    index.add("c", blocks(system[:160] + "x" * 340))  # 40 blocks of the system prompt, then apart
    sizes.clear()
    for question in ("q4", "q5", "q6"):
        assert index.matches(blocks(system + question * 50)) == {"a": 100, "b": 100, "c": 40}
    # c's add saw a run end at 40 first, q4's match saw it again: from q5 on, 39 and 40 come along
    assert sizes == [15, 10, 17, 17]  # q4: the samples and hints, then blocks 34..43


def test_the_next_turn_of_a_conversation_needs_one_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PrefixIndex()
    turn = "system: be brief. user: hi. " * 12  # 84 blocks of 4 bytes
    index.add("b", blocks(turn[:200] + "elsewhere" * 20))
    index.add("a", blocks(turn))
    sizes = lookups(monkeypatch)
    for i in range(3):  # each turn resends the conversation so far, and the last add was its pod
        following = turn + f"assistant: answer {i}. user: more {i}. " * 3
        assert index.matches(blocks(following)) == {"a": len(turn) // 4, "b": 50}
        # b's run ends at block 50: seen once when a was added, it becomes a hint the second time
        assert len(sizes) == (2 if i == 0 else 1), f"turn {i}: {sizes}"
        index.add("a", blocks(following))
        turn = following
        sizes.clear()
