"""epp.prefix.hashing: prompt_hashes against the documented formula (a per-block Python loop),
and what the chain guarantees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.prefix import prompt_hashes
from epp.prefix.hashing import DEFAULT_BLOCK_SIZE_TOKENS, DEFAULT_MAX_PREFIX_TOKENS, as_hashes
from tests.prefix._helpers import PROPERTY
from tests.prefix._reference import reference_hashes


@PROPERTY
@given(
    data=st.binary(max_size=700),
    block_tokens=st.sampled_from([1, 2, 3, 16, 17]),
    max_blocks=st.integers(0, 200),
    model=st.sampled_from(["m", "llama-3-8b", "é"]),
    salt=st.sampled_from([None, "", "tenant-a"]),
)
def test_hashes_follow_the_documented_formula(
    data: bytes, block_tokens: int, max_blocks: int, model: str, salt: str | None
) -> None:
    block_chars = 4 * block_tokens
    got = prompt_hashes(data, model, salt, block_chars, max_blocks)
    assert got.dtype == np.uint64
    assert got.tolist() == reference_hashes(data, model, salt, block_chars, max_blocks)


@PROPERTY
@given(common=st.text(max_size=300), a=st.text(max_size=200), b=st.text(max_size=200))
def test_equal_hash_at_a_block_means_equal_prefix_through_it(common: str, a: str, b: str) -> None:
    x, y = (common + a).encode(), (common + b).encode()
    hx, hy = prompt_hashes(x, "m", None, 8), prompt_hashes(y, "m", None, 8)
    shared = 0
    while shared < min(len(x), len(y)) and x[shared] == y[shared]:
        shared += 1
    for i in range(min(len(hx), len(hy))):
        assert (hx[i] == hy[i]) == ((i + 1) * 8 <= shared)


def test_only_whole_blocks_count_and_str_hashes_as_its_utf8() -> None:
    text = "ab€" * 40  # 200 bytes of UTF-8
    hashes = prompt_hashes(text, "m")
    assert len(hashes) == 200 // 64
    assert prompt_hashes(text + "xyz", "m").tolist() == hashes.tolist()  # still 3 whole blocks
    assert prompt_hashes(text.encode(), "m").tolist() == hashes.tolist()
    assert len(prompt_hashes("x" * 63, "m")) == 0


def test_model_salt_and_block_size_separate_every_block() -> None:
    text = "the same prompt " * 64
    base = prompt_hashes(text, "model-a").tolist()
    assert not set(base) & set(prompt_hashes(text, "model-b").tolist())
    assert not set(base) & set(prompt_hashes(text, "model-a", "salt").tolist())
    assert prompt_hashes(text, "model-a", "").tolist() == base  # an empty salt is no salt
    assert not set(base) & set(prompt_hashes(text, "model-a", None, 128).tolist())
    assert not set(prompt_hashes(text, "ab", "c").tolist()) & set(prompt_hashes(text, "a", "bc").tolist())


def test_order_matters_within_and_across_blocks() -> None:
    one, two = "A" * 64, "B" * 64
    assert prompt_hashes(one + two, "m")[1] != prompt_hashes(two + one, "m")[1]
    assert prompt_hashes("ab" * 32, "m")[0] != prompt_hashes("ba" * 32, "m")[0]
    assert prompt_hashes("abcdefgh" + "x" * 56, "m")[0] != prompt_hashes("efghabcd" + "x" * 56, "m")[0]


def test_the_cap_keeps_the_first_blocks() -> None:
    text = "0123456789" * 100
    full = prompt_hashes(text, "m", None, 64, 1000)
    assert prompt_hashes(text, "m", None, 64, 5).tolist() == full[:5].tolist()
    assert len(prompt_hashes(text, "m", None, 64, 0)) == 0
    default_blocks = DEFAULT_MAX_PREFIX_TOKENS // DEFAULT_BLOCK_SIZE_TOKENS
    assert len(prompt_hashes("x" * 64 * (default_blocks + 3), "m")) == default_blocks == 8192


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((123, "m"), TypeError, "prompt must be str or bytes"),
        (("p", None), TypeError, "model must be str"),
        (("p", "m", 5), TypeError, "cache_salt must be str or None"),
        (("p", "m", None, 6), ValueError, "block_chars must be a positive multiple of 4"),
        (("p", "m", None, 0), ValueError, "block_chars must be a positive multiple of 4"),
        (("p", "m", None, 64, -1), ValueError, "max_blocks must be an integer"),
    ],
)
def test_bad_hashing_arguments_get_a_clear_error(args: tuple, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        prompt_hashes(*args)


def test_as_hashes_takes_a_uint64_array_as_it_is_and_anything_else_once_converted() -> None:
    h = prompt_hashes("a" * 640, "m")
    assert as_hashes(h) is h  # no copy: what add() compares a lookup's hashes with first
    strided = np.arange(1, 21, dtype=np.uint64)[::2]
    assert as_hashes(strided).flags.c_contiguous and as_hashes(strided).tolist() == strided.tolist()
    for plain in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7], dtype=np.int32), iter([5, 6, 7])):
        converted = as_hashes(plain)
        assert converted.dtype == np.uint64 and converted.tolist() == [5, 6, 7]
    assert as_hashes([]).size == 0 and as_hashes([]).dtype == np.uint64
