"""epp.prefix.table: one table's lookups, finds and inserts agree, spilled keys included; the row
format's readers (holder_masks, bits)."""

from __future__ import annotations

import numpy as np
import pytest

import epp.prefix.table as prefix_table
from epp.prefix.table import Table, bits, holder_masks


def test_holder_masks_read_both_planes_of_every_mask_word() -> None:
    one = np.array([[11, 0b0101, 0b0010], [12, 0, 0], [13, 1 << 63, 0]], dtype=np.uint64)  # 1 word
    assert holder_masks(one) == [0b0111, 0, 1 << 63]
    two = np.zeros((2, 5), dtype=np.uint64)  # key, plane 0 words 0-1, plane 1 words 0-1
    two[0, 2] = 1  # plane 0, word 1, bit 0: endpoint 64
    two[0, 3] = 1 << 5  # plane 1, word 0: endpoint 5
    two[1, 4] = 1 << 2  # plane 1, word 1: endpoint 66
    assert holder_masks(two) == [(1 << 64) | (1 << 5), 1 << 66]
    assert list(bits((1 << 64) | (1 << 5) | 1)) == [0, 5, 64] and list(bits(0)) == []


@pytest.mark.parametrize("spilling", [False, True])
def test_inserted_keys_are_found_by_lookup_and_find_and_absent_ones_are_not(
    spilling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = 0.85  # (a table grows at 88.5%)
    if spilling:  # buckets of 7 usable slots: at 75% load, two choices leave a few keys (6) to spill
        monkeypatch.setattr(prefix_table, "_MIN_SLOTS", 8)
        monkeypatch.setattr(prefix_table, "_MAX_SLOTS", 8)
        load = 0.75
    table = Table(2000, 1)
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(1, 2**64, 4000, dtype=np.uint64, endpoint=False))[: int(table.usable * load)]
    rng.shuffle(keys)
    values = np.stack([keys ^ np.uint64(0xFF), keys >> np.uint64(3)], axis=1)
    ids = table.insert(keys, values)
    assert (ids >= 0).all() and np.unique(ids).size == keys.size and table.live == keys.size
    assert (table.spilled > 0) == spilling
    rows = table.lookup(keys)
    assert rows[:, 0].tolist() == keys.tolist() and (rows[:, 1:] == values).all()
    found, found_rows = table.find(keys)
    assert found.tolist() == ids.tolist() and (found_rows == rows).all()
    absent = np.array([2**63 + 5, 2**63 + 7], dtype=np.uint64)
    assert not table.lookup(absent).any() and table.find(absent)[0].tolist() == [-1, -1]


def test_a_forwarded_slot_keeps_only_its_new_id() -> None:
    table = Table(100, 1)
    keys = np.arange(1, 11, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    ids = table.insert(keys, np.ones(2, dtype=np.uint64))
    table.forward(ids[:4], np.array([7, 8, 9, 10]))
    assert table.live == 6
    assert table.flat[ids[:4], 1].tolist() == [7, 8, 9, 10]
    assert not table.flat[ids[:4], 0].any() and not table.flat[ids[:4], 2].any()
    assert not table.lookup(keys[:4]).any() and table.lookup(keys[4:])[:, 0].tolist() == keys[4:].tolist()
