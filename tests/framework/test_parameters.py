"""The parameter helpers plugins check their config with."""

from __future__ import annotations

import pytest

from epp.framework import bool_parameter, duration_parameter, str_parameter


@pytest.mark.parametrize(
    ("value", "positive", "expected"),
    [(None, False, 7.0), ("50ms", False, 0.05), ("1m30s", True, 90.0), ("0s", False, 0.0)],
)
def test_durations(value: str | None, positive: bool, expected: float) -> None:
    parameters = {} if value is None else {"timeout": value}
    assert duration_parameter("p", parameters, "timeout", 7.0, positive=positive) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("value", "positive", "message"),
    [
        (30, False, 'p: timeout must be a Go duration string such as "30s", "2m" or "1m30s", got 30'),
        ("soon", False, "'soon' is not a Go duration"),
        ("-1s", False, "must be at least 0s"),
        ("0s", True, "must be positive"),
    ],
)
def test_bad_durations_name_the_plugin_and_key(value: object, positive: bool, message: str) -> None:
    with pytest.raises(ValueError) as info:
        duration_parameter("p", {"timeout": value}, "timeout", 1.0, positive=positive)
    assert message in str(info.value)


def test_strings_and_booleans() -> None:
    assert str_parameter("p", {}, "k", "", allow_empty=True) == ""
    with pytest.raises(ValueError, match="p: k must be a non-empty string"):
        str_parameter("p", {"k": ""}, "k", "x")
    assert bool_parameter("p", {"k": False}, "k", True) is False
    with pytest.raises(ValueError, match="p: k must be true or false, got 'yes'"):
        bool_parameter("p", {"k": "yes"}, "k", True)


@pytest.mark.parametrize(
    ("seconds", "spelled"), [(0.0, "0s"), (0.05, "50ms"), (2.0, "2s"), (1.5, "1.5s"), (0.0003, "300us")]
)
def test_durations_are_spelled_as_go_spells_them(seconds: float, spelled: str) -> None:
    from epp.framework.parameters import format_duration

    assert format_duration(seconds) == spelled
