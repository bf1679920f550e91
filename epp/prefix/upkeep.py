"""The index's upkeep: growing the slot table without stalling the request path, and keeping the
endpoints' lists of slot ids valid while it moves.

The table grows, in either dimension (more slots, or more mask words for more endpoints),
without stalling the request path: the next table is allocated and its pages touched a bounded
piece per update (first touches of fresh memory are slow), then the keys move over a few hundred
per update (:mod:`epp.prefix.store` says how), then each endpoint's lists are rewritten a bounded
piece per update (8,192 ids; all at once when they hold at most 65,536 in all), and then the old
table is freed; lookups meanwhile consult both tables. The index runs one :meth:`Upkeep.step`
after each update. Registering an endpoint (the plugin does it when a pod joins the pool) is
what starts this when its bit needs a wider table, so its first add finds the table ready.

When a growth must start before the lists are rewritten (the table is full, or an endpoint needs
the wider table now), the store calls back (its ``rewrite_ids``) and :meth:`Upkeep.rewrite_all`
rewrites every list at once.

Otherwise, now and then (at most every 64 updates), keys are moved out of the spill buckets
where their own buckets have room again (every lookup reads a third bucket while any key is
spilled), and their holders' ids rewritten.
"""

from __future__ import annotations

import numpy as np

from epp.prefix.generations import Endpoint, Holdings
from epp.prefix.store import SlotStore
from epp.prefix.table import bits, holder_masks

__all__ = ["Upkeep"]

_REWRITE_AT_ONCE = 65536  # list entries rewritten in one go after a migration (else in steps of:)
_REWRITE_STEP = 8192
_UNSPILL_EVERY = 64  # updates between two tries at emptying the spill buckets


class Upkeep:
    """The bounded steps of growing ``store`` and rewriting the lists of ``holdings``."""

    __slots__ = ("_holdings", "_next_unspill", "_rewrite", "_rewrite_epoch", "_store")

    def __init__(self, store: SlotStore, holdings: Holdings) -> None:
        self._store = store
        self._holdings = holdings
        self._rewrite: list[Endpoint] = []  # endpoints whose lists still hold old-table ids
        self._rewrite_epoch = 0  # the migration that list was made for
        self._next_unspill = 0  # the update at which to try emptying the spill bucket again

    @property
    def busy(self) -> bool:
        """Growing: a table prepared, keys moving, or lists still to rewrite."""
        return self._store.busy or bool(self._rewrite)

    def step(self, updates: int) -> None:
        """One bounded step of growing the table, if it is growing: touch the prepared table,
        move keys into it, rewrite the endpoints' lists, free the old table. Otherwise, now and
        then, move keys out of the spill buckets. ``updates``: the index's count of updates."""
        store = self._store
        if store.next is not None and not store.migrating:
            store.step()  # touch the prepared table; it takes over once warm
            return
        if not store.migrating:
            if self._holdings.words_wanted > store.words:
                store.prepare(store.live, self._holdings.words_wanted)
            elif store.spilled and updates >= self._next_unspill:
                self._next_unspill = updates + _UNSPILL_EVERY
                self._unspill()
            return
        if store.moving:
            store.step()
            return
        endpoints = self._holdings.endpoints
        if self._rewrite_epoch != store.epoch:  # every key has moved: now the lists
            self._rewrite_epoch = store.epoch
            self._rewrite = list(endpoints.values())
            for ep in self._rewrite:
                for gen in ep.gens:
                    gen.clean = 0
            if sum(gen.size for ep in self._rewrite for gen in ep.gens) <= _REWRITE_AT_ONCE:
                self._rewrite_pending()
            return
        budget = _REWRITE_STEP
        while self._rewrite and budget > 0:
            ep = self._rewrite[-1]
            if endpoints.get(ep.name) is ep:
                budget = self._rewrite_lists(ep, budget)
                if budget <= 0:
                    return
            self._rewrite.pop()
        if not self._rewrite:
            store.drop_old()

    def rewrite_all(self) -> None:
        """Rewrite every endpoint's lists now: the store's ``rewrite_ids`` callback (every key
        has moved; the store frees the old table when this returns, to start another growth)."""
        self._rewrite_epoch = self._store.epoch
        for ep in self._holdings.endpoints.values():
            for gen in ep.gens:
                gen.clean = 0
            self._rewrite_lists(ep)
        self._rewrite = []

    def _rewrite_pending(self) -> None:
        """Rewrite the lists still to rewrite at once, and free the old table."""
        endpoints = self._holdings.endpoints
        for ep in self._rewrite:
            if endpoints.get(ep.name) is ep:
                for gen in ep.gens:
                    gen.clean = 0
                self._rewrite_lists(ep)
        self._rewrite = []
        self._store.drop_old()

    def _rewrite_lists(self, ep: Endpoint, budget: int = 1 << 62) -> int:
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

    def _unspill(self) -> None:
        """Move keys out of the spill bucket where they fit now, and rewrite their holders' ids."""
        store = self._store
        old, new = store.unspill()
        if not old.size:
            return
        holders = holder_masks(np.bitwise_or.reduce(store.get(store.resolve(new)), axis=0)[None, :])[0]
        by_bit = self._holdings.by_bit
        for bit in bits(holders):
            ep = by_bit[bit]
            if ep is None:  # (never: a removed endpoint's bits are cleared)
                continue
            for gen in ep.gens:
                ids = gen.ids[: gen.size]
                at = np.searchsorted(old, ids)
                np.minimum(at, old.size - 1, out=at)
                hit = old[at] == ids
                ids[hit] = new[at[hit]]
