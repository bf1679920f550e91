"""epp.prefix.generations: the three-generation policy, where it matches an exact LRU and where
it differs, capacities and removal (the property tests of test_index.py hold it to the
reference in every case)."""

from __future__ import annotations

import pytest

from epp.prefix import PrefixIndex
from tests.prefix._helpers import ENDPOINTS, blocks


def test_evictions_take_the_oldest_generation_and_a_prompts_tail_first() -> None:
    index = PrefixIndex(10)
    first, second = blocks("a" * 24), blocks("b" * 24)  # 6 blocks each
    index.add("e", first)
    index.add("e", second)  # 12 > 10: the first prompt's generation closed, its last two blocks go
    assert index.matches(first) == {"e": 4}
    assert index.matches(second) == {"e": 6}
    index.add("e", first[:4])  # refresh: now the second prompt is the older one
    index.add("e", blocks("c" * 8))
    assert index.matches(second) == {"e": 4} and index.matches(first) == {"e": 4}
    assert index.size == index.endpoint_size("e") == 10


def test_within_the_oldest_generation_the_last_to_enter_goes_first() -> None:
    # Where this differs from an exact LRU: p1 and p2 share the oldest generation; p2 entered it
    # last, so p2 goes although p1 is older.
    index = PrefixIndex(12)  # generations close at 4 blocks; no batch below 16
    p1, p2, p3, p4, p5 = (blocks(c * 12) for c in "vwxyz")  # 3 blocks each
    for prompt in (p1, p2, p3, p4, p5):
        index.add("e", prompt)
    assert index.endpoint_size("e") == 12
    assert [index.match(p, ["e"])[0] for p in (p1, p2, p3, p4, p5)] == [3, 0, 3, 3, 3]


def test_evictions_come_in_batches_of_a_sixteenth() -> None:
    index = PrefixIndex(32)  # evicts down to 30 once over 32
    for i in range(11):
        index.add("e", blocks(f"{i:03d}" * 4))  # 11 × 3 = 33 blocks offered: one over
    assert index.endpoint_size("e") == 30
    index.add("e", blocks("new!"))
    assert index.endpoint_size("e") == 31


def test_a_prompt_longer_than_the_capacity_keeps_its_head() -> None:
    index = PrefixIndex(5)
    h = blocks("z" * 80)
    index.add("e", h)
    assert index.matches(h) == {"e": 5} and index.size == 5


def test_capacity_changes_evict_down_to_the_new_capacity() -> None:
    index = PrefixIndex(100)
    h = blocks("q" * 200)  # 50 blocks
    index.set_capacity("e", 80)
    assert index.capacity("e") == 80 and index.capacity("other") == 100
    index.add("e", h)
    index.set_capacity("e", 30)  # down to 30 − 30 // 16, the prompt's tail first
    assert index.matches(h) == {"e": 29} and index.size == 29
    index.set_capacity("e", 1000)
    index.add("e", h)
    assert index.matches(h) == {"e": 50}
    with pytest.raises(ValueError, match="capacity must be an integer ≥ 1"):
        index.set_capacity("e", 0)
    with pytest.raises(ValueError, match="capacity must be an integer ≥ 1"):
        PrefixIndex(-5)


def test_remove_cleans_the_endpoint_out_and_its_slot_is_reused() -> None:
    index = PrefixIndex()
    h = blocks("r" * 100)
    for endpoint in ENDPOINTS:  # 70 endpoints: two mask words
        index.add(endpoint, h)
    assert len(index.matches(h)) == 70
    assert index.remove(ENDPOINTS[3]) and not index.remove(ENDPOINTS[3])
    assert ENDPOINTS[3] not in index and ENDPOINTS[4] in index
    assert index.size == 69 * len(h)
    index.add("newcomer", h[:10])
    found = index.matches(h)
    assert ENDPOINTS[3] not in found and found["newcomer"] == 10 and found[ENDPOINTS[69]] == len(h)
    for endpoint in index.endpoints():
        index.remove(endpoint)
    assert index.size == 0 and index.matches(h) == {} and index._store.live == 0
