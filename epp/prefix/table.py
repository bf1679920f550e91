"""Where the prefix index keeps its block hashes: a numpy hash table whose slots never move,
grown by a migration done a bounded step at a time.

Private to :mod:`epp.prefix.index`. A *slot* holds one block hash and, for every endpoint, a
2-bit code (0: the endpoint does not hold the block; 1-3: which of its generations holds it),
stored as two bit planes of ``W`` uint64 words each (64 endpoints a word). The index keeps, per
endpoint, lists of slot ids; a slot id stays valid for as long as its block is held, which is
what lets an eviction clear an endpoint's bits with one scatter instead of a search.

Layout and lookups
------------------
``2**p`` buckets of ``S`` slots (32 ≤ S < 64; twice the buckets of fewer slots when that costs
at most 1/8 more memory or the table is small, as smaller buckets are cheaper to read), then a
few spill buckets, as one ``(buckets, S, 1 + 2W)`` uint64 array: per slot its key, then plane 0,
then plane 1. A key
lives in one of two buckets, the top ``p`` bits of its low and of its high 32-bit half (one
shift of a uint32 view). A lookup takes the first slot of the two buckets whose key matches:
one loop in C (``epp/prefix/_native.c``) that fetches the buckets of the keys ahead while it searches,
zeros on a miss. :meth:`_Table.find`, which updates use for slot ids, is numpy: slot 0 of every
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

Growth: prepared, warmed, moved, a step at a time
-------------------------------------------------
Past 80% load (counting keys still to move in), or when endpoints need more mask words, the next
table is allocated; each :meth:`SlotStore.step` (the index runs one after each update) first
touches the next 128 KiB of it (first touches of fresh memory are slow, random ones much slower
than sequential ones), then, once all of it is touched, the new table takes over and the old
one's keys move over a few hundred a step (more if inserts come faster). Meanwhile lookups
consult both tables, new keys go to the new one, and a write to a key still in the old table
moves it first, so the old table is only read from. A moved slot keeps, in place of its key, the
id of its new slot, so the endpoints' lists of old ids stay usable: ids carry the table's parity
in bit 31, an old-parity id is translated when read, and once every key has moved the index
rewrites the lists (a bounded number of ids a step) before the old table is freed. Slot ids
therefore fit in uint32. Past 88.5% load (or for an endpoint that needs a wider table now) the
prepared table takes over at once, touching what is left of it in one go.

Sizing: the new table gets room for 1.5× the keys it takes over, or, when that comes near the
sum of the endpoints' capacities (the most distinct blocks the index can hold), for that sum at
88% load; so a full index of 64 endpoints × 31,250 blocks that share nothing sits in 2.36 million
slots of 24 bytes. During a growth both tables are allocated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from epp.prefix import _native

__all__ = ["SlotStore", "PARITY"]

_U64 = np.uint64
_MIN_SLOTS = 32  # slots a bucket, sentinel included: with two choices, full pairs stay rare up to 88% load
_MAX_SLOTS = 63  # the occupancy bitmap is a uint64
_PREPARE_AT = 0.8  # live keys / usable slots at which the next table is prepared
_GROW_AT = 0.885  # ... and at which it takes over at once, prepared or not
_FULL_LOAD = 0.88  # the load a table sized by the capacities is built for
_GROWTH = 1.5  # room a new table gets, relative to the keys it takes over
_STEP_KEYS = 512  # keys moved per migration step: a few hundred microseconds here
_WARM_WORDS = 1 << 14  # uint64 words of a prepared table touched per step: 128 KiB
_SMALL = 65536  # an old table holding at most this many keys moves over in one go
PARITY = 1 << 31  # bit 31 of a slot id: the parity of the table it points into
_ID_MASK = PARITY - 1


class _Table:
    """One geometry: 2**p hashed buckets, then ``ns`` spill buckets, S slots each.
    Slot id = bucket · S + slot (the store adds the parity bit)."""

    __slots__ = ("p", "nb", "ns", "total", "S", "W", "R", "rows", "flat", "cells", "keys", "occ", "live", "spilled", "usable", "_shift", "_ar", "_zero", "_full", "_rows")

    def __init__(self, usable: int, words: int) -> None:
        per = _MIN_SLOTS - 1
        p = max(1, (max(usable, 2 * per) // per).bit_length() - 1)  # 2**p buckets, usable/2**p in [31, 62)
        S = min(_MAX_SLOTS, max(_MIN_SLOTS, math.ceil(usable / (1 << p)) + 1))
        # Twice the buckets, fewer slots each (cheaper lookups), when that costs ≤ 1/8 more
        # memory, or the table is small anyway.
        narrow = max(_MIN_SLOTS, math.ceil(usable / (2 << p)) + 1)
        if (2 << p) * narrow <= max((1 << p) * S * 9 // 8, _SMALL):
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


def _pad(rows: np.ndarray, words: int, to: int) -> np.ndarray:
    """Rows of a table with ``words`` plane words as rows with ``to`` words."""
    if words == to:
        return rows
    out = np.zeros((rows.shape[0], 1 + 2 * to), dtype=_U64)
    out[:, 0] = rows[:, 0]
    out[:, 1 : 1 + words] = rows[:, 1 : 1 + words]
    out[:, 1 + to : 1 + to + words] = rows[:, 1 + words :]
    return out


class SlotStore:
    """The current table and, while growing, the one its keys are moving out of.

    Ids handed out point into the current table; an id of the other parity points into the old
    one (or, once its key has moved, to where its new id is kept). Writes go to the current
    table only: :meth:`find` and :meth:`resolve` move old slots over first.
    """

    __slots__ = ("cur", "old", "next", "warmed", "cursor", "parity", "capacity_hint", "epoch", "settle", "_inserted")

    def __init__(self, words: int = 1, usable: int = 1024) -> None:
        self.cur = _Table(usable, words)
        self.old: _Table | None = None
        self.next: _Table | None = None  # allocated, its pages being touched before it takes over
        self.warmed = 0  # uint64 words of ``next`` touched so far
        self.cursor = 0  # old buckets below this have moved
        self.parity = 0  # of the current table's ids
        self.capacity_hint = 0  # the most distinct blocks the index can hold (its capacities)
        self.epoch = 0  # migrations started
        self._inserted = 0  # keys inserted since the last migration step
        # Called before a migration starts while the previous one still has the old table: the
        # owner must finish it, rewrite its stored ids (resolve) and call drop_old().
        self.settle: Callable[[], None] = self._settle

    # --- sizes -------------------------------------------------------------------------------

    @property
    def words(self) -> int:
        return self.cur.W

    @property
    def live(self) -> int:
        return self.cur.live + (self.old.live if self.old is not None else 0)

    @property
    def slots(self) -> int:
        return self.cur.nb * self.cur.S

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.cur, self.old, self.next) if t is not None)

    @property
    def migrating(self) -> bool:
        """An old table is still allocated (its keys moving, or the lists still pointing in)."""
        return self.old is not None

    @property
    def moving(self) -> bool:
        return self.old is not None and self.cursor < self.old.total

    def tag(self, ids: np.ndarray) -> np.ndarray:
        """Current-table slot ids as stored ids (uint32 with the parity bit)."""
        return (ids | (self.parity << 31)).astype(np.uint32) if self.parity else ids.astype(np.uint32)

    # --- reads -------------------------------------------------------------------------------

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """(n, 1 + 2W) rows for the keys: (key, plane 0 words, plane 1 words), zeros when absent."""
        rows = self.cur.lookup(keys)
        if self.old is not None and self.cursor < self.old.total:
            rows |= _pad(self.old.lookup(keys), self.old.W, self.cur.W)
        return rows

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Current-table slot ids of the keys (-1 when absent) and their rows; keys still in the
        old table are moved over first."""
        ids, rows = self.cur.find(keys)
        if self.moving:
            missing = np.flatnonzero(ids < 0)
            if missing.size:
                old_ids, old_rows = self.old.find(keys[missing])
                there = old_ids >= 0
                if there.any():
                    moved = self._move(old_ids[there])
                    ids[missing[there]] = moved
                    rows[missing[there]] = self.cur.get(moved)
        return ids, rows

    def resolve(self, stored: np.ndarray) -> np.ndarray:
        """Stored ids (uint32) → current-table slot ids (int64), moving old slots over."""
        ids = stored.astype(np.int64)
        if self.old is None:
            if self.parity:
                ids &= _ID_MASK
            return ids
        theirs = (ids >> 31) != self.parity
        ids &= _ID_MASK
        if theirs.any():
            at = np.flatnonzero(theirs)
            old = ids[at]
            if self.cursor < self.old.total:
                waiting = old[self.old.flat[old, 0] != 0]  # a moved slot's key is 0
                if waiting.size:
                    self._move(np.unique(waiting))
            ids[at] = self.old.flat[old, 1].astype(np.int64)  # a moved slot keeps its new id here
        return ids

    # --- writes (current table only) ------------------------------------------------------------

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self.cur.get(ids)

    def get_planes(self, ids: np.ndarray, columns: np.ndarray) -> np.ndarray:
        return self.cur.flat[ids[:, None], columns]

    def put_planes(self, ids: np.ndarray, columns: np.ndarray, values: np.ndarray) -> None:
        self.cur.flat[ids[:, None], columns] = values

    def clear(self, ids: np.ndarray, rows: np.ndarray, c0: int, c1: int, keep: np.uint64) -> None:
        self.cur.clear(ids, rows, c0, c1, keep)

    def insert(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Insert absent keys; current-table ids. Past 80% load (counting the keys still to move
        in) a bigger table is prepared; past 88.5% it takes over now."""
        wanted = self.live + keys.size
        if wanted > _PREPARE_AT * self.cur.usable and self.room_for(wanted) > self.cur.usable:
            if wanted > _GROW_AT * self.cur.usable:
                self.grow(wanted, self.cur.W)
            elif self.old is None and self.next is None:
                self.prepare(wanted, self.cur.W)
        if self.old is not None:
            self._inserted += keys.size
        ids = self.cur.insert(keys, values)
        if (ids < 0).any():  # both buckets and the spill bucket full: grow past the capacities
            homeless = ids < 0
            self.grow(max(self.live + int(homeless.sum()), int(self.cur.usable * 1.25)), self.cur.W, exceed=True)
            placed = self.cur.insert(keys[homeless], np.broadcast_to(values, (keys.size, self.cur.R - 1))[homeless])
            if (placed < 0).any():
                raise RuntimeError("prefix index: no room after growing")  # a bug, never input
            ids, _ = self.find(keys)  # those placed before the growth have moved (or move now)
        return ids

    def _move(self, old_ids: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Move these old slots (distinct, not yet moved; ``rows``: their contents if at hand)
        to the current table; their new ids."""
        rows = _pad(self.old.get(old_ids) if rows is None else rows, self.old.W, self.cur.W)
        keys = rows[:, 0].copy()
        # Keys moved together came from neighbouring old buckets, so their halves that placed them
        # there point to neighbouring new buckets too: on a tie, prefer the other half's bucket.
        placed_by_low = (self.old.buckets(keys)[:, 0] == old_ids // self.old.S)
        new = self.cur.insert(keys, rows[:, 1:], prefer_second=placed_by_low)
        if (new < 0).any():
            raise RuntimeError("prefix index: no room while migrating")  # a bug: the new table has room
        self.old.cells[old_ids] = self.old._zero
        self.old.flat[old_ids, 1] = new.astype(_U64)  # plane 0 of the slot: where resolve() finds it
        self.old.live -= old_ids.size
        return new

    # --- growth --------------------------------------------------------------------------------

    def room_for(self, keys: int) -> int:
        """Usable slots for a table taking over ``keys`` keys: room for 1.5× as many, or, when
        that comes near the capacities' sum (the most the index can hold), for that sum."""
        want = max(keys * _GROWTH, 1024)
        cap = max(self.capacity_hint, keys)
        if self.capacity_hint and want >= 0.8 * cap:
            want = cap
        return math.ceil(want / _FULL_LOAD)

    def prepare(self, keys: int, words: int) -> None:
        """Allocate the next table (room for ``keys`` keys, ``words`` plane words); :meth:`step`
        touches its pages a megabyte at a time (first touches of fresh memory are slow, and
        random ones much slower than sequential ones), then lets it take over."""
        self.next = _Table(self.room_for(keys), words)
        self.warmed = 0

    def grow(self, keys: int, words: int, *, exceed: bool = False) -> None:
        """Switch to a table with room for ``keys`` keys and ``words`` plane words now (after
        finishing any migration still running, and the prepared table's warm-up if it fits)."""
        if self.old is not None:
            self.settle()
        usable = self.room_for(keys)
        if exceed:
            usable = max(usable, math.ceil(keys / _FULL_LOAD))
        ready = self.next
        if ready is None or ready.usable < usable or ready.W < words:
            ready, self.warmed = _Table(usable, words), 0
        ready.rows.reshape(-1)[self.warmed :] = 0  # touch the rest, in order, before keys land
        self.next = None
        self._switch(ready)

    def _switch(self, table: _Table) -> None:
        self.old, self.cur = self.cur, table
        self.cursor = 0
        self.parity ^= 1
        self.epoch += 1
        self._inserted = 0
        if self.old.live <= _SMALL:
            self.step(self.old.total)

    def step(self, buckets: int | None = None) -> bool:
        """A bounded piece of growing: touch the next megabyte of a prepared table (taking over
        once all is touched), or move the next old buckets' keys: about 4,000, or twice the keys
        inserted since the last step if more, so that the move ends long before the new table
        fills (it has room for 1.5× the keys it takes over). True while work remains."""
        if self.next is not None and self.old is None:
            words = self.next.rows.reshape(-1)
            start, self.warmed = self.warmed, min(words.size, self.warmed + _WARM_WORDS)
            words[start : self.warmed] = 0
            if self.warmed >= words.size:
                ready, self.next = self.next, None
                self._switch(ready)
            return True
        old = self.old
        total = old.total if old is not None else 0  # the spill buckets last
        if old is None or self.cursor >= total:
            return False
        if buckets is None:
            per_bucket = max(1.0, old.live / (total - self.cursor))
            buckets = max(1, math.ceil(max(_STEP_KEYS, 2 * self._inserted) / per_bucket))
        self._inserted = 0
        end = min(total, self.cursor + buckets)
        block = old.flat[self.cursor * old.S : end * old.S]
        there = np.flatnonzero(block[:, 0])
        if there.size:
            self._move(there + self.cursor * old.S, block[there])
        self.cursor = end
        return end < total

    def finish(self) -> None:
        """Move every remaining key (callers rewrite their lists, then call :meth:`drop_old`)."""
        while self.old is not None and self.step(self.old.total):
            pass

    @property
    def busy(self) -> bool:
        """Growing: a table prepared, or keys moving, or the old table still referenced."""
        return self.next is not None or self.old is not None

    def drop_old(self) -> None:
        """Free the old table: every stored id now points into the current one."""
        self.old = None

    def _settle(self) -> None:  # for a store whose owner keeps no ids
        self.finish()
        self.drop_old()
