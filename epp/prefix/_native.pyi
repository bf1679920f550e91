"""Types of the C extension built from ``_native.c`` (its docstrings say what each loop computes).

Buffers are anything exposing the buffer protocol: numpy arrays, bytes (numpy's own stubs give
``ndarray.__buffer__`` only from Python 3.12, hence the union). ``out`` must be writable. Sizes are
checked in C before any access: too small a buffer raises ValueError, a non-contiguous or read-only
one TypeError.
"""

from typing import TypeAlias

import numpy as np
from typing_extensions import Buffer

_Buffer: TypeAlias = Buffer | np.ndarray

def chain(data: _Buffer, block_chars: int, count: int, keys: _Buffer, base: int, out: _Buffer, /) -> None:
    """``out[i]`` = the chained NH hash of blocks 0..i of ``data`` (uint64, written in place)."""

def lookup(
    rows: _Buffer, buckets: int, slots: int, width: int, shift: int, spill: int, keys: _Buffer, out: _Buffer, /
) -> None:
    """``out[i]`` = the slot (``width`` uint64) whose key is ``keys[i]``, or zeros (written in place)."""

def kv_chain(
    tokens: list[int] | _Buffer, block_size: int, count: int, parent: int, seed: int, suffix: _Buffer, /
) -> list[int]:
    """The chained XXH64 keys of the first ``count`` blocks of ``tokens`` (see kvindex)."""

class KeyMasks:
    """Block key (non-zero uint64) -> mask of pod slots 0-63 (see ``_native.c``)."""

    def __init__(self) -> None: ...
    def get(self, key: int, /) -> int:
        """The key's mask, 0 when absent."""
    def add(self, key: int, bits: int, /) -> int:
        """Sets ``bits`` in the key's mask; returns the mask before."""
    def discard(self, key: int, bits: int, /) -> None:
        """Clears ``bits`` in the key's mask; the key goes once its mask is 0."""
    def match(self, keys: list[int], /) -> list[tuple[int, int]]:
        """(slot, consecutive keys from the first holding it) for each slot of ``keys[0]``'s mask."""
    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
