"""What the prefix index's tests share: hypothesis settings, endpoint names, the module settings
each property test runs under, and short prompts of 4-byte blocks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from hypothesis import HealthCheck, settings

import epp.prefix.index as prefix_index
import epp.prefix.matching as prefix_matching
import epp.prefix.store as prefix_store
import epp.prefix.table as prefix_table
import epp.prefix.upkeep as prefix_upkeep
from epp.prefix import prompt_hashes

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ENDPOINTS = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(70)]


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


def blocks(text: str) -> np.ndarray:
    return prompt_hashes(text, "m", None, 4)
