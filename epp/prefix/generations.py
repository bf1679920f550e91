"""What each endpoint holds: its blocks in up to three generations, an approximate LRU whose
updates are cheap, and the bookkeeping of endpoints (their bits in the table's masks, their
capacities).

Three generations, not an exact LRU
-----------------------------------
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

What matching relies on: every endpoint's set is *prefix-closed* (holding ``h[i]`` means
holding ``h[0..i-1]``). A block is only ever touched together with all blocks before it, which
then sit in the same or a newer generation, and within a generation a block enters no later than
the blocks after it, so an eviction (last entered first) never removes a block before its
extensions.

What an add writes
------------------
The code of an endpoint's block is stored in the slot of the block (:mod:`epp.prefix.table`);
its generations are lists of those slots' ids (stored ids, :mod:`epp.prefix.store`). An add
reads the endpoint's code at its last held block (if that block is in the current generation,
all of the held prefix is: prefix-closure again), and then writes only what changes: codes of
blocks that move in, new slots for blocks nobody held, ids appended. So re-adding a held prompt
costs a few microseconds, and 512 new blocks one vectorised insert of 512 keys. An eviction
clears the endpoint's bits of the ids it pops with one scatter, and frees the slots nobody else
holds.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import numpy as np

from epp.prefix.store import SlotStore

__all__ = ["Endpoint", "Generation", "Holdings"]

_U64 = np.uint64
_GENERATIONS = 3  # the 2-bit code per (endpoint, block): 0 = not held, 1-3 = a generation
_EVICT_BATCH = 16  # an endpoint over capacity evicts down to capacity − capacity // 16


class Generation:
    """Slot ids (uint32, with the table parity bit) in entry order; ``live``: how many of them
    are still this generation's (the others moved to a newer one)."""

    __slots__ = ("clean", "code", "ids", "live", "size")

    def __init__(self, code: int) -> None:
        self.code = code
        self.ids = np.empty(0, dtype=np.uint32)
        self.size = 0
        self.live = 0
        self.clean = 0  # while lists are being rewritten after a migration: entries done (epp.prefix.upkeep)

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


class Endpoint:
    """One endpoint: its bit in the table's masks (word ``word``, ``flag`` within it), its
    capacity, its generations (oldest first; the last is the current one) and how many blocks
    it holds."""

    __slots__ = ("bit", "capacity", "flag", "gens", "held", "name", "word")

    def __init__(self, name: Hashable, bit: int, capacity: int) -> None:
        self.name = name
        self.bit = bit
        self.word, shift = divmod(bit, 64)
        self.flag = _U64(1 << shift)
        self.capacity = capacity
        self.gens = [Generation(1)]  # oldest first; the last is the current one
        self.held = 0

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gens)


