from epp.prefix.kvindex import KVEventIndex, chain_keys
from epp.prefix.kvwire import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def _stored(hashes, parent, tokens, medium="GPU", extra=None):
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, medium=medium, extra_keys=extra
    )


def test_a_request_matches_the_blocks_a_pod_stored_across_batches():
    index = KVEventIndex()
    tokens = list(range(100, 116))  # 4 blocks
    index.apply("a:1", [_stored([11, 12], None, tokens[:8])])
    index.apply("a:1", [_stored([13], 12, tokens[8:12])])  # chained through the engine's parent hash
    index.apply("b:1", [_stored([99], None, tokens[:4])])
    keys = chain_keys(tokens, BS)
    assert len(keys) == 4
    assert index.match(keys) == {"a:1": (3, 3.0), "b:1": (1, 1.0)}
    # A different first block matches nothing even where later blocks' tokens agree.
    assert index.match(chain_keys([0, *tokens[1:]], BS)) == {}


def test_removed_blocks_break_the_run_and_cpu_weighs_less():
    index = KVEventIndex()
    tokens = list(range(12))
    index.apply("a:1", [_stored([1, 2, 3], None, tokens)])
    index.apply("a:1", [BlockRemoved(block_hashes=[2], medium="GPU")])
    keys = chain_keys(tokens, BS)
    assert index.match(keys) == {"a:1": (1, 1.0)}
    index.apply("c:1", [_stored([7, 8], None, tokens[:8], medium="CPU")])
    assert index.match(keys)["c:1"] == (2, 1.6)


def test_clear_and_unknown_and_remove():
    index = KVEventIndex()
    tokens = list(range(8))
    index.apply("a:1", [_stored([1, 2], None, tokens)])
    index.apply("a:1", [AllBlocksCleared()])
    assert index.match(chain_keys(tokens, BS)) == {} and index.known("a:1")
    index.apply("a:1", [_stored([1, 2], None, tokens)])
    index.mark_unknown("a:1")
    assert not index.known("a:1") and index.stats().blocks == 0
    index.apply("a:1", [])
    assert index.known("a:1")
    index.remove_pod("a:1")
    assert index.pods() == [] and not index.known("a:1")


def test_extra_keys_and_unknown_parents_never_match_a_plain_lookup():
    index = KVEventIndex()
    tokens = list(range(8))
    index.apply("a:1", [_stored([1], None, tokens[:4], extra=[["salt-x"]])])
    index.apply("b:1", [_stored([5], 404, tokens[4:8])])  # its parent was stored before we listened
    assert index.match(chain_keys(tokens, BS)) == {}
    assert index.stats().unresolved_parents == 1


def test_blocks_per_pod_are_bounded_oldest_first():
    index = KVEventIndex(max_blocks_per_pod=3)
    tokens = list(range(20))
    index.apply("a:1", [_stored([1, 2, 3, 4, 5], None, tokens)])
    stats = index.stats()
    assert stats.blocks == 3 and stats.evicted_by_bound == 2
    # The first blocks went first: a lookup from the start matches nothing.
    assert index.match(chain_keys(tokens, BS)) == {}
    assert len(index.blocks_of("a:1")) == 3
