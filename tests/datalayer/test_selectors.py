"""Metric selectors (epp.datalayer.selectors): upstream's equality-only PromQL subset."""

from __future__ import annotations

import pytest

import epp.datalayer.selectors
from epp.datalayer.selectors import Selector, escape_label_value, is_label_name, parse_selector


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:num_requests_waiting", Selector("vllm:num_requests_waiting")),
        ("  name  ", Selector("name")),
        ("name{}", Selector("name")),
        ('name{a="b"}', Selector("name", (("a", "b"),))),
        ("name{a=b, c = d}", Selector("name", (("a", "b"), ("c", "d")))),
        ('name { a = "x,y" , }', Selector("name", (("a", "x,y"),))),
        ('name{a="q\\"u\\\\o\\nte"}', Selector("name", (("a", 'q"u\\o\nte'),))),
        ('nv_trt_llm_request_metrics{request_type=waiting}',
         Selector("nv_trt_llm_request_metrics", (("request_type", "waiting"),))),
    ],
)
def test_parse_selector(text: str, expected: Selector) -> None:
    assert parse_selector(text) == expected
    assert parse_selector(str(expected)) == expected  # str() is a canonical round trip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty metric selector"),
        ("   ", "empty metric selector"),
        ("1abc", "invalid metric name"),
        ("a-b", "invalid metric name"),
        ("{a=\"b\"}", "invalid metric name ''"),
        ("name}", "invalid metric name"),
        ("name{", "unclosed '{'"),
        ('name{a="b"', "unclosed '{'"),
        ('name{a="b}', "unterminated quoted label value"),
        ('name{a!="b"}', "only equality matchers"),
        ('name{a=~"b.*"}', "only equality matchers"),
        ("name{a}", 'expected label="value"'),
        ("name{=b}", 'expected label="value"'),
        ("name{a=}", "missing label value"),
        ('name{a="b" c="d"}', "expected ',' or '}'"),
        ('name{a="b",a="c"}', "label 'a' given twice"),
        ('name{1a="b"}', "invalid label name '1a'"),
        ('name{a="b"} extra', "unexpected text"),
        ('name{a="\\x"}', "invalid escape"),
    ],
)
def test_parse_selector_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_selector(text)
    assert message in str(info.value)


def test_public_api_is_locked() -> None:
    assert epp.datalayer.selectors.__all__ == ["Selector", "escape_label_value", "is_label_name", "parse_selector"]


@pytest.mark.parametrize(
    ("value", "escaped"),
    [("plain", "plain"), ('q"t', 'q\\"t'), ("back\\slash", "back\\\\slash"), ("new\nline", "new\\nline")],
)
def test_label_values_are_escaped_as_the_exposition_format_writes_them(value: str, escaped: str) -> None:
    assert escape_label_value(value) == escaped
    assert parse_selector(f'm{{a="{escaped}"}}') == Selector("m", (("a", value),))  # and read back


@pytest.mark.parametrize(("text", "valid"), [("a", True), ("_a1", True), ("1a", False), ("a-b", False), ("", False)])
def test_label_names(text: str, valid: bool) -> None:
    assert is_label_name(text) is valid
