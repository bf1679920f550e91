"""The paged KV cache of one simulated pod, with vLLM-style automatic prefix caching.

What is simulated
-----------------
* **Blocks.** GPU memory holds ``num_blocks`` KV blocks of ``block_size`` tokens (16, vLLM's default
  ``--block-size`` on CUDA). A request holds ``ceil(tokens / block_size)`` blocks for the tokens whose KV it
  keeps. Usage (``vllm:kv_cache_usage_perc``) is the fraction of blocks held by requests; blocks that only
  keep cached content count as free, as in vLLM.
* **Block hashes.** Block ``i`` of a sequence is identified by a chained hash: it depends on the tokens of
  block ``i``, on its position and, through a running sum, on every block before it, so a block matches only
  when the whole prefix up to it matches. The chain is seeded by the model name (base model or LoRA adapter:
  adapters never share KV with the base model). vLLM chains ``hash(parent_hash, block_tokens, extra_keys)``
  one block at a time; here every block's digest is computed at once with numpy, then chained with a
  cumulative sum, so hashing a 100k-token prompt costs well under a millisecond. Only full blocks get a hash.
* **Prefix cache.** Once a full block's KV has been computed its hash is registered; a later request whose
  prompt starts with the same blocks reuses them instead of computing them again. A block that nobody holds
  keeps its content and stays findable until its space is needed: free cached blocks form an LRU list, and
  a request's blocks are released tail first, so the end of a prompt is evicted before its beginning
  (vLLM's free-queue order). Empty blocks are handed out before any cached block is evicted (vLLM's free queue
  may evict a cached block while an empty one is still free; this only matters when the cache is nearly full).
* **Duplicates.** If two requests compute the same block at the same time, the second one to finish it
  adopts the already registered block and frees its own copy.
* **Events.** With a :class:`KVEventSink` (the pod's KV-event publisher), every block evicted to make
  room is announced at once as one ``BlockRemoved`` per block, in eviction order (vLLM's
  ``_maybe_evict_cached_block``: least recently used first, so a request's tail before its head),
  and :meth:`reset` as ``AllBlocksCleared``. New blocks are announced by the engine, which knows
  their tokens: :meth:`register` says whether a block is new to the cache (an adopted duplicate
  changes nothing an observer could see, so it is not announced).
* **Reset.** :meth:`reset` (vLLM's ``reset_prefix_cache``) empties the prefix cache only when no
  request holds a block, and otherwise changes nothing and returns False, as vLLM does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import xxhash

__all__ = ["BLOCK_SIZE", "KVCache", "KVEventSink", "block_hashes", "model_seed"]

BLOCK_SIZE = 16
"""Tokens per KV block: vLLM's default ``--block-size`` on CUDA."""

_MAX_BLOCK_SIZE = 256
# Per-lane multipliers of the block digest: fixed random odd 64-bit numbers (odd, so each lane is a bijection).
_LANES = np.random.default_rng(0x5EED).integers(0, 2**63, size=_MAX_BLOCK_SIZE, dtype=np.uint64) * np.uint64(2) + 1
_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: spreads block positions over 64 bits


def _mix64(x: np.ndarray) -> np.ndarray:
    # SplitMix64's finaliser: a bijection on 64-bit integers with full avalanche.
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def model_seed(model: str) -> int:
    """The hash-chain seed of a model (base model or adapter) name."""
    return xxhash.xxh3_64_intdigest(model.encode())


def block_hashes(tokens: np.ndarray, seed: int, block_size: int = BLOCK_SIZE) -> np.ndarray:
    """Chained hashes (``uint64``) of every full block of ``tokens``; ``seed`` comes from :func:`model_seed`."""
    if not 0 < block_size <= _MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in 1..{_MAX_BLOCK_SIZE}, got {block_size}")
    n = len(tokens) // block_size
    blocks = tokens[: n * block_size].reshape(n, block_size).astype(np.uint64)
    # Digest of each block's tokens and position; integer overflow wraps (arithmetic mod 2**64) by design.
    digest = (blocks * _LANES[:block_size]).sum(axis=1, dtype=np.uint64)
    digest = _mix64(digest ^ (np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN64))
    # The running sum chains block i to every block before it.
    return _mix64(np.cumsum(digest, dtype=np.uint64) ^ np.uint64(seed))


