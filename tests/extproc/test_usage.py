"""Reading the usage a model server reports, from the kept end of a response."""

from __future__ import annotations

import pytest

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
    ],
)
def test_usage_of(chunks: list[bytes], stream: bool, expected: Usage | None) -> None:
    assert usage_of(chunks, stream=stream) == expected


def test_deep_nesting_is_no_usage_not_an_error() -> None:
    assert usage_of([b'{"a":' * 5000 + b"1" + b"}" * 5000], stream=False) is None
