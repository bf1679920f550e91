"""The precise prefix index: which blocks each pod holds, as the pods' own KV-cache events say.

Keys. A block is keyed by this index's own 64-bit hash, never the engine's: the engine's hashes are
not reproducible outside its process (a sha256 chain over pickled tokens, seeded per process) and a
chain cannot be extended from the ints alone. The key of a stored block is
``xxh3_64(parent_key ‖ token ids as uint32 ‖ extra_keys as msgpack, seed)``, chained from the key of
its parent (found through the pod's map engine hash -> key; 0 for a first block), so a request's
token ids, cut into blocks of the same size, give the same keys (:func:`chain_keys`). A block with
``extra_keys`` (a salt, an adapter, multimodal ids) only matches a lookup that passes the same keys;
a plain text lookup passes none, so it never matches a salted block (the engine would not reuse it
either). The engine's hash is kept only to resolve ``BlockRemoved`` and parents.

State. Per pod (a :data:`PodId`, ``"ip:port"`` or ``"ip:port@rank"``): the map (engine hash, medium)
-> key, in insertion order, and per key the media holding it; over all pods, key -> {pod: weight}, the
weight the best medium that holds the block (``GPU`` 1.0, ``CPU`` 0.8, llm-d's defaults; an unnamed
medium counts as GPU). A lookup walks the request's keys once and keeps, per pod, the run of
consecutive blocks from the first (the weighted sum is reported too). Memory is bounded: a pod holds
at most ``max_blocks_per_pod`` blocks (the oldest stored are dropped first, counted in
``evicted_by_bound``); a pod the pool no longer has is dropped with :meth:`remove_pod`.

A pod is *known* while its stream is followed without a hole; :meth:`mark_unknown` (a gap with no
replay, a lost connection) drops its blocks and makes :meth:`known` false until :meth:`apply` is
called for it again, so the producer can fall back to the approximate index for it meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import xxhash

from epp.prefix.kvwire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["DEFAULT_MEDIA_WEIGHTS", "KVEventIndex", "KVIndexStats", "PodId", "chain_keys"]

PodId = str
DEFAULT_MEDIA_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8}
_DEFAULT_MEDIUM = "GPU"
_ENCODE = msgspec.msgpack.Encoder().encode


def _block_key(parent: int, tokens: Sequence[int] | np.ndarray, extra: object, seed: int) -> int:
    data = parent.to_bytes(8, "little") + np.asarray(tokens, dtype=np.uint32).tobytes()
    if extra is not None:
        data += _ENCODE(extra)
    return xxhash.xxh3_64_intdigest(data, seed) or 1  # 0 is the root's parent


def chain_keys(
    token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int = 0, max_blocks: int | None = None
) -> list[int]:
    """The keys of the whole blocks of ``token_ids`` (no extra keys), as stored events give them."""
    tokens = np.asarray(token_ids, dtype=np.uint32)
    count = len(tokens) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    keys: list[int] = []
    parent = 0
    for i in range(count):
        parent = _block_key(parent, tokens[i * block_size : (i + 1) * block_size], None, seed)
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class KVIndexStats:
    pods: int
    blocks: int
    evicted_by_bound: int
    unresolved_parents: int


class _Pod:
    __slots__ = ("block_size", "held", "known", "media")

    def __init__(self) -> None:
        self.held: dict[tuple[object, str], int] = {}  # (engine hash, medium) -> key, oldest first
        self.media: dict[int, dict[str, int]] = {}  # key -> medium -> copies
        self.known = True
        self.block_size = 0


class KVEventIndex:
    """Blocks per pod from KV events; one instance per picker, fed by a subscriber (one thread)."""

    def __init__(
        self,
        *,
        seed: int = 0,
        max_blocks_per_pod: int = 1 << 20,
        media_weights: Mapping[str, float] = DEFAULT_MEDIA_WEIGHTS,
    ) -> None:
        if max_blocks_per_pod < 1:
            raise ValueError(f"max_blocks_per_pod must be ≥ 1, got {max_blocks_per_pod}")
        self.seed = seed
        self.max_blocks_per_pod = max_blocks_per_pod
        self._weights = dict(media_weights)
        self._pods: dict[PodId, _Pod] = {}
        self._where: dict[int, dict[PodId, float]] = {}
        self._evicted = 0
        self._unresolved = 0

    # -- events ---------------------------------------------------------------------------------

    def apply(self, pod: PodId, events: Iterable[KVEvent]) -> None:
        """Apply one batch of ``pod``'s events, in order; the pod is known afterwards."""
        state = self._pods.get(pod)
        if state is None:
            state = self._pods[pod] = _Pod()
        state.known = True
        for event in events:
            if isinstance(event, BlockStored):
                self._store(pod, state, event)
            elif isinstance(event, BlockRemoved):
                medium = event.medium or _DEFAULT_MEDIUM
                for engine_hash in event.block_hashes:
                    self._drop(pod, state, (engine_hash, medium))
            elif isinstance(event, AllBlocksCleared):
                self.clear_pod(pod)

    def _store(self, pod: PodId, state: _Pod, event: BlockStored) -> None:
        medium = event.medium or _DEFAULT_MEDIUM
        size = event.block_size
        state.block_size = size
        parent = 0
        if event.parent_block_hash is not None:
            found = state.held.get((event.parent_block_hash, medium))
            if found is None:  # the parent may live on another medium of the same pod
                found = next((k for (h, _), k in state.held.items() if h == event.parent_block_hash), None)
            if found is None:
                # A parent this index never saw (stored before it subscribed): the chain cannot be
                # rebuilt, and a guessed key could only produce false matches.
                self._unresolved += 1
                return
            parent = found
        tokens = event.token_ids
        extra = event.extra_keys
        for i, engine_hash in enumerate(event.block_hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                break  # only full blocks are published; a short tail cannot be a block
            parent = _block_key(parent, block, extra[i] if extra and i < len(extra) else None, self.seed)
            slot = (engine_hash, medium)
            if slot in state.held:
                self._drop(pod, state, slot)
            state.held[slot] = parent
            copies = state.media.setdefault(parent, {})
            copies[medium] = copies.get(medium, 0) + 1
            self._reweigh(pod, state, parent)
        while len(state.held) > self.max_blocks_per_pod:
            self._drop(pod, state, next(iter(state.held)))
            self._evicted += 1

    def _drop(self, pod: PodId, state: _Pod, slot: tuple[object, str]) -> None:
        key = state.held.pop(slot, None)
        if key is None:
            return
        copies = state.media[key]
        copies[slot[1]] -= 1
        if not copies[slot[1]]:
            del copies[slot[1]]
        if not copies:
            del state.media[key]
        self._reweigh(pod, state, key)

    def _reweigh(self, pod: PodId, state: _Pod, key: int) -> None:
        copies = state.media.get(key)
        holders = self._where.get(key)
        if copies:
            weight = max(self._weights.get(m, 0.0) for m in copies)
            if holders is None:
                holders = self._where[key] = {}
            holders[pod] = weight
        elif holders is not None:
            holders.pop(pod, None)
            if not holders:
                del self._where[key]

    def clear_pod(self, pod: PodId) -> None:
        """Forget every block of ``pod`` (AllBlocksCleared, a restart); it stays tracked."""
        state = self._pods.get(pod)
        if state is None:
            return
        for key in state.media:
            holders = self._where.get(key)
            if holders is not None:
                holders.pop(pod, None)
                if not holders:
                    del self._where[key]
        state.held.clear()
        state.media.clear()

    def mark_unknown(self, pod: PodId) -> None:
        """Drop ``pod``'s blocks and call it unknown until its next applied batch."""
        self.clear_pod(pod)
        state = self._pods.get(pod)
        if state is None:
            state = self._pods[pod] = _Pod()
        state.known = False

    def remove_pod(self, pod: PodId) -> None:
        self.clear_pod(pod)
        self._pods.pop(pod, None)

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

    def match(self, keys: Sequence[int]) -> dict[PodId, tuple[int, float]]:
        """Per pod holding the first block: (consecutive blocks held from the first, their weighted sum)."""
        result: dict[PodId, tuple[int, float]] = {}
        alive: dict[PodId, float] | None = None
        for i, key in enumerate(keys):
            holders = self._where.get(key)
            if not holders:
                break
            if alive is None:
                alive = dict(holders)
            else:
                for pod in [p for p in alive if p not in holders]:
                    del alive[pod]
                for pod in alive:
                    alive[pod] += holders[pod]
            if not alive:
                break
            for pod, weight in alive.items():
                result[pod] = (i + 1, weight)
        return result

    def blocks_of(self, pod: PodId) -> frozenset[int]:
        state = self._pods.get(pod)
        return frozenset(state.media) if state else frozenset()

    def stats(self) -> KVIndexStats:
        return KVIndexStats(
            pods=len(self._pods),
            blocks=sum(len(p.held) for p in self._pods.values()),
            evicted_by_bound=self._evicted,
            unresolved_parents=self._unresolved,
        )
