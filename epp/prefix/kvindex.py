"""The precise prefix index: which blocks each pod holds, as the pods' own KV-cache events say.

Keys. A block is keyed by this index's own 64-bit hash, never the engine's: the engine's hashes are
not reproducible outside its process (a sha256 chain over pickled tokens, seeded per process) and a
chain cannot be extended from the ints alone. The key of a stored block is
``xxh64(le64(parent key) ‖ token ids as le32 ‖ msgpack(extra keys) if any, seed)``, 0 replaced by 1,
chained from the key of its parent (found through the pod's map engine hash -> key; 0 for a first
block), so a request's token ids, cut into blocks of the same size, give the same keys
(:func:`chain_keys`). The chain is computed in C, a whole event's blocks in one call
(``epp.prefix._native.kv_chain``, ~50 ns a block; ~0.22 ms for a 100k-token prompt). A block with
``extra_keys`` (vLLM: the LoRA adapter's name on every block of an adapter request, the
``cache_salt`` on the first block, multimodal ids) only matches a lookup that passes the same keys:
:func:`chain_keys` takes ``lora_name`` and ``cache_salt`` and chains vLLM's per-block tuples a run
of equal ones per native call (a request has two runs at most; finding them block by block in
Python cost an adapter request 0.45 ms more at 100k tokens); a plain lookup never matches a salted
or adapter block (the engine would not reuse it either). The engine's hash is kept only to resolve
``BlockRemoved`` and parents.

State. Per pod (a :data:`PodId`, ``"ip:port"`` or ``"ip:port@rank"``) and per *space* (the medium,
``GPU`` when unnamed, and the KV-cache group ``group_idx``): engine hash -> key, in insertion order,
and key -> how many engine hashes of that space hold it. Over all pods, key -> {pod: weight}, the
weight the best medium that holds the block (``GPU`` 1.0, ``CPU`` 0.8, llm-d's defaults; other
media 0 unless configured). Storing a hash already held is idempotent and ``BlockRemoved`` removes
it: vLLM may store one hash twice (two requests computed the same block; ``kv_cache_report_mode:
full`` re-announces hits), and counting copies would keep a removed block forever, while this way a
duplicate's first eviction only hides a block that is still there (a missed hit, never a false one,
as llm-d's index does). A lookup walks the request's keys once and keeps, per pod, the run of
consecutive blocks from the first (and its weighted sum). Memory is bounded: a pod holds at most
``max_blocks_per_pod`` blocks (the oldest stored are dropped first, counted in
``evicted_by_bound``); a pod the pool no longer has is dropped with :meth:`remove_pod`.

A pod is *known* while its stream is followed without a hole; :meth:`mark_unknown` (a gap with no
replay, a lost connection) drops its blocks and makes :meth:`known` false until :meth:`apply` is
called for it again, so the producer can fall back to the approximate index for it meanwhile.

Cost (``python bench/kvevents_decode.py``: one batch of 32 events storing 512 blocks of 16 tokens,
applied to a pod new to the index each time): 230 µs, 0.45 µs per block, where the first version
took 2,430 µs (4.7 µs per block: a Python xxh3 call, a numpy array and four dict updates per
block; 180-195 µs now); decoding the batch (msgspec, 33 KB) takes 148 µs more. Pods are bits of one
mask per key, not a dict per key: a dict per block made the garbage collector's full passes walk
every block of the index, pauses of 100 ms and more during an event storm.

Lookups. The masks live in native maps (``_native.KeyMasks``: two flat uint64 arrays, open
addressing), one per 64 pod slots (a second one only with more than 64 pods at once). A lookup
walks the request's keys in C, fetching the slots of the keys ahead: for a 100k-token prompt that
one pod holds (6,354 blocks; ~60k keys in the index) 0.3-0.5 ms where a Python walk over a dict of
ints took ~2 ms, mostly cache misses (a dict lookup reads its index, its entry and the key's int
object; ``python bench/tokenize_cost.py``, "produce").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from epp.prefix import _native
from epp.prefix.kvwire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, KVEvent

__all__ = ["DEFAULT_MEDIA_WEIGHTS", "KVEventIndex", "KVIndexStats", "PodId", "block_extra_keys", "chain_keys"]

PodId = str
DEFAULT_MEDIA_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8}
_DEFAULT_MEDIUM = "GPU"
_ENCODE = msgspec.msgpack.Encoder().encode
_NO_SUFFIX = b""


_Extra = tuple[str, ...] | None  # one block's extra keys


def _first_and_rest(lora_name: str | None, cache_salt: str | None) -> tuple[_Extra, _Extra]:
    """vLLM's extra keys of a request's first block and of every later one (None: no extra keys)."""
    rest = (lora_name,) if lora_name else None
    first = tuple(k for k in (lora_name, cache_salt) if k) or None
    return first, rest


def block_extra_keys(count: int, lora_name: str | None = None, cache_salt: str | None = None) -> list[Any] | None:
    """vLLM's per-block ``extra_keys`` of a request (``to_event_extra_keys``): the adapter's name on
    every block, the cache salt on the first; None when the request has neither."""
    first, rest = _first_and_rest(lora_name, cache_salt)
    if first is None:
        return None
    return [first, *([rest] * (count - 1))] if count else []


def _runs(extra: Sequence[Any] | None, count: int) -> list[tuple[int, Any]]:
    """``(blocks, extra keys)`` of the runs of equal extra keys over the first ``count`` blocks, in
    order; a block past the end of ``extra`` has none."""
    if not extra:
        return [(count, None)]
    listed = min(len(extra), count)
    # groupby compares neighbours in C (equal tuples of one event, or one shared tuple: identity).
    runs = [(len(list(group)), e) for e, group in itertools.groupby(itertools.islice(extra, listed))]
    if listed < count:
        runs.append((count - listed, None))
    return runs


def _chain(
    tokens: list[int] | np.ndarray, block_size: int, parent: int, seed: int, runs: Sequence[tuple[int, Any]]
) -> list[int]:
    """Keys of the blocks of ``runs`` (see :func:`_runs`), chained from ``parent``: one native call a run."""
    if len(runs) == 1 and runs[0][1] is None:
        return _native.kv_chain(tokens, block_size, runs[0][0], parent, seed, _NO_SUFFIX)
    keys: list[int] = []
    start = 0
    for blocks, e in runs:
        if not blocks:
            continue
        suffix = _NO_SUFFIX if e is None else _ENCODE(e)
        part = tokens[start * block_size : (start + blocks) * block_size]
        if isinstance(part, np.ndarray):
            part = np.ascontiguousarray(part, dtype=np.uint32)
        elif not isinstance(part, list):
            part = list(part)
        run = _native.kv_chain(part, block_size, blocks, parent, seed, suffix)
        keys += run
        parent = run[-1]
        start += blocks
    return keys


def chain_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    seed: int = 0,
    max_blocks: int | None = None,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    known: Sequence[int] = (),
) -> list[int]:
    """The keys of the whole blocks of ``token_ids``, as stored events of the same request give them
    (their extra keys :func:`block_extra_keys`'s, chained a run at a time without building them).

    ``known``: the keys of the first blocks, computed before by this function from the same first
    tokens and arguments (a prompt's start looked up before the rest was tokenized): the chain goes
    on from them instead of starting over."""
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    tokens: list[int] | np.ndarray
    if isinstance(token_ids, np.ndarray):
        tokens = np.ascontiguousarray(token_ids, dtype=np.uint32)
    else:
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    count = len(tokens) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    if count <= 0:
        return []
    first, rest = _first_and_rest(lora_name, cache_salt)
    if known:
        done = min(len(known), count)
        return [*known[:done], *_chain(tokens[done * block_size :], block_size, known[done - 1], seed,
                                       [(count - done, rest)])]  # fmt: skip
    runs = [(count, rest)] if first == rest else [(1, first), (count - 1, rest)]
    return _chain(tokens, block_size, 0, seed, runs)


@dataclass(frozen=True, slots=True)
class KVIndexStats:
    pods: int
    blocks: int
    evicted_by_bound: int
    unresolved_parents: int


class _Space:
    """One medium (and KV-cache group) of one pod."""

    __slots__ = ("counts", "held", "weight")

    def __init__(self, weight: float) -> None:
        self.held: dict[EngineHash, int] = {}  # engine hash -> key, oldest first
        self.counts: dict[int, int] = {}  # key -> engine hashes of this space holding it
        self.weight = weight


_WORD = 64  # pod slots per native map: slot s is bit s % 64 of map s // 64


class _Pod:
    __slots__ = ("bit", "block_size", "known", "masks", "size", "spaces", "word_bit")

    def __init__(self, bit: int, masks: _native.KeyMasks) -> None:
        self.spaces: dict[tuple[str, int | None], _Space] = {}
        self.known = True
        self.block_size = 0
        self.size = 0  # engine hashes held, over every space
        self.bit = bit  # 1 << slot: this pod's bit in the index's masks
        self.masks = masks  # the map of its slot's word
        self.word_bit = 1 << ((bit.bit_length() - 1) % _WORD)  # its bit there


class KVEventIndex:
    """Blocks per pod from KV events; one instance per picker, touched from one thread (the loop)."""

    def __init__(
        self,
        *,
        seed: int = 0,
        max_blocks_per_pod: int = 1 << 20,
        media_weights: Mapping[str, float] = DEFAULT_MEDIA_WEIGHTS,
        on_store: Callable[[PodId, list[int]], None] | None = None,
    ) -> None:
        if max_blocks_per_pod < 1:
            raise ValueError(f"max_blocks_per_pod must be ≥ 1, got {max_blocks_per_pod}")
        self.seed = seed
        self.on_store = on_store
        """Called with a pod and the keys of each BlockStored applied for it (in-flight bookkeeping)."""
        self.max_blocks_per_pod = max_blocks_per_pod
        self._weights = dict(media_weights)
        self._pods: dict[PodId, _Pod] = {}
        self._slots: list[PodId | None] = []  # slot -> pod; a pod's bit is 1 << its slot
        # key -> mask of the pods holding it, one native map per 64 pod slots: no Python object per
        # block (a dict per block made the garbage collector's full passes walk every block, pauses
        # of 100+ ms in an event storm; a dict of ints cost a lookup three cache misses).
        self._words: list[_native.KeyMasks] = []
        # key -> {pod bit: weight} for the pods that hold it only on media weighing less than 1.
        self._weak: dict[int, dict[int, float]] = {}
        self._evicted = 0
        self._unresolved = 0

    # -- events ---------------------------------------------------------------------------------

    def apply(self, pod: PodId, events: Iterable[KVEvent]) -> None:
        """Apply one batch of ``pod``'s events, in order; the pod is known afterwards."""
        state = self._pods.get(pod) or self._add_pod(pod)
        state.known = True
        for event in events:
            if isinstance(event, BlockStored):
                self._store(pod, state, event)
            elif isinstance(event, BlockRemoved):
                space = state.spaces.get((event.medium or _DEFAULT_MEDIUM, event.group_idx))
                if space is not None:
                    for engine_hash in event.block_hashes:
                        self._drop(pod, state, space, engine_hash)
            elif isinstance(event, AllBlocksCleared):
                self.clear_pod(pod)

    def _add_pod(self, pod: PodId) -> _Pod:
        try:
            slot = self._slots.index(None)
            self._slots[slot] = pod
        except ValueError:
            slot = len(self._slots)
            self._slots.append(pod)
        while len(self._words) <= slot // _WORD:
            self._words.append(_native.KeyMasks())
        state = self._pods[pod] = _Pod(1 << slot, self._words[slot // _WORD])
        return state

    def _space(self, state: _Pod, medium: str, group: int | None) -> _Space:
        space = state.spaces.get((medium, group))
        if space is None:
            space = state.spaces[(medium, group)] = _Space(self._weights.get(medium, 0.0))
        return space

    def _store(self, pod: PodId, state: _Pod, event: BlockStored) -> None:
        size = event.block_size
        hashes = event.block_hashes
        tokens = event.token_ids
        count = min(len(hashes), len(tokens) // size) if size > 0 else 0
        if count <= 0:
            return  # only full blocks are published; a short tail cannot be a block
        space = self._space(state, event.medium or _DEFAULT_MEDIUM, event.group_idx)
        parent = 0
        if event.parent_block_hash is not None:
            found = space.held.get(event.parent_block_hash)
            if found is None:  # the parent may live in another space of the same pod
                for other in state.spaces.values():
                    found = other.held.get(event.parent_block_hash)
                    if found is not None:
                        break
            if found is None:
                # A parent this index never saw (stored before it subscribed, or evicted): the
                # chain cannot be rebuilt, and a guessed key could only produce false matches.
                self._unresolved += 1
                return
            parent = found
        state.block_size = size
        keys = _chain(tokens, size, parent, self.seed, _runs(event.extra_keys, count))
        if self.on_store is not None:
            self.on_store(pod, keys)
        held, counts, weight = space.held, space.counts, space.weight
        where = state.masks
        bit, word_bit = state.bit, state.word_bit
        added = 0
        for engine_hash, key in zip(hashes, keys, strict=False):  # keys: the whole blocks only
            old = held.get(engine_hash)
            if old is not None:
                if old == key:
                    continue  # stored again (a duplicate, a reported hit): idempotent
                self._drop(pod, state, space, engine_hash)
            held[engine_hash] = key
            added += 1
            c = counts.get(key)
            if c:
                counts[key] = c + 1
                continue
            counts[key] = 1
            if not where.add(key, word_bit) & word_bit:
                if weight < 1.0:
                    self._weak.setdefault(key, {})[bit] = weight
            elif weight < 1.0 or key in self._weak:
                self._reweigh(state, key)
        state.size += added
        over = state.size - self.max_blocks_per_pod
        if over > 0:
            # The oldest first, a sixteenth of the bound at a time: taking them one by one from the
            # front of a dict rescans its deleted slots each time (quadratic in a storm).
            victims = list(itertools.islice(held, max(over, self.max_blocks_per_pod // 16)))
            for victim in victims:
                self._drop(pod, state, space, victim)
            self._evicted += len(victims)

    def _drop(self, pod: PodId, state: _Pod, space: _Space, engine_hash: EngineHash) -> None:
        key = space.held.pop(engine_hash, None)
        if key is None:
            return
        state.size -= 1
        c = space.counts[key] - 1
        if c:
            space.counts[key] = c
            return
        del space.counts[key]
        if len(state.spaces) > 1 and any(key in other.counts for other in state.spaces.values()):
            self._reweigh(state, key)  # still held on another medium
            return
        self._unhold(state, key)

    def _unhold(self, state: _Pod, key: int) -> None:
        state.masks.discard(key, state.word_bit)
        weak = self._weak.get(key)
        if weak is not None and weak.pop(state.bit, None) is not None and not weak:
            del self._weak[key]

    def _reweigh(self, state: _Pod, key: int) -> None:
        """The pod holds ``key``: record the weight of its best medium for it."""
        best = max(space.weight for space in state.spaces.values() if key in space.counts)
        if best < 1.0:
            self._weak.setdefault(key, {})[state.bit] = best
        else:
            weak = self._weak.get(key)
            if weak is not None and weak.pop(state.bit, None) is not None and not weak:
                del self._weak[key]

    def clear_pod(self, pod: PodId) -> None:
        """Forget every block of ``pod`` (AllBlocksCleared, a restart); it stays tracked."""
        state = self._pods.get(pod)
        if state is None:
            return
        for space in state.spaces.values():
            for key in space.counts:
                self._unhold(state, key)
        state.spaces.clear()
        state.size = 0

    def mark_unknown(self, pod: PodId) -> None:
        """Drop ``pod``'s blocks and call it unknown until its next applied batch."""
        self.clear_pod(pod)
        state = self._pods.get(pod) or self._add_pod(pod)
        state.known = False

    def remove_pod(self, pod: PodId) -> None:
        self.clear_pod(pod)
        state = self._pods.pop(pod, None)
        if state is not None:
            self._slots[state.bit.bit_length() - 1] = None

    # -- queries --------------------------------------------------------------------------------

    def known(self, pod: PodId) -> bool:
        """Whether ``pod`` publishes events and its stream is followed without a hole."""
        state = self._pods.get(pod)
        return state is not None and state.known

    def pods(self) -> list[PodId]:
        return list(self._pods)

    def block_size(self) -> int:
        """The block size the pods' events use (0 until one stored a block)."""
        return max((p.block_size for p in self._pods.values()), default=0)

    def block_sizes(self) -> set[int]:
        """Every block size pods' events use (pods of different engines may differ)."""
        return {p.block_size for p in self._pods.values() if p.block_size}

    def match(self, keys: Sequence[int]) -> dict[PodId, tuple[int, float]]:
        """Per pod holding the first block: (consecutive blocks held from the first, their weighted sum).

        The walk is the native maps' (``KeyMasks.match``, one per 64 pod slots: each key's slot
        fetched a few keys ahead; a Python loop over a dict of ints took 2 ms for a 100k-token
        prompt one pod holds, most of it cache misses); the blocks a pod holds only on a lighter
        medium (``_weak``) lower its sum."""
        if not keys:
            return {}
        keys = keys if isinstance(keys, list) else list(keys)
        runs = [(w * _WORD + slot, run) for w, word in enumerate(self._words) for slot, run in word.match(keys)]
        if not runs:
            return {}
        loss: dict[int, float] = {}  # slot -> weight its blocks lack from 1 each
        weak = self._weak
        if weak:
            ends = {1 << slot: run for slot, run in runs}
            longest = max(ends.values())
            for j in itertools.compress(range(longest), map(weak.__contains__, keys[:longest])):
                for bit, w in weak[keys[j]].items():
                    if j < ends.get(bit, 0):
                        slot = bit.bit_length() - 1
                        loss[slot] = loss.get(slot, 0.0) + 1.0 - w
        slots = self._slots
        result: dict[PodId, tuple[int, float]] = {}
        for slot, run in runs:
            pod = slots[slot]
            if pod is not None:
                result[pod] = (run, run - loss.get(slot, 0.0))
        return result

    def holds(self, pod: PodId, key: int) -> bool:
        """Whether ``pod`` holds the block ``key`` (in any space)."""
        state = self._pods.get(pod)
        return state is not None and bool(state.masks.get(key) & state.word_bit)

    def blocks_of(self, pod: PodId) -> frozenset[int]:
        """The keys ``pod`` holds (in any space)."""
        state = self._pods.get(pod)
        if state is None:
            return frozenset()
        return frozenset(key for space in state.spaces.values() for key in space.counts)

    def engine_hashes(self, pod: PodId) -> set[EngineHash]:
        """The engine's hashes of the blocks ``pod`` holds, as its events named them (any space)."""
        state = self._pods.get(pod)
        if state is None:
            return set()
        return {h for space in state.spaces.values() for h in space.held}

    def stats(self) -> KVIndexStats:
        return KVIndexStats(
            pods=len(self._pods),
            blocks=sum(p.size for p in self._pods.values()),
            evicted_by_bound=self._evicted,
            unresolved_parents=self._unresolved,
        )
