from hypothesis import given, settings
from hypothesis import strategies as st

from epp.prefix.kvindex import DEFAULT_MEDIA_WEIGHTS, KVEventIndex, chain_keys
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


def test_an_adapter_or_salted_request_matches_the_blocks_its_events_stored_with_extra_keys():
    # vLLM's events carry the adapter's name on every block and the salt on the first (decoded from
    # msgpack: lists, equal but not the same object); chain_keys chains them a run at a time.
    tokens = list(range(40))  # 10 blocks
    for lora, salt, first, rest in (
        ("ad1", None, ["ad1"], ["ad1"]),
        (None, "s", ["s"], None),
        ("ad1", "s", ["ad1", "s"], ["ad1"]),
    ):
        index = KVEventIndex()
        extra = [first] + [None if rest is None else list(rest) for _ in range(5)]
        index.apply("a:1", [_stored(list(range(1, 7)), None, tokens[:24], extra=extra)])
        later = [None if rest is None else list(rest) for _ in range(3)]  # a next batch: the last block's extra unsent
        index.apply("a:1", [_stored([7, 8, 9, 10], 6, tokens[24:], extra=later if rest else None)])
        keys = chain_keys(tokens, BS, lora_name=lora, cache_salt=salt)
        expected = 10 if rest is None else 9  # a block without the adapter's key is not the adapter's block
        assert index.match(keys) == {"a:1": (expected, float(expected))}, (lora, salt)
        assert index.match(chain_keys(tokens, BS)) == {}  # a plain lookup never matches a salted first block


def _walk(model, blocks):
    """The reference: per pod, the blocks it holds in turn from the first, and their weights."""
    result = {}
    for pod, weights in model.items():
        run = 0
        while run < blocks and run in weights:
            run += 1
        if run:
            result[pod] = (run, sum(weights[b] for b in range(run)))
    return result


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_match_is_the_walk_of_each_pods_run_from_the_first_block(data):
    blocks = data.draw(st.integers(1, 400), label="blocks")
    tokens = list(range(blocks * BS))
    keys = chain_keys(tokens, BS)
    index = KVEventIndex()
    model = {}
    pods = data.draw(st.integers(1, 70), label="pods")  # past 64: masks wider than a machine word
    for p in range(pods):
        held = data.draw(st.integers(0, blocks), label="held")
        if not held:
            continue
        medium = data.draw(st.sampled_from(["GPU", "CPU"]), label="medium")
        hashes = [p * 10_000 + b for b in range(held)]
        index.apply(f"p{p}:1", [_stored(hashes, None, tokens[: held * BS], medium=medium)])
        holes = data.draw(st.lists(st.integers(0, held - 1), max_size=3), label="holes")
        if holes:
            index.apply(f"p{p}:1", [BlockRemoved(block_hashes=[hashes[h] for h in holes], medium=medium)])
        model[f"p{p}:1"] = {b: DEFAULT_MEDIA_WEIGHTS[medium] for b in range(held) if b not in holes}
    got = index.match(keys)
    want = _walk(model, blocks)
    assert got.keys() == want.keys()
    for pod, (run, weighted) in want.items():
        assert got[pod][0] == run
        assert abs(got[pod][1] - weighted) < 1e-6


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    data=st.data(),
    max_blocks=st.none() | st.integers(1, 20),
    lora=st.none() | st.just("adapter"),
    salt=st.none() | st.just("salt"),
)
def test_a_chain_goes_on_from_the_keys_of_its_start(tokens: list[int], data: st.DataObject, max_blocks: int | None,
                                                     lora: str | None, salt: str | None) -> None:  # fmt: skip
    """``known``: the keys of a prompt's start, computed before; the rest is chained on from them."""
    cut = data.draw(st.integers(0, len(tokens)))
    whole = chain_keys(tokens, BS, 7, max_blocks, lora_name=lora, cache_salt=salt)
    start = chain_keys(tokens[:cut], BS, 7, max_blocks, lora_name=lora, cache_salt=salt)
    assert chain_keys(tokens, BS, 7, max_blocks, lora_name=lora, cache_salt=salt, known=start) == whole