class Holdings:
    """Every endpoint's generations of blocks, over one :class:`SlotStore`; the policy of the
    module docstring, and the endpoints' bits (a removed endpoint's bit goes to the next one).

    Changes go through :meth:`register`, :meth:`record`, :meth:`set_capacity` and
    :meth:`remove`; the attributes are for reading. ``words_wanted``: the mask words the
    endpoints' bits need (the store is widened to them, ahead of time by :mod:`epp.prefix.upkeep`,
    or at the first add that needs it).
    """

    __slots__ = ("_free_bits", "_values", "by_bit", "capacities", "endpoints", "names", "size", "store", "words_wanted")

    def __init__(self, store: SlotStore) -> None:
        self.store = store
        self.endpoints: dict[Hashable, Endpoint] = {}
        self.by_bit: list[Endpoint | None] = []  # None: a free bit
        self.names: list[Hashable] = []  # by bit, the endpoints' names (None where free)
        self.size = 0  # blocks held, summed over endpoints
        self.capacities = 0  # summed over endpoints: the most distinct blocks they can hold
        self.words_wanted = 1
        self._free_bits: list[int] = []
        self._values: dict[tuple[int, int, int], np.ndarray] = {}  # (word, code, words) -> a new slot's planes

    @property
    def nbytes(self) -> int:
        """Bytes of the endpoints' lists."""
        return sum(ep.nbytes for ep in self.endpoints.values())

    # --- endpoints ---------------------------------------------------------------------------

    def get(self, name: Hashable) -> Endpoint | None:
        try:
            return self.endpoints.get(name)
        except TypeError:
            raise TypeError(f"endpoint must be hashable, got {type(name).__name__}") from None

    def register(self, name: Hashable, capacity: int) -> Endpoint:
        """A new endpoint (not known yet), on the lowest free bit; it may raise ``words_wanted``."""
        if self._free_bits:
            bit = heapq.heappop(self._free_bits)
        else:
            bit = len(self.by_bit)
            self.by_bit.append(None)
            self.names.append(None)
        self.capacities += capacity
        self.store.capacity_hint = self.capacities
        if bit >= 64 * self.words_wanted:
            self.words_wanted = bit // 64 + 1
        ep = Endpoint(name, bit, capacity)
        self.by_bit[bit] = ep
        self.names[bit] = name
        self.endpoints[name] = ep
        return ep

    def set_capacity(self, ep: Endpoint, capacity: int) -> bool:
        """Set the endpoint's capacity; True when it held more and evicted down to
        ``capacity − capacity // 16``."""
        if capacity == ep.capacity:
            return False
        self.capacities += capacity - ep.capacity
        self.store.capacity_hint = self.capacities
        ep.capacity = capacity
        if ep.held <= capacity:
            return False
        self._evict(ep, capacity - capacity // _EVICT_BATCH, current_too=True)
        return True

    def remove(self, name: Hashable) -> bool:
        """Forget the endpoint and everything it held; False when it was not known."""
        ep = self.endpoints.pop(name, None)
        if ep is None:
            return False
        for gen in ep.gens:
            self._evict_generation(ep, gen, gen.live)
        self.by_bit[ep.bit] = None
        self.names[ep.bit] = None
        heapq.heappush(self._free_bits, ep.bit)
        self.capacities -= ep.capacity
        self.store.capacity_hint = self.capacities
        return True

    # --- codes -------------------------------------------------------------------------------

    def _columns(self, ep: Endpoint) -> np.ndarray:
        words = self.store.words
        return np.array([1 + ep.word, 1 + words + ep.word], dtype=np.intp)

    def _codes(self, rows: np.ndarray, ep: Endpoint, offset: int = 1) -> np.ndarray:
        """The endpoint's generation code (0 = not held) in each row (planes from ``offset``)."""
        c0 = offset + ep.word
        c1 = c0 + self.store.words
        shift = _U64(ep.bit % 64)
        return ((rows[:, c0] >> shift) & _U64(1)) | (((rows[:, c1] >> shift) & _U64(1)) << _U64(1))

    def _pattern(self, ep: Endpoint, code: int) -> np.ndarray:
        """The endpoint's two plane bits for ``code``, at its word in each plane."""
        return np.array([ep.flag if code & 1 else 0, ep.flag if code & 2 else 0], dtype=_U64)

    def _set_code(self, ep: Endpoint, ids: np.ndarray, code: int) -> None:
        """Write the endpoint's code at these current-table slots."""
        columns = self._columns(ep)
        planes = self.store.get_planes(ids, columns)
        planes &= ~ep.flag
        planes |= self._pattern(ep, code)
        self.store.put_planes(ids, columns, planes)

    # --- an add ------------------------------------------------------------------------------

    def record(self, ep: Endpoint, h: np.ndarray, m: int, top: int, last_row: np.ndarray | None) -> None:
        """Steps 2-4 of an add of ``h`` (distinct, nonzero, at most ``ep.capacity`` blocks):
        ``ep`` holds h[0..m); some endpoint holds h[0..top), none h[top]. ``last_row``: the
        table row of h[m-1] if a match looked it up (else it is looked up here)."""
        store = self.store
        if ep.word >= store.words:  # its bit needs the wider table now
            store.grow(store.live, self.words_wanted)
        n = h.size
        cur = ep.gens[-1]
        # Are h[0..m) all in the current generation? Exactly when h[m-1] is (prefix-closure).
        held_codes = None
        if m:
            row = last_row
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
        self.size += gained
        if len(ep.gens) > 1:
            ep.gens[:-1] = [gen for gen in ep.gens[:-1] if gen.live]
        if ep.held > ep.capacity:
            self._evict(ep, ep.capacity - ep.capacity // _EVICT_BATCH, current_too=False)

    def _row_values(self, ep: Endpoint, code: int) -> np.ndarray:
        """The planes of a slot only this endpoint holds, with this code."""
        words = self.store.words
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

    def _close(self, ep: Endpoint) -> Generation:
        """Close the current generation and open a new one with a free code."""
        used = {gen.code for gen in ep.gens}
        code = min(c for c in range(1, _GENERATIONS + 1) if c not in used)
        gen = Generation(code)
        ep.gens.append(gen)
        return gen

    def _drop_closed(self, ep: Endpoint, held: np.ndarray, held_codes: np.ndarray | None) -> None:
        """Step 2's rare case: drop both closed generations but for the prompt's blocks, which
        move to the current generation (about to close)."""
        cur = ep.gens[-1]
        if held_codes is not None:  # (None: all of them are in the current generation)
            moving = np.flatnonzero(held_codes != cur.code)
            if moving.size:
                ids, rows = self.store.find(held[moving])
                codes = self._codes(rows, ep)
                self._set_code(ep, ids, cur.code)
                for gen in ep.gens[:-1]:
                    gen.live -= int(np.count_nonzero(codes == gen.code))
                cur.append(self.store.tag(ids))
                cur.live += moving.size
        for gen in ep.gens[:-1]:
            self._evict_generation(ep, gen, gen.live)
        ep.gens[:-1] = []

    # --- eviction ----------------------------------------------------------------------------

    def _evict(self, ep: Endpoint, target: int, *, current_too: bool) -> None:
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

    def _evict_generation(self, ep: Endpoint, gen: Generation, count: int) -> None:
        """Evict the ``count`` (≤ live) blocks of ``gen`` that entered it last."""
        store = self.store
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
            self.size -= ids.size
            count -= ids.size
        if not gen.live:
            gen.size = 0
        gen.compact()
