"""The prefix-cache index: which endpoint most likely holds a prompt's prefix in its KV-cache.

This is the engine under the ``approx-prefix-cache-producer`` and ``prefix-cache-scorer``
plugins: it remembers which prompt blocks were sent to which endpoint and, for a new prompt,
answers "how many leading blocks of it does each endpoint hold?", in tens of microseconds for an
8k-token prompt against 64 full endpoints, so it is never a reason to turn affinity off.

Hashing (:func:`prompt_hashes`)
-------------------------------
The prompt's UTF-8 bytes are cut into blocks of ``block_chars`` bytes (upstream: blockSizeTokens
× 4, default 64); only whole blocks count, and at most ``max_blocks`` of them. Block *i*'s 64-bit
hash is ``h[i] = S + Σ (a[2j] + K[2j]) · (a[2j+1] + K[2j+1]) mod 2**64`` over the 32-bit words
``a`` of blocks 0..i (each keyed word is taken mod 2**32, the product exactly in 64 bits: UMAC's
NH), where ``K`` is a fixed pseudo-random key per word position (splitmix64 of the position) and
``S`` a seed hashed (xxh3) from the block size, the model name and ``cache_salt``. So ``h[i] =
h[i-1] + mix(block i)``: a chain, where equal hashes at block *i* mean equal model, salt, block size
and bytes through block *i* (but for a rare accident: NH pairs collide with odds ≤ 2**-32 for a
random key), and the per-position keys make swapped words or blocks hash differently. It is two
numpy passes over the words and one cumulative sum, with no Python loop. It is no cryptographic
hash (nor is upstream's xxhash): a client who crafts a collision only misroutes its own request's
affinity; the model server salts its real cache itself.

Index (:class:`PrefixIndex`)
----------------------------
Each endpoint has an LRU of at most ``capacity`` block hashes (upstream's lruCapacityPerServer,
31,250 by default, settable per endpoint for autoTune). ``add(endpoint, hashes)`` runs after each
pick: it touches the prompt's blocks — refreshing those held, inserting the others — and evicts the
least recently used past capacity. Within one add, block 0 counts as the most recent and the last
block as the least (upstream touches them in prompt order, the other way round), so an endpoint
sheds a prompt's tail before its head, as vLLM does. That also makes every endpoint's set
*prefix-closed*: a block is only ever touched together with all the blocks before it, each of
which gets a newer stamp, so an endpoint holding ``h[i]`` holds ``h[0..i-1]``. Matching relies on
it: the endpoints holding ``h[i]`` can only shrink as *i* grows, so one lookup of about √n sampled
blocks finds, for each endpoint, the gap between two samples where its run ends, and a second
lookup of just those gaps' blocks finds the exact end. O(√n) lookups instead of n, in two
vectorised calls; a prompt of at most 64 blocks is looked up whole in one.

Storage: one global table, hash → bitmask of the endpoints holding it (:mod:`epp._prefix_table`),
answers lookups; per endpoint, its hashes sorted (uint64) with a uint32 recency stamp each, for
refreshes (binary search) and evictions (the oldest stamps; a sorted batch of the 1024 oldest is
kept, so an eviction rarely scans the whole LRU). Memory is bounded by the capacities: 12 bytes per
(endpoint, block) plus about 16 bytes / 0.8 load per distinct block: ≈ 62 MiB for 64 endpoints ×
31,250 blocks when no two endpoints share a block (the worst case), less when they do.

Not thread-safe: one event loop owns an index (and the hashing scratch buffers).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

from epp._prefix_table import MaskTable

__all__ = [
    "CHARS_PER_TOKEN",
    "DEFAULT_BLOCK_SIZE_TOKENS",
    "DEFAULT_LRU_CAPACITY_PER_SERVER",
    "DEFAULT_MAX_PREFIX_TOKENS",
    "PrefixIndex",
    "PrefixIndexStats",
    "prompt_hashes",
]

# Upstream's defaults (GIE / llm-d approximate prefix cache plugin).
CHARS_PER_TOKEN = 4  # upstream's averageCharactersPerToken: the prompt is not tokenized
DEFAULT_BLOCK_SIZE_TOKENS = 16  # vLLM's default KV-cache block size
DEFAULT_MAX_PREFIX_TOKENS = 131072  # 128K tokens: the context window of large production models
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250  # ≈ 500K tokens of KV-cache (8B model, 80 GB GPU) / 16

_U64 = np.uint64
_EMPTY = np.empty(0, dtype=_U64)
_EMPTY.flags.writeable = False
_SEED_DOMAIN = b"epp.prefix_index/v1\x00"

# --- hashing ---------------------------------------------------------------------------------

_keys = np.empty(0, dtype=np.uint32)  # K[j], grown on demand; the same values for every block size
_keyed = np.empty(0, dtype=np.uint32)  # scratch: the keyed 32-bit words
_sums = np.empty(0, dtype=_U64)  # scratch: the pair products, then their running sums


def _position_keys(count: int) -> np.ndarray:
    """K[0..count): the low halves of splitmix64 of the word position, fixed forever."""
    z = (np.arange(1, count + 1, dtype=_U64) * _U64(0x9E3779B97F4A7C15)) ^ _U64(0x243F6A8885A308D3)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return (z ^ (z >> _U64(31))).astype(np.uint32)


def _ensure_words(count: int) -> None:
    """Keys and scratch for ``count`` 32-bit words (an even number)."""
    global _keys, _keyed, _sums
    if count > _keys.size:
        size = max(count, 2 * _keys.size, 8192)
        _keys = _position_keys(size)
        _keyed = np.empty(size, dtype=np.uint32)
        _sums = np.empty(size // 2, dtype=_U64)


@lru_cache(maxsize=4096)
def _seed(block_chars: int, model: str, cache_salt: str | None) -> np.uint64:
    seed = xxhash.xxh3_64_intdigest(_SEED_DOMAIN + block_chars.to_bytes(4, "little"))
    seed = xxhash.xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"), seed)
    if cache_salt:  # upstream: an empty salt is no salt
        seed = xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8", "surrogatepass"), seed)
    return _U64(seed)


def prompt_hashes(
    prompt: str | bytes,
    model: str,
    cache_salt: str | None = None,
    block_chars: int = DEFAULT_BLOCK_SIZE_TOKENS * CHARS_PER_TOKEN,
    max_blocks: int = DEFAULT_MAX_PREFIX_TOKENS // DEFAULT_BLOCK_SIZE_TOKENS,
) -> np.ndarray:
    """The chained 64-bit hashes of the prompt's whole blocks: a uint64 array of length
    ``min(len(prompt's UTF-8 bytes) // block_chars, max_blocks)``.

    ``block_chars`` is blockSizeTokens × :data:`CHARS_PER_TOKEN` (so a multiple of 4);
    ``max_blocks`` is maxPrefixTokensToMatch // blockSizeTokens. ``prompt`` may come encoded.
    """
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "surrogatepass")
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        data = prompt
    else:
        raise TypeError(f"prompt must be str or bytes, not {type(prompt).__name__}")
    if not isinstance(model, str):
        raise TypeError(f"model must be str, not {type(model).__name__}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be str or None, not {type(cache_salt).__name__}")
    if type(block_chars) is not int or block_chars <= 0 or block_chars % 4:
        raise ValueError(f"block_chars must be a positive multiple of 4, got {block_chars!r}")
    if type(max_blocks) is not int or max_blocks < 0:
        raise ValueError(f"max_blocks must be an integer ≥ 0, got {max_blocks!r}")
    n = min(len(data) // block_chars, max_blocks)
    if n == 0:
        return _EMPTY
    per_block = block_chars // 4  # 32-bit words per block
    words = np.frombuffer(data, dtype="<u4", count=n * per_block)
    if per_block % 2:  # blockSizeTokens odd: pad each block with a zero word, to whole pairs
        padded = np.zeros((n, per_block + 1), dtype=np.uint32)
        padded[:, :per_block] = words.reshape(n, per_block)
        words, per_block = padded.reshape(-1), per_block + 1
    _ensure_words(words.size)
    keyed = _keyed[: words.size]
    np.add(words, _keys[: words.size], out=keyed)  # mod 2**32
    sums = _sums[: words.size // 2]
    np.multiply(keyed[0::2], keyed[1::2], out=sums, dtype=_U64)  # exact 32×32 → 64-bit products
    np.add.accumulate(sums, out=sums)
    pairs = per_block // 2
    return sums[pairs - 1 :: pairs] + _seed(block_chars, model, cache_salt)


# --- the index -------------------------------------------------------------------------------

_STAMP_LIMIT = 1 << 32  # recency stamps are uint32; renumbered (order kept) before they wrap
_OLDEST_BATCH = 1024  # evictions served from one partition of an LRU's stamps
_FULL_LOOKUP = 64  # prompts of at most this many blocks are looked up whole, not sampled


@dataclass(frozen=True, slots=True)
class PrefixIndexStats:
    """Counters since the index was made, from the ``add`` calls: what the endpoint already held."""

    adds: int  # add() calls counted (count_hit=True)
    matched_blocks: int  # blocks the endpoint already held, consecutively from the first
    total_blocks: int  # blocks offered

    @property
    def hit_ratio(self) -> float:
        """matched / total blocks (0 before any block was offered)."""
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0


class _Lru:
    """One endpoint's blocks: hashes sorted, each with its last-touch stamp (higher = newer)."""

    __slots__ = ("name", "bit", "capacity", "keys", "stamps", "clock", "old_keys", "old_stamps", "old_next")

    def __init__(self, name: Hashable, bit: int, capacity: int) -> None:
        self.name = name
        self.bit = bit
        self.capacity = capacity
        self.keys = _EMPTY
        self.stamps = np.empty(0, dtype=np.uint32)
        self.clock = 0  # the next stamp
        # The oldest entries as of the last scan, oldest first. An entry there whose stamp is
        # unchanged is still older than every entry not there.
        self.old_keys = _EMPTY
        self.old_stamps = self.stamps
        self.old_next = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.stamps.nbytes + self.old_keys.nbytes + self.old_stamps.nbytes


def _as_hashes(hashes: Iterable[int] | np.ndarray) -> np.ndarray:
    if type(hashes) is np.ndarray and hashes.dtype == _U64 and hashes.ndim == 1:
        return hashes if hashes.flags.c_contiguous else np.ascontiguousarray(hashes)
    array = np.asarray(hashes if isinstance(hashes, np.ndarray) else list(hashes))
    if array.ndim != 1:
        raise ValueError(f"hashes must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return _EMPTY
    if array.dtype.kind not in "iu" or (array.dtype.kind == "i" and (array < 0).any()):
        raise TypeError(f"hashes must be unsigned 64-bit integers, got {array.dtype} values")
    return np.ascontiguousarray(array, dtype=_U64)


@lru_cache(maxsize=256)
def _samples(n: int) -> tuple[np.ndarray, list[int]]:
    """Block positions to look up first for an n-block prompt: every √n-th, and the last."""
    positions = np.arange(0, n, max(2, math.isqrt(n)))
    if positions[-1] != n - 1:
        positions = np.append(positions, n - 1)
    positions.flags.writeable = False
    return positions, positions.tolist()


def _as_ints(masks: np.ndarray) -> list[int]:
    """Rows of (rows, W) uint64 masks as Python ints (bit 64·w + b is word w's bit b)."""
    if masks.shape[1] == 1:
        return masks.reshape(-1).tolist()
    data = masks.astype("<u8", copy=False).tobytes()
    width = 8 * masks.shape[1]
    return [int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)]


def _bits(mask: int) -> Iterator[int]:
    """The set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Per-endpoint LRUs of prompt block hashes, and the longest prefix each endpoint holds.

    Endpoints are any hashable names (the datastore's endpoint names). An endpoint appears on its
    first :meth:`add` or :meth:`set_capacity` and leaves on :meth:`remove`.
    """

    def __init__(self, default_capacity: int = DEFAULT_LRU_CAPACITY_PER_SERVER) -> None:
        self.default_capacity = _check_capacity(default_capacity)
        self._table = MaskTable()
        self._lrus: dict[Hashable, _Lru] = {}
        self._by_bit: list[_Lru | None] = []
        self._free_bits: list[int] = []
        self._size = 0
        self._adds = self._matched = self._offered = 0

    # --- what it holds -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Block hashes held, summed over endpoints (upstream's prefix_indexer_size)."""
        return self._size

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes of the index's numpy arrays: the hash table and every endpoint's LRU."""
        return self._table.nbytes + sum(lru.nbytes for lru in self._lrus.values())

    @property
    def stats(self) -> PrefixIndexStats:
        return PrefixIndexStats(self._adds, self._matched, self._offered)

    def endpoints(self) -> list[Hashable]:
        return list(self._lrus)

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._lrus

    def endpoint_size(self, endpoint: Hashable) -> int:
        """Blocks the endpoint holds (0 for an unknown endpoint)."""
        lru = self._lrus.get(endpoint)
        return 0 if lru is None else lru.keys.size

    def capacity(self, endpoint: Hashable) -> int:
        """The endpoint's capacity in blocks (the default for an unknown endpoint)."""
        lru = self._lrus.get(endpoint)
        return self.default_capacity if lru is None else lru.capacity

    # --- matching ----------------------------------------------------------------------------

    def matches(self, hashes: np.ndarray | Iterable[int]) -> dict[Hashable, int]:
        """Every endpoint holding the prompt's first block, with how many leading blocks it holds.

        ``hashes`` is the output of :func:`prompt_hashes` (or a prefix of it). Upstream's score is
        this count divided by ``len(hashes)``.
        """
        h = _as_hashes(hashes)
        n = h.size
        if n == 0 or self._size == 0:
            return {}
        lookup = self._table.lookup
        positions: Sequence[int]
        if n <= _FULL_LOOKUP:
            positions, held = range(n), _as_ints(lookup(h))
        else:
            sampled, positions = _samples(n)
            held = _as_ints(lookup(h[sampled]))
        alive = held[0]
        if not alive:
            return {}
        # The holders only shrink along the prompt: find the sample where each endpoint drops out.
        gaps: list[tuple[int, int]] = []  # (sample index, endpoints that dropped out there)
        for k in range(1, len(held)):
            dropped = alive & ~held[k]
            if dropped:
                gaps.append((k, dropped))
                alive ^= dropped
                if not alive:
                    break
        by_bit = self._by_bit
        found = {by_bit[bit].name: n for bit in _bits(alive)}
        if not gaps:
            return found
        # Each of those runs ends in the gap before its sample: look all such gaps up at once.
        spans = [(positions[k - 1] + 1, positions[k], dropped) for k, dropped in gaps]
        if len(spans) == 1:
            between = h[spans[0][0] : spans[0][1]]
        else:
            between = np.concatenate([h[start:end] for start, end, _ in spans])
        inside = _as_ints(lookup(between)) if between.size else []
        offset = 0
        for start, end, dropped in spans:
            for j, mask in enumerate(inside[offset : offset + end - start]):
                gone = dropped & ~mask
                if gone:
                    for bit in _bits(gone):
                        found[by_bit[bit].name] = start + j
                    dropped ^= gone
                    if not dropped:
                        break
            for bit in _bits(dropped):  # held through the gap, not at the sample that ends it
                found[by_bit[bit].name] = end
            offset += end - start
        return found

    def match(self, hashes: np.ndarray | Iterable[int], endpoints: Sequence[Hashable]) -> list[int]:
        """For each of ``endpoints``, how many leading blocks of the prompt it holds."""
        found = self.matches(hashes)
        return [found.get(endpoint, 0) for endpoint in endpoints]

    # --- updates -----------------------------------------------------------------------------

    def add(self, endpoint: Hashable, hashes: np.ndarray | Iterable[int], *, count_hit: bool = True) -> int:
        """Record that the prompt with these block hashes was sent to ``endpoint``.

        Touches the blocks (block 0 the most recent), inserting those the endpoint does not hold
        and evicting its least recently used blocks past its capacity; a prompt longer than the
        capacity keeps its first ``capacity`` blocks. ``hashes`` must be the output of
        :func:`prompt_hashes` or a prefix of it (matching relies on adds of whole prefixes).
        Returns how many leading blocks the endpoint already held, and counts it in :attr:`stats`
        unless ``count_hit`` is false (for a second endpoint of one request, e.g. a prefill pod).
        """
        h = _as_hashes(hashes)
        lru = self._lru(endpoint) or self._new_lru(endpoint, self.default_capacity)
        offered = h.size
        if offered > lru.capacity:
            h = h[: lru.capacity]
        n = h.size
        matched = 0
        if n:
            if lru.clock + n >= _STAMP_LIMIT:
                _renumber(lru)
            first = lru.clock
            stamps = np.arange(first + n - 1, first - 1, -1, dtype=np.int64).astype(np.uint32)
            lru.clock += n
            size = lru.keys.size
            if size:
                at = np.searchsorted(lru.keys, h)
                np.minimum(at, size - 1, out=at)
                held = lru.keys[at] == h
                matched = n if held.all() else int(held.argmin())
                lru.stamps[at[held]] = stamps[held]
                fresh = ~held
                new_keys, new_stamps = h[fresh], stamps[fresh]
            else:
                new_keys, new_stamps = h, stamps
            if new_keys.size:
                order = np.argsort(new_keys)
                new_keys, new_stamps = new_keys[order], new_stamps[order]
                if new_keys.size > 1:
                    distinct = np.empty(new_keys.size, dtype=bool)
                    distinct[0] = True
                    np.not_equal(new_keys[1:], new_keys[:-1], out=distinct[1:])
                    if not distinct.all():
                        new_keys, new_stamps = new_keys[distinct], new_stamps[distinct]
                excess = size + new_keys.size - lru.capacity
                if excess > 0:
                    self._evict(lru, excess, below=first)
                at = np.searchsorted(lru.keys, new_keys)
                lru.keys = np.insert(lru.keys, at, new_keys)
                lru.stamps = np.insert(lru.stamps, at, new_stamps)
                self._size += new_keys.size
                self._table.set_bit(new_keys, lru.bit)
        if count_hit:
            self._adds += 1
            self._matched += matched
            self._offered += offered
        return matched

    def set_capacity(self, endpoint: Hashable, capacity: int) -> None:
        """Set the endpoint's capacity in blocks (autoTune: its ``num_gpu_blocks``), evicting its
        least recently used blocks past it."""
        capacity = _check_capacity(capacity)
        lru = self._lru(endpoint)
        if lru is None:
            self._new_lru(endpoint, capacity)
            return
        lru.capacity = capacity
        if lru.keys.size > capacity:
            self._evict(lru, lru.keys.size - capacity, below=lru.clock)

    def remove(self, endpoint: Hashable) -> bool:
        """Forget the endpoint and everything it held; False when it was not known."""
        lru = self._lrus.pop(endpoint, None)
        if lru is None:
            return False
        self._table.clear_bit(lru.keys, lru.bit)
        self._size -= lru.keys.size
        self._by_bit[lru.bit] = None
        heapq.heappush(self._free_bits, lru.bit)
        return True

    # --- internals ---------------------------------------------------------------------------

    def _lru(self, endpoint: Hashable) -> _Lru | None:
        try:
            return self._lrus.get(endpoint)
        except TypeError:
            raise TypeError(f"endpoint must be hashable, got {type(endpoint).__name__}") from None

    def _new_lru(self, endpoint: Hashable, capacity: int) -> _Lru:
        if self._free_bits:
            bit = heapq.heappop(self._free_bits)
        else:
            bit = len(self._by_bit)
            self._by_bit.append(None)
            if bit >= 64 * self._table.words:
                self._table.widen(self._table.words + 1)
        lru = _Lru(endpoint, bit, capacity)
        self._by_bit[bit] = lru
        self._lrus[endpoint] = lru
        return lru

    def _evict(self, lru: _Lru, count: int, below: int) -> None:
        """Drop the endpoint's ``count`` least recently used blocks, all stamped before ``below``.

        During an add, ``below`` is the add's first stamp: the blocks it just refreshed are never
        the ones to go, and must stay out of the batch of oldest too, since the blocks it is about
        to insert get older stamps than theirs.
        """
        while count > 0:
            if lru.old_next >= lru.old_keys.size:
                _scan_oldest(lru, count, below)
                if not lru.old_keys.size:
                    raise RuntimeError("prefix index: nothing left to evict")  # a bug, never bad input
            window = lru.old_next + 2 * count + 64  # check a few more than needed, not the whole batch
            keys = lru.old_keys[lru.old_next : window]
            at = np.searchsorted(lru.keys, keys)
            np.minimum(at, lru.keys.size - 1, out=at)
            still_oldest = (lru.keys[at] == keys) & (lru.stamps[at] == lru.old_stamps[lru.old_next : window])
            taken = np.cumsum(still_oldest)
            end = int(np.searchsorted(taken, count)) + 1 if taken[-1] >= count else keys.size
            lru.old_next += end
            gone = np.sort(keys[:end][still_oldest[:end]])
            count -= gone.size
            at = np.searchsorted(lru.keys, gone)
            lru.keys = np.delete(lru.keys, at)
            lru.stamps = np.delete(lru.stamps, at)
            self._size -= gone.size
            self._table.clear_bit(gone, lru.bit)


def _check_capacity(capacity: int) -> int:
    if type(capacity) is not int or capacity < 1:
        raise ValueError(f"capacity must be an integer ≥ 1 (blocks), got {capacity!r}")
    return capacity


def _scan_oldest(lru: _Lru, at_least: int, below: int) -> None:
    """Refill the endpoint's batch of oldest entries with its max(at_least, 1024) oldest,
    leaving out any stamped ``below`` or later."""
    size = lru.keys.size
    count = min(size, max(at_least, _OLDEST_BATCH))
    chosen = np.argpartition(lru.stamps, count - 1)[:count] if count < size else np.arange(size)
    chosen = chosen[np.argsort(lru.stamps[chosen])]
    chosen = chosen[: np.searchsorted(lru.stamps[chosen], below)]
    lru.old_keys = lru.keys[chosen]
    lru.old_stamps = lru.stamps[chosen]
    lru.old_next = 0


def _renumber(lru: _Lru) -> None:
    """Stamps 0..size-1 in the same order, before the uint32 clock would wrap."""
    order = np.argsort(lru.stamps)
    lru.stamps[order] = np.arange(order.size, dtype=np.uint32)
    lru.clock = order.size
    lru.old_keys, lru.old_stamps, lru.old_next = _EMPTY, lru.stamps[:0], 0
