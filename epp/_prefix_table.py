"""A uint64 key → endpoint-bitmask hash table in numpy arrays, looked up many keys per call.

Private to :mod:`epp.prefix_index`, which keeps the per-endpoint LRUs; this table only answers
"which endpoints hold this block hash?" for a batch of hashes at once.

Design
------
Bucketed cuckoo hashing: ``2**p`` buckets of ``S`` slots (16 ≤ S < 32, so memory grows in
steps of a few percent); a key lives in one of two buckets, the top ``p`` bits of its low and of
its high 32-bit half. A bucket is one row of a ``(2**p, 1 + W, S)`` uint64 array: S keys, then the
S slots' masks, W words each (64 endpoints per word). A lookup is five numpy calls whatever the
batch size: one shift for both bucket numbers, one row gather (keys and masks together), a
compare, a multiply that zeroes the masks of non-matching slots, and a max.

A slot is empty when its mask is zero; a freed slot's key is reset to 0, so a stale key never
shadows a live one. Inserts place a batch at once: each key goes to the emptier of its buckets,
keys that chose the same bucket take its free slots in turn (one sort), and the few that find
both buckets full displace an occupant to that occupant's other bucket (a bounded cuckoo walk,
scalar, rare below the 90% load ceiling).

Memory: 8·(1 + W) bytes per slot. When an insert would pass 90% load the table is rebuilt at
80% (so at most about ``peak live keys / 0.8`` slots, once past the first 2**20 slots, which it
doubles through); it never shrinks.
"""

from __future__ import annotations

import math
import random

import numpy as np

__all__ = ["MaskTable"]

_U64 = np.uint64
_MIN_WIDTH = 16  # slots per bucket at least: with two choices, full buckets stay rare up to ~90% load
_MAX_LOAD = 0.9
_GROW_LOAD = 0.8
_MAX_KICKS = 256  # cuckoo walk length before giving up and growing
_DOUBLING = 1 << 20  # below this many slots the table doubles when it grows (cheap, few rehashes)


