"""Matching: how many leading blocks of a prompt each endpoint holds, in one or two vectorised
table lookups of a few dozen blocks, not one per block.

It relies on the generation policy's result (:mod:`epp.prefix.generations`): every endpoint's
set of blocks is *prefix-closed* (holding ``h[i]`` means holding ``h[0..i-1]``). So the endpoints
holding ``h[i]`` can only shrink as *i* grows: one lookup of about √n sampled blocks finds, for
each endpoint, the gap between two samples where its run ends, and a second lookup of just
those gaps' blocks finds the exact end. O(√n) lookups instead of n, in two vectorised calls; a
prompt of at most 64 blocks is looked up whole in one.

Most runs end where the prompt parts from one sent before: after a family's shared system
prompt, or where a conversation's previous turn ended. So the index keeps, for each first block
(of the last 1,024 added), the length of the last prompt added that started with it and up to
four run ends that matches of such prompts found twice running (an end found once may be a
one-off); the first lookup takes the blocks on either side of each of those along with the
samples. A run that ends at one of them is then known exactly, and only runs that end
elsewhere need the second lookup. A prompt whose first block is not among them most likely
starts where no endpoint holds anything, and is sampled four times more sparsely (every 4√n-th
block: fewer keys, and a new key's buckets are cache misses). None of this can make a count
wrong: hints and spacing only choose which blocks are looked up first.

A match also hands back the table rows it looked up (:class:`Seen`): an add that follows reads
the endpoint's code at its last held block there instead of looking it up again.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

from epp.prefix.store import SlotStore
from epp.prefix.table import bits, holder_masks

__all__ = ["Matcher", "Seen"]

_DENSE = 1.0  # a prompt whose first block was seen lately is sampled every _DENSE·√n blocks,
_SPARSE = 4.0  # one whose first block was not (most likely held nowhere) every _SPARSE·√n
_FULL_LOOKUP = 64  # prompts of at most this many blocks are looked up whole, not sampled
_RECENT_PROMPTS = 1024  # first blocks whose recent prompts' lengths and run ends the index keeps as hints
_RECENT_ENDS = 4  # run ends kept per first block
_NO_ROWS = np.empty((0, 3), dtype=np.uint64)
_NO_ROWS.flags.writeable = False


@lru_cache(maxsize=512)
def _samples(n: int, spacing: float) -> tuple[np.ndarray, list[int]]:
    """Block positions to look up first for an n-block prompt: every (spacing·√n)-th, and the last."""
    positions = np.arange(0, n, max(2, int(spacing * math.sqrt(n))))
    if positions[-1] != n - 1:
        positions = np.append(positions, n - 1)
    positions.flags.writeable = False
    return positions, positions.tolist()


class Seen:
    """The rows a match looked up: at ``positions`` (samples, or every block), at ``hints``
    (their rows follow the samples' in ``rows``), and in the gaps ``spans`` ((start, end, _)
    block ranges, concatenated in ``gap_rows``)."""

    __slots__ = ("gap_rows", "hints", "positions", "rows", "spans")

    def __init__(self, positions: Sequence[int], hints: Sequence[int], rows: np.ndarray) -> None:
        self.positions = positions
        self.hints = hints
        self.rows = rows
        self.spans: list[tuple[int, int, int]] = []
        self.gap_rows = _NO_ROWS

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

    __slots__ = ("_for", "added", "ends", "seen")

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


class Matcher:
    """Runs of a prompt's blocks held by each endpoint, looked up in a :class:`SlotStore`; and
    the hints (per first block, where runs ended lately) that make most matches one lookup."""

    __slots__ = ("_recent", "_store")

    def __init__(self, store: SlotStore) -> None:
        self._store = store
        self._recent: OrderedDict[int, _Recent] = OrderedDict()  # by first block hash, least recent first

    def held(self, keys: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The table rows of the keys, and for each key the mask of endpoints holding it."""
        rows = self._store.lookup(keys)
        if rows.shape[1] == 3:  # one mask word, the common case: holder_masks' first branch, without its call
            return rows, (rows[:, 1] | rows[:, 2]).tolist()
        return rows, holder_masks(rows)

    def runs(self, h: np.ndarray) -> tuple[dict[int, int], Seen]:
        """Endpoint bit → leading blocks of ``h`` (not empty) held, for every endpoint holding
        ``h[0]``; and the rows looked up on the way (an add reads the endpoint's code at its last
        block there)."""
        n = h.size
        positions: Sequence[int]
        hints: list[int] = []
        recent = None
        if n <= _FULL_LOOKUP:
            positions = range(n)
            rows, held = self.held(h)
        else:
            recent = self._recent.get(int(h[0]))
            if recent is None:
                sampled, positions = _samples(n, _SPARSE)
            else:
                hints, sampled = recent.hints(n)
                positions = _samples(n, _DENSE)[1]
            rows, held = self.held(h.take(sampled))
        seen = Seen(positions, hints, rows)
        alive = held[0]
        if not alive:
            return {}, seen
        # The holders only shrink along the prompt: find the sample where each endpoint drops out.
        spans: list[tuple[int, int, int]] = []  # (first block, end block, endpoints that dropped out)
        for k, mask in enumerate(held[: len(positions)] if hints else held):
            dropped = alive & ~mask
            if dropped:
                spans.append((positions[k - 1] + 1, positions[k], dropped))
                alive ^= dropped
                if not alive:
                    break
        found = dict.fromkeys(bits(alive), n) if alive else {}
        if spans:
            if hints:  # split the spans at the hinted blocks: often down to the exact ends
                spans = _narrow(spans, hints, held[len(positions) :])
            self._resolve(h, spans, seen, found)
            if recent is not None:
                recent.learn(found.values(), n)
        return found, seen

    def _resolve(self, h: np.ndarray, spans: list[tuple[int, int, int]], seen: Seen, found: dict[int, int]) -> None:
        """Find where each span's endpoints' runs end: a span (start, end, endpoints) holds
        endpoints that hold ``h[start-1]`` and lack ``h[end]``; one lookup of all the spans'
        blocks tells where in between (an empty span needs none)."""
        open_spans = []
        for span in spans:
            if span[0] < span[1]:
                open_spans.append(span)
            else:
                for bit in bits(span[2]):
                    found[bit] = span[1]
        if not open_spans:
            return
        if len(open_spans) == 1:
            between = h[open_spans[0][0] : open_spans[0][1]]
        else:
            between = np.concatenate([h[start:end] for start, end, _ in open_spans])
        seen.gap_rows, inside = self.held(between)
        seen.spans = open_spans
        offset = 0
        for start, end, dropped in open_spans:
            j = start
            for mask in inside[offset : offset + end - start]:
                gone = dropped & ~mask
                if gone:
                    for bit in bits(gone):
                        found[bit] = j
                    dropped ^= gone
                    if not dropped:
                        break
                j += 1
            for bit in bits(dropped):  # held through the span, not at the block that ends it
                found[bit] = end
            offset += end - start

    def added(self, h: np.ndarray) -> None:
        """The prompt ``h`` (as recorded: at most the endpoint's capacity) was added: remember
        its length under its first block, a hint for the next prompts that start with it."""
        blocks = h.size
        if blocks <= _FULL_LOOKUP:
            return
        first = int(h[0])
        recent = self._recent.get(first)
        if recent is None:
            self._recent[first] = _Recent(blocks)
            if len(self._recent) > _RECENT_PROMPTS:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(first)
            recent.added_blocks(blocks)
