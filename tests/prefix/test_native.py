"""epp.prefix._native: the C loops check their buffers (what they compute is held to the
references through epp.prefix.hashing and epp.prefix.table)."""

from __future__ import annotations

import numpy as np
import pytest


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
