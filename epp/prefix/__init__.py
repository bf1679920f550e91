"""The prefix-cache index: prompt hashing and a per-pod index of the prompt blocks each pod holds.

A leaf library (it imports nothing else of epp: numpy, xxhash and the standard library only):
the prefix-cache producer plugins build on it. Its design is in the docstring of
:mod:`epp.prefix.index`, which says where each part lives.
"""

from epp.prefix.hashing import CHARS_PER_TOKEN, DEFAULT_BLOCK_SIZE_TOKENS, DEFAULT_MAX_PREFIX_TOKENS, prompt_hashes
from epp.prefix.index import DEFAULT_LRU_CAPACITY_PER_SERVER, PrefixIndex, PrefixIndexStats, PrefixLookup

__all__ = [
    "CHARS_PER_TOKEN",
    "DEFAULT_BLOCK_SIZE_TOKENS",
    "DEFAULT_LRU_CAPACITY_PER_SERVER",
    "DEFAULT_MAX_PREFIX_TOKENS",
    "PrefixIndex",
    "PrefixIndexStats",
    "PrefixLookup",
    "prompt_hashes",
]
