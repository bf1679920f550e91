"""Where the prefix index keeps its block hashes: the current :class:`~epp.prefix.table.Table`
and, while growing, the one its keys are moving out of; grown by a migration done a bounded step
at a time, so that no update stalls the request path.

Private to the prefix index. The owner (the index) keeps slot ids in lists (*stored ids*,
uint32); :meth:`SlotStore.resolve` turns them into current-table slot ids and
:meth:`SlotStore.restamp` rewrites them in place of the old. The one thing the store needs from
its owner is the ``rewrite_ids`` callback of its constructor, for the case where a growth must
start while the previous one's old table is still referenced (see :class:`SlotStore`).

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

from epp.prefix.table import Table

__all__ = ["SlotStore"]

_U64 = np.uint64
_PREPARE_AT = 0.8  # live keys / usable slots at which the next table is prepared
_GROW_AT = 0.885  # ... and at which it takes over at once, prepared or not
_FULL_LOAD = 0.88  # the load a table sized by the capacities is built for
_GROWTH = 1.5  # room a new table gets, relative to the keys it takes over
_STEP_KEYS = 512  # keys moved per migration step: a few hundred microseconds here
_WARM_WORDS = 1 << 14  # uint64 words of a prepared table touched per step: 128 KiB
_SMALL = 65536  # an old table holding at most this many keys moves over in one go
_PARITY = 1 << 31  # bit 31 of a stored id: the parity of the table it points into
_ID_MASK = _PARITY - 1
_NO_IDS = np.empty(0, dtype=np.uint32)
_NO_IDS.flags.writeable = False


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

    An owner that keeps stored ids rewrites them (:meth:`restamp`) once every key has moved
    (:attr:`moving` false), a bounded piece per update, then calls :meth:`drop_old`. A growth
    that must start before that (the current table is full, or needs more mask words now) first
    moves every remaining key, then calls ``rewrite_ids()``, which must rewrite every stored id
    the owner keeps with :meth:`restamp` before it returns, and then frees the old table itself.
    Without ``rewrite_ids``, the owner keeps no ids.
    """

    __slots__ = (
        "_inserted",
        "_rewrite_ids",
        "capacity_hint",
        "cur",
        "cursor",
        "epoch",
        "next",
        "old",
        "parity",
        "warmed",
    )

    def __init__(self, words: int = 1, usable: int = 1024, *, rewrite_ids: Callable[[], None] | None = None) -> None:
        self.cur = Table(usable, words)
        self.old: Table | None = None
        self.next: Table | None = None  # allocated, its pages being touched before it takes over
        self.warmed = 0  # uint64 words of ``next`` touched so far
        self.cursor = 0  # old buckets below this have moved
        self.parity = 0  # of the current table's ids
        self.capacity_hint = 0  # the most distinct blocks the index can hold (its capacities)
        self.epoch = 0  # migrations started
        self._inserted = 0  # keys inserted since the last migration step
        self._rewrite_ids = rewrite_ids

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
    def usable(self) -> int:
        """The current table's slots for keys (all but each bucket's sentinel)."""
        return self.cur.usable

    @property
    def slot_bytes(self) -> int:
        return 8 * self.cur.R

    @property
    def spilled(self) -> int:
        """Keys in the current table's spill buckets (every lookup reads a third bucket meanwhile)."""
        return self.cur.spilled

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
        return (ids | _PARITY).astype(np.uint32) if self.parity else ids.astype(np.uint32)

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
        old = self.old
        if old is not None and self.cursor < old.total:
            missing = np.flatnonzero(ids < 0)
            if missing.size:
                old_ids, _ = old.find(keys[missing])
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

    def restamp(self, stored: np.ndarray) -> np.ndarray:
        """Stored ids (uint32) as stored ids of the current table, moving old slots over."""
        return self.tag(self.resolve(stored))

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
        old = self.old
        assert old is not None  # (only ever called while migrating)
        rows = _pad(old.get(old_ids) if rows is None else rows, old.W, self.cur.W)
        keys = rows[:, 0].copy()
        # Keys moved together came from neighbouring old buckets, so their halves that placed them
        # there point to neighbouring new buckets too: on a tie, prefer the other half's bucket.
        placed_by_low = old.buckets(keys)[:, 0] == old_ids // old.S
        new = self.cur.insert(keys, rows[:, 1:], prefer_second=placed_by_low)
        if (new < 0).any():
            raise RuntimeError("prefix index: no room while migrating")  # a bug: the new table has room
        old.forward(old_ids, new)  # where resolve() finds the new id
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
        self.next = Table(self.room_for(keys), words)
        self.warmed = 0

    def grow(self, keys: int, words: int, *, exceed: bool = False) -> None:
        """Switch to a table with room for ``keys`` keys and ``words`` plane words now (after
        finishing any migration still running, and the prepared table's warm-up if it fits)."""
        if self.old is not None:
            self._settle()
        usable = self.room_for(keys)
        if exceed:
            usable = max(usable, math.ceil(keys / _FULL_LOAD))
        ready = self.next
        if ready is None or ready.usable < usable or words > ready.W:
            ready, self.warmed = Table(usable, words), 0
        ready.rows.reshape(-1)[self.warmed :] = 0  # touch the rest, in order, before keys land
        self.next = None
        self._switch(ready)

    def _switch(self, table: Table) -> None:
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

    def _settle(self) -> None:
        """End the migration still running now: every key moves, the owner rewrites its ids."""
        self.finish()
        if self._rewrite_ids is not None:
            self._rewrite_ids()
        self.drop_old()

    # --- spilled keys --------------------------------------------------------------------------

    def unspill(self) -> tuple[np.ndarray, np.ndarray]:
        """Move the keys of the spill buckets whose own buckets have room now back there (only
        while no migration runs): the stored ids that changed, sorted, and their new stored
        ids. The owner must rewrite the ids it keeps."""
        old, new = self.cur.unspill()
        changed = old != new
        if not changed.any():
            return _NO_IDS, _NO_IDS
        old, new = self.tag(old[changed]), self.tag(new[changed])
        order = np.argsort(old)
        return old[order], new[order]
