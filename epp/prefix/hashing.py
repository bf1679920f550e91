"""Prompt hashing: the chained 64-bit hashes of a prompt's blocks, which the prefix index keys on.

The prompt's UTF-8 bytes are cut into blocks of ``block_chars`` bytes (upstream: blockSizeTokens
× 4, default 64); only whole blocks count, and at most ``max_blocks`` of them. Block *i*'s 64-bit
hash is ``h[i] = S + Σ (a[2j] + K[2j]) · (a[2j+1] + K[2j+1]) mod 2**64`` over the 32-bit words
``a`` of blocks 0..i (each keyed word is taken mod 2**32, the product exactly in 64 bits: UMAC's
NH), where ``K`` is a fixed pseudo-random key per word position (splitmix64 of the position) and
``S`` a seed hashed (xxh3) from the block size, the model name and ``cache_salt``; a hash that
comes out 0 is replaced by 1 (the index reserves 0). So ``h[i] = h[i-1] + mix(block i)``: a
chain, where equal hashes at block *i* mean equal model, salt, block size and bytes through block
*i* (but for a rare accident: NH pairs collide with odds ≤ 2**-32 for a random key), and the
per-position keys make swapped words or blocks hash differently. It is one pass over the words
in C (``epp/prefix/_native.c``; about 4 µs for an 8k-token prompt, where the same sum as numpy
passes took 14). It is no cryptographic hash (nor is upstream's xxhash): a client who crafts a
collision only misroutes its own request's affinity; the model server salts its real cache
itself.

:func:`as_hashes` is the other way in: the index takes any sequence of block hashes (the output
of :func:`prompt_hashes`, or a plain list of ints) and checks it once, here.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import numpy as np
import xxhash

from epp.prefix import _native

__all__ = ["CHARS_PER_TOKEN", "DEFAULT_BLOCK_SIZE_TOKENS", "DEFAULT_MAX_PREFIX_TOKENS", "as_hashes", "prompt_hashes"]

# Upstream's defaults (GIE / llm-d approximate prefix cache plugin).
CHARS_PER_TOKEN = 4  # upstream's averageCharactersPerToken: the prompt is not tokenized
DEFAULT_BLOCK_SIZE_TOKENS = 16  # vLLM's default KV-cache block size
DEFAULT_MAX_PREFIX_TOKENS = 131072  # 128K tokens: the context window of large production models

_U64 = np.uint64
_EMPTY = np.empty(0, dtype=_U64)
_EMPTY.flags.writeable = False
# Part of every seed, so of every hash: changing it (it still names the module hashing first
# lived in) changes every hash.
_SEED_DOMAIN = b"epp.prefix.index/v1\x00"

_keys = np.empty(0, dtype=np.uint32)  # K[j], grown on demand; the same values for every block size


def _position_keys(count: int) -> np.ndarray:
    """K[0..count): the low halves of splitmix64 of the word position, fixed forever."""
    z = (np.arange(1, count + 1, dtype=_U64) * _U64(0x9E3779B97F4A7C15)) ^ _U64(0x243F6A8885A308D3)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return (z ^ (z >> _U64(31))).astype(np.uint32)


def _ensure_keys(count: int) -> None:
    """Keys for ``count`` 32-bit word positions."""
    global _keys
    if count > _keys.size:
        _keys = _position_keys(max(count, 2 * _keys.size, 8192))


@lru_cache(maxsize=4096)
def _seed(block_chars: int, model: str, cache_salt: str | None) -> int:
    seed = xxhash.xxh3_64_intdigest(_SEED_DOMAIN + block_chars.to_bytes(4, "little"))
    seed = xxhash.xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"), seed)
    if cache_salt:  # upstream: an empty salt is no salt
        seed = xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8", "surrogatepass"), seed)
    return seed


def prompt_hashes(
    prompt: str | bytes,
    model: str,
    cache_salt: str | None = None,
    block_chars: int = DEFAULT_BLOCK_SIZE_TOKENS * CHARS_PER_TOKEN,
    max_blocks: int = DEFAULT_MAX_PREFIX_TOKENS // DEFAULT_BLOCK_SIZE_TOKENS,
) -> np.ndarray:
    """The chained 64-bit hashes of the prompt's whole blocks: a uint64 array of length
    ``min(len(prompt's UTF-8 bytes) // block_chars, max_blocks)``, never containing 0.

    ``block_chars`` is blockSizeTokens × :data:`CHARS_PER_TOKEN` (so a multiple of 4);
    ``max_blocks`` is maxPrefixTokensToMatch // blockSizeTokens. ``prompt`` may come encoded.
    """
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "surrogatepass")
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        data = prompt
    else:
        raise TypeError(f"prompt must be str or bytes, not {type(prompt).__name__}")
    if not isinstance(model, str):
        raise TypeError(f"model must be str, not {type(model).__name__}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be str or None, not {type(cache_salt).__name__}")
    if type(block_chars) is not int or block_chars <= 0 or block_chars % 4:
        raise ValueError(f"block_chars must be a positive multiple of 4, got {block_chars!r}")
    if type(max_blocks) is not int or max_blocks < 0:
        raise ValueError(f"max_blocks must be an integer ≥ 0, got {max_blocks!r}")
    n = min(len(data) // block_chars, max_blocks)
    if n == 0:
        return _EMPTY
    per_block = block_chars // 4  # 32-bit words per block
    _ensure_keys(n * (per_block + per_block % 2))
    out = np.empty(n, dtype=_U64)
    _native.chain(data, block_chars, n, _keys, _seed(block_chars, model, cache_salt), out)
    return out


def as_hashes(hashes: Iterable[int] | np.ndarray) -> np.ndarray:
    """Block hashes as the index takes them: a one-dimensional C-contiguous uint64 array (the
    same array when it is one already). ValueError or TypeError, saying so, for anything else."""
    if type(hashes) is np.ndarray and hashes.dtype == _U64 and hashes.ndim == 1:
        return hashes if hashes.flags.c_contiguous else np.ascontiguousarray(hashes)
    array = np.asarray(hashes if isinstance(hashes, np.ndarray) else list(hashes))
    if array.ndim != 1:
        raise ValueError(f"hashes must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return _EMPTY
    if array.dtype.kind not in "iu" or (array.dtype.kind == "i" and (array < 0).any()):
        raise TypeError(f"hashes must be unsigned 64-bit integers, got {array.dtype} values")
    return np.ascontiguousarray(array, dtype=_U64)
