"""The prefix-cache index: which endpoint most likely holds a prompt's prefix in its KV-cache.

This is the engine under the ``approx-prefix-cache-producer`` and ``prefix-cache-scorer``
plugins: it remembers which prompt blocks were sent to which endpoint and, for a new prompt,
answers "how many leading blocks of it does each endpoint hold?" (10-30 µs for an 8k-token
prompt against 64 full endpoints, hashing included), and records each pick on the request path (an
:meth:`PrefixIndex.add` of an 8k-token prompt costs microseconds when the endpoint already holds
it, tens when it brings new blocks). Neither is a reason to turn affinity off.

:class:`PrefixIndex` puts together one module per concept, each with its design in its
docstring:

- :mod:`epp.prefix.hashing`: a prompt's chained block hashes (:func:`prompt_hashes`);
- :mod:`epp.prefix.generations`: what each endpoint holds, in three generations (an approximate
  LRU), and what an add writes;
- :mod:`epp.prefix.matching`: how many leading blocks each endpoint holds, from a few sampled
  lookups and hints of where runs ended lately;
- :mod:`epp.prefix.table` and :mod:`epp.prefix.store`: the hash table of slots (a block hash and
  every endpoint's 2-bit code for it) and its growth by migration;
- :mod:`epp.prefix.upkeep`: the bounded steps of that growth, one after each update, and the
  rewriting of the endpoints' lists of slot ids it needs.

A lookup, then an add
---------------------
On the request path a prompt is looked up (:meth:`PrefixIndex.lookup`, or
:meth:`PrefixIndex.matches` for the counts alone), an endpoint picked, and the pick recorded
(:meth:`PrefixIndex.add`). An add needs what the lookup found (the runs, and the table rows it
read), so ``add(endpoint, hashes, lookup=...)`` takes the :class:`PrefixLookup` and skips its
own lookup, as long as nothing changed in the index since: each add, remove and evicting
capacity change makes older lookups stale, and add() then looks the prompt up again (a stale
lookup costs time, never a wrong count). The index keeps no memory of past lookups.

Memory
------
Memory is bounded by the capacities: the table is sized for what is held, never more than the
sum of the endpoints' capacities at 88% load, so a full index of 64 endpoints × 31,250 blocks
that share nothing (the worst case) takes 2.36 million slots of 24 bytes (56.6 MB) plus 4 bytes
per (endpoint, block) of lists: ≈ 62 MiB; less when endpoints share blocks. More than 64
endpoints need a second mask word per plane (40 bytes a slot). During a growth both tables are
allocated.

Not thread-safe: one event loop owns an index (and the hashing scratch buffers).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from epp.prefix.generations import Endpoint, Holdings
from epp.prefix.hashing import as_hashes
from epp.prefix.matching import Matcher, Seen
from epp.prefix.store import SlotStore
from epp.prefix.upkeep import Upkeep

__all__ = ["DEFAULT_LRU_CAPACITY_PER_SERVER", "PrefixIndex", "PrefixIndexStats", "PrefixLookup"]

DEFAULT_LRU_CAPACITY_PER_SERVER = 31250  # upstream's default: ≈ 500K tokens of KV-cache (8B model, 80 GB GPU) / 16
_INITIAL_SLOTS = 1024  # the table's first size; it grows with the blocks held


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


class PrefixLookup:
    """What :meth:`PrefixIndex.lookup` found for a prompt.

    ``hashes``: the prompt's block hashes, as the index took them (a uint64 array);
    ``matches``: every endpoint holding the first block, with how many leading blocks it holds
    (what :meth:`PrefixIndex.matches` returns). Passed to :meth:`PrefixIndex.add` with the same
    hashes, it spares the add its own lookup while it is fresh: until the index next changes.
    Made only by the index; treat as read-only.
    """

    __slots__ = ("_index", "_runs", "_seen", "_version", "hashes", "matches")

    def __init__(
        self,
        index: PrefixIndex,
        version: int,
        hashes: np.ndarray,
        matches: dict[Hashable, int],
        runs: dict[int, int],
        seen: Seen | None,
    ) -> None:
        self._index = index
        self._version = version
        self.hashes = hashes
        self.matches = matches
        self._runs = runs  # by endpoint bit
        self._seen = seen  # the table rows looked up on the way

    def __repr__(self) -> str:
        return f"PrefixLookup({self.hashes.size} blocks, matches={self.matches!r})"


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
        self._holdings = Holdings(self._store)
        self._matcher = Matcher(self._store)
        self._upkeep = Upkeep(self._store, self._holdings)
        self._adds = self._matched = self._offered = 0
        self._version = 0  # bumped by every change to what endpoints hold: older lookups are stale

    # --- what it holds -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Block hashes held, summed over endpoints (upstream's prefix_indexer_size)."""
        return self._holdings.size

    def __len__(self) -> int:
        return self._holdings.size

    @property
    def nbytes(self) -> int:
        """Bytes of the index's numpy arrays: the hash table(s) and every endpoint's lists."""
        return self._store.nbytes + self._holdings.nbytes

    @property
    def stats(self) -> PrefixIndexStats:
        return PrefixIndexStats(self._adds, self._matched, self._offered)

    def endpoints(self) -> list[Hashable]:
        return list(self._holdings.endpoints)

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._holdings.endpoints

    def endpoint_size(self, endpoint: Hashable) -> int:
        """Blocks the endpoint holds (0 for an unknown endpoint)."""
        ep = self._holdings.endpoints.get(endpoint)
        return 0 if ep is None else ep.held

    def capacity(self, endpoint: Hashable) -> int:
        """The endpoint's capacity in blocks (the default for an unknown endpoint)."""
        ep = self._holdings.endpoints.get(endpoint)
        return self.default_capacity if ep is None else ep.capacity

    # --- matching ----------------------------------------------------------------------------

    def lookup(self, hashes: np.ndarray | Iterable[int]) -> PrefixLookup:
        """What :meth:`matches` finds, and what :meth:`add` needs to skip its own lookup of the
        same hashes (pass it as ``lookup=``)."""
        h = as_hashes(hashes)
        runs, seen = self._matcher.runs(h) if h.size and self._holdings.size else ({}, None)
        names = self._holdings.names
        return PrefixLookup(self, self._version, h, {names[bit]: count for bit, count in runs.items()}, runs, seen)

    def matches(self, hashes: np.ndarray | Iterable[int]) -> dict[Hashable, int]:
        """Every endpoint holding the prompt's first block, with how many leading blocks it holds.

        ``hashes`` is the output of :func:`~epp.prefix.hashing.prompt_hashes` (or a prefix of
        it). Upstream's score is this count divided by ``len(hashes)``.
        """
        h = as_hashes(hashes)
        runs = self._matcher.runs(h)[0] if h.size and self._holdings.size else {}
        names = self._holdings.names
        return {names[bit]: count for bit, count in runs.items()}

    def match(self, hashes: np.ndarray | Iterable[int], endpoints: Sequence[Hashable]) -> list[int]:
        """For each of ``endpoints``, how many leading blocks of the prompt it holds."""
        found = self.matches(hashes)
        return [found.get(endpoint, 0) for endpoint in endpoints]

    # --- updates -----------------------------------------------------------------------------

    def add(
        self,
        endpoint: Hashable,
        hashes: np.ndarray | Iterable[int],
        *,
        count_hit: bool = True,
        lookup: PrefixLookup | None = None,
    ) -> int:
        """Record that the prompt with these block hashes was sent to ``endpoint``.

        Moves the blocks into the endpoint's current generation (the first block the freshest),
        inserting those it does not hold, and evicts past its capacity (see
        :mod:`epp.prefix.generations`); a prompt longer than the capacity keeps its first
        ``capacity`` blocks. ``hashes`` must be the output of
        :func:`~epp.prefix.hashing.prompt_hashes` or a prefix of it: distinct, nonzero, and
        added whole (matching relies on it). Returns how many leading blocks the endpoint
        already held, and counts it in :attr:`stats` unless ``count_hit`` is false (for a second
        endpoint of one request, e.g. a prefill pod).

        ``lookup``: what :meth:`lookup` found for these hashes, to be used instead of looking
        them up again if nothing changed in the index since (else it is looked up again).
        ValueError if it was made by another index or for other hashes.
        """
        if lookup is None:
            h = as_hashes(hashes)
        else:
            if lookup._index is not self:
                raise ValueError("lookup was made by another PrefixIndex")
            h = lookup.hashes  # as lookup() took them
            if hashes is not h and not np.array_equal(as_hashes(hashes), h):
                raise ValueError("lookup was made for other hashes")
        if h.size and np.count_nonzero(h) != h.size:  # (counting is 3× quicker than h.all() on uint64)
            raise ValueError("hashes must be nonzero (0 is reserved), as prompt_hashes makes them")
        ep = self._holdings.get(endpoint) or self._register(endpoint, self.default_capacity)
        offered = h.size
        if offered > ep.capacity:
            h = h[: ep.capacity]
        n = h.size
        matched = 0
        if n:
            if lookup is not None and lookup._version == self._version:
                runs, seen = lookup._runs, lookup._seen
                if n < offered:
                    runs = {bit: min(count, n) for bit, count in runs.items()}
            elif self._holdings.size:
                runs, seen = self._matcher.runs(h)
            else:
                runs, seen = {}, None
            matched = runs.get(ep.bit, 0)
            last_row = seen.row(matched - 1) if matched and seen is not None else None
            self._holdings.record(ep, h, matched, max(runs.values(), default=0), last_row)
            self._matcher.added(h)
            self._version += 1  # (what _changed() does, inline on the request path)
            self._upkeep.step(self._version)
        if count_hit:
            self._adds += 1
            self._matched += matched
            self._offered += offered
        return matched

    def set_capacity(self, endpoint: Hashable, capacity: int) -> None:
        """Set the endpoint's capacity in blocks (autoTune: its ``num_gpu_blocks``), evicting
        down to ``capacity − capacity // 16`` when it holds more (see
        :mod:`epp.prefix.generations`)."""
        capacity = _check_capacity(capacity)
        ep = self._holdings.get(endpoint)
        if ep is None:
            self._register(endpoint, capacity)
        elif self._holdings.set_capacity(ep, capacity):
            self._changed()

    def remove(self, endpoint: Hashable) -> bool:
        """Forget the endpoint and everything it held; False when it was not known."""
        if not self._holdings.remove(endpoint):
            return False
        self._changed()
        return True

    # --- internals -----------------------------------------------------------------------------

    def _register(self, endpoint: Hashable, capacity: int) -> Endpoint:
        words = self._holdings.words_wanted
        ep = self._holdings.register(endpoint, capacity)
        if self._holdings.words_wanted > words:  # a wider table: prepared now, in use at its first add
            self._upkeep.step(self._version)
        return ep

    def _changed(self) -> None:
        """What endpoints hold changed: older lookups are stale; a step of upkeep."""
        self._version += 1
        self._upkeep.step(self._version)

    def _maintain(self) -> None:
        """One step of upkeep, as after an update (tests and benchmarks drive a growth with it)."""
        self._upkeep.step(self._version)

    def _rewrite_ids(self) -> None:
        """The store's callback: rewrite every list of slot ids now (see :class:`SlotStore`)."""
        self._upkeep.rewrite_all()