class KVEventSink(Protocol):
    """Where the cache announces what it drops (``epp.sim.kvevents.KVEventPublisher`` is one)."""

    def removed(self, block_hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class KVCache:
    """Block accounting and the prefix cache of one pod.

    Requests hold two kinds of blocks: *registered* blocks (a prefix of the request's blocks whose content is
    computed and hashed; they may be shared with other requests) and *unhashed* blocks (being filled, or the
    partial last block). Callers keep, per request, the hashes of its registered blocks and the count of its
    unhashed ones, and hand both back to :meth:`release`.
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, events: KVEventSink | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self._refs: dict[int, int] = {}  # hash -> number of requests holding the block, for every cached block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first
        self._unhashed_held = 0
        self.evictions = 0
        """Cached blocks evicted so far to make room."""

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return len(self._refs) - len(self._evictable) + self._unhashed_held

    @property
    def num_free(self) -> int:
        """Blocks not held by any request (empty, or holding evictable cached content)."""
        return self.num_blocks - self.num_used

    @property
    def num_cached(self) -> int:
        """Blocks whose content is registered in the prefix cache (held or evictable)."""
        return len(self._refs)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (``vllm:kv_cache_usage_perc``)."""
        return self.num_used / self.num_blocks

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this hash is in the prefix cache."""
        return block_hash in self._refs

    def count_hits(self, hashes: Sequence[int], limit: int) -> int:
        """How many of the first ``limit`` hashes are cached, counting from the start until the first miss."""
        refs = self._refs
        n = 0
        for h in hashes[:limit]:
            if h not in refs:
                break
            n += 1
        return n

    def admit(self, hashes: Sequence[int], n_hit: int, n_new: int) -> bool:
        """Hold the cached blocks ``hashes[:n_hit]`` and ``n_new`` empty blocks, or change nothing and
        return False if they do not fit."""
        refs = self._refs
        hits = hashes[:n_hit]
        # Pinning a block nobody holds takes it out of the free pool as well.
        pinned_from_free = sum(1 for h in hits if refs[h] == 0)
        if n_new + pinned_from_free > self.num_free:
            return False
        for h in hits:
            r = refs[h]
            if r == 0:
                del self._evictable[h]
            refs[h] = r + 1
        self._take(n_new)
        return True

    def grow(self, n: int) -> bool:
        """Hold ``n`` more empty blocks, evicting cached ones if needed; False (and no change) if they don't fit."""
        if n > self.num_free:
            return False
        self._take(n)
        return True

    def register(self, block_hash: int) -> bool:
        """One of the caller's unhashed blocks now holds computed content ``block_hash``; True if the
        block is new to the prefix cache (False: an equal block was cached, and is held instead)."""
        refs = self._refs
        r = refs.get(block_hash)
        self._unhashed_held -= 1
        if r is None:
            refs[block_hash] = 1
            return True
        # Someone computed the same block meanwhile: hold theirs, free ours.
        if r == 0:
            del self._evictable[block_hash]
        refs[block_hash] = r + 1
        return False

    def cached_hashes(self) -> set[int]:
        """Every block hash in the prefix cache (held or evictable)."""
        return set(self._refs)

    def reset(self) -> bool:
        """Empty the prefix cache (vLLM's ``reset_prefix_cache``); False, and nothing changed, while a
        request holds a block."""
        if self.num_used:
            return False
        self._refs.clear()
        self._evictable.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def release(self, hashes: Sequence[int], n_unhashed: int) -> None:
        """Drop a request's registered blocks (in sequence order) and its ``n_unhashed`` other blocks."""
        self._unhashed_held -= n_unhashed
        refs = self._refs
        evictable = self._evictable
        for h in reversed(hashes):  # tail first: the end of a sequence is evicted before its start
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                evictable[h] = None

    def _take(self, n: int) -> None:
        empty = self.num_blocks - len(self._refs) - self._unhashed_held
        events = self.events
        for _ in range(n - empty):
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
            self.evictions += 1
            if events is not None:
                events.removed([h])
        self._unhashed_held += n
