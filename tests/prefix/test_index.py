"""epp.prefix.index against deliberately simple references: a per-block Python loop for the
hashes, and plain lists and dicts implementing the documented generation policy for the index."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import epp.prefix
import epp.prefix.index as prefix_index
import epp.prefix.matching as prefix_matching
import epp.prefix.store as prefix_store
import epp.prefix.table as prefix_table
import epp.prefix.upkeep as prefix_upkeep
from epp.prefix import PrefixIndex, PrefixLookup, prompt_hashes
from epp.prefix.hashing import DEFAULT_BLOCK_SIZE_TOKENS, DEFAULT_MAX_PREFIX_TOKENS

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
    seed = xxhash.xxh3_64_intdigest(b"epp.prefix.index/v1\x00" + block_chars.to_bytes(4, "little"))
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
        out.append((total + seed) & M64 or 1)  # 0 is reserved
    return out


class ReferenceIndex:
    """The documented policy, one block at a time: per endpoint, up to three generations (lists
    of blocks in entry order, oldest first, the last the current one)."""

    def __init__(self, capacity: int) -> None:
        self.default = capacity
        self.gens: dict[str, list[list[int]]] = {}
        self.where: dict[str, dict[int, list[int]]] = {}  # block -> the generation (list) holding it
        self.capacities: dict[str, int] = {}

    def _endpoint(self, endpoint: str, capacity: int | None = None) -> None:
        if endpoint not in self.gens:
            self.gens[endpoint] = [[]]
            self.where[endpoint] = {}
            self.capacities[endpoint] = self.default if capacity is None else capacity

    def held(self, endpoint: str) -> int:
        return len(self.where.get(endpoint, {}))

    def add(self, endpoint: str, hashes: list[int]) -> int:
        self._endpoint(endpoint)
        capacity, gens, where = self.capacities[endpoint], self.gens[endpoint], self.where[endpoint]
        h = hashes[:capacity]
        matched = 0
        for block in h:
            if block not in where:
                break
            matched += 1
        if not h:
            return matched
        cur = gens[-1]
        entering = sum(1 for block in h if where.get(block) is not cur)
        closed = len(gens) - 1
        if cur and (len(cur) + entering > capacity or (len(cur) >= -(-capacity // 3) and closed < 2)):
            if closed == 2:
                for block in h:  # the prompt's blocks leave the two closed generations...
                    gen = where.get(block)
                    if gen is not None and gen is not cur:
                        gen.remove(block)
                        cur.append(block)
                        where[block] = cur
                for gen in gens[:-1]:  # ...which are then dropped
                    for block in gen:
                        del where[block]
                del gens[:-1]
            cur = []
            gens.append(cur)
        for block in h:
            gen = where.get(block)
            if gen is not cur:
                if gen is not None:
                    gen.remove(block)
                cur.append(block)
                where[block] = cur
        gens[:-1] = [gen for gen in gens[:-1] if gen]
        if len(where) > capacity:
            self._evict(endpoint, capacity - capacity // 16, current_too=False)
        return matched

    def _evict(self, endpoint: str, target: int, current_too: bool) -> None:
        gens, where = self.gens[endpoint], self.where[endpoint]
        while len(where) > target:
            gen = gens[0]
            if gen is gens[-1]:
                while current_too and len(where) > target:
                    del where[gen.pop()]
                return
            while len(where) > target and gen:
                del where[gen.pop()]  # the block that entered it last
            if not gen:
                gens.pop(0)

    def set_capacity(self, endpoint: str, capacity: int) -> None:
        if endpoint not in self.gens:
            self._endpoint(endpoint, capacity)
            return
        self.capacities[endpoint] = capacity
        if len(self.where[endpoint]) > capacity:
            self._evict(endpoint, capacity - capacity // 16, current_too=True)

    def remove(self, endpoint: str) -> bool:
        self.capacities.pop(endpoint, None)
        self.where.pop(endpoint, None)
        return self.gens.pop(endpoint, None) is not None

    def matches(self, hashes: list[int]) -> dict[str, int]:
        found = {}
        for endpoint, where in self.where.items():
            held = 0
            for block in hashes:
                if block not in where:
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
    default_blocks = DEFAULT_MAX_PREFIX_TOKENS // DEFAULT_BLOCK_SIZE_TOKENS
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
STEMS = st.lists(st.text("abc", min_size=8, max_size=240), min_size=1, max_size=4)
ENDPOINTS = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(70)]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[str], list[tuple]]:
    stems = draw(STEMS)
    prompts = [stem + draw(st.text("abc", max_size=160)) for stem in stems for _ in range(2)]
    endpoints = ENDPOINTS[: draw(st.sampled_from([1, 3, 8, 70]))]
    capacity = draw(st.sampled_from([1, 4, 20, 60, 500]))
    # (add, endpoint, prompt, look it up first as the plugin does: add() then reuses the lookup)
    add = st.tuples(st.just("add"), st.sampled_from(endpoints), st.integers(0, len(prompts) - 1), st.booleans())
    operation = st.one_of(
        add,
        add,
        add,
        st.tuples(st.just("remove"), st.sampled_from(endpoints)),
        st.tuples(st.just("capacity"), st.sampled_from(endpoints), st.sampled_from([1, 3, 30, 400])),
    )
    operations = draw(st.lists(operation, min_size=8, max_size=60))
    return capacity, prompts, operations


# Module settings per run: the default; every prompt sampled (none looked up whole); a table that
# starts tiny, warms its next table 512 bytes a step, moves one key a step and rewrites three list
# entries a step, so that growth, moves and id translation happen mid-scenario; and buckets of
# 7-14 usable slots, so that keys spill (and come back) and a full spill bucket forces growth.
MODES = {
    "default": {},
    "sampled": {(prefix_matching, "_FULL_LOOKUP"): 0},
    # hints kept for two first blocks only, one run end each: they go stale and get evicted
    "few hints": {
        (prefix_matching, "_FULL_LOOKUP"): 0,
        (prefix_matching, "_RECENT_PROMPTS"): 2,
        (prefix_matching, "_RECENT_ENDS"): 1,
    },
    "migrating": {
        (prefix_index, "_INITIAL_SLOTS"): 1,
        (prefix_upkeep, "_REWRITE_AT_ONCE"): 0,
        (prefix_upkeep, "_REWRITE_STEP"): 3,
        (prefix_table, "_SMALL_TABLE"): 0,
        (prefix_store, "_SMALL"): 0,
        (prefix_store, "_STEP_KEYS"): 1,
        (prefix_store, "_WARM_WORDS"): 64,
    },
    "spilling": {
        (prefix_index, "_INITIAL_SLOTS"): 1,
        (prefix_table, "_MIN_SLOTS"): 8,
        (prefix_table, "_MAX_SLOTS"): 15,
        (prefix_store, "_STEP_KEYS"): 8,
        (prefix_table, "_SMALL_TABLE"): 0,
        (prefix_store, "_SMALL"): 0,
    },
}


@contextmanager
def mode(name: str) -> Iterator[None]:
    saved = {key: getattr(*key) for key in MODES[name]}
    for (module, attribute), value in MODES[name].items():
        setattr(module, attribute, value)
    try:
        yield
    finally:
        for (module, attribute), value in saved.items():
            setattr(module, attribute, value)


@pytest.mark.parametrize("name", list(MODES))
@PROPERTY
@given(scenario=scenarios())
def test_the_index_matches_the_reference_across_adds_evictions_and_removals(name: str, scenario: tuple) -> None:
    with mode(name):
        check_against_reference(*scenario)


def check_against_reference(
    capacity: int, prompts: list[str], operations: list[tuple], check_every: int = 1, old_lookups: bool = False
) -> None:
    """Run the operations on both; compare every prompt's matches and the sizes after each
    ``check_every``-th operation (and the prompt just added after each add). With
    ``old_lookups``, an add not preceded by a lookup gets the last one made of its prompt."""
    hashed = [prompt_hashes(p, "m", None, 4) for p in prompts]
    index, reference = PrefixIndex(capacity), ReferenceIndex(capacity)
    last_lookup: dict[int, PrefixLookup] = {}
    for step, op in enumerate(operations, 1):
        if op[0] == "add":
            hashes = hashed[op[2]]
            lookup = last_lookup.get(op[2]) if old_lookups else None
            if op[3]:
                lookup = last_lookup[op[2]] = index.lookup(hashes)
                assert lookup.matches == reference.matches(hashes.tolist())
            assert index.add(op[1], hashes, lookup=lookup) == reference.add(op[1], hashes.tolist())
            assert index.matches(hashes) == reference.matches(hashes.tolist())
        elif op[0] == "remove":
            assert index.remove(op[1]) == reference.remove(op[1])
        else:
            index.set_capacity(op[1], op[2])
            reference.set_capacity(op[1], op[2])
        if step % check_every and step != len(operations):
            continue
        for hashes in hashed:
            assert index.matches(hashes) == reference.matches(hashes.tolist())
        assert index.size == sum(len(where) for where in reference.where.values())
        assert {e: index.endpoint_size(e) for e in reference.where} == {e: len(w) for e, w in reference.where.items()}
        assert index._store.live == len(set().union(*reference.where.values()))  # no block left behind
        assert all(index.capacity(e) == c for e, c in reference.capacities.items())


def random_workload(seed: int) -> tuple[int, list[str], list[tuple]]:
    """A longer scenario than hypothesis draws by itself: a few families of prompts sharing
    prefixes, hundreds of operations (mostly adds), enough blocks and endpoints for the table to
    grow and to need a second mask word."""
    rng = random.Random(seed)
    endpoints = ENDPOINTS[: rng.choice([1, 3, 8, 70])]
    capacity = rng.choice([4, 20, 60, 200, 500])

    def text(low: int, high: int) -> str:
        return "".join(rng.choice("abcd") for _ in range(rng.randint(low, high)))

    families = [text(20, 400) for _ in range(rng.randint(2, 6))]
    prompts = [family + text(0, 200) for family in families for _ in range(4)]
    operations: list[tuple] = []
    for _ in range(300):
        draw, endpoint = rng.random(), rng.choice(endpoints)
        if draw < 0.85:
            operations.append(("add", endpoint, rng.randrange(len(prompts)), rng.random() < 0.5))
        elif draw < 0.93:
            operations.append(("capacity", endpoint, rng.choice([2, 10, capacity, 3 * capacity])))
        else:
            operations.append(("remove", endpoint))
    return capacity, prompts, operations


@pytest.mark.parametrize("name", list(MODES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32))
def test_long_workloads_match_the_reference(name: str, seed: int) -> None:
    with mode(name):
        check_against_reference(*random_workload(seed), check_every=25)


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


def test_add_returns_what_was_held_and_counts_the_hit_ratio() -> None:
    index = PrefixIndex()
    h = blocks("x" * 80)  # 20 blocks
    assert index.add("a", h) == 0
    assert index.add("a", h) == 20
    assert index.add("b", h, count_hit=False) == 0
    assert index.stats.adds == 2 and index.stats.matched_blocks == 20 and index.stats.total_blocks == 40
    assert index.stats.hit_ratio == 0.5
    assert PrefixIndex().stats.hit_ratio == 0.0


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
    assert 4 < per_block < 4 + 24 / 0.5  # list entry + a slot (24 bytes) at ≥ 50% load
    assert 0.5 < index._store.live / index._store.usable < 0.9


def test_a_table_that_grows_moves_its_keys_a_step_at_a_time() -> None:
    with mode("migrating"):  # warming 512 bytes, moving 1 key, rewriting 3 list entries a step
        index, reference = PrefixIndex(10_000), ReferenceIndex(10_000)
        prompts = [blocks(f"{i:04d}" * 60) for i in range(40)]  # 60 blocks each, all distinct
        for i, hashes in enumerate(prompts):
            assert index.add(f"e{i % 3}", hashes) == reference.add(f"e{i % 3}", hashes.tolist())
        assert index._store.busy
        steps = 0
        while index._store.busy:  # the remaining steps, as later updates would run them
            index._maintain()
            steps += 1
            if steps % 50 == 0:
                assert all(index.matches(h) == reference.matches(h.tolist()) for h in prompts)
        assert 100 < steps < 100_000 and index._store.epoch >= 2
        assert all(index.matches(h) == reference.matches(h.tolist()) for h in prompts)


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


def test_hash_value_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="nonzero"):
        PrefixIndex().add("e", [3, 0, 1])
    assert prompt_hashes("a" * 64, "m").all()


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
    assert sorted(epp.prefix.__all__) == [
        "CHARS_PER_TOKEN",
        "DEFAULT_BLOCK_SIZE_TOKENS",
        "DEFAULT_LRU_CAPACITY_PER_SERVER",
        "DEFAULT_MAX_PREFIX_TOKENS",
        "PrefixIndex",
        "PrefixIndexStats",
        "PrefixLookup",
        "prompt_hashes",
    ]


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


# --- a lookup, then an add -----------------------------------------------------------------------


def runs_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every prompt the index matches from now on (in this test)."""
    sizes: list[int] = []
    runs = prefix_matching.Matcher.runs

    def counted(self: prefix_matching.Matcher, h: np.ndarray) -> tuple:
        sizes.append(h.size)
        return runs(self, h)

    monkeypatch.setattr(prefix_matching.Matcher, "runs", counted)
    return sizes


