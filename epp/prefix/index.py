"""The prefix-cache index: which endpoint most likely holds a prompt's prefix in its KV-cache.

This is the engine under the ``approx-prefix-cache-producer`` and ``prefix-cache-scorer``
plugins: it remembers which prompt blocks were sent to which endpoint and, for a new prompt,
answers "how many leading blocks of it does each endpoint hold?" (10-30 µs for an 8k-token
prompt against 64 full endpoints, hashing included), and records each pick on the request path (an
:meth:`PrefixIndex.add` of an 8k-token prompt costs microseconds when the endpoint already holds
it, tens when it brings new blocks). Neither is a reason to turn affinity off.

Hashing (:func:`prompt_hashes`)
-------------------------------
The prompt's UTF-8 bytes are cut into blocks of ``block_chars`` bytes (upstream: blockSizeTokens
× 4, default 64); only whole blocks count, and at most ``max_blocks`` of them. Block *i*'s 64-bit
hash is ``h[i] = S + Σ (a[2j] + K[2j]) · (a[2j+1] + K[2j+1]) mod 2**64`` over the 32-bit words
``a`` of blocks 0..i (each keyed word is taken mod 2**32, the product exactly in 64 bits: UMAC's
NH), where ``K`` is a fixed pseudo-random key per word position (splitmix64 of the position) and
``S`` a seed hashed (xxh3) from the block size, the model name and ``cache_salt``; a hash that
comes out 0 is replaced by 1 (the index reserves 0). So ``h[i] = h[i-1] + mix(block i)``: a
chain, where equal hashes at block *i* mean equal model, salt, block size and bytes through block
*i* (but for a rare accident: NH pairs collide with odds ≤ 2**-32 for a random key), and the
per-position keys make swapped words or blocks hash differently. It is one pass over the words
in C (``epp/prefix/_native.c``; about 4 µs for an 8k-token prompt, where the same sum as numpy passes
took 14). It is no cryptographic hash (nor is upstream's
xxhash): a client who crafts a collision only misroutes its own request's affinity; the model
server salts its real cache itself.

What an endpoint holds: three generations, not an exact LRU
-----------------------------------------------------------
Each endpoint holds at most ``capacity`` blocks (upstream's lruCapacityPerServer, 31,250 by
default, settable per endpoint for autoTune), grouped in up to three *generations*, oldest first;
the newest is the *current* one, and every held block is in exactly one. ``add(endpoint,
hashes)`` records a pick; with ``C`` the capacity and ``h`` the first ``C`` hashes:

1. The result is how many leading blocks of ``h`` the endpoint held.
2. If the current generation holds blocks and either cannot take ``h``'s blocks it lacks without
   passing ``C``, or holds at least ``⌈C/3⌉`` while fewer than two closed generations exist, it
   is *closed* and a new, empty current generation opens. If two closed generations already
   exist at that moment, both are dropped first, except for ``h``'s blocks in them (which move
   to the generation being closed); they hold fewer blocks than ``h`` brings, all of which an
   eviction in step 4 would have removed anyway.
3. ``h``'s blocks, first to last, move into the current generation (those not already in it are
   appended to its *entry order*; those in an older one leave it).
4. If the endpoint now holds more than ``C`` blocks, it evicts down to ``C − ⌊C/16⌋`` (a batch,
   so that evictions come once every few adds): from the oldest closed generation first, the
   block that entered it last first, never from the current generation. A closed generation
   is dropped as soon as it holds no block.

``set_capacity`` evicts the same way down to ``C − ⌊C/16⌋`` when the endpoint holds more than
its new ``C``, going on into the current generation (last entered first) if need be.

How it differs from an exact LRU, and why. An exact LRU needs a recency stamp per (endpoint,
block) that each touch updates and each eviction searches; kept as numpy arrays per endpoint,
each add copied those arrays (milliseconds at 31,250 blocks). Here the per-(endpoint, block)
state is a 2-bit generation code stored beside the block hash, and an endpoint's generations are
lists of slot ids: an add writes codes and appends ids, an eviction pops ids off a list. The
approximations: blocks are ordered by generation, and within the oldest one the most recently
*entered* go first (not the least recently used; entering first is what keeps the sets
prefix-closed, below); and evictions come in batches of C/16, so an endpoint holds between
``C − C/16`` and ``C`` blocks once full. Every block of the oldest generation is older than every
block of the newer ones, so a block touched within the last two generations' worth of traffic
is never evicted. In simulations of shared system prompts, many prompt families and multi-turn
sessions, hit ratios stay within 0.01 of an exact LRU's. Upstream touches blocks in prompt order
within an add; here the prompt's first block is the freshest, so an endpoint sheds a prompt's
tail before its head, as vLLM does.

Matching relies on the result: every endpoint's set is *prefix-closed* (holding ``h[i]`` means
holding ``h[0..i-1]``). A block is only ever touched together with all blocks before it, which
then sit in the same or a newer generation, and within a generation a block enters no later than
the blocks after it, so an eviction (last entered first) never removes a block before its
extensions. So the endpoints holding ``h[i]`` can only shrink as *i* grows: one lookup of about
√n sampled blocks finds, for each endpoint, the gap between two samples where its run ends, and
a second lookup of just those gaps' blocks finds the exact end. O(√n) lookups instead of n, in two
vectorised calls; a prompt of at most 64 blocks is looked up whole in one.

Most runs end where the prompt parts from one sent before: after a family's shared system
prompt, or where a conversation's previous turn ended. So the index keeps, for each first block
(of the last 1,024 added), the length of the last prompt added that started with it and up to
four run ends that matches of such prompts found twice running (an end found once may be a
one-off); the first lookup takes the blocks on either side of each of those along with the
samples. A run that ends at one of them is then known
exactly, and only runs that end elsewhere need the second lookup. A prompt whose first block is
not among them most likely starts where no endpoint holds anything, and is sampled four times
more sparsely (every 4√n-th block: fewer keys, and a new key's buckets are cache misses). None
of this can make a count wrong: hints and spacing only choose which blocks are looked up first.

Storage, and what things cost
-----------------------------
One hash table of slots (:mod:`epp.prefix.table`), each a block hash and every endpoint's 2-bit
code for it (two uint64 planes, 64 endpoints a word). Slots never move while held, so an
endpoint's generations are uint32 lists of slot ids and an eviction clears its bits with one
scatter. An add looks the prompt up like a match (skipped when it follows :meth:`matches` of
the same hashes array with nothing changed in between, as the plugin's match-pick-add does),
reads the endpoint's code at its last held block (if that block is in the current generation,
all of the held prefix is: prefix-closure again), and then writes only what changes: codes of
blocks that move in, new slots for blocks nobody held, ids appended. So re-adding a held prompt
costs a few microseconds, and 512 new blocks one vectorised insert of 512 keys.

Memory is bounded by the capacities: the table is sized for what is held, never more than the
sum of the endpoints' capacities at 88% load, so a full index of 64 endpoints × 31,250 blocks
that share nothing (the worst case) takes 2.36 million slots of 24 bytes (56.6 MB) plus 4 bytes
per (endpoint, block) of lists: ≈ 62 MiB; less when endpoints share blocks. More than 64
endpoints need a second mask word per plane (40 bytes a slot). The table grows, in either
dimension, without stalling the request path: the next table is allocated and its pages touched
a bounded piece per update (first touches of fresh memory are slow), then the keys move over a
few hundred per update, then each endpoint's lists are rewritten a bounded piece per update;
lookups meanwhile consult both tables. Registering an endpoint (the plugin does it when a pod
joins the pool) is what starts this when its bit needs a wider table, so its first add finds the
table ready.

Not thread-safe: one event loop owns an index (and the hashing scratch buffers).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

from epp.prefix import _native
from epp.prefix.store import SlotStore
from epp.prefix.table import bits as _bits
from epp.prefix.table import holder_masks

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
_SEED_DOMAIN = b"epp.prefix.index/v1\x00"

# --- hashing ---------------------------------------------------------------------------------

_keys = np.empty(0, dtype=np.uint32)  # K[j], grown on demand; the same values for every block size


def _position_keys(count: int) -> np.ndarray:
    """K[0..count): the low halves of splitmix64 of the word position, fixed forever."""
    z = (np.arange(1, count + 1, dtype=_U64) * _U64(0x9E3779B97F4A7C15)) ^ _U64(0x243F6A8885A308D3)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return (z ^ (z >> _U64(31))).astype(np.uint32)


def _ensure_keys(count: int) -> None:
    """Keys for ``count`` 32-bit word positions."""
    global _keys
    if count > _keys.size:
        _keys = _position_keys(max(count, 2 * _keys.size, 8192))


@lru_cache(maxsize=4096)
def _seed(block_chars: int, model: str, cache_salt: str | None) -> int:
    seed = xxhash.xxh3_64_intdigest(_SEED_DOMAIN + block_chars.to_bytes(4, "little"))
    seed = xxhash.xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"), seed)
    if cache_salt:  # upstream: an empty salt is no salt
        seed = xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8", "surrogatepass"), seed)
    return seed


def prompt_hashes(
    prompt: str | bytes,
    model: str,
    cache_salt: str | None = None,
    block_chars: int = DEFAULT_BLOCK_SIZE_TOKENS * CHARS_PER_TOKEN,
    max_blocks: int = DEFAULT_MAX_PREFIX_TOKENS // DEFAULT_BLOCK_SIZE_TOKENS,
) -> np.ndarray:
    """The chained 64-bit hashes of the prompt's whole blocks: a uint64 array of length
    ``min(len(prompt's UTF-8 bytes) // block_chars, max_blocks)``, never containing 0.

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
    _ensure_keys(n * (per_block + per_block % 2))
    out = np.empty(n, dtype=_U64)
    _native.chain(data, block_chars, n, _keys, _seed(block_chars, model, cache_salt), out)
    return out


# --- the index -------------------------------------------------------------------------------

_DENSE = 1.0  # a prompt whose first block was seen lately is sampled every _DENSE·√n blocks,
_SPARSE = 4.0  # one whose first block was not (most likely held nowhere) every _SPARSE·√n
_FULL_LOOKUP = 64  # prompts of at most this many blocks are looked up whole, not sampled
_GENERATIONS = 3  # the 2-bit code per (endpoint, block): 0 = not held, 1-3 = a generation
_EVICT_BATCH = 16  # an endpoint over capacity evicts down to capacity − capacity // 16
_INITIAL_SLOTS = 1024  # the table's first size; it grows with the blocks held
_REWRITE_AT_ONCE = 65536  # list entries rewritten in one go after a migration (else in steps of:)
_REWRITE_STEP = 8192
_RECENT_PROMPTS = 1024  # first blocks whose recent prompts' lengths and run ends the index keeps as hints
_RECENT_ENDS = 4  # run ends kept per first block


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


class _Generation:
    """Slot ids (uint32, with the table parity bit) in entry order; ``live``: how many of them
    are still this generation's (the others moved to a newer one)."""

    __slots__ = ("code", "ids", "size", "live", "clean")

    def __init__(self, code: int) -> None:
        self.code = code
        self.ids = np.empty(0, dtype=np.uint32)
        self.size = 0
        self.live = 0
        self.clean = 0  # while lists are being rewritten after a migration: entries done

    def append(self, stored: np.ndarray) -> None:
        end = self.size + stored.size
        if end > self.ids.size:
            grown = np.empty(max(end, self.ids.size + self.ids.size // 2, 64), dtype=np.uint32)
            grown[: self.size] = self.ids[: self.size]
            self.ids = grown
        self.ids[self.size : end] = stored
        self.size = end

    def compact(self) -> None:
        """Give back list room once most entries are gone (amortised: halving at most)."""
        if self.ids.size > 1024 and self.size < self.ids.size // 4:
            self.ids = self.ids[: max(self.size * 2, 64)].copy()

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes


class _Endpoint:
    __slots__ = ("name", "bit", "word", "flag", "capacity", "gens", "held")

    def __init__(self, name: Hashable, bit: int, capacity: int) -> None:
        self.name = name
        self.bit = bit
        self.word, shift = divmod(bit, 64)
        self.flag = _U64(1 << shift)
        self.capacity = capacity
        self.gens = [_Generation(1)]  # oldest first; the last is the current one
        self.held = 0

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gens)


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


@lru_cache(maxsize=512)
def _samples(n: int, spacing: float) -> tuple[np.ndarray, list[int]]:
    """Block positions to look up first for an n-block prompt: every (spacing·√n)-th, and the last."""
    positions = np.arange(0, n, max(2, int(spacing * math.sqrt(n))))
    if positions[-1] != n - 1:
        positions = np.append(positions, n - 1)
    positions.flags.writeable = False
    return positions, positions.tolist()


class _Seen:
    """The rows a match looked up: at ``positions`` (samples, or every block), at ``hints``
    (their rows follow the samples' in ``rows``), and in the gaps ``spans`` ((start, end, _)
    block ranges, concatenated in ``gap_rows``)."""

    __slots__ = ("positions", "hints", "rows", "spans", "gap_rows")

    def __init__(self, positions: Sequence[int], hints: Sequence[int], rows: np.ndarray) -> None:
        self.positions = positions
        self.hints = hints
        self.rows = rows
        self.spans: list[tuple[int, int, int]] = []
        self.gap_rows: np.ndarray | None = None

    def row(self, position: int) -> np.ndarray | None:
        """The row looked up for this block position, if it was."""
        at = bisect_left(self.positions, position)
        if at < len(self.positions) and self.positions[at] == position:
            return self.rows[at]
        if position in self.hints:
            return self.rows[len(self.positions) + self.hints.index(position)]
        offset = 0
        for start, end, _ in self.spans:
            if start <= position < end:
                return self.gap_rows[offset + position - start]
            offset += end - start
        return None


def _narrow(spans: list[tuple[int, int, int]], hints: list[int], masks: list[int]) -> list[tuple[int, int, int]]:
    """Split each span at the hinted blocks inside it (``masks``: who holds each): an endpoint
    of the span that lacks a hinted block ends at or before it, one that holds it after it."""
    narrowed = []
    for start, end, dropped in spans:
        at = bisect_left(hints, start)
        while at < len(hints) and hints[at] < end:
            gone = dropped & ~masks[at]
            if gone:
                narrowed.append((start, hints[at], gone))
                dropped ^= gone
                if not dropped:
                    break
            start = hints[at] + 1
            at += 1
        if dropped:
            narrowed.append((start, end, dropped))
    return narrowed


class _Recent:
    """Where runs of prompts that start with one block are likely to end: the length of the last
    such prompt added (its endpoint holds it whole: the run of a prompt that goes on from it, as
    a conversation's next turn does, ends there) and ends that recent matches of such prompts
    found more than once (most recent first; where a family's prompts part, e.g. after a shared
    system prompt).
    Lookups include the blocks on either side of each, so a run ending there needs no second."""

    __slots__ = ("added", "ends", "seen", "_for")

    def __init__(self, added: int) -> None:
        self.added = added
        self.ends: list[int] = []
        self.seen = 0  # the last end seen that is not a hint yet
        self._for: tuple[int, list[int], np.ndarray] | None = None  # the last hints made, for n blocks

    def hints(self, n: int) -> tuple[list[int], np.ndarray]:
        """Block positions to look up for an n-block prompt, in sorted order, after the samples:
        each likely end's last block and the block after it; and the samples and those positions
        as one index array (empty lists when there are none)."""
        made = self._for
        if made is not None and made[0] == n:
            return made[1], made[2]
        hints = []
        for end in (self.added, *self.ends):
            if 0 < end < n:
                hints.append(end - 1)
                hints.append(end)
        if len(hints) > 2:
            hints = sorted(set(hints))
        sampled, positions = _samples(n, _DENSE)
        self._for = n, hints, np.array(positions + hints, dtype=np.intp) if hints else sampled
        return self._for[1], self._for[2]

    def learn(self, ends: Iterable[int], n: int) -> None:
        """Runs of an n-block prompt ended at ``ends``. An end becomes a hint, first in
        :attr:`ends`, when it is found twice running (no other new end found in between); one
        already there moves first. (An end found once may be a one-off, a prompt parting
        somewhere new: not worth two keys of every lookup.)"""
        known = self.ends
        for end in set(ends):  # endpoints whose runs end together are one sighting
            if end >= n or end == self.added:
                continue
            if end in known:
                if known[0] != end:
                    known.remove(end)
                    known.insert(0, end)
            elif end == self.seen:
                if len(known) == _RECENT_ENDS:
                    known.pop()
                known.insert(0, end)
                self._for = None
            else:
                self.seen = end

    def added_blocks(self, blocks: int) -> None:
        if blocks != self.added:
            self.added = blocks
            self._for = None


def _check_capacity(capacity: int) -> int:
    if type(capacity) is not int or capacity < 1:
        raise ValueError(f"capacity must be an integer ≥ 1 (blocks), got {capacity!r}")
    return capacity


class PrefixIndex:
    """Per-endpoint generations of prompt block hashes, and the longest prefix each endpoint holds.

    Endpoints are any hashable names (the datastore's endpoint names). An endpoint appears on its
    first :meth:`add` or :meth:`set_capacity` and leaves on :meth:`remove`.
    """

    def __init__(self, default_capacity: int = DEFAULT_LRU_CAPACITY_PER_SERVER) -> None:
        self.default_capacity = _check_capacity(default_capacity)
        self._store = SlotStore(1, _INITIAL_SLOTS, rewrite_ids=self._rewrite_ids)
        self._endpoints: dict[Hashable, _Endpoint] = {}
        self._by_bit: list[_Endpoint | None] = []
        self._free_bits: list[int] = []
        self._size = 0
        self._capacities = 0
        self._adds = self._matched = self._offered = 0
        self._version = 0  # bumped by every change to what endpoints hold
        self._memo: tuple[object, int, dict[int, int], _Seen | None] | None = None  # the last match, for add()
        self._values: dict[tuple[int, int, int], np.ndarray] = {}  # (word, code, words) -> a new slot's planes
        self._rewrite: list[_Endpoint] = []  # endpoints whose lists still hold old-table ids
        self._rewrite_epoch = 0  # the migration that list was made for
        self._next_unspill = 0  # the version at which to try emptying the spill bucket again
        self._words_wanted = 1  # mask words the endpoints' bits need
        self._recent: OrderedDict[int, _Recent] = OrderedDict()  # by first block hash, least recent first

    # --- what it holds -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Block hashes held, summed over endpoints (upstream's prefix_indexer_size)."""
        return self._size

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes of the index's numpy arrays: the hash table(s) and every endpoint's lists."""
        return self._store.nbytes + sum(ep.nbytes for ep in self._endpoints.values())

    @property
    def stats(self) -> PrefixIndexStats:
        return PrefixIndexStats(self._adds, self._matched, self._offered)

    def endpoints(self) -> list[Hashable]:
        return list(self._endpoints)

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._endpoints

    def endpoint_size(self, endpoint: Hashable) -> int:
        """Blocks the endpoint holds (0 for an unknown endpoint)."""
        ep = self._endpoints.get(endpoint)
        return 0 if ep is None else ep.held

    def capacity(self, endpoint: Hashable) -> int:
        """The endpoint's capacity in blocks (the default for an unknown endpoint)."""
        ep = self._endpoints.get(endpoint)
        return self.default_capacity if ep is None else ep.capacity

    # --- matching ----------------------------------------------------------------------------

    def matches(self, hashes: np.ndarray | Iterable[int]) -> dict[Hashable, int]:
        """Every endpoint holding the prompt's first block, with how many leading blocks it holds.

        ``hashes`` is the output of :func:`prompt_hashes` (or a prefix of it). Upstream's score is
        this count divided by ``len(hashes)``.
        """
        h = _as_hashes(hashes)
        runs, seen = self._runs(h)
        self._memo = (hashes, self._version, runs, seen)
        by_bit = self._by_bit
        return {by_bit[bit].name: count for bit, count in runs.items()}

    def match(self, hashes: np.ndarray | Iterable[int], endpoints: Sequence[Hashable]) -> list[int]:
        """For each of ``endpoints``, how many leading blocks of the prompt it holds."""
        found = self.matches(hashes)
        return [found.get(endpoint, 0) for endpoint in endpoints]

    def _held(self, keys: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The table rows of the keys, and for each key the mask of endpoints holding it."""
        rows = self._store.lookup(keys)
        return rows, holder_masks(rows)

    def _runs(self, h: np.ndarray) -> tuple[dict[int, int], _Seen | None]:
        """Endpoint bit → leading blocks of ``h`` held, for every endpoint holding ``h[0]``; and
        the rows looked up on the way (add() reads an endpoint's code at its last block there)."""
        n = h.size
        if n == 0 or self._size == 0:
            return {}, None
        positions: Sequence[int]
        hints: list[int] = []
        recent = None
        if n <= _FULL_LOOKUP:
            positions = range(n)
            rows, held = self._held(h)
        else:
            recent = self._recent.get(int(h[0]))
            if recent is None:
                sampled, positions = _samples(n, _SPARSE)
            else:
                hints, sampled = recent.hints(n)
                positions = _samples(n, _DENSE)[1]
            rows, held = self._held(h.take(sampled))
        seen = _Seen(positions, hints, rows)
        alive = held[0]
        if not alive:
            return {}, seen
        # The holders only shrink along the prompt: find the sample where each endpoint drops out.
        spans: list[tuple[int, int, int]] = []  # (first block, end block, endpoints that dropped out)
        k = 0
        for mask in held[: len(positions)] if hints else held:
            dropped = alive & ~mask
            if dropped:
                spans.append((positions[k - 1] + 1, positions[k], dropped))
                alive ^= dropped
                if not alive:
                    break
            k += 1
        found = dict.fromkeys(_bits(alive), n) if alive else {}
        if spans:
            if hints:  # split the spans at the hinted blocks: often down to the exact ends
                spans = _narrow(spans, hints, held[len(positions) :])
            self._resolve(h, spans, seen, found)
            if recent is not None:
                recent.learn(found.values(), n)
        return found, seen

    def _resolve(self, h: np.ndarray, spans: list[tuple[int, int, int]], seen: _Seen, found: dict[int, int]) -> None:
        """Find where each span's endpoints' runs end: a span (start, end, endpoints) holds
        endpoints that hold ``h[start-1]`` and lack ``h[end]``; one lookup of all the spans'
        blocks tells where in between (an empty span needs none)."""
        open_spans = []
        for span in spans:
            if span[0] < span[1]:
                open_spans.append(span)
            else:
                for bit in _bits(span[2]):
                    found[bit] = span[1]
        if not open_spans:
            return
        if len(open_spans) == 1:
            between = h[open_spans[0][0] : open_spans[0][1]]
        else:
            between = np.concatenate([h[start:end] for start, end, _ in open_spans])
        seen.gap_rows, inside = self._held(between)
        seen.spans = open_spans
        offset = 0
        for start, end, dropped in open_spans:
            j = start
            for mask in inside[offset : offset + end - start]:
                gone = dropped & ~mask
                if gone:
                    for bit in _bits(gone):
                        found[bit] = j
                    dropped ^= gone
                    if not dropped:
                        break
                j += 1
            for bit in _bits(dropped):  # held through the span, not at the block that ends it
                found[bit] = end
            offset += end - start

    def _remember(self, first: int, blocks: int) -> None:
        """A prompt of ``blocks`` blocks starting with the block hashed ``first`` was added."""
        recent = self._recent.get(first)
        if recent is None:
            self._recent[first] = _Recent(blocks)
            if len(self._recent) > _RECENT_PROMPTS:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(first)
            recent.added_blocks(blocks)

    # --- updates -----------------------------------------------------------------------------

    def add(self, endpoint: Hashable, hashes: np.ndarray | Iterable[int], *, count_hit: bool = True) -> int:
        """Record that the prompt with these block hashes was sent to ``endpoint``.

        Moves the blocks into the endpoint's current generation (the first block the freshest),
        inserting those it does not hold, and evicts past its capacity (see the module
        docstring); a prompt longer than the capacity keeps its first ``capacity`` blocks.
        ``hashes`` must be the output of :func:`prompt_hashes` or a prefix of it: distinct,
        nonzero, and added whole (matching relies on it). Returns how many leading blocks the
        endpoint already held, and counts it in :attr:`stats` unless ``count_hit`` is false (for
        a second endpoint of one request, e.g. a prefill pod).
        """
        h = _as_hashes(hashes)
        if h.size and not h.all():
            raise ValueError("hashes must be nonzero (0 is reserved), as prompt_hashes makes them")
        ep = self._endpoint(endpoint) or self._new_endpoint(endpoint, self.default_capacity)
        offered = h.size
        if offered > ep.capacity:
            h = h[: ep.capacity]
        n = h.size
        matched = 0
        if n:
            memo = self._memo
            if memo is not None and memo[0] is hashes and memo[1] == self._version:
                runs, seen = memo[2], memo[3]
                if n < offered:
                    runs = {bit: min(count, n) for bit, count in runs.items()}
            else:
                runs, seen = self._runs(h)
            matched = runs.get(ep.bit, 0)
            self._record(ep, h, matched, max(runs.values(), default=0), seen)
            if n > _FULL_LOOKUP:
                self._remember(int(h[0]), n)
            self._version += 1
            self._maintain()
        if count_hit:
            self._adds += 1
            self._matched += matched
            self._offered += offered
        return matched

    def set_capacity(self, endpoint: Hashable, capacity: int) -> None:
        """Set the endpoint's capacity in blocks (autoTune: its ``num_gpu_blocks``), evicting
        down to ``capacity − capacity // 16`` when it holds more (see the module docstring)."""
        capacity = _check_capacity(capacity)
        ep = self._endpoint(endpoint)
        if ep is None:
            self._new_endpoint(endpoint, capacity)
            return
        if capacity == ep.capacity:
            return
        self._capacities += capacity - ep.capacity
        self._store.capacity_hint = self._capacities
        ep.capacity = capacity
        if ep.held > capacity:
            self._evict(ep, capacity - capacity // _EVICT_BATCH, current_too=True)
            self._version += 1
            self._maintain()

    def remove(self, endpoint: Hashable) -> bool:
        """Forget the endpoint and everything it held; False when it was not known."""
        ep = self._endpoints.pop(endpoint, None)
        if ep is None:
            return False
        for gen in ep.gens:
            self._evict_generation(ep, gen, gen.live)
        self._by_bit[ep.bit] = None
        heapq.heappush(self._free_bits, ep.bit)
        self._capacities -= ep.capacity
        self._store.capacity_hint = self._capacities
        self._version += 1
        self._maintain()
        return True

    # --- internals: endpoints ------------------------------------------------------------------

    def _endpoint(self, endpoint: Hashable) -> _Endpoint | None:
        try:
            return self._endpoints.get(endpoint)
        except TypeError:
            raise TypeError(f"endpoint must be hashable, got {type(endpoint).__name__}") from None

    def _new_endpoint(self, endpoint: Hashable, capacity: int) -> _Endpoint:
        if self._free_bits:
            bit = heapq.heappop(self._free_bits)
        else:
            bit = len(self._by_bit)
            self._by_bit.append(None)
        self._capacities += capacity
        self._store.capacity_hint = self._capacities
        if bit >= 64 * self._words_wanted:  # a wider table: prepared now, in use at its first add
            self._words_wanted = bit // 64 + 1
            self._maintain()
        ep = _Endpoint(endpoint, bit, capacity)
        self._by_bit[bit] = ep
        self._endpoints[endpoint] = ep
        return ep

    def _columns(self, ep: _Endpoint) -> np.ndarray:
        words = self._store.words
        return np.array([1 + ep.word, 1 + words + ep.word], dtype=np.intp)

    def _codes(self, rows: np.ndarray, ep: _Endpoint, offset: int = 1) -> np.ndarray:
        """The endpoint's generation code (0 = not held) in each row (planes from ``offset``)."""
        c0 = offset + ep.word
        c1 = c0 + self._store.words
        shift = _U64(ep.bit % 64)
        return ((rows[:, c0] >> shift) & _U64(1)) | (((rows[:, c1] >> shift) & _U64(1)) << _U64(1))

    def _pattern(self, ep: _Endpoint, code: int) -> np.ndarray:
        """The endpoint's two plane bits for ``code``, at its word in each plane."""
        return np.array([ep.flag if code & 1 else 0, ep.flag if code & 2 else 0], dtype=_U64)

    def _set_code(self, ep: _Endpoint, ids: np.ndarray, code: int) -> None:
        """Write the endpoint's code at these current-table slots."""
        columns = self._columns(ep)
        planes = self._store.get_planes(ids, columns)
        planes &= ~ep.flag
        planes |= self._pattern(ep, code)
        self._store.put_planes(ids, columns, planes)

    # --- internals: add ------------------------------------------------------------------------

    def _record(self, ep: _Endpoint, h: np.ndarray, m: int, top: int, seen: _Seen | None) -> None:
        """Steps 2-4 of add: ``ep`` holds h[0..m); some endpoint holds h[0..top), none h[top]."""
        store = self._store
        if ep.word >= store.words:  # its bit needs the wider table now
            store.grow(store.live, self._words_wanted)
        n = h.size
        cur = ep.gens[-1]
        # Are h[0..m) all in the current generation? Exactly when h[m-1] is (prefix-closure).
        held_codes = None
        if m:
            row = seen.row(m - 1) if seen is not None else None
            if row is None:
                row = store.lookup(h[m - 1 : m])[0]
            words, shift = row.tolist(), ep.bit % 64
            width = (len(words) - 1) // 2  # the row's own mask words (a table grown since has more)
            last = (words[1 + ep.word] >> shift & 1) | (words[1 + width + ep.word] >> shift & 1) << 1
            if last != cur.code:
                held_codes = self._codes(store.lookup(h[:m]), ep)
        entering = n - m if held_codes is None else n - m + int(np.count_nonzero(held_codes != cur.code))
        closed = len(ep.gens) - 1
        if cur.live and (cur.live + entering > ep.capacity or (cur.live >= -(-ep.capacity // 3) and closed < 2)):
            if closed == 2:
                self._drop_closed(ep, h[:m], held_codes)
            cur = self._close(ep)
            held_codes = None  # all of h[0..m) is now in a closed generation
            if m:
                held_codes = np.zeros(m, dtype=_U64)  # anything but the new code: all move
        code = cur.code
        parts: list[np.ndarray] = []
        # New blocks first (inserting may grow the table; ids found after that stay valid).
        new_ids = store.insert(h[top:], self._row_values(ep, code)) if n > top else None
        if held_codes is not None:
            moving = np.flatnonzero(held_codes != code)
            if moving.size:
                ids, rows = store.find(h[moving])
                codes = self._codes(rows, ep)
                self._set_code(ep, ids, code)
                for gen in ep.gens[:-1]:
                    gen.live -= int(np.count_nonzero(codes == gen.code))
                parts.append(store.tag(ids))
                cur.live += moving.size
        if top > m:
            ids, _ = store.find(h[m:top])
            if (ids < 0).any():
                raise RuntimeError("prefix index: a held block is missing")  # a bug, never input
            self._set_code(ep, ids, code)
            parts.append(store.tag(ids))
        if new_ids is not None:
            parts.append(store.tag(new_ids))
        if parts:
            cur.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        gained = n - m
        cur.live += gained
        ep.held += gained
        self._size += gained
        if len(ep.gens) > 1:
            ep.gens[:-1] = [gen for gen in ep.gens[:-1] if gen.live]
        if ep.held > ep.capacity:
            self._evict(ep, ep.capacity - ep.capacity // _EVICT_BATCH, current_too=False)

    def _row_values(self, ep: _Endpoint, code: int) -> np.ndarray:
        """The planes of a slot only this endpoint holds, with this code."""
        words = self._store.words
        key = (ep.bit, code, words)
        values = self._values.get(key)
        if values is None:
            values = np.zeros(2 * words, dtype=_U64)
            values[ep.word] = ep.flag if code & 1 else 0
            values[words + ep.word] = ep.flag if code & 2 else 0
            values.flags.writeable = False
            if len(self._values) > 4096:
                self._values.clear()
            self._values[key] = values
        return values

    def _close(self, ep: _Endpoint) -> _Generation:
        """Close the current generation and open a new one with a free code."""
        used = {gen.code for gen in ep.gens}
        code = min(c for c in range(1, _GENERATIONS + 1) if c not in used)
        gen = _Generation(code)
        ep.gens.append(gen)
        return gen

    def _drop_closed(self, ep: _Endpoint, held: np.ndarray, held_codes: np.ndarray | None) -> None:
        """Step 2's rare case: drop both closed generations but for the prompt's blocks, which
        move to the current generation (about to close)."""
        cur = ep.gens[-1]
        if held_codes is not None:  # (None: all of them are in the current generation)
            moving = np.flatnonzero(held_codes != cur.code)
            if moving.size:
                ids, rows = self._store.find(held[moving])
                codes = self._codes(rows, ep)
                self._set_code(ep, ids, cur.code)
                for gen in ep.gens[:-1]:
                    gen.live -= int(np.count_nonzero(codes == gen.code))
                cur.append(self._store.tag(ids))
                cur.live += moving.size
        for gen in ep.gens[:-1]:
            self._evict_generation(ep, gen, gen.live)
        ep.gens[:-1] = []

    # --- internals: eviction -------------------------------------------------------------------

    def _evict(self, ep: _Endpoint, target: int, *, current_too: bool) -> None:
        """Evict down to ``target`` blocks: oldest generation first, last entered first."""
        while ep.held > target:
            gen = ep.gens[0]
            if gen is ep.gens[-1]:
                if current_too:
                    self._evict_generation(ep, gen, ep.held - target)
                return
            before = ep.held
            self._evict_generation(ep, gen, ep.held - target)
            if not gen.live:
                ep.gens.pop(0)
            elif ep.held == before:
                raise RuntimeError("prefix index: nothing left to evict")  # a bug, never input

    def _evict_generation(self, ep: _Endpoint, gen: _Generation, count: int) -> None:
        """Evict the ``count`` (≤ live) blocks of ``gen`` that entered it last."""
        store = self._store
        c0 = 1 + ep.word
        c1 = c0 + store.words
        p0, p1 = self._pattern(ep, gen.code).tolist()
        flag = ep.flag
        while count > 0 and gen.size:
            if gen.live == gen.size:  # no entry of it moved on: the last ``count`` are its own
                start = gen.size - min(count, gen.size)
                ids = store.resolve(gen.ids[start : gen.size])
                rows = store.get(ids)
            else:
                take = min(gen.size, count + count // 4 + 64)  # a few more than needed: some moved on
                start = gen.size - take
                ids = store.resolve(gen.ids[start : gen.size])
                rows = store.get(ids)
                other = (rows[:, c0] ^ _U64(p0)) | (rows[:, c1] ^ _U64(p1))
                other &= flag
                mine = np.flatnonzero(other == 0)  # the entries whose code is this generation's
                if mine.size > count:
                    mine = mine[mine.size - count :]
                    start += int(mine[0])
                ids, rows = ids[mine], rows[mine]
            if ids.size:
                store.clear(ids, rows, c0, c1, ~flag)
            gen.size = start
            gen.live -= ids.size
            ep.held -= ids.size
            self._size -= ids.size
            count -= ids.size
        if not gen.live:
            gen.size = 0
        gen.compact()

    # --- internals: the table's growth ---------------------------------------------------------

    def _maintain(self) -> None:
        """One bounded step of growing the table, if it is growing: touch the prepared table,
        move keys into it, rewrite the endpoints' lists (8,192 ids a step), free the old table.
        Otherwise, now and then, move keys out of the spill buckets (every lookup reads a third
        bucket while any key is spilled)."""
        store = self._store
        if store.next is not None and not store.migrating:
            store.step()  # touch the prepared table; it takes over once warm
            return
        if not store.migrating:
            if self._words_wanted > store.words:
                store.prepare(store.live, self._words_wanted)
            elif store.spilled and self._version >= self._next_unspill:
                self._next_unspill = self._version + 64
                self._unspill()
            return
        if store.moving:
            store.step()
            return
        if self._rewrite_epoch != store.epoch:  # every key has moved: now the lists
            self._rewrite_epoch = store.epoch
            self._rewrite = list(self._endpoints.values())
            for ep in self._rewrite:
                for gen in ep.gens:
                    gen.clean = 0
            if sum(gen.size for ep in self._rewrite for gen in ep.gens) <= _REWRITE_AT_ONCE:
                self._rewrite_all()
            return
        budget = _REWRITE_STEP
        while self._rewrite and budget > 0:
            ep = self._rewrite[-1]
            if self._endpoints.get(ep.name) is ep:
                budget = self._rewrite_lists(ep, budget)
                if budget <= 0:
                    return
            self._rewrite.pop()
        if not self._rewrite:
            store.drop_old()

    def _unspill(self) -> None:
        """Move keys out of the spill bucket where they fit now, and rewrite their holders' ids."""
        store = self._store
        old, new = store.unspill()
        if not old.size:
            return
        holders = holder_masks(np.bitwise_or.reduce(store.get(store.resolve(new)), axis=0)[None, :])[0]
        for bit in _bits(holders):
            for gen in self._by_bit[bit].gens:
                ids = gen.ids[: gen.size]
                at = np.searchsorted(old, ids)
                np.minimum(at, old.size - 1, out=at)
                hit = old[at] == ids
                ids[hit] = new[at[hit]]

    def _rewrite_lists(self, ep: _Endpoint, budget: int = 1 << 62) -> int:
        """Rewrite the endpoint's stored ids into the current table's, each generation from
        where the last call stopped (entries come and go only at a list's end), at most
        ``budget`` of them; the budget left (≤ 0: not done)."""
        store = self._store
        for gen in ep.gens:
            start = min(gen.clean, gen.size)
            end = min(gen.size, start + budget)
            if end > start:
                gen.ids[start:end] = store.restamp(gen.ids[start:end])
                budget -= end - start
            gen.clean = end
            if end < gen.size:
                return 0
        return max(budget, 1)

    def _rewrite_all(self) -> None:
        for ep in self._rewrite:
            if self._endpoints.get(ep.name) is ep:
                for gen in ep.gens:
                    gen.clean = 0
                self._rewrite_lists(ep)
        self._rewrite = []
        self._store.drop_old()

    def _rewrite_ids(self) -> None:
        """Rewrite every endpoint's lists now (the store calls this, every key moved, before it
        frees the old table to start another growth)."""
        self._rewrite_epoch = self._store.epoch
        for ep in self._endpoints.values():
            for gen in ep.gens:
                gen.clean = 0
            self._rewrite_lists(ep)
        self._rewrite = []