class MaskTable:
    """Maps distinct uint64 keys to nonzero bitmasks of ``words`` uint64 words."""

    __slots__ = ("_rows", "_nb", "_width", "_shift", "_live", "_rng")

    def __init__(self, words: int = 1, slots: int = 1024) -> None:
        self._rng = random.Random(0x5EED)  # cuckoo victims: deterministic, so runs repeat
        self._allocate(slots, words)

    def _allocate(self, slots: int, words: int) -> None:
        bits = max(0, (max(slots, _MIN_WIDTH) // _MIN_WIDTH).bit_length() - 1)  # 2**bits·16 ≤ slots
        self._nb = 1 << bits
        self._width = max(_MIN_WIDTH, math.ceil(slots / self._nb))
        self._shift = np.uint32(32 - bits)
        self._rows = np.zeros((self._nb, 1 + words, self._width), dtype=_U64)
        self._live = 0

    # --- sizes -------------------------------------------------------------------------------

    @property
    def words(self) -> int:
        return self._rows.shape[1] - 1

    @property
    def slots(self) -> int:
        return self._nb * self._width

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self._rows.nbytes

    def widen(self, words: int) -> None:
        """Give every slot ``words`` mask words (more endpoints); existing bits stay."""
        if words > self.words:
            rows = np.zeros((self._nb, 1 + words, self._width), dtype=_U64)
            rows[:, : self._rows.shape[1]] = self._rows
            self._rows = rows

    # --- lookups -----------------------------------------------------------------------------

    def _buckets(self, keys: np.ndarray) -> np.ndarray:
        """Each key's two bucket numbers, shape (len(keys), 2): its two 32-bit halves' top bits."""
        if self._nb == 1:
            return np.zeros((keys.size, 2), dtype=np.uint32)
        return keys.view(np.uint32).reshape(-1, 2) >> self._shift

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The mask of each key (zero when absent), shape (len(keys), words).

        ``keys`` must be a C-contiguous native uint64 array.
        """
        rows = self._rows[self._buckets(keys)]  # (k, 2, 1 + W, 16)
        hit = rows[:, :, 0, :] == keys[:, None, None]
        masks = rows[:, :, 1:, :]
        masks *= hit[:, :, None, :]  # only the matching slot (if any) keeps its mask
        return masks.max(axis=(1, 3))

    def _find(self, keys: np.ndarray, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each key is: (bucket, slot) arrays, bucket -1 when absent."""
        hit = self._rows[buckets, 0, :] == keys[:, None, None]
        hit &= self._occupied(buckets)
        flat = hit.reshape(keys.size, 2 * self._width)
        first = flat.argmax(axis=1)
        index = np.arange(keys.size)
        bucket = buckets[index, first // self._width].astype(np.int64)
        bucket[~flat[index, first]] = -1
        return bucket, first % self._width

    def _occupied(self, buckets: np.ndarray) -> np.ndarray:
        """Which slots of these buckets hold a key (a nonzero mask): shape buckets.shape + (S,)."""
        if self.words == 1:
            return self._rows[buckets, 1, :] != 0
        return self._rows[buckets, 1:, :].any(axis=-2)

    # --- updates -----------------------------------------------------------------------------

    def set_bit(self, keys: np.ndarray, bit: int) -> None:
        """Set ``bit`` in the mask of each key, inserting the keys that are absent. Keys distinct."""
        word, value = divmod(bit, 64)
        flag = _U64(1 << value)
        buckets = self._buckets(keys)
        bucket, slot = self._find(keys, buckets)
        present = bucket >= 0
        if present.any():
            self._rows[bucket[present], 1 + word, slot[present]] |= flag
        if not present.all():
            missing = ~present
            masks = np.zeros((int(missing.sum()), self.words), dtype=_U64)
            masks[:, word] = flag
            self._insert(keys[missing], masks, buckets[missing])

    def clear_bit(self, keys: np.ndarray, bit: int) -> None:
        """Clear ``bit`` in the mask of each key present; free the slots left with no bit. Keys distinct."""
        word, value = divmod(bit, 64)
        bucket, slot = self._find(keys, self._buckets(keys))
        present = bucket >= 0
        bucket, slot = bucket[present], slot[present]
        if not bucket.size:
            return
        self._rows[bucket, 1 + word, slot] &= _U64(~(1 << value) & 0xFFFF_FFFF_FFFF_FFFF)
        emptied = ~self._rows[bucket, 1:, slot].any(axis=1)
        self._rows[bucket[emptied], 0, slot[emptied]] = 0
        self._live -= int(emptied.sum())

    def _insert(self, keys: np.ndarray, masks: np.ndarray, buckets: np.ndarray) -> None:
        """Insert absent, distinct keys with their nonzero masks (shape (k, W))."""
        if self._live + keys.size > _MAX_LOAD * self.slots:
            self._grow(self._live + keys.size)
            buckets = self._buckets(keys)
        free = ~self._occupied(buckets)  # (k, 2, S)
        counts = free.sum(axis=2)
        first = (counts[:, 1] > counts[:, 0]).astype(np.int64)  # the emptier bucket first
        pending = np.arange(keys.size)
        for attempt in (first, 1 - first):
            if not pending.size:
                return
            choice = attempt[pending]
            bucket = buckets[pending, choice].astype(np.int64)
            # Keys of this batch that chose the same bucket take its free slots in turn.
            order = np.argsort(bucket, kind="stable")
            pending, bucket = pending[order], bucket[order]
            starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
            rank = np.arange(bucket.size) - np.repeat(starts, np.diff(np.r_[starts, bucket.size]))
            free_here = ~self._occupied(bucket)  # (p, S), fresh: sees earlier passes' placements
            nth = np.cumsum(free_here, axis=1)
            fits = nth[:, -1] > rank
            slot = (nth == (rank + 1)[:, None]).argmax(axis=1)
            placed, at, slot = pending[fits], bucket[fits], slot[fits]
            self._rows[at, 0, slot] = keys[placed]
            self._rows[at, 1:, slot] = masks[placed]
            self._live += placed.size
            pending = pending[~fits]
        for i in pending.tolist():
            self._cuckoo(keys[i : i + 1].copy(), masks[i].copy())

    def _cuckoo(self, key: np.ndarray, mask: np.ndarray) -> None:
        """Place one key whose two buckets are full, displacing occupants along a random walk."""
        for _ in range(_MAX_KICKS):
            buckets = self._buckets(key)[0].astype(np.int64)
            for bucket in buckets.tolist():
                free = np.flatnonzero(~self._rows[bucket, 1:, :].any(axis=0))
                if free.size:
                    self._rows[bucket, 0, free[0]] = key[0]
                    self._rows[bucket, 1:, free[0]] = mask
                    self._live += 1
                    return
            bucket = int(buckets[self._rng.randrange(2)])
            slot = self._rng.randrange(self._width)
            evicted_key = self._rows[bucket, 0, slot : slot + 1].copy()
            evicted_mask = self._rows[bucket, 1:, slot].copy()
            self._rows[bucket, 0, slot] = key[0]
            self._rows[bucket, 1:, slot] = mask
            key, mask = evicted_key, evicted_mask
        # The walk failed: grow (rehashing everything) and place the key left homeless.
        self._grow(self._live + 1, at_least=int(self.slots * 1.25))
        self._insert(key, mask[None, :], self._buckets(key))

    def _grow(self, live: int, at_least: int = 0) -> None:
        flat_keys = self._rows[:, 0, :].reshape(-1)
        flat_masks = self._rows[:, 1:, :].transpose(0, 2, 1).reshape(-1, self.words)
        occupied = flat_masks.any(axis=1)
        keys, masks = flat_keys[occupied], flat_masks[occupied]
        slots = max(math.ceil(live / _GROW_LOAD), at_least)
        if self.slots < _DOUBLING:
            slots = max(slots, 2 * self.slots)
        self._allocate(slots, self.words)
        if keys.size:
            self._insert(keys, masks, self._buckets(keys))
