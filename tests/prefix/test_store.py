"""epp.prefix.store: the table grows with what is held, a step at a time, and stored ids stay
usable across a growth."""

from __future__ import annotations

import numpy as np
import pytest

from epp.prefix import PrefixIndex, prompt_hashes
from epp.prefix.store import SlotStore
from tests.prefix._helpers import blocks, mode
from tests.prefix._reference import ReferenceIndex


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


def distinct_keys(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.unique(rng.integers(1, 2**64, 2 * count, dtype=np.uint64, endpoint=False))[:count]


def test_stored_ids_resolve_across_a_growth_until_the_owner_restamps_them() -> None:
    store = SlotStore(1, 1024)
    keys = distinct_keys(600, 1)
    stored = store.tag(store.insert(keys, np.ones(2, dtype=np.uint64)))
    store.grow(5000, 1)  # a bigger table takes over; 600 keys move over in one go
    assert store.migrating and not store.moving
    assert (store.get(store.resolve(stored))[:, 0] == keys).all()  # old-parity ids still work
    stored = store.restamp(stored)
    store.drop_old()
    assert not store.migrating and (store.get(store.resolve(stored))[:, 0] == keys).all()


@pytest.mark.parametrize("owner_keeps_ids", [True, False])
def test_a_growth_that_cannot_wait_has_the_owner_rewrite_its_ids_first(owner_keeps_ids: bool) -> None:
    held: list[np.ndarray] = []
    calls: list[tuple[bool, bool]] = []

    def rewrite_ids() -> None:  # what an owner does: every stored id, rewritten for the current table
        calls.append((store.migrating, store.moving))
        held[:] = [store.restamp(ids) for ids in held]

    store = SlotStore(1, 1024, rewrite_ids=rewrite_ids if owner_keeps_ids else None)
    keys = distinct_keys(900, 2)
    held.append(store.tag(store.insert(keys[:600], np.ones(2, dtype=np.uint64))))
    store.grow(600, 1)  # no old table yet: no call
    assert store.migrating and not calls
    held.append(store.tag(store.insert(keys[600:], np.ones(2, dtype=np.uint64))))
    store.grow(5000, 2)  # the old table is still referenced: the owner rewrites, then it goes
    assert calls == ([(True, False)] if owner_keeps_ids else [])  # called once, every key moved by then
    assert store.words == 2 and store.epoch == 2 and store.live == 900
    if owner_keeps_ids:  # the ids rewritten then resolve through the table just made
        assert (store.get(store.resolve(np.concatenate(held)))[:, 0] == keys).all()
    assert (store.lookup(keys)[:, 0] == keys).all()
