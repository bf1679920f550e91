"""epp.prefix.upkeep: a growth started ahead of need, and the endpoints' lists kept valid when
one cannot wait."""

from __future__ import annotations

import pytest

import epp.prefix.upkeep as prefix_upkeep
from epp.prefix import PrefixIndex
from tests.prefix._helpers import blocks, mode
from tests.prefix._reference import ReferenceIndex


def test_a_65th_endpoint_gets_a_wider_table_prepared_when_it_registers() -> None:
    index = PrefixIndex(100)
    h = blocks("w" * 200)
    for i in range(64):
        index.add(f"e{i}", h)
    assert index._store.words == 1
    index.set_capacity("e64", 100)  # as the plugin does when a pod joins the pool
    assert index._store.words == 1 and index._store.busy  # prepared, not yet in use
    index.add("e64", h[:10])
    assert index._store.words == 2
    found = index.matches(h)
    assert len(found) == 65 and found["e64"] == 10 and found["e0"] == len(h)


def test_a_wider_table_needed_while_lists_are_being_rewritten_rewrites_them_all_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rewrites: list[bool] = []
    rewrite_all = prefix_upkeep.Upkeep.rewrite_all

    def counted(self: prefix_upkeep.Upkeep) -> None:
        rewrites.append(self.busy)
        rewrite_all(self)

    monkeypatch.setattr(prefix_upkeep.Upkeep, "rewrite_all", counted)
    with mode("migrating"):  # warming 512 bytes, moving 1 key, rewriting 3 list entries a step
        index, reference = PrefixIndex(10_000), ReferenceIndex(10_000)
        for i in range(64):  # bits 0-63: one mask word
            index.set_capacity(f"e{i}", 10_000)
            reference.set_capacity(f"e{i}", 10_000)
        prompts = [blocks(f"{i:04d}" * 60) for i in range(40)]  # 60 blocks each, all distinct
        for i, hashes in enumerate(prompts):
            assert index.add(f"e{i % 3}", hashes) == reference.add(f"e{i % 3}", hashes.tolist())
            store = index._store
            if store.epoch >= 2 and store.migrating and not store.moving:
                break  # a second growth: every key moved, lists still pointing into the old table
        else:
            raise AssertionError("no growth reached its list rewriting")
        before = len(rewrites)
        # e64's bit needs a second mask word now: that growth cannot wait for the lists.
        assert index.add("e64", prompts[0]) == reference.add("e64", prompts[0].tolist())
        assert rewrites[before:] == [True] and index._store.words == 2
        assert all(index.matches(h) == reference.matches(h.tolist()) for h in prompts)
        while index._upkeep.busy:
            index._maintain()
        for i in range(3):  # evictions go by the lists: with an id gone wrong, the wrong slot
            index.set_capacity(f"e{i}", 100)
            reference.set_capacity(f"e{i}", 100)
        assert all(index.matches(h) == reference.matches(h.tolist()) for h in prompts)
        assert index._store.live == len(set().union(*reference.where.values()))
