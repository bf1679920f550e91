"""Deliberately simple references for epp.prefix: a per-block Python loop for the hashes, and
plain lists and dicts implementing the documented generation policy for the index."""

from __future__ import annotations

import xxhash

M32 = (1 << 32) - 1

M64 = (1 << 64) - 1


def reference_keys(count: int) -> list[int]:
    keys = []
    for position in range(1, count + 1):
        z = ((position * 0x9E3779B97F4A7C15) & M64) ^ 0x243F6A8885A308D3
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        keys.append((z ^ (z >> 31)) & M32)
    return keys


def reference_hashes(data: bytes, model: str, salt: str | None, block_chars: int, max_blocks: int) -> list[int]:
    """The documented formula, one block and one word pair at a time."""
    seed = xxhash.xxh3_64_intdigest(b"epp.prefix.index/v1\x00" + block_chars.to_bytes(4, "little"))
    seed = xxhash.xxh3_64_intdigest(model.encode(), seed)
    if salt:
        seed = xxhash.xxh3_64_intdigest(salt.encode(), seed)
    count = min(len(data) // block_chars, max_blocks)
    per_block = block_chars // 4
    keys = reference_keys(count * (per_block + 1))
    out, total, position = [], 0, 0
    for i in range(count):
        block = data[i * block_chars : (i + 1) * block_chars]
        words = [int.from_bytes(block[j : j + 4], "little") for j in range(0, block_chars, 4)]
        if len(words) % 2:
            words.append(0)
        for j in range(0, len(words), 2):
            a = (words[j] + keys[position]) & M32
            b = (words[j + 1] + keys[position + 1]) & M32
            total = (total + a * b) & M64
            position += 2
        out.append((total + seed) & M64 or 1)  # 0 is reserved
    return out


class ReferenceIndex:
    """The documented policy, one block at a time: per endpoint, up to three generations (lists
    of blocks in entry order, oldest first, the last the current one)."""

    def __init__(self, capacity: int) -> None:
        self.default = capacity
        self.gens: dict[str, list[list[int]]] = {}
        self.where: dict[str, dict[int, list[int]]] = {}  # block -> the generation (list) holding it
        self.capacities: dict[str, int] = {}

    def _endpoint(self, endpoint: str, capacity: int | None = None) -> None:
        if endpoint not in self.gens:
            self.gens[endpoint] = [[]]
            self.where[endpoint] = {}
            self.capacities[endpoint] = self.default if capacity is None else capacity

    def held(self, endpoint: str) -> int:
        return len(self.where.get(endpoint, {}))

    def add(self, endpoint: str, hashes: list[int]) -> int:
        self._endpoint(endpoint)
        capacity, gens, where = self.capacities[endpoint], self.gens[endpoint], self.where[endpoint]
        h = hashes[:capacity]
        matched = 0
        for block in h:
            if block not in where:
                break
            matched += 1
        if not h:
            return matched
        cur = gens[-1]
        entering = sum(1 for block in h if where.get(block) is not cur)
        closed = len(gens) - 1
        if cur and (len(cur) + entering > capacity or (len(cur) >= -(-capacity // 3) and closed < 2)):
            if closed == 2:
                for block in h:  # the prompt's blocks leave the two closed generations...
                    gen = where.get(block)
                    if gen is not None and gen is not cur:
                        gen.remove(block)
                        cur.append(block)
                        where[block] = cur
                for gen in gens[:-1]:  # ...which are then dropped
                    for block in gen:
                        del where[block]
                del gens[:-1]
            cur = []
            gens.append(cur)
        for block in h:
            gen = where.get(block)
            if gen is not cur:
                if gen is not None:
                    gen.remove(block)
                cur.append(block)
                where[block] = cur
        gens[:-1] = [gen for gen in gens[:-1] if gen]
        if len(where) > capacity:
            self._evict(endpoint, capacity - capacity // 16, current_too=False)
        return matched

    def _evict(self, endpoint: str, target: int, current_too: bool) -> None:
        gens, where = self.gens[endpoint], self.where[endpoint]
        while len(where) > target:
            gen = gens[0]
            if gen is gens[-1]:
                while current_too and len(where) > target:
                    del where[gen.pop()]
                return
            while len(where) > target and gen:
                del where[gen.pop()]  # the block that entered it last
            if not gen:
                gens.pop(0)

    def set_capacity(self, endpoint: str, capacity: int) -> None:
        if endpoint not in self.gens:
            self._endpoint(endpoint, capacity)
            return
        self.capacities[endpoint] = capacity
        if len(self.where[endpoint]) > capacity:
            self._evict(endpoint, capacity - capacity // 16, current_too=True)

    def remove(self, endpoint: str) -> bool:
        self.capacities.pop(endpoint, None)
        self.where.pop(endpoint, None)
        return self.gens.pop(endpoint, None) is not None

    def matches(self, hashes: list[int]) -> dict[str, int]:
        found = {}
        for endpoint, where in self.where.items():
            held = 0
            for block in hashes:
                if block not in where:
                    break
                held += 1
            if held:
                found[endpoint] = held
        return found