def test_add_reuses_a_fresh_lookup_instead_of_matching_again(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PrefixIndex(100)
    system = blocks("S" * 400)  # 100 blocks: the sampled path
    index.add("a", system)
    index.add("b", system[:40])
    matched = runs_counted(monkeypatch)
    h = blocks("S" * 400 + "q" * 80)  # 120 blocks
    lookup = index.lookup(h)
    assert lookup.matches == index.matches(h) == {"a": 100, "b": 40} and lookup.hashes is h
    assert len(matched) == 2
    assert index.add("b", h, lookup=lookup) == 40
    assert len(matched) == 2  # no match of its own
    index.set_capacity("c", 50)  # registering an endpoint changes nothing held: still fresh
    lookup = index.lookup(h)
    assert index.add("c", h, lookup=lookup) == 0  # capacity 50: the lookup's runs cut to 50 blocks
    assert len(matched) == 3
    assert index.matches(h) == {"a": 100, "b": 100, "c": 50}
    # The same hashes as another array (or a list) are the same prompt.
    lookup = index.lookup(h)
    assert index.add("a", list(h), lookup=lookup) == 100 and len(matched) == 5
    # Without a lookup, add() looks the prompt up itself (even right after a match of it).
    index.matches(h)
    assert index.add("a", h) == 100 and len(matched) == 7


def test_add_never_reuses_a_stale_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PrefixIndex(100)
    h = blocks("z" * 320)  # 80 blocks
    matched = runs_counted(monkeypatch)
    before = index.lookup(h)  # nothing held yet: no match at all
    assert before.matches == {} and not matched
    assert index.add("a", h) == 0
    # Reusing `before` would find nothing held and insert every block a second time.
    assert index.add("a", h, lookup=before) == 80
    assert matched == [80]
    assert index.matches(h) == {"a": 80} and index.size == 80 and index._store.live == 80
    stale = index.lookup(h)  # {"a": 80}
    assert index.remove("a")
    # "b" gets the bit "a" had: reusing `stale` would credit it with a's 80 blocks.
    assert index.add("b", h, lookup=stale) == 0
    stale = index.lookup(h)  # {"b": 80}
    index.set_capacity("b", 50)  # evicts down to 47
    assert index.add("b", h, lookup=stale) == 47
    assert index.matches(h) == {"b": 50} and index.size == 50


def test_a_lookup_belongs_to_its_index_and_its_hashes() -> None:
    index, other = PrefixIndex(), PrefixIndex()
    h = blocks("x" * 100)
    index.add("a", h)
    with pytest.raises(ValueError, match="another PrefixIndex"):
        other.add("a", h, lookup=index.lookup(h))
    with pytest.raises(ValueError, match="other hashes"):
        index.add("a", h[:10], lookup=index.lookup(h))
    assert index.size == 25 and other.size == 0


@pytest.mark.parametrize("name", list(MODES))
@PROPERTY
@given(scenario=scenarios())
def test_adds_given_old_lookups_match_the_reference(name: str, scenario: tuple) -> None:
    """Each add gets the lookup last made of its prompt: just made, or older, fresh or stale."""
    with mode(name):
        check_against_reference(*scenario, old_lookups=True)
