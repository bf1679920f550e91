"""A plain prefix index (per-block loop): the stand-in until epp.prefix_index lands."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash


def prompt_hashes(prompt: str, model: str, salt: str | None, block_chars: int, max_blocks: int) -> np.ndarray:
    data = prompt.encode("utf-8", "surrogatepass")
    count = min(len(data) // block_chars, max_blocks)
    seed = xxhash.xxh3_64_intdigest(f"{model}\x00{salt or ''}".encode())
    out = np.empty(count, dtype=np.uint64)
    for i in range(count):
        seed = xxhash.xxh3_64_intdigest(data[i * block_chars : (i + 1) * block_chars], seed)
        out[i] = seed
    return out


class PrefixIndex:
    def __init__(self, default_capacity: int = 31250) -> None:
        self.default_capacity = default_capacity
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    @property
    def size(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    @property
    def nbytes(self) -> int:
        return self.size * 100

    def match(self, hashes: np.ndarray, endpoints: Sequence[str]) -> list[int]:
        values = hashes.tolist()
        out = []
        for name in endpoints:
            lru = self._lru.get(name)
            n = 0
            if lru:
                for value in values:
                    if value not in lru:
                        break
                    n += 1
            out.append(n)
        return out

    def add(self, endpoint: str, hashes: np.ndarray) -> None:
        lru = self._lru.setdefault(endpoint, OrderedDict())
        for value in hashes.tolist():
            lru[value] = None
            lru.move_to_end(value)
        capacity = self._capacity.get(endpoint, self.default_capacity)
        while len(lru) > capacity:
            lru.popitem(last=False)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        self._capacity[endpoint] = blocks

    def remove(self, endpoint: str) -> None:
        self._lru.pop(endpoint, None)
        self._capacity.pop(endpoint, None)
