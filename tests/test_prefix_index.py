"""epp.prefix_index against deliberately simple references: a per-block Python loop for the
hashes, dicts of OrderedDict LRUs for the index."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import epp.prefix_index as prefix_index
from epp.prefix_index import PrefixIndex, prompt_hashes

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- the references ------------------------------------------------------------------------------


def reference_keys(count: int) -> list[int]:
    keys = []
    for position in range(1, count + 1):
        z = ((position * 0x9E3779B97F4A7C15) & M64) ^ 0x243F6A8885A308D3
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        keys.append((z ^ (z >> 31)) & M32)
    return keys


def reference_hashes(data: bytes, model: str, salt: str | None, block_chars: int, max_blocks: int) -> list[int]:
    """The documented formula, one block and one word pair at a time."""
    seed = xxhash.xxh3_64_intdigest(b"epp.prefix_index/v1\x00" + block_chars.to_bytes(4, "little"))
    seed = xxhash.xxh3_64_intdigest(model.encode(), seed)
    if salt:
        seed = xxhash.xxh3_64_intdigest(salt.encode(), seed)
    count = min(len(data) // block_chars, max_blocks)
    per_block = block_chars // 4
    keys = reference_keys(count * (per_block + 1))
    out, total, position = [], 0, 0
    for i in range(count):
        block = data[i * block_chars : (i + 1) * block_chars]
        words = [int.from_bytes(block[j : j + 4], "little") for j in range(0, block_chars, 4)]
        if len(words) % 2:
            words.append(0)
        for j in range(0, len(words), 2):
            a = (words[j] + keys[position]) & M32
            b = (words[j + 1] + keys[position + 1]) & M32
            total = (total + a * b) & M64
            position += 2
        out.append((total + seed) & M64)
    return out


class ReferenceIndex:
    """One OrderedDict LRU per endpoint; a prompt's blocks are touched last to first, so the
    first block is the most recent (as documented)."""

    def __init__(self, capacity: int) -> None:
        self.default = capacity
        self.lrus: dict[str, OrderedDict[int, None]] = {}
        self.capacities: dict[str, int] = {}

    def _lru(self, endpoint: str) -> OrderedDict[int, None]:
        self.capacities.setdefault(endpoint, self.default)
        return self.lrus.setdefault(endpoint, OrderedDict())

    def _trim(self, endpoint: str) -> None:
        lru = self.lrus[endpoint]
        while len(lru) > self.capacities[endpoint]:
            lru.popitem(last=False)

    def add(self, endpoint: str, hashes: list[int]) -> int:
        lru = self._lru(endpoint)
        hashes = hashes[: self.capacities[endpoint]]
        held = 0
        for h in hashes:
            if h not in lru:
                break
            held += 1
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
            self._trim(endpoint)
        return held

    def set_capacity(self, endpoint: str, capacity: int) -> None:
        self._lru(endpoint)
        self.capacities[endpoint] = capacity
        self._trim(endpoint)

    def remove(self, endpoint: str) -> bool:
        self.capacities.pop(endpoint, None)
        return self.lrus.pop(endpoint, None) is not None

    def matches(self, hashes: list[int]) -> dict[str, int]:
        found = {}
        for endpoint, lru in self.lrus.items():
            held = 0
            for h in hashes:
                if h not in lru:
                    break
                held += 1
            if held:
                found[endpoint] = held
        return found


# --- hashing -------------------------------------------------------------------------------------


@PROPERTY
@given(
    data=st.binary(max_size=700),
    block_tokens=st.sampled_from([1, 2, 3, 16, 17]),
    max_blocks=st.integers(0, 200),
    model=st.sampled_from(["m", "llama-3-8b", "é"]),
    salt=st.sampled_from([None, "", "tenant-a"]),
)
def test_hashes_follow_the_documented_formula(data: bytes, block_tokens: int, max_blocks: int, model: str, salt: str | None) -> None:
    block_chars = 4 * block_tokens
    got = prompt_hashes(data, model, salt, block_chars, max_blocks)
    assert got.dtype == np.uint64
    assert got.tolist() == reference_hashes(data, model, salt, block_chars, max_blocks)


@PROPERTY
@given(common=st.text(max_size=300), a=st.text(max_size=200), b=st.text(max_size=200))
def test_equal_hash_at_a_block_means_equal_prefix_through_it(common: str, a: str, b: str) -> None:
    x, y = (common + a).encode(), (common + b).encode()
    hx, hy = prompt_hashes(x, "m", None, 8), prompt_hashes(y, "m", None, 8)
    shared = 0
    while shared < min(len(x), len(y)) and x[shared] == y[shared]:
        shared += 1
    for i in range(min(len(hx), len(hy))):
        assert (hx[i] == hy[i]) == ((i + 1) * 8 <= shared)


def test_only_whole_blocks_count_and_str_hashes_as_its_utf8() -> None:
    text = "ab€" * 40  # 200 bytes of UTF-8
    hashes = prompt_hashes(text, "m")
    assert len(hashes) == 200 // 64
    assert prompt_hashes(text + "xyz", "m").tolist() == hashes.tolist()  # still 3 whole blocks
    assert prompt_hashes(text.encode(), "m").tolist() == hashes.tolist()
    assert len(prompt_hashes("x" * 63, "m")) == 0


def test_model_salt_and_block_size_separate_every_block() -> None:
    text = "the same prompt " * 64
    base = prompt_hashes(text, "model-a").tolist()
    assert not set(base) & set(prompt_hashes(text, "model-b").tolist())
    assert not set(base) & set(prompt_hashes(text, "model-a", "salt").tolist())
    assert prompt_hashes(text, "model-a", "").tolist() == base  # an empty salt is no salt
    assert not set(base) & set(prompt_hashes(text, "model-a", None, 128).tolist())
    assert not set(prompt_hashes(text, "ab", "c").tolist()) & set(prompt_hashes(text, "a", "bc").tolist())


def test_order_matters_within_and_across_blocks() -> None:
    one, two = "A" * 64, "B" * 64
    assert prompt_hashes(one + two, "m")[1] != prompt_hashes(two + one, "m")[1]
    assert prompt_hashes("ab" * 32, "m")[0] != prompt_hashes("ba" * 32, "m")[0]
    assert prompt_hashes("abcdefgh" + "x" * 56, "m")[0] != prompt_hashes("efghabcd" + "x" * 56, "m")[0]


def test_the_cap_keeps_the_first_blocks() -> None:
    text = "0123456789" * 100
    full = prompt_hashes(text, "m", None, 64, 1000)
    assert prompt_hashes(text, "m", None, 64, 5).tolist() == full[:5].tolist()
    assert len(prompt_hashes(text, "m", None, 64, 0)) == 0
    default_blocks = prefix_index.DEFAULT_MAX_PREFIX_TOKENS // prefix_index.DEFAULT_BLOCK_SIZE_TOKENS
    assert len(prompt_hashes("x" * 64 * (default_blocks + 3), "m")) == default_blocks == 8192


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((123, "m"), TypeError, "prompt must be str or bytes"),
        (("p", None), TypeError, "model must be str"),
        (("p", "m", 5), TypeError, "cache_salt must be str or None"),
        (("p", "m", None, 6), ValueError, "block_chars must be a positive multiple of 4"),
        (("p", "m", None, 0), ValueError, "block_chars must be a positive multiple of 4"),
        (("p", "m", None, 64, -1), ValueError, "max_blocks must be an integer"),
    ],
)
def test_bad_hashing_arguments_get_a_clear_error(args: tuple, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        prompt_hashes(*args)


# --- the index against the reference ------------------------------------------------------------

# A family of prompts sharing prefixes: a few stems, each continued a few ways; with 4-byte
# blocks, the longer ones pass 64 blocks and take the sampled lookup path.
STEMS = st.lists(st.text("abc", min_size=0, max_size=180), min_size=1, max_size=4)
ENDPOINTS = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(70)]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[str], list[tuple]]:
    stems = draw(STEMS)
    prompts = [stem + draw(st.text("abc", max_size=140)) for stem in stems for _ in range(2)]
    endpoints = ENDPOINTS[: draw(st.sampled_from([1, 3, 8, 70]))]
    capacity = draw(st.sampled_from([1, 4, 20, 60, 500]))
    operation = st.one_of(
        st.tuples(st.just("add"), st.sampled_from(endpoints), st.integers(0, len(prompts) - 1)),
        st.tuples(st.just("remove"), st.sampled_from(endpoints)),
        st.tuples(st.just("capacity"), st.sampled_from(endpoints), st.sampled_from([1, 3, 30, 400])),
    )
    operations = draw(st.lists(operation, min_size=1, max_size=40))
    return capacity, prompts, operations


@pytest.mark.parametrize("whole_lookup_up_to", [64, 0])  # 0: every prompt takes the sampled path
@PROPERTY
@given(scenario=scenarios())
def test_the_index_matches_the_reference_across_adds_evictions_and_removals(whole_lookup_up_to: int, scenario: tuple) -> None:
    saved, prefix_index._FULL_LOOKUP = prefix_index._FULL_LOOKUP, whole_lookup_up_to
    try:
        check_against_reference(*scenario)
    finally:
        prefix_index._FULL_LOOKUP = saved


def check_against_reference(capacity: int, prompts: list[str], operations: list[tuple]) -> None:
    hashed = [prompt_hashes(p, "m", None, 4) for p in prompts]
    index, reference = PrefixIndex(capacity), ReferenceIndex(capacity)
    for op in operations:
        if op[0] == "add":
            hashes = hashed[op[2]]
            assert index.add(op[1], hashes) == reference.add(op[1], hashes.tolist())
        elif op[0] == "remove":
            assert index.remove(op[1]) == reference.remove(op[1])
        else:
            index.set_capacity(op[1], op[2])
            reference.set_capacity(op[1], op[2])
        for hashes in hashed:
            assert index.matches(hashes) == reference.matches(hashes.tolist())
        assert index.size == sum(len(lru) for lru in reference.lrus.values())
        assert {e: index.endpoint_size(e) for e in reference.lrus} == {e: len(v) for e, v in reference.lrus.items()}


# --- plain unit tests ----------------------------------------------------------------------------


def blocks(text: str) -> np.ndarray:
    return prompt_hashes(text, "m", None, 4)


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


def test_add_returns_what_was_held_and_counts_the_hit_ratio() -> None:
    index = PrefixIndex()
    h = blocks("x" * 80)  # 20 blocks
    assert index.add("a", h) == 0
    assert index.add("a", h) == 20
    assert index.add("b", h, count_hit=False) == 0
    assert index.stats.adds == 2 and index.stats.matched_blocks == 20 and index.stats.total_blocks == 40
    assert index.stats.hit_ratio == 0.5
    assert PrefixIndex().stats.hit_ratio == 0.0


def test_evictions_drop_the_least_recently_used_and_a_prompts_tail_first() -> None:
    index = PrefixIndex(10)
    first, second = blocks("a" * 24), blocks("b" * 24)  # 6 blocks each
    index.add("e", first)
    index.add("e", second)  # 12 > 10: the first prompt's last two blocks go
    assert index.matches(first) == {"e": 4}
    assert index.matches(second) == {"e": 6}
    index.add("e", first[:4])  # refresh: now the second prompt is the older one
    index.add("e", blocks("c" * 8))
    assert index.matches(second) == {"e": 4} and index.matches(first) == {"e": 4}
    assert index.size == index.endpoint_size("e") == 10


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
    index.set_capacity("e", 30)
    assert index.matches(h) == {"e": 30} and index.size == 30
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
    assert index.size == 0 and index.matches(h) == {} and len(index._table) == 0


def test_many_distinct_blocks_grow_the_table_and_stay_found() -> None:
    index = PrefixIndex(50_000)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(97, 123, 64 * 300, dtype=np.uint8).tobytes() for _ in range(40)]
    for i, prompt in enumerate(prompts):
        index.add(f"e{i % 4}", prompt_hashes(prompt, "m"))
    assert index.size == 40 * 300
    for i, prompt in enumerate(prompts):
        assert index.matches(prompt_hashes(prompt, "m")) == {f"e{i % 4}": 300}
    per_block = index.nbytes / index.size
    assert 12 < per_block < 12 + 16 / 0.5  # LRU entry + table slot at ≥ 50% load


@pytest.mark.parametrize(
    ("hashes", "error"),
    [
        ([-1, 2], TypeError),
        ([1.5], TypeError),
        (np.zeros((2, 2), dtype=np.uint64), ValueError),
    ],
)
def test_bad_hashes_get_a_clear_error(hashes: object, error: type[Exception]) -> None:
    index = PrefixIndex()
    with pytest.raises(error, match="hashes must be"):
        index.add("e", hashes)
    with pytest.raises(error, match="hashes must be"):
        index.matches(hashes)


def test_plain_int_lists_work_and_unhashable_endpoints_are_refused() -> None:
    index = PrefixIndex()
    index.add("e", [5, 6, 7])
    assert index.matches([5, 6, 9]) == {"e": 2}
    with pytest.raises(TypeError, match="endpoint must be hashable"):
        index.add(["not", "hashable"], [1])


def test_the_public_api() -> None:
    assert sorted(prefix_index.__all__) == [
        "CHARS_PER_TOKEN",
        "DEFAULT_BLOCK_SIZE_TOKENS",
        "DEFAULT_LRU_CAPACITY_PER_SERVER",
        "DEFAULT_MAX_PREFIX_TOKENS",
        "PrefixIndex",
        "PrefixIndexStats",
        "prompt_hashes",
    ]
