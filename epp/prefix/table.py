"""The prefix index's hash table of block hashes: one numpy array of slots that never move.

A *slot* holds one block hash and, for every endpoint, a 2-bit code (0: the endpoint does not
hold the block; 1-3: which of its generations holds it), stored as two bit planes of ``W`` uint64
words each (64 endpoints a word: endpoint bit ``64·w + b`` is bit ``b`` of word ``w``). The
index keeps, per endpoint, lists of slot ids; a slot id stays valid for as long as its block is
held, which is what lets an eviction clear an endpoint's bits with one scatter instead of a
search. A :class:`Table` has one fixed geometry; growing into a bigger one is
:mod:`epp.prefix.store`'s.

Layout and lookups
------------------
``2**p`` buckets of ``S`` slots (32 ≤ S < 64; twice the buckets of fewer slots when that costs
at most 1/8 more memory or the table is small, as smaller buckets are cheaper to read), then a
few spill buckets, as one ``(buckets, S, 1 + 2W)`` uint64 array: per slot its key, then plane 0,
then plane 1. A key lives in one of two buckets, the top ``p`` bits of its low and of its high
32-bit half (one shift of a uint32 view). A lookup takes the first slot of the two buckets whose key matches:
one loop in C (``epp/prefix/_native.c``) that fetches the buckets of the keys ahead while it searches,
zeros on a miss. :meth:`Table.find`, which updates use for slot ids, is numpy: slot 0 of every
bucket is a sentinel that stays empty, where a miss lands, so it needs no "was it found?" pass.
The hash value 0 is reserved (the index refuses it): an empty slot's key.

Inserts: a batch at once; each key goes to the emptier of its buckets (a uint64 occupancy bitmap
per bucket; slots fill from the lowest, so the smaller bitmap is the emptier one) at its lowest
free slot. Keys of the batch that picked the same slot are told apart by reading the keys back
(one wins, the others try again). Nothing is ever displaced, so a key whose two buckets are both
full goes to its *spill bucket* (one of ``max(1, 2**p / 1024)``, by the low bits of its low
half), which lookups then also read, one more bucket, for as long as any key is spilled; the
index moves spilled keys back when their buckets have room. With two choices and S ≥ 32 a full
pair stays vanishingly rare below 88% load (a simulation of 3.7 million inserts with
oldest-first deletions at 88% saw none), and the table grows before that.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from epp.prefix import _native

__all__ = ["Table", "bits", "holder_masks"]

_U64 = np.uint64
_MIN_SLOTS = 32  # slots a bucket, sentinel included: with two choices, full pairs stay rare up to 88% load
_MAX_SLOTS = 63  # the occupancy bitmap is a uint64
_SMALL_TABLE = 65536  # slots: a table this small takes the narrower buckets whatever they cost in memory


def holder_masks(rows: np.ndarray) -> list[int]:
    """For each row of a table (key, plane 0 words, plane 1 words), the mask of the endpoints
    holding its block, as a Python int (endpoint bit ``64·w + b`` is word ``w``'s bit ``b``)."""
    words = rows.shape[1] // 2
    if words == 1:
        return (rows[:, 1] | rows[:, 2]).tolist()
    masks = rows[:, 1 : 1 + words] | rows[:, 1 + words :]
    data = masks.astype("<u8", copy=False).tobytes()
    width = 8 * words
    return [int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)]


