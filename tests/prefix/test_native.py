"""epp.prefix._native: the C loops check their buffers (what they compute is held to the
references through epp.prefix.hashing and epp.prefix.table)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def test_the_native_loops_refuse_buffers_too_small_instead_of_reading_past_them() -> None:
    from epp.prefix import _native

    keys = np.zeros(64, dtype=np.uint32)
    out = np.empty(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="too small"):
        _native.chain(b"x" * 200, 64, 4, keys, 0, out)  # 3 blocks of data for 4
    with pytest.raises(ValueError, match="too small"):
        _native.chain(b"x" * 256, 64, 4, keys[:40], 0, out)  # keys for 2.5 blocks
    with pytest.raises(ValueError, match="too small"):
        _native.chain(b"x" * 256, 64, 4, keys, 0, out[:3])
    with pytest.raises(ValueError, match="multiple of 4"):
        _native.chain(b"x" * 256, 6, 4, keys, 0, out)
    with pytest.raises(TypeError, match="writable"):
        _native.chain(b"x" * 256, 64, 4, keys, 0, b"\0" * 32)
    rows = np.zeros((4, 8, 3), dtype=np.uint64)  # 4 buckets of 8 slots
    found = np.empty((2, 3), dtype=np.uint64)
    with pytest.raises(ValueError, match="too small"):
        _native.lookup(rows, 4, 8, 3, 30, 1, np.ones(2, dtype=np.uint64), found)  # 4 + 1 spill buckets
    with pytest.raises(ValueError, match="geometry"):
        _native.lookup(rows, 2, 8, 3, 30, 0, np.ones(2, dtype=np.uint64), found)  # 4 buckets' worth of shift
    with pytest.raises(TypeError, match="contiguous"):
        _native.lookup(rows, 4, 8, 3, 30, 0, np.ones(4, dtype=np.uint64)[::2], found)
    _native.lookup(rows, 4, 8, 3, 30, 0, np.ones(2, dtype=np.uint64), found)  # the right sizes: found nothing
    assert not found.any()


def _spread(k: int) -> int:
    return k * 0x9E3779B97F4A7C15 % 2**64  # an odd multiplier: never 0 for 0 < k < 2**64


def _model_runs(model: dict[int, int], keys: list[int]) -> list[tuple[int, int]]:
    """KeyMasks.match's reference: per slot of the first key's mask, its consecutive keys from the first."""
    first = model.get(keys[0], 0)
    runs = []
    for slot in range(64):
        if first >> slot & 1:
            run = 0
            while run < len(keys) and model.get(keys[run], 0) >> slot & 1:
                run += 1
            runs.append((slot, run))
    return runs


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "discard"]), st.integers(1, 40), st.integers(0, 2**64 - 1)),
        max_size=400,
    ),
    st.lists(st.integers(1, 45), min_size=1, max_size=60),
)
def test_key_masks_behave_as_a_dict_of_masks(ops: list[tuple[str, int, int]], probe: list[int]) -> None:
    # Few distinct keys and many operations: the table grows, and deletions shift entries back
    # over runs that wrap around its end; every key's mask and the walk must stay the dict's.
    from epp.prefix import _native

    table, model = _native.KeyMasks(), {}
    for op, key, bits in ops:
        key = _spread(key)  # over the 64-bit range, as chain keys are
        if op == "add":
            assert table.add(key, bits) == model.get(key, 0)
            if model.get(key, 0) | bits:
                model[key] = model.get(key, 0) | bits
        else:
            table.discard(key, bits)
            mask = model.pop(key, 0) & ~bits
            if mask:
                model[key] = mask
        assert len(table) == len(model)
    for key in {*model, *map(_spread, range(41, 46))}:
        assert table.get(key) == model.get(key, 0)
    keys = [_spread(k) for k in probe]
    assert table.match(keys) == _model_runs(model, keys)


def test_key_masks_refuse_the_reserved_key_and_what_is_not_a_uint64() -> None:
    from epp.prefix import _native

    table = _native.KeyMasks()
    with pytest.raises(ValueError, match="reserved"):
        table.add(0, 1)
    with pytest.raises(OverflowError):
        table.add(-1, 1)
    with pytest.raises(OverflowError):
        table.add(2**64, 1)
    with pytest.raises(TypeError, match="integers"):
        table.get("1")
    with pytest.raises(TypeError, match="list"):
        table.match((1, 2))
    assert table.get(0) == 0 and table.match([]) == [] and len(table) == 0
    for key in range(1, 5000):  # grows from 64 slots, at half load
        table.add(key, 1 << (key % 64))
    assert len(table) == 4999 and table.nbytes == 2 * 8 * 16384


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 23)), max_size=300))
def test_key_masks_deletions_inside_a_cluster_that_wraps_keep_every_key_found(ops: list[tuple[bool, int]]) -> None:
    # White-box: 24 keys whose home slot (the multiplicative hash, see _native.c) is 60 or 61 of the
    # first 64 slots (under half load: the table does not grow), so they form one cluster that wraps
    # around the end, and each deletion must shift the keys after it back into its hole.
    from epp.prefix import _native

    colliding = [k for k in range(1, 20_000) if (k * 0x9E3779B97F4A7C15 % 2**64) >> 58 in (60, 61)][:24]
    table, model = _native.KeyMasks(), {}
    for add, index in ops:
        key = colliding[index]
        if add:
            table.add(key, 1 << index)
            model[key] = 1 << index
        else:
            table.discard(key, 1 << index)
            model.pop(key, None)
        assert all(table.get(k) == model.get(k, 0) for k in colliding)
        assert len(table) == len(model)
