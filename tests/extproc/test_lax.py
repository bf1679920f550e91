"""pydantic's lax coercions (epp.extproc.lax), on raw JSON values as the loose decode keeps them. Each
verdict was checked against pydantic 2.13 validating the field types of vLLM 0.32's request models
(vllm/entrypoints/openai/completion/protocol.py): what pydantic refuses reads as None / False."""

from __future__ import annotations

import json

import msgspec
import pytest

from epp.errors import EppError
from epp.extproc.lax import lax_bool, lax_int, lax_salt, loose_prompt_text, loose_turn, newer
from epp.extproc.parsing import parse_request


def _raw(value: object) -> msgspec.Raw:
    return msgspec.Raw(json.dumps(value).encode())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True), (False, False), (None, False), ("true", True), ("False", False), ("yes", True),
        ("no", False), ("on", True), ("off", False), ("t", True), ("f", False), ("y", True), ("n", False),
        ("1", True), ("0", False), (1, True), (0, False), (1.0, True), (0.0, False),
        ("maybe", False), (" true", False), ("", False), (2, False), (0.5, False), ([True], False), ({}, False),
    ],
)  # fmt: skip
def test_lax_bool(value: object, expected: bool) -> None:
    assert lax_bool(_raw(value)) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, 3), (0, 0), (-3, -3), (3.0, 3), ("3", 3), ("3.0", 3), (" 3 ", 3), ("+3", 3), ("-3", -3),
        ("3_000", 3000), (True, 1), (False, 0), (None, None), (3.5, None), ("3.5", None), ("1e3", None),
        ("x", None), ("0x10", None), (1e20, None), ([3], None), ({"n": 3}, None),
    ],
)  # fmt: skip
def test_lax_int(value: object, expected: int | None) -> None:
    assert lax_int(_raw(value)) == expected


def test_absent_and_oversized_raw_values_read_as_defaults() -> None:
    assert lax_bool(msgspec.Raw(b"")) is False and lax_int(msgspec.Raw(b"")) is None
    assert lax_int(msgspec.Raw(b'"' + b"1" * 2000 + b'"')) is None  # never decoded
    assert newer(_raw("x"), 16) == 16 and newer(_raw("32"), 16) == 32


@pytest.mark.parametrize(("value", "expected"), [("s", "s"), ("", None), (5, None), ("s" * 1024, "s" * 1024), ("s" * 1025, None)])
def test_lax_salt(value: object, expected: str | None) -> None:
    assert lax_salt(_raw(value)) == expected


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, ""), ("x", "x"), (["a", "b"], "a\nb"), (["1", 2], "1 2"), ([1.0, True], "1 1"), ([[1, "2"], [3.0]], "1 2\n3")],
)
def test_loose_prompt_text_reads_what_vllm_reads(value: object, text: str) -> None:
    assert loose_prompt_text(value, "prompt", "refused") == text


@pytest.mark.parametrize("value", [5, {"a": 1}])
def test_loose_prompt_text_of_no_form_keeps_the_refusal(value: object) -> None:
    with pytest.raises(EppError) as info:
        loose_prompt_text(value, "prompt", "refused")
    assert info.value.message == "refused"


def test_loose_turn_renders_as_the_typed_path() -> None:
    turn = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"text": 5}, {"text": "b"}]}
    assert loose_turn(turn, "refused") == "<|user|>\nab\n"
    assert loose_turn({"type": "function_call_output"}, None) == "<|function_call_output|>\n\n"
    with pytest.raises(EppError):
        loose_turn({"content": "x"}, "refused")


@pytest.mark.parametrize("field", ["max_tokens", "cache_salt", "stream", "max_completion_tokens"])
def test_a_routing_field_with_bytes_that_are_not_utf8_is_no_hint_not_an_error(field: str) -> None:
    # Found by the parser fuzzing: a nested value holding raw surrogate bytes is valid JSON structure
    # to the body's decode, but its strings cannot be decoded.
    body = b'{"model":"m","prompt":"p","%s":{"\xed\xa0\x80":null}}' % field.encode()
    request = parse_request({":path": "/v1/completions"}, body)
    assert (request.model, request.prompt) == ("m", "p")
