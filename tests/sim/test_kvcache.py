import numpy as np
import pytest

from epp.sim.kvcache import KVCache, block_hashes, model_seed


def _tokens(*blocks: int) -> np.ndarray:
    """One 16-token block per argument, filled with that value."""
    return np.repeat(np.array(blocks, dtype=np.uint32), 16)


def test_hash_of_a_block_depends_on_everything_before_it() -> None:
    seed = model_seed("m")
    abc = block_hashes(_tokens(1, 2, 3), seed)
    assert len(abc) == 3 and abc.dtype == np.uint64
    assert np.array_equal(block_hashes(_tokens(1, 2, 9), seed)[:2], abc[:2])
    xbc = block_hashes(_tokens(7, 2, 3), seed)
    assert not set(xbc.tolist()) & set(abc.tolist())  # same blocks 2, 3 after another first block
    assert block_hashes(_tokens(2, 1), seed)[1] != block_hashes(_tokens(1, 2), seed)[1]  # order matters
    assert not set(block_hashes(_tokens(1, 2, 3), model_seed("adapter")).tolist()) & set(abc.tolist())


def test_partial_block_has_no_hash() -> None:
    assert len(block_hashes(np.arange(40, dtype=np.uint32), 0)) == 2


def test_admit_reuses_cached_prefix_and_counts_usage() -> None:
    kv = KVCache(num_blocks=10)
    hashes = block_hashes(_tokens(1, 2, 3, 4), 0).tolist()
    assert kv.count_hits(hashes, 4) == 0
    assert kv.admit(hashes, 0, 4)
    for h in hashes:
        kv.register(h)
    assert kv.num_used == 4 and kv.usage == pytest.approx(0.4)
    kv.release(hashes, 0)
    assert kv.num_used == 0 and kv.num_cached == 4  # freed blocks keep their content
    assert kv.count_hits(hashes, 3) == 3
    other = block_hashes(_tokens(1, 2, 8), 0).tolist()
    assert kv.count_hits(other, 3) == 2
    assert kv.admit(other, 2, 1)
    assert kv.num_used == 3


def test_admit_that_does_not_fit_changes_nothing() -> None:
    kv = KVCache(num_blocks=4)
    assert kv.admit([], 0, 3)
    assert not kv.admit([], 0, 2)
    assert kv.num_used == 3
    assert kv.grow(1) and not kv.grow(1)


def test_lru_evicts_oldest_request_first_and_its_tail_first() -> None:
    kv = KVCache(num_blocks=6)
    a = block_hashes(_tokens(1, 2, 3), 0).tolist()
    b = block_hashes(_tokens(4, 5, 6), 0).tolist()
    for seq in (a, b):
        assert kv.admit(seq, 0, 3)
        for h in seq:
            kv.register(h)
        kv.release(seq, 0)
    assert kv.num_free == 6 and kv.num_cached == 6
    assert kv.grow(2)  # no empty block left: evict two cached ones
    assert kv.evictions == 2
    assert kv.count_hits(a, 3) == 1  # a's last two blocks went first
    assert kv.count_hits(b, 3) == 3


def test_hit_on_a_block_makes_it_recent() -> None:
    kv = KVCache(num_blocks=4)
    a, b = block_hashes(_tokens(1, 2), 0).tolist(), block_hashes(_tokens(3, 4), 0).tolist()
    for seq in (a, b):
        kv.admit(seq, 0, 2)
        for h in seq:
            kv.register(h)
        kv.release(seq, 0)
    kv.admit(a, 2, 0)  # reuse a: now b is the least recently used
    kv.release(a, 0)
    kv.grow(2)
    assert kv.count_hits(a, 2) == 2 and kv.count_hits(b, 2) == 0


def test_a_block_computed_twice_is_stored_once() -> None:
    kv = KVCache(num_blocks=4)
    h = block_hashes(_tokens(1), 0).tolist()
    kv.admit(h, 0, 1)
    kv.admit(h, 0, 1)  # both missed: two copies being computed
    kv.register(h[0])
    kv.register(h[0])
    assert kv.num_used == 1 and kv.num_cached == 1
    kv.release(h, 0)
    kv.release(h, 0)
    assert kv.num_used == 0 and kv.num_free == 4
