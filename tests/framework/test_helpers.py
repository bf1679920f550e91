"""epp.framework.helpers: LogLimiter (the pickers' and scorers' helpers are tested with the plugins)."""

from __future__ import annotations

from epp.framework import LogLimiter


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_a_minute_per_key_and_the_next_one_says_how_many_were_held_back() -> None:
    clock = _Clock()
    limit = LogLimiter(60.0, clock=clock)
    assert limit.allow("a") == 0  # the first of a key goes through
    assert limit.allow("b") == 0  # keys are independent
    clock.now += 59.9
    assert limit.allow("a") is None and limit.allow("a") is None
    clock.now += 0.1
    assert limit.allow("a") == 2  # a minute after the last let through: how many were held back
    assert limit.allow("a") is None
    clock.now += 60
    assert limit.allow("a") == 1
    clock.now += 60
    assert limit.allow("a") == 0  # the count starts again
    assert limit.allow() == 0 and limit.allow() is None  # no key: one line for all


def test_keys_are_bounded_and_reset_forgets_them() -> None:
    clock = _Clock()
    limit = LogLimiter(60.0, max_keys=3, clock=clock)
    for key in "abc":
        assert limit.allow(key) == 0
    assert limit.allow("a") is None
    assert limit.allow("d") == 0  # a fourth key: every key forgotten, memory stays bounded
    assert limit.allow("a") == 0  # (so "a" goes through early, its held count lost)
    assert limit.allow("a") is None
    limit.reset()
    assert limit.allow("a") == 0
