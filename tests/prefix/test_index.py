"""epp.prefix.index against the plain reference (tests/prefix/_reference.py), in every module
setting of tests/prefix/_helpers.py; its public interface, and the lookup an add can reuse."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import epp.prefix
import epp.prefix.matching as prefix_matching
from epp.prefix import PrefixIndex, PrefixLookup, prompt_hashes
from tests.prefix._helpers import ENDPOINTS, MODES, PROPERTY, blocks, mode
from tests.prefix._reference import ReferenceIndex

# --- the index against the reference ------------------------------------------------------------

# A family of prompts sharing prefixes: a few stems, each continued a few ways; with 4-byte
# blocks, the longer ones pass 64 blocks and take the sampled lookup path.
STEMS = st.lists(st.text("abc", min_size=8, max_size=240), min_size=1, max_size=4)


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


def test_add_returns_what_was_held_and_counts_the_hit_ratio() -> None:
    index = PrefixIndex()
    h = blocks("x" * 80)  # 20 blocks
    assert index.add("a", h) == 0
    assert index.add("a", h) == 20
    assert index.add("b", h, count_hit=False) == 0
    assert index.stats.adds == 2 and index.stats.matched_blocks == 20 and index.stats.total_blocks == 40
    assert index.stats.hit_ratio == 0.5
    assert PrefixIndex().stats.hit_ratio == 0.0


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
