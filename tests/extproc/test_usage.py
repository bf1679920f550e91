"""Reading the usage a model server reports, from the kept end of a response."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.extproc.usage import Usage, usage_of

SSE_END = (
    b'data: {"id":"c","choices":[{"index":0,"text":" end"}],"usage":null}\n\n'
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize(
    ("chunks", "stream", "expected"),
    [
        ([b'{"id":"x","choices":[{"text":"hi"}],"usage":{"prompt_tokens":5,"completion_tokens":7}}'], False, Usage(5, 7)),
        ([b'{"id":"x","choi', b'ces":[],"usage":{"prompt_tokens":5,', b'"completion_tokens":7}}'], False, Usage(5, 7)),
        ([b'{"id":"x","choices":[]}'], False, None),
        ([b"not json"], False, None),
        ([SSE_END], True, Usage(12, 34)),
        ([SSE_END[:50], SSE_END[50:]], True, Usage(12, 34)),  # the usage event split over two chunks
        ([b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'], True, None),  # no include_usage
        ([b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\ndata: {"usage":{"prompt_tokens":1,"completion_tokens":9}}\n\n'], True, Usage(1, 9)),
        ([b'e_tokens":3}}\n\ndata: [DONE]\n\n'], True, None),  # the kept tail starts inside the event
        ([], True, None),
        ([b'{"usage":{"prompt_tokens":-1,"completion_tokens":2}}'], False, None),
        # vLLM's JSON tail: usage with a nested details object, more fields after it
        ([b'..."text":"x"}],"usage":{"prompt_tokens":3,"total_tokens":8,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":0}},"kv_transfer_params":null}'], False, Usage(3, 5)),
        ([b'{"choices":[{"text":"the word \\"usage\\": {"}],"usage":null}'], False, None),  # the key inside a string, then null
        ([b'{"choices":[],"usage":{"prompt_tokens":3,"completion'], False, None),  # cut before it closes
        # closing braces inside the object's strings are not its end
        ([b'{"usage":{"note":"a}b}}","prompt_tokens":2,"completion_tokens":4,"x":{"y":"}"}}}'], False, Usage(2, 4)),
        ([b'{"usage":{"prompt_tokens":"2","completion_tokens":4}}'], False, None),  # a whole object, wrongly typed
    ],
)
def test_usage_of(chunks: list[bytes], stream: bool, expected: Usage | None) -> None:
    assert usage_of(chunks, stream=stream) == expected


def test_deep_nesting_is_no_usage_not_an_error() -> None:
    assert usage_of([b'{"a":' * 5000 + b"1" + b"}" * 5000], stream=False) is None


def test_an_object_with_more_braces_than_it_tries_is_no_usage() -> None:
    # (each try decodes from the object's start: a bound keeps a hostile tail from being quadratic)
    nested = b'{"a":' * 100 + b"1" + b"}" * 100
    assert usage_of([b'{"usage":{"x":' + nested + b',"prompt_tokens":1,"completion_tokens":2}}'], stream=False) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.text("{}\\\"usage: ", max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("{}\\\"ab", max_size=4), inner, max_size=3),
    max_leaves=8,
)


@given(
    before=st.dictionaries(st.text("{}\\\"ab", max_size=4), _JSON, max_size=3),
    extra=st.dictionaries(st.text("{}\\\"ab", max_size=4).filter(lambda k: "tokens" not in k), _JSON, max_size=3),
    prompt=st.integers(0, 10**6),
    completion=st.integers(0, 10**6),
    after=_JSON,
)
def test_the_usage_object_is_read_whatever_surrounds_it(
    before: dict[str, object], extra: dict[str, object], prompt: int, completion: int, after: object
) -> None:
    usage = {**extra, "prompt_tokens": prompt, "completion_tokens": completion}
    body = json.dumps({**before, "usage": usage, "zzz_after": after}, separators=(",", ":"))
    if body.count('"usage"') > 1:
        return  # (a key or string of the surroundings names it too: what the last one is differs)
    assert usage_of([body.encode()], stream=False) == Usage(prompt, completion)