def bits(mask: int) -> Iterator[int]:
    """The set bits of ``mask`` (endpoint bits), lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class Table:
    """One geometry: 2**p hashed buckets, then ``ns`` spill buckets, S slots each.
    Slot id = bucket · S + slot (:class:`epp.prefix.store.SlotStore` adds the parity bit)."""

    __slots__ = (
        "R",
        "S",
        "W",
        "_ar",
        "_full",
        "_rows",
        "_shift",
        "_zero",
        "cells",
        "flat",
        "keys",
        "live",
        "nb",
        "ns",
        "occ",
        "p",
        "rows",
        "spilled",
        "total",
        "usable",
    )

    def __init__(self, usable: int, words: int) -> None:
        per = _MIN_SLOTS - 1
        p = max(1, (max(usable, 2 * per) // per).bit_length() - 1)  # 2**p buckets, usable/2**p in [31, 62)
        S = min(_MAX_SLOTS, max(_MIN_SLOTS, math.ceil(usable / (1 << p)) + 1))
        # Twice the buckets, fewer slots each (cheaper lookups), when that costs ≤ 1/8 more
        # memory, or the table is small anyway.
        narrow = max(_MIN_SLOTS, math.ceil(usable / (2 << p)) + 1)
        if (2 << p) * narrow <= max((1 << p) * S * 9 // 8, _SMALL_TABLE):
            p, S = p + 1, narrow
        nb = 1 << p
        if (nb + max(1, nb >> 10)) * S >= 1 << 31:  # slot ids are 31-bit
            raise ValueError(f"prefix index: a table of {usable:,} slots is too large")
        self.p, self.nb, self.S, self.W, self.R = p, nb, S, words, 1 + 2 * words
        self.ns = max(1, nb >> 10)  # spill buckets (a power of two): a key's is picked by its low bits
        self.total = nb + self.ns
        self.rows = np.zeros((self.total, S, self.R), dtype=_U64)
        self.flat = self.rows.reshape(self.total * S, self.R)
        # The same memory as one opaque item per slot (fancy writes of whole slots are 2-3×
        # faster that way), and as the key column.
        self.cells = self.flat.view(np.dtype((np.void, 8 * self.R))).reshape(-1)
        self.keys = self.flat[:, 0]
        self.occ = np.ones(self.total, dtype=_U64)  # bit 0: the sentinel slot, never free
        self.live = 0
        self.spilled = 0  # keys in spill buckets
        self.usable = nb * (S - 1)
        self._shift = np.uint32(32 - p)
        self._ar = np.arange(1024, dtype=np.intp)
        self._zero = np.zeros(1, dtype=self.cells.dtype)[0]
        self._full = _U64((1 << S) - 1)  # a full bucket's occupancy bitmap
        self._rows: tuple[np.ndarray, np.ndarray | None] = (np.empty((0, self.R), dtype=_U64), None)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.occ.nbytes

    def _arange(self, n: int) -> np.ndarray:
        if n > self._ar.size:
            self._ar = np.arange(max(n, 2 * self._ar.size), dtype=np.intp)
        return self._ar[:n]

    def buckets(self, keys: np.ndarray) -> np.ndarray:
        """(n, 2) uint32: each key's two buckets. ``keys``: C-contiguous native uint64."""
        return keys.view(np.uint32).reshape(-1, 2) >> self._shift

    def spill_bucket(self, keys: np.ndarray) -> np.ndarray:
        """(n,) uint32: each key's spill bucket (by the low bits of its low half)."""
        return (keys.view(np.uint32)[0::2] & np.uint32(self.ns - 1)) + np.uint32(self.nb)

    def _probed(self, keys: np.ndarray) -> np.ndarray:
        """The buckets a lookup reads: the key's two, and its spill bucket while any key spilled."""
        b = self.buckets(keys)
        if not self.spilled:
            return b
        return np.concatenate((b, self.spill_bucket(keys)[:, None]), axis=1)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """(n, R): the slot of each key (key, planes), or zeros when absent. ``keys``: C-contiguous
        native uint64. The probes of :meth:`_probed`, in C (epp/prefix/_native.c)."""
        out = np.empty((keys.size, self.R), dtype=_U64)
        _native.lookup(self.rows, self.nb, self.S, self.R, 32 - self.p, self.ns if self.spilled else 0, keys, out)
        return out

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows): each key's slot id (-1 when absent) and slot contents (zeros when absent)."""
        n = keys.size
        b = self._probed(keys)
        rows = self.rows.take(b, axis=0)
        width = rows.shape[1] * self.S
        pos = (rows[:, :, :, 0] == keys[:, None, None]).reshape(n, width).argmax(axis=1)
        ar = self._arange(n)
        got = rows.reshape(n, width, self.R)[ar, pos]
        choice, slot = np.divmod(pos, self.S)
        ids = b[ar, choice].astype(np.int64) * self.S + slot
        ids[slot == 0] = -1
        return ids, got

    def insert(self, keys: np.ndarray, values: np.ndarray, prefer_second: np.ndarray | None = None) -> np.ndarray:
        """Place absent, distinct, nonzero keys with their planes ((n, 2W) or (2W,)) in the
        emptier of their buckets (on a tie the first, or the second where ``prefer_second``),
        or their spill bucket when both are full; the new slot ids, -1 for a key that found its
        spill bucket full too.

        Vectorised passes: keys of a pass that chose the same slot leave one winner, the rest
        try again; the last few keys, and keys whose buckets are both full, go one at a time."""
        n = keys.size
        if n <= 4 and prefer_second is None:  # a question's block or two: quicker one at a time
            rows = np.empty((n, self.R), dtype=_U64)
            rows[:, 0] = keys
            rows[:, 1:] = values
            b = self.buckets(keys)
            return np.array([self._place(rows[i], b[i]) for i in range(n)], dtype=np.int64)
        if values.ndim == 1:  # the same planes for every key (one endpoint's new blocks)
            rows = self._scratch(n, values)
        else:
            rows = np.empty((n, self.R), dtype=_U64)
            rows[:, 1:] = values
        rows[:, 0] = keys
        b = self.buckets(keys)
        if prefer_second is not None:
            b = np.where(prefer_second[:, None], b[:, ::-1], b)
        ids, ok = self._insert_pass(keys, rows, b)
        if ok is None:
            return ids
        pending = np.flatnonzero(~ok)
        while pending.size > 4:
            placed, ok = self._insert_pass(keys[pending], rows[pending], b[pending])
            ids[pending] = placed
            if ok is None:
                return ids
            if ok.any():
                pending = pending[~ok]
            else:
                break
        for i in pending.tolist():
            ids[i] = self._place(rows[i], b[i])
        return ids

    def _scratch(self, n: int, values: np.ndarray) -> np.ndarray:
        """An (n, R) buffer whose plane columns hold ``values`` (rewritten only when they change)."""
        rows, filled = self._rows
        if rows.shape[0] < n:
            rows, filled = np.empty((max(n, 2 * rows.shape[0]), self.R), dtype=_U64), None
        if filled is not values:  # (the index passes the same read-only array for the same planes)
            rows[:, 1:] = values
            filled = values if not values.flags.writeable else None
        self._rows = (rows, filled)
        return rows[:n]

    def _insert_pass(self, keys: np.ndarray, rows: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """One vectorised pass (``b``: each key's two buckets, the one to take on a tie first):
        the slot ids (-1 for keys not placed) and, unless every key was placed (None), which were."""
        both = self.occ.take(b)  # (n, 2) occupancy bitmaps
        # Slots fill from the lowest, so the smaller bitmap is (nearly always) the emptier bucket.
        bucket = np.where(both[:, 1] < both[:, 0], b[:, 1], b[:, 0])
        bits = np.minimum(both[:, 0], both[:, 1])
        after = bits + _U64(1)  # the lowest clear bit set, the ones below it cleared
        count = np.bitwise_count(after ^ bits)  # the slot + 1 (S + 1 when the bucket is full)
        at = np.multiply(bucket, self.S, dtype=np.intp)
        at += count
        at -= 1
        full = count > self.S if bits.max() == self._full else None
        if full is not None:
            at[full] = 0  # bucket 0's sentinel: written, then restored below
        self.cells[at] = rows.view(self.cells.dtype).reshape(-1)
        ok = self.keys[at] == keys
        if full is not None:
            ok &= ~full
            self.flat[0] = 0
        after |= bits
        if ok.all():
            self.occ[bucket] = after  # the winners' buckets are distinct
            self.live += keys.size
            return at, None
        won = np.flatnonzero(ok)
        self.occ[bucket[won]] = after[won]
        self.live += won.size
        at[~ok] = -1
        return at, ok

    def _place(self, row: np.ndarray, buckets: np.ndarray) -> int:
        """Insert one key (the slow path): the emptier of its buckets, else the spill bucket;
        its slot id, or -1 when the spill bucket is full too."""
        b0, b1 = buckets.tolist()
        o0, o1 = int(self.occ[b0]), int(self.occ[b1])
        bucket, bits = (b1, o1) if o1.bit_count() < o0.bit_count() else (b0, o0)
        free = ~bits & (bits + 1)
        if free.bit_length() > self.S:
            bucket = int(self.spill_bucket(row[:1])[0])
            bits = int(self.occ[bucket])
            free = ~bits & (bits + 1)
            if free.bit_length() > self.S:
                return -1
            self.spilled += 1
        at = bucket * self.S + free.bit_length() - 1
        self.flat[at] = row
        self.occ[bucket] = bits | free
        self.live += 1
        return at

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self.flat.take(ids, axis=0)

    def clear(self, ids: np.ndarray, rows: np.ndarray, c0: int, c1: int, keep: np.uint64) -> None:
        """Write back these slots' ``rows`` (distinct ids; a copy, modified here) with plane
        words ``c0`` and ``c1`` masked by ``keep``; slots left with no bit at all are emptied."""
        rows[:, c0] &= keep
        rows[:, c1] &= keep
        held = rows[:, 1] | rows[:, 2]  # (a row-wise any() is slow in numpy)
        for column in range(3, self.R):
            held |= rows[:, column]
        empty = held == 0
        gone_count = int(np.count_nonzero(empty))
        if gone_count:
            if gone_count == ids.size:
                rows[:] = 0
                gone = ids
            else:
                rows[empty] = 0
                gone = ids[empty]
            bucket, slot = np.divmod(gone, self.S)
            np.bitwise_and.at(self.occ, bucket, ~(_U64(1) << slot.astype(_U64)))
            self.live -= gone_count
            if self.spilled:
                self.spilled -= int(np.count_nonzero(bucket >= self.nb))
        self.cells[ids] = rows.view(self.cells.dtype).reshape(-1)

    def free(self, ids: np.ndarray) -> None:
        """Empty these slots (distinct ids)."""
        if not ids.size:
            return
        self.cells[ids] = self._zero
        bucket, slot = np.divmod(ids, self.S)
        np.bitwise_and.at(self.occ, bucket, ~(_U64(1) << slot.astype(_U64)))
        self.live -= ids.size
        if self.spilled:
            self.spilled -= int(np.count_nonzero(bucket >= self.nb))

    def forward(self, ids: np.ndarray, to: np.ndarray) -> None:
        """These slots' keys moved to another table, to slot ids ``to``: empty each slot but for
        the first word of plane 0, which keeps its new id (a migration reads it there). The
        occupancy bitmaps stay as they are: a table being moved out of takes no more keys."""
        self.cells[ids] = self._zero
        self.flat[ids, 1] = to.astype(_U64)
        self.live -= ids.size

    def unspill(self) -> tuple[np.ndarray, np.ndarray]:
        """Move the spill bucket's keys whose own buckets now have room back there: (old ids,
        new ids). Callers must rewrite the ids they keep."""
        there = np.flatnonzero(self.rows[self.nb :, :, 0].reshape(-1)) + self.nb * self.S
        rows = self.get(there)
        bits = self.occ.take(self.buckets(rows[:, 0].copy()))
        room = (np.bitwise_count(bits) < self.S).any(axis=1)
        there, rows = there[room], rows[room]
        if there.size:
            self.free(there)
            return there, self.insert(rows[:, 0].copy(), rows[:, 1:])
        return there, there
